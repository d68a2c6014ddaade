"""Step time of two meshpipe source trees, alternated: is a refactor free?

Run:  python -m benchmarks.trees --before DIR [--before-python PY] [--sizes tiny,large]
                                 [--pairs 6] [--steps 40] [--warmup 8] [--quiet-s 5] [--out FILE]

Each measurement is one child process in one tree (`TREE/… python -m benchmarks.trees
child SIZE STEPS WARMUP`, with that tree first on its path and its own venv's python): an
embedded Ray, the pipeline benchmark's job (`benchmarks.pipeline.checked_job`: the GPT of
`benchmarks.common.SIZES`, 2 stages × 1 host × 1 CPU device, 1F1B, m=8, stage actors pinned
to their own core, the default executor), run by the tree's own `PipelineExecutor`; the step
period is `benchmarks.formulas.call_period_s` of the steps after `warmup` (compile). The
child prints JSON: the period, the steps' periods, the affinity each actor's step thread read
back, the load average before and after, and the CPU seconds per measured step of every process
on the machine by role (`_cpu_by_role`: the stage actors — their XLA compute threads apart —,
the driver, Ray's processes, the rest).

Where the rule is a few per cent (a refactor's cost at `tiny`), use `benchmarks.interleaved`:
one child after the other, the pairs here compare two stretches of this VM as much as two
trees (the same code runs up to 2× faster or slower in phases of seconds); there both trees
are up at once and take turns.

The parent runs the two trees in pairs (before then after, then after then before, ...:
`benchmarks.paired.block_order`), so a drift of the shared machine over a pair cancels in the
pair's ratio after ÷ before; it reports per size the median ratio, its order-statistic
interval (`benchmarks.paired.median_interval`) and the spread of the ratios, each order's median
apart, and the same for the step's non-compute share (`_busiest_compute_s`): on this VM the
same XLA programs ran ~35 % faster or slower from one process to the next (2026-12-06), which
moves the wall ratio by far more than a refactor's cost; the share is normalised by the compute
the run actually got (how much steadier it is has not been measured yet). The child of the
"before" tree runs this file from the "after" tree (it only needs the executor API both
trees share), so the before tree needs no copy of it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
M, SCHEDULE = 8, "1f1b"


def child(size_name: str, steps: int, warmup: int) -> dict:
    """One pipelined run in this process's tree (see the module docstring)."""
    import ray

    from benchmarks.common import SIZES
    from benchmarks.formulas import call_period_s
    from benchmarks.pipeline import checked_job
    from orchestrator.core.plan import make_plan
    from orchestrator.driver import placement
    from orchestrator.driver.executor import PipelineExecutor

    load0 = os.getloadavg()
    checked = checked_job(SIZES[size_name], SCHEDULE, M, warmup + steps)
    plan = make_plan(checked)
    placement.connect(checked.cluster, namespace=f"meshpipe-trees-{size_name}")
    ex = PipelineExecutor(checked, plan.schedule, checked.data, f"trees-{size_name}")
    walls, affinity, shares, cpu0 = [], {}, [], None
    try:
        ex.start()
        if warmup == 0:
            cpu0 = _cpu_by_role()
        for r in ex.steps(warmup + steps):
            if r.step == warmup - 1:
                cpu0 = _cpu_by_role()
            if r.step >= warmup:
                walls.append(r.wall_s)
                shares.append(1.0 - _busiest_compute_s(r.spans) / r.wall_s)
                for st in r.stats:
                    if "affinity" in st:
                        affinity[f"{st['stage']}/{st.get('host', 0)}"] = st["affinity"]
        cpu1 = _cpu_by_role()
    finally:
        ex.shutdown()
        ray.shutdown()
    cpu = {k: (cpu1[k] - cpu0.get(k, 0.0)) / len(walls) for k in cpu1}      # CPU seconds per measured step
    return {"cpu_per_step_s": cpu, "step_s": call_period_s(walls, warmup, checked.cluster.calls_of_steps), "walls_s": walls,
            "noncompute_share": statistics.median(shares), "affinity": affinity, "load_before": load0, "load_after": os.getloadavg()}


