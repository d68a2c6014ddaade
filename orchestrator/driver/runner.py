"""Running a checked job: pipeline on Ray, or the single-process reference.

Basic flow of `run_job`:
  checks that need no Ray (TLS files; with --resume the checkpoint's) → plan (pure) → the run's
  record opened (`orchestrator.driver.record.RunRecord`) → [Ray: attempts
  (`orchestrator.driver.attempts`) until one finishes or recovery stops] or [reference] →
  summary.json. Whatever was started is shut down in `finally` (actors, placement group, and
  an embedded Ray we started), also on Ctrl-C/SIGTERM (`orchestrator.driver.interrupt`): the
  actors are told to abandon their step first, so stopping takes seconds, not a step deadline.

Records survive a failure and are never erased: each completed step is appended to
`metrics.jsonl` as it arrives, and `summary.json` is written on every exit — status completed,
failed or interrupted, with the error, the steps done and the losses so far; a stage's full
(redacted) traceback goes to `error.txt` (the next ones `error.1.txt`, ...). Every run writes into
a directory of its own under the run's name (`orchestrator.driver.rundir`), `--resume` into the
one it continues, appending to its `metrics.jsonl` after the earlier invocation's summary and
pictures were set aside in `previous/<k>/` (`orchestrator.driver.record.RunRecord`): no run
replaces another's record. With batched dispatch (`cluster.steps_per_call` k) the driver
learns steps k at a time, so the steps completed inside a call that fails are not recorded. The
driver keeps a bounded amount per step: the loss and the step time (summary.json's lists) and the
step's scalar telemetry; spans only for the steps trace.json shows.

Recovery (`failure: {max_restarts: N}`, `orchestrator.driver.attempts.run_attempts`): a failed
attempt (an actor's error or death, or no progress within the progress deadline) is torn down
and, while restarts are left and a checkpoint is committed, a new attempt re-reserves the
placement and restores the newest commit as `--resume` would; the steps after that commit are
dropped from summary.json's lists (losses, step times, evals; metrics.jsonl gets a `restart`
line) and run again. summary.json counts `restarts` and lists `recoveries`. With
`failure.elastic`, a restart whose placement cannot be had re-plans onto the hosts that are left,
and a run on fewer hosts grows back at a commit (`orchestrator.driver.elastic`); summary.json lists
them as `replans` and names the plan the run ended on (`plan_in_use`).

Telemetry (`orchestrator.driver.telemetry`, `orchestrator.driver.metrics`): every step's
spans and per-actor stats feed the progress display (a bar on a terminal, one
`step_line` per step otherwise, e.g. in Ray Jobs logs), the Ray metrics, and at
the end `trace.json` + `timeline.png` in the run directory (also after a failed
step, for what ran) and a summary block.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Sequence

from orchestrator.core.plan import make_plan, plan_json
from orchestrator.driver.record import RunRecord
from orchestrator.driver.rundir import open_run

log = logging.getLogger("meshpipe")


def step_line(rec: dict, samples: int) -> str:
    line = (f"step {rec['step']:>4d}  loss {rec['loss']:.5f}  time {rec['step_time_s'] * 1e3:8.1f} ms  "
            f"{samples / rec['step_time_s']:9.1f} samples/s")
    if rec.get("eval_loss") is not None:
        line += f"  eval loss {rec['eval_loss']:.5f}"
    if rec.get("health"):      # a training-health event (orchestrator.core.health): its action and kind
        line += f"  [{rec['health']}]"
    return line


def run_job(checked, *, reference: bool = False, echo: Callable[[str], None] = print,
            tty: bool = False, hooks: Sequence = (), keep_params: bool = False, resume=None,
            resume_command: str | None = None, run_id: str | None = None) -> dict:
    """Train the checked job; `tty`: draw a progress bar on stdout instead of one line per step;
    `hooks`: `stages.hooks.WorkerHook` objects every stage worker calls (pipeline runs only);
    `keep_params`: the returned summary also holds "params" (name -> final numpy array; not written);
    `resume`: None, "latest", "auto" (latest if a step is committed, else a fresh start) or a step —
    continue from that committed checkpoint (`orchestrator.driver.checkpoint`; its checks raise
    CheckpointError before anything starts) and append to the run's record;
    `resume_command`: the command line that continues this run, for the message of a failure
    not recovered from (`meshpipe run` passes its own; default `meshpipe run <job.yaml> --resume`);
    `run_id`: with `resume`, the run directory to continue (default: the latest; `rundir.open_run`).

    Writes `metrics.jsonl` (one record per step, as it completes) and `summary.json` into the
    run directory (`metrics.reference.jsonl` / `summary.reference.json` with `reference`), a new
    one under `<run.output_dir>/<run.name>/` or the one `--resume` continues
    (`orchestrator.driver.rundir`; the summary's `run_dir`; `orchestrator.driver.record`). The
    summary is written also when the run fails or is interrupted — `status` "failed" or
    "interrupted", `error`, `steps_done` and the losses so far — and the error is re-raised.
    """
    from orchestrator.driver.telemetry import Progress, summary_block

    job = checked.job
    ckpt = _prepare(checked, reference, resume, echo)
    plan = make_plan(checked)
    out = open_run(job, resume=resume is not None, run_id=run_id)
    echo(f"run directory {out}")
    progress = Progress(job.run.steps, tty=tty, echo=echo, line=lambda rec: step_line(rec, job.data.global_batch))
    record = RunRecord(checked, out, plan_json(plan), reference=reference, resume=resume is not None,
                       losses=ckpt.losses if ckpt else (), progress=progress)
    try:
        if reference:
            norms, arrays = _run_reference(checked, record)
        else:
            norms, arrays = _run_pipeline(checked, plan, record, out, echo, hooks, keep_params, ckpt,
                                          resume_command or "meshpipe run <job.yaml> --resume")
    except BaseException as e:
        record.close()
        record.stopped(e, echo)
        raise
    finally:
        record.close()
    done = record.completed(norms, echo)
    if not reference:
        echo(summary_block(done, out))
    if keep_params:
        done["params"] = arrays
    return done


def _prepare(checked, reference: bool, resume, echo):
    """The checkpoint plan (`orchestrator.driver.checkpoint.prepare`; None for `--reference` or no
    `checkpoint:`), after the checks that need no Ray (the TLS files load and pass a handshake)."""
    from orchestrator.driver.checkpoint import CheckpointError, prepare

    if reference:
        if resume is not None:    # the reference run saves nothing (checkpoint: is for the pipeline)
            raise CheckpointError("--resume applies to pipeline runs, not --reference")
        return None
    from orchestrator.core.tls import check_transport_tls

    check_transport_tls(checked.cluster)
    ckpt = prepare(checked, resume)
    if resume == "auto" and ckpt is not None and ckpt.marker is None:
        echo(f"--resume auto: no committed checkpoint in {checked.job.checkpoint.dir}: starting at step 0")
    return ckpt


def _run_reference(checked, record: RunRecord) -> tuple[dict, dict | None]:
    """The single-process reference run (`orchestrator.driver.reference`)."""
    from orchestrator.driver.reference import train_reference

    job = checked.job
    result = train_reference(checked.model, checked.data, steps=job.run.steps, seed=job.run.seed,
                             microbatches=job.pipeline.microbatches, optimizer=job.optimizer.spec(),
                             on_step=record.step, eval_every=job.run.eval_every, loss_scale=job.precision.scaling())
    return result["param_norms"], result.get("params")


def _run_pipeline(checked, plan, record: RunRecord, out: Path, echo, hooks: Sequence = (),
                  keep_params: bool = False, ckpt=None,
                  resume_command: str = "meshpipe run <job.yaml> --resume") -> tuple[dict, dict | None]:
    """Run the pipeline on Ray as attempts (`orchestrator.driver.attempts`: a restart is a new one
    while `failure.max_restarts` allows); returns the final parameter norms (and arrays with
    `keep_params`). summary.json's pipeline fields fill `record.extra` as the run goes, so a
    failed run's summary has what was known. On Ctrl-C/SIGTERM the actors are told to abandon
    their step before they are shut down; whatever was started is shut down on every exit."""
    from orchestrator.core.recovery import RestartPolicy
    from orchestrator.driver import placement
    from orchestrator.driver.attempts import Attempt, Session, run_attempts
    from orchestrator.driver.checkpoint import remove_probe
    from orchestrator.driver.interrupt import reinstall
    from orchestrator.driver.quiet import filter_worker_logs

    job = checked.job
    _sweep(echo)
    started = placement.connect(checked.cluster, namespace=f"meshpipe-{job.run.name}")
    reaper = None
    try:
        _refuse_compiled_graph_restarts(checked)
        # cleans up after this driver however it ends -- only a Ray this driver started itself: connected to
        # a running cluster (cluster.address, a Ray job), that cluster's session is not ours to reap
        reaper = _reaper(out) if started and checked.cluster.address is None else None
    except BaseException:
        if started:
            import ray

            ray.shutdown()
        raise
    reinstall()            # ray.init put absl's signal handler in place of ours (stack dump, abort)
    filter_worker_logs()
    session = Session(checked, plan, record, ckpt, resume_command, echo)
    if session.resumed_from:
        echo(f"resuming from checkpoint step {session.resumed_from} in {job.checkpoint.dir}")
    attempts: list[Attempt] = []

    def start(first: int, recovering: dict | None) -> Attempt:
        attempts.append(Attempt(session, first, recovering, hooks, keep_params))
        return attempts[-1]

    ok = interrupted = False
    try:
        record.extra["ray"] = _ray_info(job.run.name, echo)
        session.open()
        result = run_attempts(start, session.resumed_from, RestartPolicy(job.failure.max_restarts), session)
        ok = True
        return result
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        if attempts:
            attempts[-1].close(after_failure=not ok and not interrupted, interrupted=interrupted)
        remove_probe(session.ckpt)
        session.close(out, ok)
        if started:
            import ray

            ray.shutdown()
        if reaper is not None:
            reaper.close()


def _sweep(echo) -> None:
    """Remove the Compiled Graph channel semaphores earlier drivers' dead clusters left in /dev/shm
    (`orchestrator.driver.reaper.sweep_semaphores`), saying so."""
    from orchestrator.driver.reaper import SHM, semaphore_owner, sweep_semaphores

    try:
        removed = sweep_semaphores()
    except Exception as e:  # noqa: BLE001 - a cleanup of others' leftovers never stops a run
        log.debug("sweeping %s: %s", SHM, e)
        return
    if removed:
        owners = ", ".join(str(p) for p in sorted({semaphore_owner(n) for n in removed}))
        echo(f"removed {len(removed)} Ray Compiled Graph channel semaphores from {SHM}, left by raylets that are "
             f"gone (pids {owners}) and mapped by no process")


def _reaper(out):
    """A `orchestrator.driver.reaper.Reaper` for the Ray this driver started (None when it cannot)."""
    from orchestrator.driver.reaper import Reaper

    try:
        return Reaper.start(str(out / "leftovers.txt"))
    except Exception as e:  # noqa: BLE001 - an aid: the next run's sweep still finds the semaphores
        log.warning("no reaper for the embedded Ray (what it leaves if this driver is killed stays): %s", e)
        return None


def _refuse_compiled_graph_restarts(checked) -> None:
    """`compiled_graph` with restarts on a multi-node cluster: a ConfigError before anything starts
    (`orchestrator.core.recovery.compiled_graph_restarts` says why)."""
    import ray

    from orchestrator.core.config.errors import ConfigError
    from orchestrator.core.recovery import compiled_graph_restarts

    if checked.cluster.executor != "compiled_graph" or checked.job.failure.max_restarts == 0:
        return
    why = compiled_graph_restarts(checked.cluster.executor, checked.job.failure.max_restarts,
                                  sum(1 for n in ray.nodes() if n.get("Alive")))
    if why is not None:
        raise ConfigError(why)


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
    if info.get("metrics_endpoints"):
        from orchestrator.driver.workers import metrics_line

        echo(metrics_line(info["metrics_endpoints"]))
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
    from orchestrator.driver.ray_internals import token_auth_enabled, token_source

    if not token_auth_enabled():
        return []
    source = token_source() or "Ray's token loader"
    gcs = f" --address {gcs_address}" if gcs_address else ""
    return [f"token auth is on: the dashboard asks for the token; paste the output of "
            f"`ray get-auth-token` (it reads {source}); the browser keeps it as a cookie",
            f"Ray CLI: RAY_AUTH_MODE=token ray status{gcs}; "
            f"RAY_AUTH_MODE=token ray list actors --address {dashboard_url}"]
