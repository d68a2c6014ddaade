"""Where a stage worker's per-action time goes: step-thread CPU time and a cProfile, per action.

Run:  python -m benchmarks.action_profile [--size tiny] [--schedule 1f1b] [--m 8] [--steps 40]
                                          [--warmup 6] [--top 25] [--out DIR] [--no-pin]

One real pipelined run (Ray, 2 stages × 1 host × 1 CPU device, the job of
`benchmarks.pipeline.job_dict`) with a `ProfileHook` in every stage worker. The hook runs
at the start of each step on the worker's step thread and, in that thread only:
  - steps [warmup, warmup + steps): records the thread's CPU time (`time.thread_time`),
    the process's (`time.process_time`: every thread, XLA's and the transport readers'
    too) and wall time — no profiler on, so these are the runtime's own costs;
  - steps [warmup + steps, warmup + 2·steps): the same steps under `cProfile` (the step
    thread only), dumped to DIR/stage<s>.prof.
It checks every step ran on the same thread (thread CPU time is per thread).

Printed per stage: step-thread CPU ms per action (all actions of the stage's list, and
per compute action as the pipeline benchmark's overhead divides), process CPU per action,
and the cProfile's top functions by own time with calls per step. On `tiny` every
program is almost free, so the step thread's CPU time is nearly all Python and dispatch:
the figure robust under load (CPU time does not grow when the machine is busy, wall
time does) that a change to the runtime's per-action path is judged by. It is a
diagnostic, not a published figure: the published figures come from `benchmarks.run`.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from stages.hooks import WorkerHook

_STATE: dict = {}      # per actor process: what the hook keeps between steps


@dataclass(frozen=True)
class ProfileHook(WorkerHook):
    """Measure steps [warmup, warmup+steps) and profile [warmup+steps, warmup+2·steps) (module doc)."""

    out_dir: str
    warmup: int
    steps: int

    def on_step(self, cfg, step: int) -> None:
        import cProfile

        marks = (self.warmup, self.warmup + self.steps, self.warmup + 2 * self.steps)
        if step < marks[0] or step > marks[2]:
            return
        tid = threading.get_ident()
        if _STATE.setdefault("tid", tid) != tid:
            raise RuntimeError(f"step {step} ran on another thread than step {self.warmup}: thread CPU "
                               "time cannot be compared across threads")
        now = (time.thread_time(), time.process_time(), time.perf_counter())
        if step == marks[0]:
            _STATE["t0"] = now
        elif step == marks[1]:
            t0 = _STATE["t0"]
            _STATE["measured"] = {"thread_cpu_s": now[0] - t0[0], "process_cpu_s": now[1] - t0[1],
                                  "wall_s": now[2] - t0[2]}
            _STATE["prof"] = prof = cProfile.Profile()
            prof.enable()
        if step == marks[2]:
            _STATE["prof"].disable()
            out = Path(self.out_dir)
            _STATE["prof"].dump_stats(str(out / f"stage{cfg.stage}.prof"))
            (out / f"stage{cfg.stage}.json").write_text(json.dumps({
                **_STATE["measured"], "steps": self.steps, "actions": list(cfg.stage_spec.actions),
                "pid": os.getpid(), "affinity": sorted(os.sched_getaffinity(0))}))


def compute_actions(actions: list[str]) -> int:
    """F, B, I, W, OPT in a stage's action texts (as the pipeline benchmark's N counts them).

    Example:
        >>> compute_actions(["0F0", "0SEND_F0", "0RECV_B0", "0B0", "0OPT"])
        3
    """
    from orchestrator.core.schedule import Action, Kind

    return sum(Action.parse(t).kind in (Kind.F, Kind.B, Kind.I, Kind.W, Kind.OPT) for t in actions)


def report(out_dir: Path, stages: int, top: int) -> dict:
    """Per stage: CPU per action from the unprofiled steps, and the profile's top own-time functions."""
    import pstats

    result = {}
    for s in range(stages):
        meta = json.loads((out_dir / f"stage{s}.json").read_text())
        n, k, steps = len(meta["actions"]), compute_actions(meta["actions"]), meta["steps"]
        per = {"thread_cpu_ms_per_action": meta["thread_cpu_s"] / steps / n * 1e3,
               "thread_cpu_ms_per_compute_action": meta["thread_cpu_s"] / steps / k * 1e3,
               "process_cpu_ms_per_action": meta["process_cpu_s"] / steps / n * 1e3,
               "wall_ms_per_step": meta["wall_s"] / steps * 1e3, "actions": n, "compute_actions": k,
               "affinity": meta["affinity"]}
        st = pstats.Stats(str(out_dir / f"stage{s}.prof"))
        rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]
        per["top"] = [{"fn": f"{Path(f).name}:{line}({name})", "calls_per_step": nc / steps,
                       "own_us_per_step": tt / steps * 1e6, "cum_us_per_step": ct / steps * 1e6}
                      for (f, line, name), (_, nc, tt, ct, _) in rows]
        per["profiled_us_per_step"] = sum(v[2] for v in st.stats.values()) / steps * 1e6
        result[s] = per
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-pin", action="store_true")
    args = ap.parse_args()

    import logging

    import ray

    from benchmarks.common import SIZES
    from benchmarks.pipeline import checked_job
    from orchestrator.core.plan import make_plan
    from orchestrator.driver.executor import PipelineExecutor

    out = Path(args.out or tempfile.mkdtemp(prefix="meshpipe-action-profile-"))
    out.mkdir(parents=True, exist_ok=True)
    size = SIZES[args.size]
    total = args.warmup + 2 * args.steps + 1
    checked = checked_job(size, args.schedule, args.m, total, pin=not args.no_pin)
    plan = make_plan(checked)
    load0 = os.getloadavg()
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level=logging.WARNING,
             _system_config={"worker_niceness": 0})
    ex = PipelineExecutor(checked, plan.schedule, checked.data, f"profile-{size.name}-{args.schedule}",
                          hooks=[ProfileHook(str(out), args.warmup, args.steps)])
    walls = []
    try:
        ex.start()
        for r in ex.steps(total):
            if args.warmup <= r.step < args.warmup + args.steps:
                walls.append(r.wall_s)
    finally:
        ex.shutdown()
        ray.shutdown()
    walls.sort()
    res = {"size": size.name, "schedule": args.schedule, "m": args.m, "steps": args.steps,
           "load_before": load0, "load_after": os.getloadavg(),
           "median_step_ms": walls[len(walls) // 2] * 1e3, "stages": report(out, len(plan.schedule.actions), args.top)}
    (out / "summary.json").write_text(json.dumps(res, indent=1))
    print(f"{size.name} {args.schedule} m={args.m}: median step {res['median_step_ms']:.2f} ms (unprofiled steps), "
          f"load {load0[0]:.2f} -> {res['load_after'][0]:.2f}; files in {out}")
    for s, per in res["stages"].items():
        print(f"stage {s}: {per['actions']} actions ({per['compute_actions']} compute), affinity {per['affinity']}: "
              f"step-thread CPU {per['thread_cpu_ms_per_action']:.4f} ms/action "
              f"({per['thread_cpu_ms_per_compute_action']:.4f} per compute action), process CPU "
              f"{per['process_cpu_ms_per_action']:.4f} ms/action, wall {per['wall_ms_per_step']:.2f} ms/step")
        print(f"  profiled own time {per['profiled_us_per_step']:.0f} us/step; top by own time:")
        for row in per["top"]:
            print(f"  {row['own_us_per_step']:8.1f} us  {row['cum_us_per_step']:8.1f} cum  "
                  f"{row['calls_per_step']:7.1f} calls/step  {row['fn']}")


if __name__ == "__main__":
    main()
