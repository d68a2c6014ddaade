"""Recovery benchmark: effective training time (ETTR) with an actor killed every 40 steps.

    PYTHONPATH=. python -m benchmarks.recovery [--size small] [--steps 100] [--kill-every 40]
                                               [--kill-at 30] [--every 20] [--no-uncached]

Runs of the same 2-stage GPT (`benchmarks.common.SIZES`; stage 0 {data: 2}, stage 1 {model: 2},
1F1B, m = 4, adam, a checkpoint every `every` steps, async) on an embedded local Ray:
  1. uninterrupted (`failure.max_restarts: 0`): the baseline wall time and losses;
  2. with failures: stage 1's actor SIGKILLs itself (`KillAt`, a worker hook: a real kill -9 of
     the process, at the start of steps `kill_at`, `kill_at + kill_every`, ...), once each;
     `failure.max_restarts` covers them; JAX's persistent compilation cache on (`compile_cache:
     auto`), so a restarted stage loads its programs;
  3. the same with the cache off (`compile_cache: null`) — the restart's compile time with vs
     without the cache, same job, same machine, one run after the other.
Per restart it reports detection (the kill, as the dying actor stamped it, → the driver
noticed), teardown, placement, start (placement + actors + set-up + restore), restore, the
first step trained again (it compiles, or loads from the cache) and jax's compile seconds, and
the steps run again. ETTR = steps × median steady step time ÷ wall time of the whole run (start,
compilation, checkpoints and recoveries are the non-productive part); `vs_uninterrupted` =
run 1's wall ÷ this run's wall (only what the failures cost). Beside it:
  - `ettr_bound` = N ÷ (N + steps re-run): a kill in step k resumed from checkpoint c runs the
    k - c finished steps again, so with kills at 30 and 70 and a checkpoint every 20 the bound is
    100 ÷ 120 = 0.833 at any model size, whatever recovery costs (the issue's 0.90 cannot be met
    with those parameters);
  - `ettr_steady` = the same ETTR over the wall time less the one-time start-up (`startup_s`: the
    first attempt's placement, actors and set-up — summary.json's `startup_s` — plus the first
    compilation: the first result's wait less the steady steps of its call), what a long run
    tends to.
A computed ETTR above its bound is an accounting error (a wall time or a count that cannot be
true): the benchmark stops instead of publishing it. It checks the failed runs' losses equal the
uninterrupted run's exactly (a recovered run must be bit-equal) and records the conditions (load
average, cpu count, affinity, versions); it asserts nothing about the times.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import RESULTS, SIZES, fmt, load_note, machine_info, md_table
from stages.hooks import WorkerHook


@dataclass(frozen=True)
class KillAt(WorkerHook):
    """(stage, host) SIGKILLs itself at the start of each step in `steps`, the first time any attempt
    gets there: `flags/kill-<step>` records it (and the time, for the detection figure)."""

    stage: int
    host: int
    steps: tuple
    flags: str

    def on_step(self, cfg, step: int) -> None:
        import signal

        if (cfg.stage, cfg.host) != (self.stage, self.host) or step not in self.steps:
            return
        try:
            fd = os.open(os.path.join(self.flags, f"kill-{step}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            return
        os.write(fd, repr(time.time()).encode())
        os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)


def job(size, name: str, steps: int, out: Path, ckpt: Path, every: int, restarts: int, cache) -> dict:
    m = 4
    return {
        "run": {"name": name, "steps": steps, "seed": 0, "output_dir": str(out)},
        "model": {"name": "gpt", "args": size.model_args()},
        "data": {"source": "synthetic", "global_batch": m * size.mbs, "seq_len": size.seq},
        "optimizer": {"name": "adam", "args": {"learning_rate": 1e-3}},
        "pipeline": {"schedule": "1f1b", "microbatches": m,
                     "stages": [{"layers": [0, size.cut()], "mesh": {"data": 2}},
                                {"layers": [size.cut(), size.num_layers()], "mesh": {"model": 2}}]},
        "layout": {"batch": "data", "heads": "model", "mlp": "model", "vocab": "model"},
        "checkpoint": {"dir": str(ckpt), "every_steps": every, "keep": 2, "async": True},
        "failure": {"max_restarts": restarts, "compile_cache": cache},
    }


def run(raw: dict, hooks=()) -> tuple[dict, float]:
    from orchestrator.core.config import check_job, parse_cluster, parse_job
    from orchestrator.driver.runner import run_job

    checked = check_job(parse_job(raw), parse_cluster({"hosts": 2, "devices_per_host": 2}))
    t0 = time.perf_counter()
    got = run_job(checked, echo=lambda s: None, hooks=hooks)
    return got, time.perf_counter() - t0


def startup_s(got: dict, step: float) -> float:
    """The run's one-time start-up: the first attempt's placement, actors and set-up (summary.json's
    `startup_s`) plus its first compilation — the first step's time is the wait for the first call's
    results (`cluster.steps_per_call` steps, the first compiling), less that call's steady steps."""
    per_call = min((got.get("executor") or {}).get("steps_per_call", 1), len(got["step_times_s"]))
    return got.get("startup_s", 0.0) + max(0.0, got["step_times_s"][0] - per_call * step)


