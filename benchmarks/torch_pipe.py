"""The peer: torch.distributed.pipelining on the same GPT shapes, measured the way meshpipe is.

Optional: torch is a benchmark-only dependency (`pip install torch==2.13.0`,
the CPU wheel); without it `available()` is False and the runner notes the skip.

Model: a torch GPT with the same layers and matmul shapes as
`orchestrator/core/model/gpt.py` (token + position embedding; pre-RMSNorm blocks with
causal multi-head attention written as explicit matmuls, as the JAX model does,
and a GELU MLP; RMSNorm + unembedding head; mean next-token cross-entropy), so
the same FLOPs per microbatch; parameters are not bit-equal to meshpipe's.
Cut into the same two stages.

Pipelined (`pipe`): 2 ranks via `torch.multiprocessing` (spawn), gloo,
`torch.set_num_threads(1)`, rank r pinned to core r mod nproc (like meshpipe's
stage actors); per schedule (Schedule1F1B, ScheduleGPipe) and m: `warmup` then
`steps` steps of `schedule.step(...)` + adam `step()` + `zero_grad()`.
  step_s   median time between consecutive step ends on rank 0;
  costs    per rank, median in-pipeline times of the stage's own
           `forward_one_chunk` (+ the loss function on the last stage) = F and
           `backward_one_chunk` = B (wrapped on the stage instance; the
           schedule's sends/receives and waits are outside them, as meshpipe's
           SEND/RECV are outside its F/B spans), and adam `step()` = OPT;
  standalone  the same three timed outside the pipeline right after the timed
           steps, one rank at a time (the other core idle): the action costs of torch's ideal, as
           meshpipe's come from its standalone stage timings (`costs` cross-check them);
  observed each rank's CPU affinity and torch thread counts, read back in the rank.
Plain (`plain`): one process, one thread per core of its affinity (the runner
gives it all cores, then one core), the whole model, m microbatches
accumulated by a Python loop, then adam.

Every wait has a deadline: the process group's timeout, and the parent kills
the ranks it spawned if they have not finished by `deadline_s`.
Run by hand: `python -m benchmarks.torch_pipe pipe 1f1b,gpipe 2 small:4,8:5 tiny:8:20`.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import LEARNING_RATE, SIZES, Size, median, spread

TORCH_SCHEDULES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}


def available() -> bool:
    try:
        import torch.distributed.pipelining  # noqa: F401
    except ImportError:
        return False
    return True


# ----------------------------------------------------------------------------- model

def _layers(size: Size):
    import torch
    from torch import nn

    d, h, nh, v, s = size.d_model, size.d_mlp, size.heads, size.vocab, size.seq

    def rms(x, scale):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * scale

    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(v, d)
            self.pos = nn.Parameter(0.01 * torch.randn(s, d))
            nn.init.normal_(self.tok.weight, std=0.02)

        def forward(self, x):
            return self.tok(x) + self.pos[None, : x.shape[1]]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.Parameter(torch.ones(d)), nn.Parameter(torch.ones(d))
            self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
            self.w1, self.w2 = nn.Linear(d, h, bias=False), nn.Linear(h, d, bias=False)
            self.register_buffer("causal", torch.tril(torch.ones(s, s, dtype=torch.bool)), persistent=False)

        def forward(self, x):
            b, t, _ = x.shape
            a = rms(x, self.ln1)
            q, k, vv = (w(a).view(b, t, nh, d // nh).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
            scores = (q @ k.transpose(-1, -2)) / (d // nh) ** 0.5
            scores = scores.masked_fill(~self.causal[:t, :t], -1e30)
            o = (scores.softmax(-1) @ vv).transpose(1, 2).reshape(b, t, d)
            x = x + self.wo(o)
            return x + self.w2(torch.nn.functional.gelu(self.w1(rms(x, self.ln2))))

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.lnf = nn.Parameter(torch.ones(d))
            self.unembed = nn.Linear(d, v, bias=False)

        def forward(self, x):
            return self.unembed(rms(x, self.lnf))

    return [Embed()] + [Block() for _ in range(size.blocks)] + [Head()]


def _loss(logits, target):
    import torch

    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def _batch(size: Size, m: int, step: int):
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    n = size.mbs * m
    start = torch.randint(0, size.vocab, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    rows = (start + stride * torch.arange(size.seq + 1)[None, :]) % size.vocab
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def _stage_module(size: Size, rank: int):
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers = _layers(size)
    cut = size.cut()
    return nn.Sequential(*(layers[:cut] if rank == 0 else layers[cut:]))


# ----------------------------------------------------------------------------- pipelined ranks

def _pin(rank: int) -> None:
    os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})


def _rank_main(rank: int, cfg: dict) -> None:
    _pin(rank)
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{cfg['port']}",
                            timeout=datetime.timedelta(seconds=cfg["pg_timeout_s"]))
    results = []
    try:
        for size_name, ms, steps in cfg["runs"]:
            for m in ms:
                for name in cfg["schedules"]:
                    rec = _run_one(rank, SIZES[size_name], m, name, steps, cfg["warmup"], torch, dist, pipelining)
                    results.append({"size": size_name, **rec})
        _second_pass(results, rank, torch, dist)
    finally:
        dist.destroy_process_group()
    Path(cfg["out"], f"rank{rank}.json").write_text(json.dumps(results))


def _timed(fn, into: list):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - t)
    return wrapper


def _run_one(rank, size, m, name, steps, warmup, torch, dist, pipelining) -> dict:
    mod = _stage_module(size, rank)
    stage = pipelining.PipelineStage(mod, rank, 2, torch.device("cpu"))
    times: dict[str, list[float]] = {"F": [], "B": [], "loss": [], "OPT": []}
    # in-pipeline action times, as meshpipe's spans: the stage's own forward / backward calls
    stage.forward_one_chunk = _timed(stage.forward_one_chunk, times["F"])
    stage.backward_one_chunk = _timed(stage.backward_one_chunk, times["B"])
    sched = getattr(pipelining, TORCH_SCHEDULES[name])(stage, n_microbatches=m,
                                                        loss_fn=_timed(_loss, times["loss"]))
    opt = torch.optim.Adam(mod.parameters(), lr=LEARNING_RATE)
    ends, losses = [], []
    dist.barrier()
    for i in range(warmup + steps):
        x, y = _batch(size, m, i)
        if rank == 0:
            sched.step(x)
        else:
            out: list = []
            sched.step(target=y, losses=out)
            losses.append(sum(v.item() for v in out) / len(out))
        t = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=False)
        times["OPT"].append(time.perf_counter() - t)
        if i == warmup - 1:
            for v in times.values():
                v.clear()
        ends.append(time.perf_counter())
    walls = [b - a for a, b in zip(ends[warmup - 1:], ends[warmup:])]
    costs = {"F": median(times["F"]) + (median(times["loss"]) if times["loss"] else 0.0),
             "B": median(times["B"]), "OPT": median(times["OPT"])}
    mean = lambda v: sum(v) / len(v) if v else 0.0
    costs_mean = {"F": mean(times["F"]) + mean(times["loss"]), "B": mean(times["B"]), "OPT": mean(times["OPT"])}
    observed = {"affinity": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads(),
                "interop_threads": torch.get_num_interop_threads()}      # read back, not the settings
    return {"schedule": name, "m": m, "rank": rank, "observed": observed, "walls_s": walls, "step_s": median(walls),
            "step_spread": spread(walls), "costs": costs, "costs_mean": costs_mean,
            "standalone": _standalone_costs(size, rank, mod, opt, torch, dist), "losses": losses}


def _second_pass(results: list[dict], rank: int, torch, dist) -> None:
    """Time every record's stage module alone once more, after all the runs (a fresh module of the
    same shapes), and keep per kind the smaller of the two medians, as meshpipe's records do
    (`benchmarks/pipeline.py` `second_pass`): contention only inflates a standalone timing. Both
    ranks walk the records in the same order, so the barriers inside pair up."""
    for rec in results:
        size = SIZES[rec["size"]]
        mod = _stage_module(size, rank)
        opt = torch.optim.Adam(mod.parameters(), lr=LEARNING_RATE)
        first, again = rec["standalone"], _standalone_costs(size, rank, mod, opt, torch, dist)
        rec["standalone"] = {k: min(first[k], again[k]) for k in first}
        rec["standalone_passes"] = [first, again]


def _standalone_costs(size, rank, mod, opt, torch, dist, reps: int = 10) -> dict:
    """Median F, B, OPT of this rank's stage module, timed alone: rank 0 first while rank 1 waits at
    a barrier, then rank 1 — each on its own core with the other core idle, as meshpipe's stage
    programs are timed (`benchmarks.pipeline.standalone_costs`). (Timing both ranks at once, as
    before 2026-12-04, put the other core's memory traffic into torch's ideal and not into meshpipe's.)
    A backward needs its own forward here, so B always reads fresh activations."""
    x, y = _batch(size, 1, 0)
    if rank == 1:
        x = torch.randn(size.mbs, size.seq, size.d_model, requires_grad=True)
    tf, tb, to = [], [], []
    for turn in range(dist.get_world_size()):
        dist.barrier()
        if turn != rank:
            continue
        for i in range(reps + 2):
            t0 = time.perf_counter()
            out = mod(x)
            if rank == 1:
                out = _loss(out, y)
            t1 = time.perf_counter()
            if rank == 0:
                out.backward(torch.ones_like(out))
            else:
                out.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            if i >= 2:
                tf.append(t1 - t0)
                tb.append(t2 - t1)
                to.append(t3 - t2)
    opt.zero_grad()
    dist.barrier()
    return {"F": median(tf), "B": median(tb), "OPT": median(to)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pipe(runs: list[tuple[str, list[int], int]], schedules: list[str], warmup: int,
         deadline_s: float = 800.0) -> list[dict]:
    """Spawn the 2 ranks once; for every (size, ms, steps) in `runs`, every m and schedule, one record."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="meshpipe-torch-") as out:
        cfg = {"runs": runs, "schedules": schedules, "warmup": max(1, warmup), "port": _free_port(), "out": out,
               "pg_timeout_s": min(120.0, deadline_s)}
        ctx = mp.spawn(_rank_main, args=(cfg,), nprocs=2, join=False)
        deadline = time.monotonic() + deadline_s
        try:
            while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"torch pipeline ranks did not finish within {deadline_s:.0f} s")
        finally:
            for proc in ctx.processes:   # only the two ranks spawned above
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    merged = []
    for r0, r1 in zip(*ranks):
        merged.append({"size": r0["size"], "schedule": r0["schedule"], "m": r0["m"], "p": 2,
                       "step_s": r0["step_s"], "step_spread": r0["step_spread"], "walls_s": r0["walls_s"],
                       "costs": [r0["costs"], r1["costs"]], "standalone": [r0["standalone"], r1["standalone"]],
                       "standalone_passes": [r0["standalone_passes"], r1["standalone_passes"]],
                       "observed": [r0["observed"], r1["observed"]],
                       "losses": r1["losses"]})
    return merged