def _busiest_compute_s(spans) -> float:
    """Of one step's spans (stage, host, action text, start, end): the compute (F, B, I, W) and
    update (OPT) seconds of the busiest stage host. `1 - that / wall` is the step's non-compute share
    (the bubble, transfers, the runtime's own time): a figure that holds still when the machine's
    speed for the same XLA programs moves between runs, as the wall time does not."""
    from orchestrator.core.schedule import Action, Kind

    busy: dict = {}
    kinds = {Kind.F, Kind.B, Kind.I, Kind.W, Kind.OPT}
    for stage, host, text, t0, t1 in spans:
        if Action.parse(text).kind in kinds:
            busy[(stage, host)] = busy.get((stage, host), 0.0) + (t1 - t0)
    return max(busy.values(), default=0.0)


def _cpu_by_role() -> dict:
    """CPU seconds (user + system) so far of every process on the machine, summed by role: the
    stage actors (`ray::StageWorker`), this driver, Ray's own processes, everything else; the
    actors' also by thread: XLA's compute pool (`tf_XLAEigen`), the threads named after the actor
    (the step thread — XLA:CPU runs part of each program on the calling thread —, the transport's,
    Ray's executor's), Ray's others. The stage actors are pinned
    to one core each and the machine has two: what the others take is taken from the actors.
    When the same XLA programs take more XLA-thread CPU in one run than in another, the process,
    not the tree, ran slower."""
    import psutil

    out = {"stage_actors": 0.0, "driver": 0.0, "ray": 0.0, "other": 0.0}
    for p in psutil.process_iter(["pid", "name", "cmdline", "cpu_times"]):
        t = p.info["cpu_times"]
        if t is None:
            continue
        cmd = " ".join(p.info["cmdline"] or [])[:300] + " " + (p.info["name"] or "")
        role = ("driver" if p.info["pid"] == os.getpid() else "stage_actors" if "StageWorker" in cmd
                else "ray" if any(n in cmd for n in ("raylet", "gcs_server", "ray::", "dashboard", "log_monitor", "ray/"))
                else "other")
        out[role] += t.user + t.system
        if role == "stage_actors":      # and by thread: XLA's compute pool, the actor's own threads, Ray's
            for name, cpu_s in _threads(p.info["pid"]):
                kind = "xla" if name.startswith("tf_XLA") else "own" if name.startswith("ray::") else "other"
                out[f"actor_{kind}"] = out.get(f"actor_{kind}", 0.0) + cpu_s
    return out


def _threads(pid: int) -> list[tuple[str, float]]:
    """(name with its digits dropped, CPU seconds) of each thread of `pid` (Linux /proc)."""
    out, tick = [], os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        out.append((name.rstrip("0123456789_-"), (int(rest[11]) + int(rest[12])) / tick))
    return out


def run_tree(tree: Path, python: str, size: str, steps: int, warmup: int, timeout: float, quiet_s: float = 5.0) -> dict:
    from benchmarks.common import run_in_tree, settle

    settle_s = settle(quiet_s=quiet_s)
    return {**run_in_tree(str(Path(__file__).resolve()), tree, python, [size, str(steps), str(warmup)], timeout),
            "settle_s": settle_s}


def _roles(run: dict) -> str:
    return " ".join(f"{k}={v:.3f}" for k, v in run["cpu_per_step_s"].items() if k != "stage_actors")


def _xla(run: dict) -> float:
    return run["cpu_per_step_s"].get("actor_xla") or float("nan")


