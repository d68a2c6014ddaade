"""bf16 vs float32 compute: the same job's step time, run alternately in one invocation.

    python -m benchmarks.precision [--job examples/llama.yaml] [--steps 20] [--pairs 2] [--out FILE]

Each pair runs the job with `precision.compute: float32` and then `bfloat16` (same cluster,
data, schedule), through `orchestrator.driver.runner.run_job` on the local Ray cluster. A run's
figure is its median step time after the first `warmup` steps (compilation). Recorded with the
conditions observed: the 1-minute load average before and after each run, the CPU count, the
planned bytes per microbatch across edge 0→1 in each precision. On a CPU host bf16 matmuls are
not faster than float32 (XLA:CPU emulates much of bf16), so the ratio says what the dtype costs
there, not what an accelerator gains. Writes JSON to `--out` (default
benchmarks/results/precision.json) and prints it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def _run(job_path: str, cluster_path: str, compute: str, steps: int, out_dir: str) -> dict:
    from orchestrator.core.config import check_job
    from orchestrator.core.config.load import load_cluster, load_job
    from orchestrator.core.edges import edges_json
    from orchestrator.driver.runner import run_job

    overrides = [f"precision.compute={compute}", f"run.steps={steps}", f"run.output_dir={out_dir}",
                 f"run.name=precision-{compute}"]
    checked = check_job(load_job(job_path, overrides), load_cluster(cluster_path))
    edge = edges_json(checked)[0]
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    summary = run_job(checked, echo=lambda s: None)
    return {"compute": compute, "step_times_s": summary["step_times_s"], "wall_s": time.perf_counter() - t0,
            "load_before": load0, "load_after": os.getloadavg()[0],
            "edge0_forward_bytes": edge["forward"]["cross_host_bytes"],
            "edge0_backward_bytes": edge["backward"]["cross_host_bytes"], "final_loss": summary["losses"][-1]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", default="examples/llama.yaml")
    ap.add_argument("--cluster", default="cluster_configs/local.yaml")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/precision.json")
    a = ap.parse_args(argv)
    if a.steps <= a.warmup:
        raise SystemExit(f"--steps {a.steps} must exceed --warmup {a.warmup}")
    runs = []
    with tempfile.TemporaryDirectory(prefix="meshpipe-precision-") as out_dir:
        for _ in range(a.pairs):
            for compute in ("float32", "bfloat16"):
                r = _run(a.job, a.cluster, compute, a.steps, out_dir)
                r["median_step_s"] = statistics.median(r["step_times_s"][a.warmup:])
                runs.append(r)
    ratios = [b["median_step_s"] / f["median_step_s"] for f, b in zip(runs[::2], runs[1::2])]
    result = {"job": a.job, "cluster": a.cluster, "steps": a.steps, "warmup": a.warmup, "cpus": os.cpu_count(),
              "runs": runs, "bf16_over_f32_step": ratios, "median_ratio": statistics.median(ratios)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}
                     | {"per_run": [(r["compute"], round(r["median_step_s"] * 1e3, 2), round(r["load_before"], 2),
                                     round(r["load_after"], 2)) for r in runs]}, indent=2))
    return result


if __name__ == "__main__":
    main()
