"""Checkpoint benchmark: blocking time of a save vs a step, total save overhead, restore time, bytes.

    PYTHONPATH=. python -m benchmarks.checkpoint [--size tiny|small|large] [--steps 40] [--every 20]

Four runs of the same 2-stage GPT (`benchmarks.common.SIZES`; stage 0 {data: 2}, stage 1
{model: 2}, 1F1B, m = 4, adam, stage actors pinned one per core by `cluster.pin_cpus`, the
affinity read back from the actors) on an embedded local Ray, in the order A B A:
  1. no checkpoint, `steps` steps: the baseline wall time (sum of step periods, first step
     excluded: it compiles);
  2. `checkpoint.every_steps = every` (async): per save the blocking seconds on the step
     thread (the stage worker's own clock around orbax's `save`, max over hosts), the
     background write seconds, bytes on disk and array bytes;
  3. the baseline again: the two baselines' difference is the run-to-run noise, reported next
     to the overhead (run 2's wall minus the baselines' mean, over that mean);
  4. resume from run 2's oldest kept commit for one step: the restore seconds (stage setup's
     restore, max over hosts).
Run 2 is also measured against itself, which no drift between runs can disturb: the steps a
save can touch (the step after it and those its background write overlaps) minus the run's
median step elsewhere, summed (`in_run_excess_s`).
It records what it observed (load average before and after, cpu count, the actors' affinity,
the versions) and the quantities; it asserts nothing about them. On a shared machine label them
as such. Bytes check: array bytes must equal parameter bytes × 3 (adam's mu and nu) + one int32
count per stage — the run fails otherwise (a figure that cannot be true is not published).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import RESULTS, SIZES, machine_info


def job(size, name: str, steps: int, out: Path, ckpt: Path | None, every: int) -> dict:
    m = 4
    raw = {
        "run": {"name": name, "steps": steps, "seed": 0, "output_dir": str(out)},
        "model": {"name": "gpt", "args": {"vocab": size.vocab, "d_model": size.d_model, "heads": size.heads,
                                          "d_mlp": size.d_mlp, "blocks": size.blocks}},
        "data": {"source": "synthetic", "global_batch": m * size.mbs, "seq_len": size.seq},
        "optimizer": {"name": "adam", "args": {"learning_rate": 1e-3}},
        "pipeline": {"schedule": "1f1b", "microbatches": m,
                     "stages": [{"layers": [0, 1 + size.blocks // 2], "mesh": {"data": 2}},
                                {"layers": [1 + size.blocks // 2, size.blocks + 2], "mesh": {"model": 2}}]},
        "layout": {"batch": "data", "heads": "model", "mlp": "model", "vocab": "model"},
    }
    if ckpt is not None:
        raw["checkpoint"] = {"dir": str(ckpt), "every_steps": every, "keep": 2, "async": True}
    return raw


def run(raw: dict, resume=None) -> dict:
    from orchestrator.core.config import check_job, parse_cluster, parse_job
    from orchestrator.driver.runner import run_job

    checked = check_job(parse_job(raw), parse_cluster({"hosts": 2, "devices_per_host": 2, "pin_cpus": True}))
    return run_job(checked, echo=lambda s: None, keep_params=True, resume=resume)


def observed(result: dict) -> dict:
    """Each stage host's CPU affinity and thread count as its actor read them back (last step)."""
    hosts = (result.get("telemetry") or {}).get("hosts_last", {})
    return {who: {k: h.get(k) for k in ("affinity", "os_threads")} for who, h in hosts.items()}


def in_run_excess(times: list[float], commits: list[dict], wall: float) -> dict:
    """The save windows' excess over the run's own median step elsewhere.

    A save after `steps_done` = k lands in step k's period (index k: the blocking part) and its
    background write overlaps the next ceil(write_s / step) steps. Step 0 (compilation) is left out.
    """
    if len(times) < 3:
        return {}
    med = statistics.median(times[1:])
    window: set[int] = set()
    for c in commits:
        span = 1 + math.ceil(c.get("write_s", 0.0) / med)
        window.update(i for i in range(c["step"], c["step"] + span) if 0 < i < len(times))
    rest = [t for i, t in enumerate(times) if i > 0 and i not in window]
    if not rest:
        return {}
    ref = statistics.median(rest)
    excess = sum(times[i] - ref for i in window)
    return {"in_run_excess_s": excess, "in_run_excess_fraction": excess / wall, "save_window_steps": len(window)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--out", default=str(RESULTS / "checkpoint.json"))
    args = ap.parse_args(argv)
    size = SIZES[args.size]
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="meshpipe-ckpt-bench-"))
    try:
        base = run(job(size, "base", args.steps, work / "runs", None, args.every))
        saved = run(job(size, "saved", args.steps, work / "runs", work / "ck", args.every))
        base2 = run(job(size, "base2", args.steps, work / "runs", None, args.every))
        from orchestrator.core.checkpoint import committed

        first = committed(work / "ck")[0]["step"]     # the oldest one `keep: 2` left
        (work / "ck2").mkdir()
        shutil.copytree(work / "ck" / f"step_{first:08d}", work / "ck2" / f"step_{first:08d}")
        resumed = run(job(size, "resumed", first + 1, work / "runs", work / "ck2", args.every), resume="latest")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    param_bytes = sum(a.nbytes for a in saved["params"].values())
    commits = saved["checkpoint"]["commits"]
    expected = 3 * param_bytes + 4 * 2
    if any(c["array_bytes"] != expected for c in commits):
        raise SystemExit(f"array bytes {[c['array_bytes'] for c in commits]} != params x 3 + counts = {expected}")
    walls = [sum(r["step_times_s"][1:]) for r in (base, saved, base2)]
    wall_base = (walls[0] + walls[2]) / 2
    step_med = statistics.median(base["step_times_s"][1:] + base2["step_times_s"][1:])
    result = {
        "conditions": {"load_before": load_before, "load_after": os.getloadavg(), "cpus": os.cpu_count(),
                       "machine": machine_info(), "size": args.size, "steps": args.steps, "every": args.every,
                       "actors": observed(saved)},
        "step_s_median": step_med,
        "saves": commits,
        "blocking_over_step": [c["blocking_s"] / step_med for c in commits],
        "wall_s": {"baseline": walls[0], "with_checkpoints": walls[1], "baseline_again": walls[2]},
        "noise_fraction": abs(walls[2] - walls[0]) / wall_base,
        # negative cannot be true: the machine's noise exceeded the effect; not published as a number
        "overhead_fraction": (walls[1] - wall_base) / wall_base if walls[1] >= wall_base else None,
        **in_run_excess(saved["step_times_s"], commits, walls[1]),
        "step_times_s": {"baseline": base["step_times_s"], "with_checkpoints": saved["step_times_s"],
                         "baseline_again": base2["step_times_s"]},
        "restore_s": resumed["checkpoint"]["restore_s"],
        "param_bytes": param_bytes, "param_plus_adam_bytes": expected,
        "resumed_loss_equal": resumed["losses"][first] == saved["losses"][first],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: v for k, v in result.items() if k != "conditions"}, indent=1, default=str))
    return result


if __name__ == "__main__":
    main()