def compare(trees: dict, sizes: list[str], pairs: int, steps: int, warmup: int, timeout: float,
            quiet_s: float = 5.0) -> dict:
    from benchmarks.paired import block_order, median_interval

    out: dict = {"m": M, "schedule": SCHEDULE, "steps": steps, "warmup": warmup, "quiet_s": quiet_s, "sizes": {}}
    for size in sizes:
        runs = []
        for i in range(pairs):
            pair = {}
            for name in block_order(i, ("before", "after")):
                tree, python = trees[name]
                pair[name] = run_tree(tree, python, size, steps, warmup, timeout, quiet_s)
            pair["ratio"] = pair["after"]["step_s"] / pair["before"]["step_s"]
            pair["share_ratio"] = pair["after"]["noncompute_share"] / pair["before"]["noncompute_share"]
            runs.append(pair)
            print(f"{size} pair {i}: before {pair['before']['step_s'] * 1e3:.2f} ms, after "
                  f"{pair['after']['step_s'] * 1e3:.2f} ms, ratio {pair['ratio']:.3f}; non-compute share "
                  f"{pair['before']['noncompute_share']:.3f} -> {pair['after']['noncompute_share']:.3f}; CPU s/step "
                  f"{_roles(pair['before'])} -> {_roles(pair['after'])}", file=sys.stderr, flush=True)
        ratios = [p["ratio"] for p in runs]
        by_order = [[r for i, r in enumerate(ratios) if i % 2 == k] for k in (0, 1)]   # before first / after first
        out["sizes"][size] = {
            "ratio_median": statistics.median(ratios), "ratios": ratios,
            "ratio_spread": [min(ratios), max(ratios)], "interval": median_interval(ratios, 0.75),
            "before_ms": [p["before"]["step_s"] * 1e3 for p in runs],
            "after_ms": [p["after"]["step_s"] * 1e3 for p in runs],
            "ratio_median_before_first": statistics.median(by_order[0]),
            "noncompute_share_ratio_median": statistics.median(p["share_ratio"] for p in runs),
            "noncompute_share_ratios": [p["share_ratio"] for p in runs],
            "ratio_median_after_first": statistics.median(by_order[1]) if by_order[1] else None,
            # the same XLA programs' CPU per step (benchmarks.same_programs checks they are the same):
            # its ratio is the two processes' speed; wall ÷ that ratio is the step with it divided out
            "xla_cpu_ratios": [_xla(p["after"]) / _xla(p["before"]) for p in runs],
            "wall_per_xla_cpu_ratio_median": statistics.median(p["ratio"] * _xla(p["before"]) / _xla(p["after"])
                                                               for p in runs),
            "cpu_per_step_s": {k: [p[k]["cpu_per_step_s"] for p in runs] for k in ("before", "after")},
            "settle_s": [p[k]["settle_s"] for p in runs for k in ("before", "after")],
            "affinity": [p[k]["affinity"] for p in runs for k in ("before", "after")],
            "load": [[p[k]["load_before"][0], p[k]["load_after"][0]] for p in runs for k in ("before", "after")]}
    return out


def main(argv: list[str]) -> None:
    if argv and argv[0] == "child":
        print(json.dumps(child(argv[1], int(argv[2]), int(argv[3]))))
        return
    from benchmarks.common import before_tree, emit, machine_info, two_tree_args

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    two_tree_args(ap)
    ap.add_argument("--sizes", default="tiny,large")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--quiet-s", type=float, default=5.0, help="seconds to wait once the previous child's Ray is gone")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.pairs < 1:
        ap.error(f"--steps {args.steps}, --warmup {args.warmup}, --pairs {args.pairs}: need steps >= 1, "
                 "warmup >= 0, pairs >= 1")
    trees = {"before": before_tree(ap, args),
             "after": (HERE, sys.executable)}
    t0, machine = time.time(), machine_info()
    result = {"machine": machine, **compare(trees, args.sizes.split(","), args.pairs, args.steps, args.warmup,
                                            args.timeout, args.quiet_s),
              "trees": {k: str(v[0]) for k, v in trees.items()}, "wall_s": time.time() - t0, "nproc": os.cpu_count()}
    emit(result, args.out)

if __name__ == "__main__":
    main(sys.argv[1:])
