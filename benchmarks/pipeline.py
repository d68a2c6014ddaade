"""meshpipe's side of the pipeline benchmark: pipelined runs on Ray, the plain-JAX baseline, memory.

Pipelined runs (`measure_pipeline`): one job per (size, schedule, m) — the GPT
of `benchmarks.common.SIZES`, 2 stages, each 1 host × 1 simulated device,
mesh {data: 1} — run by `orchestrator.driver.executor.PipelineExecutor` in the
driver's Ray session, shut down in `finally`. By default each stage actor is
pinned to its own core through the product's own setting (`cluster.pin_cpus`:
host actor i → core i mod nproc, set before jax loads, so each XLA sees one
core); what each actor's step thread was really allowed to run on is read back
on the actor (`stages.telemetry.conditions`: `os.sched_getaffinity`, thread
count) and recorded as `observed`; a pinned run whose actors do not each hold one
distinct core fails. The first `warmup` steps (compile) are dropped; the rest give:
  step_s     the step period (`StepResult.wall_s`: per actor the time between
             consecutive step ends, largest over actors; the executor keeps the
             next call queued, so this is the pipeline's throughput period), as the
             median over complete executor calls of each call's mean period
             (`formulas.call_period_s`: the once-per-call Ray task boundary is in
             it); `step_median_s` is the plain median of the steps, for reference;
  standalone per stage, each compute kind (F, B, I, W, OPT) of its stage programs
             timed alone in a child process pinned to one core, before the run
             (`standalone_costs`; median of `reps`);
  ideal_s    `simulate(lowered, standalone costs)` step time, transfers free: a
             lower bound on the step (the runtime can only add to it);
  costs      per stage, median in-run span of each compute kind (a cross-check:
             `ideal_spans_s` is the same simulation from them);
  totals     per stage, median per-step summed span time of each kind.

Plain JAX (`plain_jax`, run in a child process with a given CPU affinity so
XLA sizes its thread pool for those cores): the whole model, the same global
batch and microbatch size, gradient accumulation over the m microbatches with
`lax.scan` of `value_and_grad` plus the optax (adam) update in ONE jit, on
2 cores (and on 1 core for the split-compilation comparison). Also timed: one
fused forward+backward of one microbatch (jit of value_and_grad), and the
update alone.

Memory (`residual_bytes`): per stage, the bytes its programs keep per microbatch
(`benchmarks.stage_bytes`, `jax.eval_shape` of `StageProgram.fwd` and of the
zero-bubble I): the residuals F keeps until B or I (parameters are not among them by
construction) and, for ZB-H1, what I keeps for W; `stash_timeline` of the schedule
turns them into the peak kept per stage.

Run a child by hand: `python -m benchmarks.pipeline plain-jax small 8 6`, or
`python -m benchmarks.pipeline standalone large 8 10 0:3 3:6`.
"""
from __future__ import annotations

import json
import os
import sys
import time

from benchmarks.common import (
    LEARNING_RATE, SIZES, Size, compute_actions_per_stage, critical_path_actions, median, sim_costs,
    span_costs, span_totals, spread,
)

from benchmarks.formulas import call_period_s

TIMEOUTS = {"init_s": 180.0, "step_s": 180.0, "shutdown_s": 30.0, "jax_distributed_init_s": 30.0}