def ettrs(steps: int, step: float, wall: float, startup: float, rerun: int) -> dict:
    """ETTR, its bound N ÷ (N + steps re-run) and the steady-state ETTR (without the start-up);
    SystemExit when either ETTR exceeds the bound (it cannot: the wall holds every step run).

    >>> ettrs(100, 0.1, 20.0, 5.0, 20)
    {'ettr': 0.5, 'ettr_bound': 0.8333333333333334, 'ettr_steady': 0.6666666666666666, 'startup_s': 5.0, 'steps_rerun': 20}
    """
    bound = steps / (steps + rerun)
    if wall <= startup:
        raise SystemExit(f"the start-up ({startup:.2f} s) is not shorter than the run's wall time ({wall:.2f} s)")
    out = {"ettr": steps * step / wall, "ettr_bound": bound, "ettr_steady": steps * step / (wall - startup),
           "startup_s": startup, "steps_rerun": rerun}
    for key in ("ettr", "ettr_steady"):
        if out[key] > bound:
            raise SystemExit(f"{key} = {out[key]:.4f} exceeds its bound N / (N + steps re-run) = {steps} / "
                             f"({steps} + {rerun}) = {bound:.4f}: the accounting is wrong (wall {wall:.2f} s, "
                             f"start-up {startup:.2f} s, median step {step:.4f} s), not published")
    return out


def measure(got: dict, wall: float, base_wall: float, steps: int, flags: Path | None = None) -> dict:
    """One run's figures from its summary (`got`), its wall time and the kill flags (`KillAt`)."""
    step = statistics.median(got["step_times_s"][1:])
    kills = {int(p.name.split("-")[1]): float(p.read_text()) for p in flags.glob("kill-*")} if flags else {}
    if len(kills) != len(got["recoveries"]):
        raise SystemExit(f"{len(got['recoveries'])} restarts recorded for {len(kills)} kills")
    restarts = []
    for rec, (at_step, killed_at) in zip(got["recoveries"], sorted(kills.items())):
        restarts.append({
            "killed_in_step": at_step, "cause": rec["cause"], "resumed_from": rec["resumed_from"],
            "steps_rerun": at_step - rec["resumed_from"],        # the finished steps that ran again
            "steps_lost": rec["steps_lost"], "detection_s": rec["detected_at"] - killed_at,
            "teardown_s": rec["teardown_s"], "placement_s": rec.get("placement_s"), "start_s": rec["start_s"],
            "restore_s": rec["restore_s"], "first_step_s": rec.get("first_step_s"),
            "recompile_s": (rec["first_step_s"] - step) if rec.get("first_step_s") is not None else None,
            "jax_compile_s": rec.get("compile_s"), "recovery_s": rec.get("recovery_s")})
    return {"wall_s": wall, "step_s_median": step, "restarts": restarts,
            **ettrs(steps, step, wall, startup_s(got, step), sum(r["steps_rerun"] for r in restarts)),
            "vs_uninterrupted": base_wall / wall}


def _mean(rows: list[dict], key: str):
    xs = [r[key] for r in rows if r.get(key) is not None]
    return statistics.mean(xs) if xs else None


