"""A short, targeted pipeline check for a quiet machine: `large`, m=8, 1F1B and ZB-H1
alternated (two runs each), stage actors pinned one per core, through the benchmark's own
`measure_pipeline` (standalone-cost ideal, affinity and thread counts read back on the actors),
and plain JAX on one core for 1F1B's honest bound plain₁ × (m+p−1)/(m·p) (ZB-H1 shrinks that
bubble by design, so the bound is not reported for it).

Memory, per run and stage: measured ÷ predicted for the kept bytes (the worker's `Stash` peak)
and for every live device buffer (`jax.live_arrays()` at that peak). Predicted kept bytes = the
schedule's stash timeline (`orchestrator.core.schedule.stash_timeline`: zb-h1 holds, from I to W,
only what W reads) with sizes from the stage programs' shapes (`benchmarks.stage_bytes`);
predicted live = that + 4 × the stage's parameters (parameters, adam's two moments, gradient sum).

    python -m benchmarks.zb_check        # ~2 min on an idle 2-core machine

Writes benchmarks/results/zb_check.json. The full table is `python -m benchmarks.run` (~1 h).
"""
from __future__ import annotations

import json
import os
import time

from benchmarks.common import RESULTS, SIZES
from benchmarks.formulas import HONEST_BOUND_SCHEDULES, checked_efficiency, fb, honest_bound_s
from benchmarks.pipeline import measure_pipeline, residual_bytes
from benchmarks.run import _child, _ray_session

P, M, SIZE = 2, 8, "large"


def main() -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    raw: dict = {"load_before": os.getloadavg()}
    started = _ray_session(raw)
    runs = []
    try:
        for rep in range(2):
            for sched in ("1f1b", "zb-h1"):
                t = time.perf_counter()
                rec = measure_pipeline(SIZES[SIZE], sched, M, steps=6, warmup=2, pin=True)
                rec["load"] = os.getloadavg()
                rec.pop("example_spans", None)
                rec.pop("ideal_spans", None)
                runs.append(rec)
                eff = checked_efficiency(rec["ideal_s"], rec["step_s"], f"{sched} run {rep}")
                print(f"{sched:6s} run {rep}: step {rec['step_s'] * 1e3:.1f} ms, ideal {rec['ideal_s'] * 1e3:.1f} ms, "
                      f"efficiency {eff:.3f}, affinity {[o['affinity'] for o in rec['observed']]}, "
                      f"{time.perf_counter() - t:.0f} s, load {rec['load'][0]:.2f}", flush=True)
    finally:
        if started:
            import ray

            ray.shutdown()
    raw["runs"] = runs
    raw["memory"] = memory_ratios(runs)
    raw["plain_1core"] = plain = _child(["benchmarks.pipeline", "plain-jax", SIZE, str(M), "6"], [0], print)
    if plain.get("status") == "ok":
        raw["honest_bound_s"] = honest_bound_s(plain["step_s"], M, P)
        for r in runs:           # the bound has 1F1B's bubble; ZB-H1 shrinks it by design
            if r["schedule"] in HONEST_BOUND_SCHEDULES:       # base₁: plain₁, or the stages' F + B when less
                stages_fb = sum(fb(c) for c in r["standalone"]["stages"])
                r["honest_bound_s"] = honest_bound_s(plain["step_s"], M, P, stages_fb)
                print(f"{r['schedule']:6s} of honest bound {r['honest_bound_s'] / r['step_s']:.3f}")
    out = RESULTS / "zb_check.json"
    out.write_text(json.dumps(raw, indent=1, default=str))
    print(f"wrote {out}")


def memory_ratios(runs: list[dict]) -> list[dict]:
    """Per run and stage: predicted kept and live bytes (module docstring) beside the measured ones."""
    from orchestrator.core.schedule import generate, lower, stash_timeline

    stages = residual_bytes(SIZES[SIZE])       # shapes only (jax.eval_shape), in this process
    kept = [{"F": st["residual_bytes"], "I": st["held_bytes"]} for st in stages]
    out = []
    for i, r in enumerate(runs):
        if r.get("status") != "ok":
            continue
        peak = stash_timeline(lower(generate(r["schedule"], P, M)), kept).peak
        for s, st in enumerate(stages):
            kept_got, live_got = r["stash_peak_bytes"][s], r["live_peak_bytes"][s]
            live_pred = 4 * st["param_bytes"] + peak[s]
            rec = {"run": i, "schedule": r["schedule"], "stage": s, "predicted_kept_bytes": peak[s],
                   "measured_kept_bytes": kept_got, "predicted_live_bytes": live_pred,
                   "measured_live_bytes": live_got,
                   "kept_ratio": kept_got / peak[s] if kept_got and peak[s] else None,
                   "live_ratio": live_got / live_pred if live_got else None}
            out.append(rec)
            print(f"{r['schedule']:6s} run {i // 2} stage {s}: kept {_mib(kept_got)} of predicted {_mib(peak[s])} MiB, "
                  f"live {_mib(live_got)} of predicted {_mib(live_pred)} MiB, measured ÷ predicted "
                  f"{_ratio(rec['kept_ratio'])} / {_ratio(rec['live_ratio'])}")
    return out


def _mib(n) -> str:
    return "–" if not n else f"{n / 2**20:.1f}"


def _ratio(x) -> str:
    return "–" if x is None else f"{x:.3f}"


if __name__ == "__main__":
    main()
