"""Running a checked job: pipeline on Ray, or the single-process reference.

Basic flow of `run_job`:
  plan (pure) → output dir checked/created (owner-only) → data source →
  [Ray: connect → executor.start → step × N → param norms] or [reference] →
  summary.json. Whatever was started is shut down in `finally` (actors,
  placement group, and an embedded Ray we started), also on Ctrl-C.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

from orchestrator.plan import make_plan, plan_json
from stages.data import make_source


def output_dir(checked) -> Path:
    job = checked.job
    path = Path(job.run.output_dir) / job.run.name
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def load_text(checked) -> bytes | None:
    data = checked.job.data
    if data.source != "text":
        return None
    return Path(checked.data_path or data.path).read_bytes()


def step_line(rec: dict, samples: int) -> str:
    return (f"step {rec['step']:>4d}  loss {rec['loss']:.5f}  time {rec['step_time_s'] * 1e3:8.1f} ms  "
            f"{samples / rec['step_time_s']:9.1f} samples/s")


def run_job(checked, *, reference: bool = False, echo: Callable[[str], None] = print) -> dict:
    job = checked.job
    plan = make_plan(checked)
    out = output_dir(checked)
    source = make_source(checked.model, job.data.source, job.data.global_batch, job.run.seed,
                         text=load_text(checked))
    samples = job.data.global_batch

    def on_step(rec):
        echo(step_line(rec, samples))

    if reference:
        from stages.reference import train_reference

        result = train_reference(checked.model, source, steps=job.run.steps, seed=job.run.seed,
                                 microbatches=job.pipeline.microbatches,
                                 optimizer=(job.optimizer.name, dict(job.optimizer.args)), on_step=on_step)
        extra = {"mode": "reference"}
    else:
        result, extra = _run_pipeline(checked, plan, source, on_step)
    summary = {
        "run": job.run.name,
        "losses": result["losses"],
        "step_times_s": result["step_times_s"],
        "param_norms": result["param_norms"],
        "plan": plan_json(plan),
        "config": checked.to_json(),
        **extra,
    }
    path = out / ("summary.reference.json" if reference else "summary.json")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=1))
    os.replace(tmp, path)
    echo(f"wrote {path}")
    return summary


def _run_pipeline(checked, plan, source, on_step) -> tuple[dict, dict]:
    from orchestrator import placement
    from orchestrator.executor import PipelineExecutor

    job = checked.job
    run = job.run.name
    started = placement.connect(checked.cluster, namespace=f"meshpipe-{run}")
    ex = PipelineExecutor(checked, plan.schedule, source, run)
    losses, times, spans = [], [], []
    try:
        t0 = time.perf_counter()
        ex.start()
        startup = time.perf_counter() - t0
        for r in ex.steps(job.run.steps):
            step = r.step
            losses.append(r.loss)
            times.append(r.wall_s)
            spans.append(r.spans)
            on_step({"step": step, "loss": r.loss, "step_time_s": r.wall_s})
        norms = ex.param_norms()
    finally:
        ex.shutdown()
        if started:
            import ray

            ray.shutdown()
    extra = {"mode": "pipeline", "startup_s": startup, "workers": ex.info,
             "last_step_spans": [list(s) for s in spans[-1]] if spans else []}
    return {"losses": losses, "step_times_s": times, "param_norms": norms}, extra