def markdown(result: dict) -> str:
    c = result["conditions"]
    head = (f"# Recovery benchmark (ETTR)\n\n{c['size_text']}; {c['steps']} steps, a checkpoint every "
            f"{c['every']} (async), stage 1's actor SIGKILLed at steps {c['kill_steps']}.\n\n"
            f"Conditions: {c['machine']['nproc']} CPUs ({c['machine']['affinity']} in this process's affinity), "
            f"{c['note']}.\n\n")
    rows = []
    for label, key in (("uninterrupted", "uninterrupted"), ("kills, compile cache on", "cached"),
                       ("kills, compile cache off", "uncached")):
        r = result.get(key)
        if r is None:
            continue
        rs = r.get("restarts", [])
        rows.append([label, fmt(r["wall_s"], 1), fmt(r["step_s_median"] * 1e3, 1), fmt(r["ettr"], 3),
                     fmt(r.get("ettr_bound"), 3), fmt(r.get("ettr_steady"), 3), fmt(r.get("startup_s"), 1),
                     fmt(r.get("vs_uninterrupted"), 3), len(rs)] +
                    [fmt(_mean(rs, k), 2) for k in ("detection_s", "teardown_s", "placement_s", "restore_s",
                                                     "start_s", "recompile_s", "recovery_s")])
    table = md_table(["run", "wall s", "step ms", "ETTR", "ETTR bound", "steady ETTR", "start-up s",
                      "vs uninterrupted", "restarts", "detect s",
                      "teardown s", "placement s", "restore s", "start s", "recompile s", "recovery s"], rows)
    tail = ""
    if result.get("recompile_ratio") is not None:
        tail = (f"\n\nFirst step after a restart minus a steady step (the recompile term), cache on ÷ off: "
                f"{result['recompile_ratio']:.3f} (means over the restarts of each run).\n")
    return head + table + "\n\nTimes are means over the run's restarts; `start` = placement + actors + " \
                          "set-up + restore. ETTR bound = N / (N + steps re-run: kill step - checkpoint " \
                          "resumed from); steady ETTR leaves out the one-time start-up (first placement, " \
                          "actors, set-up and compilation)." + tail


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--kill-every", type=int, default=40)
    ap.add_argument("--kill-at", type=int, default=30, help="the first kill's step (then every --kill-every)")
    ap.add_argument("--no-uncached", action="store_true", help="skip run 3 (the cache-off comparison)")
    ap.add_argument("--out", default=str(RESULTS / "recovery.json"))
    args = ap.parse_args(argv)
    if args.steps < 100 or args.kill_every != 40 or args.every != 20:
        print("note: the issue's benchmark is >= 100 steps, a kill every 40, a checkpoint every 20")
    size = SIZES[args.size]
    kill_steps = tuple(range(args.kill_at, args.steps, args.kill_every))
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="meshpipe-recovery-bench-"))
    result: dict = {}
    try:
        base, base_wall = run(job(size, "base", args.steps, work / "runs", work / "ck0", args.every, 0, None))
        result["uninterrupted"] = measure(base, base_wall, base_wall, args.steps)
        for key, cache in (("cached", "auto"), ("uncached", None)):
            if key == "uncached" and args.no_uncached:
                continue
            flags = work / f"flags-{key}"
            flags.mkdir()
            hook = KillAt(stage=1, host=0, steps=kill_steps, flags=str(flags))
            got, wall = run(job(size, key, args.steps, work / "runs", work / f"ck-{key}", args.every,
                                len(kill_steps), cache), hooks=[hook])
            if got["losses"] != base["losses"]:
                raise SystemExit(f"{key}: the recovered run's losses differ from the uninterrupted run's")
            if got["restarts"] != len(kill_steps):
                raise SystemExit(f"{key}: {got['restarts']} restarts, {len(kill_steps)} kills")
            result[key] = measure(got, wall, base_wall, args.steps, flags)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if "uncached" in result:
        on, off = _mean(result["cached"]["restarts"], "recompile_s"), _mean(result["uncached"]["restarts"], "recompile_s")
        result["recompile_ratio"] = on / off if on is not None and off else None
    result["conditions"] = {"load_before": load_before, "load_after": os.getloadavg(), "machine": machine_info(),
                            "size": args.size, "size_text": size.describe(), "steps": args.steps,
                            "every": args.every, "kill_steps": list(kill_steps),
                            "note": load_note(load_before, os.getloadavg())}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