def job_dict(size: Size, schedule: str, m: int, steps: int, name: str) -> dict:
    cut, n = size.cut(), size.num_layers()
    v = 2 if schedule == "interleaved-1f1b" else 1
    if v == 1:
        stages = [{"layers": [0, cut], "mesh": {"data": 1}}, {"layers": [cut, n], "mesh": {"data": 1}}]
    else:   # chunks: stage 0 holds virtual stages 0 and 2, stage 1 holds 1 and 3
        q = [0, 2, cut, cut + (n - cut) // 2, n]
        stages = [{"layers": [[q[0], q[1]], [q[2], q[3]]], "mesh": {"data": 1}},
                  {"layers": [[q[1], q[2]], [q[3], q[4]]], "mesh": {"data": 1}}]
    return {
        "run": {"name": name, "steps": steps, "seed": 0, "output_dir": "/tmp/meshpipe-bench"},
        "model": {"name": "gpt", "args": size.model_args()},
        "data": {"source": "synthetic", "global_batch": size.mbs * m, "seq_len": size.seq},
        "optimizer": {"name": "adam", "args": {"learning_rate": LEARNING_RATE}},
        "pipeline": {"schedule": schedule, "microbatches": m, "virtual_stages": v, "stages": stages},
        "layout": {"batch": "data"},
    }


CLUSTER = {"address": None, "platform": "cpu", "hosts": 2, "devices_per_host": 1, "cpus_per_host": 1.0,
           "timeouts": TIMEOUTS}


def checked_job(size: Size, schedule: str, m: int, steps: int, executor: str = "step_calls",
                steps_per_call: int | None = None, pin: bool = True):
    from orchestrator.core.config import check_job, parse_cluster, parse_job

    name = f"bench-{size.name}-{schedule}-m{m}"
    return check_job(parse_job(job_dict(size, schedule, m, steps, name)),
                     parse_cluster({**CLUSTER, "executor": executor, "steps_per_call": steps_per_call,
                                    "pin_cpus": pin}))


def stage_chunks(size: Size, schedule: str) -> list[list[tuple[int, int]]]:
    """Per stage, the layer ranges of its chunks in the benchmark job (`job_dict`)."""
    out = []
    for st in job_dict(size, schedule, 1, 1, "chunks")["pipeline"]["stages"]:
        layers = st["layers"]
        out.append([tuple(c) for c in layers] if isinstance(layers[0], list) else [tuple(layers)])
    return out


_STANDALONE: dict = {}


def standalone_costs(size: Size, schedule: str, m: int, reps: int, core: int | None = None,
                     fuse: bool = False, cache: dict | None = None) -> dict:
    """Per stage, each compute kind's cost from its stage programs timed alone (a child process
    pinned to `core`, default the last one; nothing else of the benchmark runs meanwhile).

    Returns {"stages": [{F, B, I, W, OPT}], "observed": the child's affinity and threads, "when", "load"}.
    F, B, I, W: the mean over the stage's chunks (as `simulate` takes one cost per stage and kind);
    OPT: the sum (one OPT updates every chunk). A chunk the worker fuses (`stages.actions.fused_chunks`)
    costs F = its one-program F+B, B = 0 (`fuse`: the job's pipeline.fuse_loss_chunk). Measured once per
    (size, chunk layout, fusion) per process (per `cache`, default the first pass's).
    """
    from benchmarks.common import run_child

    from orchestrator.core.schedule import generate, lower
    from stages.actions import fused_chunks

    chunks = stage_chunks(size, schedule)
    low = lower(generate(schedule, len(chunks), m, **({"v": len(chunks[0])} if len(chunks[0]) > 1 else {})))
    n = size.num_layers()
    fused = [fused_chunks([a for a in row if a is not None],
                          next((c for c, (_, b) in enumerate(cs) if b == n), None)) if fuse else frozenset()
             for row, cs in zip(low.actions, chunks)]
    key = (size.name, m, tuple(map(tuple, chunks)), tuple(map(tuple, fused)))
    _cache = _STANDALONE if cache is None else cache
    if key not in _cache:
        ranges = sorted(c for cs in chunks for c in cs)
        core = (os.cpu_count() or 1) - 1 if core is None else core
        when = {"when": time.strftime("%H:%M:%S"), "load": os.getloadavg()}
        got = run_child(["benchmarks.pipeline", "standalone", size.name, str(m), str(reps),
                         *(f"{a}:{b}" for a, b in ranges)], timeout=600, cpus=[core])
        by_range = {tuple(c["layers"]): c for c in got["chunks"]}
        stages = []
        for cs, fs in zip(chunks, fused):
            # a fused chunk (the loss chunk's F and B back to back) runs F+B as one program: F = FB, B = 0
            rs = [{**by_range[c], "F": by_range[c]["FB"], "B": 0.0} if i in fs else by_range[c]
                  for i, c in enumerate(cs)]
            d = {k: sum(r[k] for r in rs) / len(rs) for k in ("F", "B", "I", "W")}
            d["OPT"] = sum(r["OPT"] for r in rs)
            stages.append(d)
        _cache[key] = {"stages": stages, "chunks": got["chunks"], "observed": got["observed"], **when}
    return _cache[key]


def second_pass(records: list[dict], steps: int, warmup: int) -> None:
    """Time every record's stage programs alone once more, after all the runs, and keep for each
    stage and kind the smaller of the two medians; the ideal is simulated again from them.

    Contention only inflates a standalone timing, and one pass can catch a burst (measured: the
    first pass, taken while Ray's own processes were starting, put `small`'s F 17-32 % above the
    same programs timed two minutes later). Both passes are kept (`standalone.passes`)."""
    from orchestrator.core.plan import make_plan
    from orchestrator.core.schedule import simulate

    second: dict = {}
    for rec in records:
        if rec.get("status") != "ok":
            continue
        size = SIZES[rec["size"]]
        checked = checked_job(size, rec["schedule"], rec["m"], warmup + steps, rec["executor"],
                              None, rec["pin_requested"])
        again = standalone_costs(size, rec["schedule"], rec["m"], reps=max(5, steps),
                                 fuse=checked.job.pipeline.fuse_loss_chunk, cache=second)
        first = rec["standalone"]
        merged = [{k: min(a[k], b[k]) for k in a} for a, b in zip(first["stages"], again["stages"])]
        rec["standalone"] = {**first, "stages": merged,
                             "passes": [{k: v for k, v in first.items() if k != "passes"}, again]}
        low = make_plan(checked).schedule
        sim = simulate(low, sim_costs(merged))
        rec.update({"ideal_s": sim.step_time,
                    "ideal_no_opt_s": simulate(low, sim_costs(merged, opt=False)).step_time,
                    "critical_path_actions": critical_path_actions(sim, low),
                    "peak_inflight": list(sim.peak_inflight),
                    "ideal_spans": [(a.stage, str(a), start, end) for a, start, end in sim.spans]})


def standalone(size: Size, m: int, reps: int, ranges: list[tuple[int, int]], warm: int = 2) -> dict:
    """Child: the stage programs of `ranges` (consecutive layer ranges, in order) timed one at a
    time on this process's CPUs, with the operands the worker gives them on a one-device stage
    (host numpy inputs, mesh {data: 1}); median seconds of F, B, I, W (accumulating) and OPT, and on the
    loss chunk FB (F and B as one program, `StageProgram.fwd_bwd_acc`)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from orchestrator.core.data.plan import synthetic_plan
    from orchestrator.core.model.registry import build_model, build_spec
    from stages.data import microbatch, synthetic_batch
    from stages.program import StageProgram, make_optimizer
    from stages.telemetry import conditions

    spec = build_spec("gpt", size.model_args(), size.seq)
    model = build_model(spec.factory, spec.args)
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    x0, y0 = synthetic_batch(synthetic_plan(spec, size.mbs * m, 0), 0)
    xs, labels = [microbatch(x0, 0, m)], microbatch(y0, 0, m)
    ids = np.array([0, 0, 0], np.int32)

    def timed(fn, n=reps):
        out, ts = None, []
        for i in range(warm + n):
            t = time.perf_counter()
            out = jax.block_until_ready(fn())
            if i >= warm:
                ts.append(time.perf_counter() - t)
        return median(ts), out

    chunks = []
    for a, b in ranges:
        prog = StageProgram(spec, model, a, b, microbatches=m, mesh=mesh, layout={"batch": "data"},
                            optimizer=make_optimizer("adam", {"learning_rate": LEARNING_RATE}))
        params = prog.init_params(0)
        opt_state, grads = prog.init_state(params)
        lab = labels if prog.last else None
        f, (y, res) = timed(lambda: prog.fwd(params, xs, lab, ids))
        dys = None if prog.last else [np.ones(y[i].shape, np.dtype(y[i].dtype)) for i in prog.out_diff]
        bw, _ = timed(lambda: prog.bwd_acc(params, res, dys, grads))
        i_s, (_, held) = timed(lambda: prog.bwd_i(params, res, dys))
        w_s, _ = timed(lambda: prog.bwd_w_acc(params, held, grads))
        state = [params, opt_state, grads]

        def opt():
            state[:] = prog.update(*state)
            return state[0]
        one = {}
        if prog.last:           # F and B as one program (the worker fuses them where they are back to back)
            acc = [prog.init_state(params)[1]]

            def fb():
                loss, _, acc[0] = prog.fwd_bwd_acc(params, xs, lab, ids, acc[0])
                return acc[0]
            one["FB"], _ = timed(fb)
        o, _ = timed(opt)
        chunks.append({"layers": [a, b], "F": f, "B": bw, "I": i_s, "W": w_s, "OPT": o, **one})
        if not prog.last:
            xs = [np.asarray(leaf) for leaf in y]
    return {"size": size.name, "m": m, "chunks": chunks, "observed": conditions()}


def measure_pipeline(size: Size, schedule: str, m: int, *, steps: int, warmup: int, pin: bool = True,
                     executor: str = "step_calls", steps_per_call: int | None = None) -> dict:
    """One pipelined run in the connected Ray session; a dict of raw measurements (see module doc)."""
    from orchestrator.core.plan import make_plan
    from orchestrator.core.schedule import simulate
    from orchestrator.driver.executor import PipelineExecutor

    rec: dict = {"size": size.name, "schedule": schedule, "m": m, "p": 2, "pin_requested": pin,
                 "executor": executor}
    try:
        checked = checked_job(size, schedule, m, warmup + steps, executor, steps_per_call, pin)
        rec["steps_per_call"] = checked.cluster.calls_of_steps
        plan = make_plan(checked)
    except Exception as e:  # noqa: BLE001 - an unsupported configuration is a result, not a crash
        return {**rec, "status": f"unsupported (config): {_first_line(e)}"}
    alone = standalone_costs(size, schedule, m, reps=max(5, steps),      # before the actors start
                             fuse=checked.job.pipeline.fuse_loss_chunk)
    source = checked.data
    ex = PipelineExecutor(checked, plan.schedule, source, f"bench-{size.name}-{schedule}-m{m}")
    walls, spans, losses, stash, observed, live = [], [], [], {}, {}, {}
    t0 = time.perf_counter()
    try:
        ex.start()
        rec["startup_s"] = time.perf_counter() - t0
        for r in ex.steps(warmup + steps):
            if r.step >= warmup:
                walls.append(r.wall_s)
                spans.append(r.spans)
                for st in r.stats:       # measured on the actors: peak bytes/device of the step's stash
                    if st.get("host") == 0 and "stash_peak_bytes" in st:
                        s_ = st["stage"]
                        stash[s_] = max(stash.get(s_, (0, 0)), (st["stash_peak_bytes"], st["stash_peak_items"]))
                        live[s_] = max(live.get(s_, 0), st.get("live_peak_bytes", 0))
                    if "affinity" in st:     # read back on the actor's step thread
                        observed[(st["stage"], st.get("host", 0))] = {"affinity": st["affinity"],
                                                                      "os_threads": st.get("os_threads")}
            losses.append(r.loss)
        rec["run_s"] = time.perf_counter() - t0 - rec["startup_s"]
    except Exception as e:  # noqa: BLE001
        return {**rec, "status": f"unsupported (runtime): {_first_line(e)}"}
    finally:
        t1 = time.perf_counter()
        ex.shutdown()
        rec["shutdown_s"] = time.perf_counter() - t1
    p = plan.schedule.p
    obs = [{"stage": s_, "host": h, **o} for (s_, h), o in sorted(observed.items())]
    check_pinning(obs, pin, f"{size.name} {schedule} m={m}")
    costs = span_costs(spans, p)
    sim = simulate(plan.schedule, sim_costs(alone["stages"]))
    sim0 = simulate(plan.schedule, sim_costs(alone["stages"], opt=False))
    totals = span_totals(spans, p)
    step = call_period_s(walls, warmup, rec["steps_per_call"])
    return {
        **rec, "status": "ok", "steps": len(walls), "step_s": step, "step_median_s": median(walls),
        "step_spread": spread(walls),
        "walls_s": walls, "observed": obs, "standalone": alone, "costs": costs, "totals": totals,
        "ideal_s": sim.step_time, "ideal_no_opt_s": sim0.step_time,
        "ideal_spans_s": simulate(plan.schedule, sim_costs(costs)).step_time,
        "busy_s": [sum(t.get(k, 0.0) for k in ("F", "B", "I", "W")) for t in totals],
        "compute_actions_per_stage": compute_actions_per_stage(plan.schedule),
        "critical_path_actions": critical_path_actions(sim, plan.schedule),
        "peak_inflight": list(sim.peak_inflight),
        "losses": losses,
        "stash_peak_bytes": [stash.get(s, (None, None))[0] for s in range(p)],
        "stash_peak_items": [stash.get(s, (None, None))[1] for s in range(p)],
        # the runtime's own list of live device buffers (jax.live_arrays) at the steps' peak, busiest device
        "live_peak_bytes": [live.get(s) for s in range(p)],
        "example_spans": [list(s) for s in spans[len(spans) // 2]] if spans else [],
        "ideal_spans": [(a.stage, str(a), start, end) for a, start, end in sim.spans],
    }


def check_pinning(observed: list[dict], pin: bool, what: str) -> None:
    """A pinned run must show, read back on every actor, one core each and no two on the same core.

    Example:
        >>> check_pinning([{"stage": 0, "affinity": [0]}, {"stage": 1, "affinity": [1]}], True, "x")
        >>> check_pinning([{"stage": 0, "affinity": [0, 1]}], True, "x")
        Traceback (most recent call last):
        ...
        RuntimeError: x: pinning was requested but the actors read back [[0, 1]] (one distinct core each expected)
    """
    if not pin:
        return
    cores = [o["affinity"] for o in observed]
    if not cores or any(len(c) != 1 for c in cores) or len({c[0] for c in cores}) != len(cores):
        raise RuntimeError(f"{what}: pinning was requested but the actors read back {cores} "
                           "(one distinct core each expected)")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


# ----------------------------------------------------------------------------- plain JAX (child process)

def plain_jax(size: Size, m: int, steps: int) -> dict:
    """The plain single-process step (one jit: scan of value_and_grad over m microbatches + adam)."""
    import jax
    import jax.numpy as jnp
    import optax

    from orchestrator.core.data.plan import synthetic_plan
    from stages.data import microbatch, synthetic_batch
    from orchestrator.core.model.registry import build_model, build_spec

    spec = build_spec("gpt", size.model_args(), size.seq)
    model = build_model(spec.factory, spec.args)
    params = [jax.jit(part.init)(jax.random.key(0)) for part in model.parts]
    tx = optax.adam(LEARNING_RATE)
    opt_state = tx.init(params)

    def loss_fn(p, x, y):
        for part, lp in zip(model.parts, p):
            x = part.apply(lp, x)
        return model.loss(x, y)

    grad_fn = jax.value_and_grad(loss_fn)

    def train_step(p, s, xs, ys):
        def body(acc, xy):
            loss, g = grad_fn(p, *xy)
            return jax.tree.map(jnp.add, acc, g), loss
        zero = jax.tree.map(jnp.zeros_like, p)
        g, losses = jax.lax.scan(body, zero, (xs, ys))
        g = jax.tree.map(lambda t: t / m, g)
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s, jnp.mean(losses)

    def update(p, s, g):
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    step_jit = jax.jit(train_step, donate_argnums=(0, 1))
    mb_jit = jax.jit(grad_fn)
    upd_jit = jax.jit(update, donate_argnums=(0, 1))
    source = synthetic_plan(spec, size.mbs * m, 0)

    def batch(i):
        x, y = synthetic_batch(source, i)
        return (jnp.asarray(x.reshape(m, size.mbs, *x.shape[1:])), jnp.asarray(y.reshape(m, size.mbs, *y.shape[1:])))

    step_times, losses = [], []
    warm = 2
    for i in range(warm + steps):
        xs, ys = batch(i)
        t = time.perf_counter()
        params, opt_state, loss = step_jit(params, opt_state, xs, ys)
        jax.block_until_ready(params)
        if i >= warm:
            step_times.append(time.perf_counter() - t)
        losses.append(float(loss))
    x0, y0 = synthetic_batch(source, 0)
    x1, y1 = jnp.asarray(microbatch(x0, 0, m)), jnp.asarray(microbatch(y0, 0, m))
    mb_times = []
    for i in range(warm + max(steps, 5)):
        t = time.perf_counter()
        out = mb_jit(params, x1, y1)
        jax.block_until_ready(out)
        if i >= warm:
            mb_times.append(time.perf_counter() - t)
    g = out[1]
    upd_times = []
    for i in range(warm + max(steps, 5)):
        t = time.perf_counter()
        params, opt_state = upd_jit(params, opt_state, g)
        jax.block_until_ready(params)
        if i >= warm:
            upd_times.append(time.perf_counter() - t)
    return {"size": size.name, "m": m, "cores": len(os.sched_getaffinity(0)), "step_s": median(step_times),
            "step_spread": spread(step_times), "fused_mb_s": median(mb_times), "update_s": median(upd_times),
            "losses": losses}


# ----------------------------------------------------------------------------- memory (driver, shapes only)

def residual_bytes(size: Size) -> list[dict]:
    """Per stage of the 2-stage cut, bytes per microbatch from the stage programs' own outputs
    (`benchmarks.stage_bytes.kept_bytes`): residual_bytes (F keeps them until B or I), held_bytes
    (I keeps them for W), output_bytes, param_bytes, residual_leaves."""
    from orchestrator.core.model.registry import build_model, build_spec
    from benchmarks.stage_bytes import kept_bytes, stage_operands
    from stages.program import StageProgram, make_optimizer

    spec = build_spec("gpt", size.model_args(), size.seq)
    model = build_model(spec.factory, spec.args)
    out = []
    for start, stop in ((0, size.cut()), (size.cut(), size.num_layers())):
        prog = StageProgram(spec, model, start, stop, microbatches=1,
                            optimizer=make_optimizer("adam", {"learning_rate": LEARNING_RATE}))
        k = kept_bytes(prog, *stage_operands(prog, size.mbs, size.seq, size.d_model))
        out.append({"layers": [start, stop], "residual_bytes": k["F"], "held_bytes": k["I"],
                    "output_bytes": k["output"], "param_bytes": k["param"], "residual_leaves": k["residual_leaves"]})
    return out


def main(argv: list[str]) -> None:
    if len(argv) == 4 and argv[0] == "plain-jax":
        print(json.dumps(plain_jax(SIZES[argv[1]], int(argv[2]), int(argv[3]))))
        return
    if len(argv) >= 5 and argv[0] == "standalone":
        ranges = [tuple(int(v) for v in r.split(":")) for r in argv[4:]]
        print(json.dumps(standalone(SIZES[argv[1]], int(argv[2]), int(argv[3]), ranges)))
        return
    raise SystemExit("usage: python -m benchmarks.pipeline plain-jax SIZE M STEPS\n"
                     "       python -m benchmarks.pipeline standalone SIZE M REPS START:STOP [START:STOP ...]")


if __name__ == "__main__":
    main(sys.argv[1:])
