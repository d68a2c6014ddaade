"""Running a checked job: pipeline on Ray, or the single-process reference.

Basic flow of `run_job`:
  plan (pure) → output dir checked/created (owner-only) → data plan →
  [Ray: connect → executor.start → step × N → param norms] or [reference] →
  summary.json. Whatever was started is shut down in `finally` (actors,
  placement group, and an embedded Ray we started), also on Ctrl-C/SIGTERM
  (`orchestrator.driver.interrupt`): the actors are told to abandon their step
  first, so stopping takes seconds, not a step deadline.

A run that stops early (a stage failed, or a signal) still writes summary.json,
with `status` "failed"/"interrupted", the steps done and the error; a stage's
full (redacted) traceback goes to `error.txt` beside it. `existing_record` is
what `meshpipe run` checks so that a second run of the same job never replaces
the first one's record silently (`--overwrite`).

Telemetry (`orchestrator.driver.telemetry`, `orchestrator.driver.metrics`): every step's
spans and per-actor stats feed the progress display (a bar on a terminal, one
`step_line` per step otherwise, e.g. in Ray Jobs logs), the Ray metrics, and at
the end `trace.json` + `timeline.png` in the run directory (also after a failed
step, for what ran) and a summary block.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from collections.abc import Callable, Sequence

from orchestrator.core.plan import make_plan, plan_json
from orchestrator.core.private_fs import private_dir, write_private
from orchestrator.core.redact import redact

log = logging.getLogger("meshpipe")


def output_dir(checked) -> Path:
    """The run directory, created owner-only (0o700 whatever the umask; see private_fs)."""
    job = checked.job
    return private_dir(Path(job.run.output_dir) / job.run.name)


RECORD_FILES = ("summary.json", "trace.json", "error.txt")


def existing_record(checked, reference: bool = False) -> Path | None:
    """The file of an earlier run that this run would replace (in its run directory), if any."""
    run_dir = Path(checked.job.run.output_dir) / checked.job.run.name
    for name in (("summary.reference.json",) if reference else RECORD_FILES):
        if (run_dir / name).exists():
            return run_dir / name
    return None


def step_line(rec: dict, samples: int) -> str:
    line = (f"step {rec['step']:>4d}  loss {rec['loss']:.5f}  time {rec['step_time_s'] * 1e3:8.1f} ms  "
            f"{samples / rec['step_time_s']:9.1f} samples/s")
    if rec.get("eval_loss") is not None:
        line += f"  eval loss {rec['eval_loss']:.5f}"
    return line


def run_job(checked, *, reference: bool = False, echo: Callable[[str], None] = print,
            tty: bool = False, hooks: Sequence = (), keep_params: bool = False) -> dict:
    """Train the checked job; `tty`: draw a progress bar on stdout instead of one line per step;
    `hooks`: `stages.hooks.WorkerHook` objects every stage worker calls (pipeline runs only);
    `keep_params`: the returned summary also holds "params" (name -> final numpy array; not written)."""
    from orchestrator.driver.telemetry import Progress, summary_block

    job = checked.job
    plan = make_plan(checked)
    out = output_dir(checked)
    source = checked.data     # a DataPlan: each host that needs data opens its own reader
    samples = job.data.global_batch
    progress = Progress(job.run.steps, tty=tty, echo=echo, line=lambda rec: step_line(rec, samples))
    done: list[dict] = []

    def on_step(rec):
        done.append(rec)
        progress.update({**rec, "samples_per_s": samples / rec["step_time_s"] if rec["step_time_s"] else 0.0})

    path = out / ("summary.reference.json" if reference else "summary.json")
    for stale in ((path.name,) if reference else RECORD_FILES):   # (an --overwrite: never mix two runs)
        (out / stale).unlink(missing_ok=True)
    try:
        try:
            if reference:
                from orchestrator.driver.reference import train_reference

                result = train_reference(checked.model, source, steps=job.run.steps, seed=job.run.seed,
                                         microbatches=job.pipeline.microbatches,
                                         optimizer=job.optimizer.spec(), on_step=on_step,
                                         eval_every=job.run.eval_every)
                extra = {"mode": "reference"}
            else:
                result, extra = _run_pipeline(checked, plan, source, on_step, out, echo, hooks, keep_params)
        finally:
            progress.close()   # end the bar's line before anything else is printed
    except BaseException as e:
        _record_stop(e, checked, plan, done, out, path, reference)
        raise
    summary = {
        "run": job.run.name,
        "status": "succeeded",
        "losses": result["losses"],
        "step_times_s": result["step_times_s"],
        "param_norms": result["param_norms"],
        "eval_losses": result.get("eval_losses", []),      # [step, mean eval loss] (data.eval)
        "plan": plan_json(plan),
        "config": json.dumps(redact(checked.to_dict()), indent=2),  # secrets never reach disk
        **extra,
    }
    write_private(path, json.dumps(summary, indent=1))  # 0o600, atomic
    echo(f"wrote {path}")
    if not reference:
        echo(summary_block(summary, out))
    if keep_params:
        summary["params"] = result["params"]
    return summary


def _record_stop(e: BaseException, checked, plan, done: list[dict], out: Path, path: Path,
                 reference: bool) -> None:
    """The record of a run that stopped early; the path (and the steps done) go onto `e`."""
    from orchestrator.core.redact import redact_text
    from orchestrator.driver.waiting import StageFailure

    status = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
    try:
        if isinstance(e, StageFailure) and e.detail:
            err = out / "error.txt"
            write_private(err, f"{e.message}\nwhere: {e.where}\n\n{e.detail}\n")
            e.error_file = str(err)
        summary = {
            "run": checked.job.run.name, "status": status, "mode": "reference" if reference else "pipeline",
            "error": redact_text(f"{type(e).__name__}: {getattr(e, 'message', None) or e}"),
            "steps_done": len(done), "steps": checked.job.run.steps,
            "losses": [r["loss"] for r in done], "step_times_s": [r["step_time_s"] for r in done],
            "plan": plan_json(plan), "config": json.dumps(redact(checked.to_dict()), indent=2),
        }
        write_private(path, json.dumps(summary, indent=1))
    except Exception as w:  # noqa: BLE001 - the record must not hide the run's own error
        log.warning("could not write %s: %s", path, w)
        return
    if isinstance(e, KeyboardInterrupt):   # what the CLI prints (interrupt.stopped_message)
        e.steps_done, e.total_steps, e.record = len(done), checked.job.run.steps, str(path)


def _run_pipeline(checked, plan, source, on_step, out: Path, echo, hooks: Sequence = (),
                  keep_params: bool = False) -> tuple[dict, dict]:
    from orchestrator.driver import placement
    from orchestrator.driver.executor import PipelineExecutor
    from orchestrator.driver.telemetry import RunTelemetry

    job = checked.job
    run = job.run.name
    started = placement.connect(checked.cluster, namespace=f"meshpipe-{run}")
    from orchestrator.driver.interrupt import reinstall
    from orchestrator.driver.quiet import filter_worker_logs

    reinstall()            # ray.init put absl's signal handler in place of ours (stack dump, abort)
    filter_worker_logs()
    ray_info = _ray_info(run, echo)
    ex = PipelineExecutor(checked, plan.schedule, source, run, plan.eval_schedule, hooks=hooks)
    tel = RunTelemetry(run, plan.schedule, plan.sim.bubble_fraction, job.data.global_batch)
    metrics = _metrics(run, plan.sim.bubble_fraction)
    losses, times, spans, evals = [], [], [], []
    ok = interrupted = False
    try:
        t0 = time.perf_counter()
        ex.start()
        startup = time.perf_counter() - t0
        for r in ex.steps(job.run.steps):
            step = r.step
            losses.append(r.loss)
            times.append(r.wall_s)
            spans = [r.spans]     # only the last step's spans are kept (driver memory per step bounded)
            st = tel.add(step, r.wall_s, r.loss, r.spans, r.stats)
            if metrics is not None:
                metrics.record(st, eval_loss=r.eval_loss)
            if r.eval_loss is not None:
                evals.append([step, r.eval_loss])
            on_step({"step": step, "loss": r.loss, "step_time_s": r.wall_s, "eval_loss": r.eval_loss})
        norms = ex.param_norms()
        arrays = ex.param_arrays() if keep_params else None
        ok = True
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        if interrupted:   # (a failed step has told every actor already: worker._fail)
            ex.abort("the driver stopped the run")   # a step still running ends now, not at its deadline
        ex.shutdown()
        try:
            tel.write(out)
        except Exception as e:  # noqa: BLE001 - pictures must not hide the run's own error
            log.warning("could not write trace.json/timeline.png: %s", e)
        if ok and metrics is not None and checked.cluster.address is not None:
            metrics.flush()   # a long-lived cluster: let the last values reach its metrics agent
        if started:
            import ray

            ray.shutdown()
    extra = {"mode": "pipeline", "startup_s": startup, "workers": ex.info, "executor": ex.dispatch_info,
             "last_step_spans": [list(s) for s in spans[-1]] if spans else [],
             "telemetry": tel.summary(), "ray": ray_info}
    return {"losses": losses, "step_times_s": times, "param_norms": norms, "params": arrays,
            "eval_losses": evals}, extra


def _ray_info(run: str, echo) -> dict:
    """Where to look while the run is on: dashboard, actor namespace, metrics endpoints."""
    from orchestrator.driver.metrics import metrics_endpoints

    info = {"namespace": f"meshpipe-{run}", "actors": f"{run}/stage<s>/host<h>", "placement_group": f"{run}/pg"}
    try:
        from orchestrator.driver.ray_internals import dashboard_url

        url = dashboard_url()
        info["dashboard_url"] = f"http://{url}" if url and "://" not in url else url
        info["metrics_endpoints"] = metrics_endpoints()
    except Exception as e:  # noqa: BLE001 - informational only
        log.debug("no dashboard/metrics info: %s", e)
    if info.get("dashboard_url"):
        echo(f"Ray dashboard {info['dashboard_url']}  (namespace {info['namespace']}, actors {info['actors']})")
        for line in auth_hint(info["dashboard_url"], _gcs_address()):
            echo(f"  {line}")
    return info


def _gcs_address() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - informational only
        return None


def auth_hint(dashboard_url: str, gcs_address: str | None) -> list[str]:
    """How a person gets into a token-authenticated Ray (Ray 2.60): browser and CLI; [] without auth.

    The dashboard shows a token prompt; what is pasted there is POSTed to
    `/api/authenticate` (Authorization: Bearer), which sets the `ray-authentication-token`
    cookie. Ray's CLI needs `RAY_AUTH_MODE=token` and finds the token itself.
    """
    from orchestrator.driver.jobs import token_source

    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled

        on = is_token_auth_enabled()
    except Exception:  # noqa: BLE001 - a Ray without token auth
        on = False
    if not on:
        return []
    source = token_source() or "Ray's token loader"
    gcs = f" --address {gcs_address}" if gcs_address else ""
    return [f"token auth is on: the dashboard asks for the token; paste the output of "
            f"`ray get-auth-token` (it reads {source}); the browser keeps it as a cookie",
            f"Ray CLI: RAY_AUTH_MODE=token ray status{gcs}; "
            f"RAY_AUTH_MODE=token ray list actors --address {dashboard_url}"]


def _metrics(run: str, simulated_bubble: float):
    from orchestrator.driver.metrics import RunMetrics

    try:
        return RunMetrics(run, simulated_bubble)
    except Exception as e:  # noqa: BLE001 - metrics are an aid, never a reason to fail a run
        log.warning("Ray metrics disabled for this run: %s", e)
        return None
