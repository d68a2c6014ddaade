"""A short, targeted pipeline check for a quiet machine: `large`, m=8, 1F1B and ZB-H1
alternated (two runs each), stage actors pinned one per core, through the benchmark's own
`measure_pipeline` (standalone-cost ideal, affinity and thread counts read back on the actors),
and plain JAX on one core for 1F1B's honest bound plain₁ × (m+p−1)/(m·p) (ZB-H1 shrinks that
bubble by design, so the bound is not reported for it).

    python -m benchmarks.zb_check        # ~2 min on an idle 2-core machine

Writes benchmarks/results/zb_check.json. The full table is `python -m benchmarks.run` (~1 h).
"""
from __future__ import annotations

import json
import os
import time

from benchmarks.common import RESULTS, SIZES
from benchmarks.formulas import HONEST_BOUND_SCHEDULES, checked_efficiency
from benchmarks.pipeline import measure_pipeline
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
    raw["plain_1core"] = plain = _child(["benchmarks.pipeline", "plain-jax", SIZE, str(M), "6"], [0], print)
    if plain.get("status") == "ok":
        bound = plain["step_s"] * (M + P - 1) / (M * P)
        raw["honest_bound_s"] = bound
        for r in runs:           # the bound has 1F1B's bubble; ZB-H1 shrinks it by design
            if r["schedule"] in HONEST_BOUND_SCHEDULES:
                print(f"{r['schedule']:6s} of honest bound {bound / r['step_s']:.3f}")
    out = RESULTS / "zb_check.json"
    out.write_text(json.dumps(raw, indent=1, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