# ----------------------------------------------------------------------------- plain torch

def plain(size: Size, m: int, steps: int, warmup: int = 2) -> dict:
    """Whole model in one process, one thread per core it was given, m-microbatch accumulation + adam."""
    import torch
    from torch import nn

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    torch.manual_seed(0)
    model = nn.Sequential(*_layers(size))
    opt = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    times = []
    for i in range(warmup + steps):
        x, y = _batch(size, m, i)
        t = time.perf_counter()
        for xs, ys in zip(x.chunk(m), y.chunk(m)):
            (_loss(model(xs), ys) / m).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return {"size": size.name, "m": m, "threads": torch.get_num_threads(), "step_s": median(times),
            "step_spread": spread(times)}


def main(argv: list[str]) -> None:
    # through the package name, so spawned ranks unpickle `benchmarks.torch_pipe._rank_main`
    from benchmarks.torch_pipe import pipe, plain

    if len(argv) >= 4 and argv[0] == "pipe":
        runs = []
        for spec in argv[3:]:
            size, ms, steps = spec.split(":")
            runs.append((size, [int(v) for v in ms.split(",")], int(steps)))
        print(json.dumps(pipe(runs, argv[1].split(","), int(argv[2]))))
    elif len(argv) == 4 and argv[0] == "plain":
        print(json.dumps(plain(SIZES[argv[1]], int(argv[2]), int(argv[3]))))
    else:
        raise SystemExit("usage: python -m benchmarks.torch_pipe pipe SCHED,SCHED WARMUP SIZE:M,M:STEPS ...\n"
                         "       python -m benchmarks.torch_pipe plain SIZE M STEPS")

if __name__ == "__main__":
    main(sys.argv[1:])
