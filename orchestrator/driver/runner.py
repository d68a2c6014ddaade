"""Running a checked job: pipeline on Ray, or the single-process reference.

Basic flow of `run_job`:
  plan (pure) → output dir checked/created (owner-only) → data plan →
  [Ray: connect → executor.start → step × N → param norms] or [reference] →
  summary.json. Whatever was started is shut down in `finally` (actors,
  placement group, and an embedded Ray we started), also on Ctrl-C/SIGTERM
  (`orchestrator.driver.interrupt`): the actors are told to abandon their step
  first, so stopping takes seconds, not a step deadline.

Records survive a failure: each completed step is appended to `metrics.jsonl`
as it arrives (`telemetry.StepLog`), and `summary.json` is written on every
exit (one path, `_record_stop` for early ones) — status completed, failed or
interrupted, with the error, the steps done and the losses so far; a stage's
full (redacted) traceback goes to `error.txt` beside it. Every run writes into a
directory of its own under the run's name, `--resume` into the latest one
(`orchestrator.driver.rundir`): no run replaces another's record. With batched dispatch (`cluster.steps_per_call` k) the
driver learns steps k at a time, so the steps completed inside a call that
fails are not recorded. The driver keeps a bounded amount per step: the loss
and the step time (summary.json's lists) and the step's scalar telemetry; spans only
for the steps trace.json shows.

Recovery (`failure: {max_restarts: N}`, `orchestrator.driver.recovery`): a failed attempt
(an actor's error or death, or no progress within the progress deadline) is torn down and,
while restarts are left and a checkpoint is committed, a new attempt re-reserves the
placement and restores the newest commit as `--resume` would; the steps after that commit
are dropped from the records (losses, step times, evals; metrics.jsonl gets a `restart`
line) and run again. summary.json counts `restarts` and lists `recoveries`.

Telemetry (`orchestrator.driver.telemetry`, `orchestrator.driver.metrics`): every step's
spans and per-actor stats feed the progress display (a bar on a terminal, one
`step_line` per step otherwise, e.g. in Ray Jobs logs), the Ray metrics, and at
the end `trace.json` + `timeline.png` in the run directory (also after a failed
step, for what ran) and a summary block.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Callable, Sequence

from orchestrator.core.plan import make_plan, plan_json
from orchestrator.core.private_fs import write_private
from orchestrator.core.redact import redact, redact_text
from orchestrator.driver.rundir import open_run

log = logging.getLogger("meshpipe")


def step_line(rec: dict, samples: int) -> str:
    line = (f"step {rec['step']:>4d}  loss {rec['loss']:.5f}  time {rec['step_time_s'] * 1e3:8.1f} ms  "
            f"{samples / rec['step_time_s']:9.1f} samples/s")
    if rec.get("eval_loss") is not None:
        line += f"  eval loss {rec['eval_loss']:.5f}"
    if rec.get("health"):
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
    CheckpointError before anything starts);
    `resume_command`: the command line that continues this run, for the message of a failure
    not recovered from (`meshpipe run` passes its own; default `meshpipe run <job.yaml> --resume`);
    `run_id`: with `resume`, the run directory to continue (default: the latest; `rundir.open_run`).

    Writes `metrics.jsonl` (one record per step, as it completes) and `summary.json` into the
    run directory (`metrics.reference.jsonl` / `summary.reference.json` with `reference`), a new
    one under `<run.output_dir>/<run.name>/` (`orchestrator.driver.rundir`; the summary's
    `run_dir`). The
    summary is written also when the run fails or is interrupted — `status` "failed" or
    "interrupted", `error`, `steps_done` and the losses so far — and the error is re-raised.
    """
    from orchestrator.driver.checkpoint import CheckpointError, prepare
    from orchestrator.driver.telemetry import Progress, StepLog, summary_block

    job = checked.job
    if reference and resume is not None:    # the reference run saves nothing (checkpoint: is for the pipeline)
        raise CheckpointError("--resume applies to pipeline runs, not --reference")
    if not reference:                 # the TLS files load and pass a handshake before Ray starts
        from orchestrator.core.tls import check_transport_tls

        check_transport_tls(checked.cluster)
    ckpt = None if reference else prepare(checked, resume)
    if resume == "auto" and ckpt is not None and ckpt.marker is None:
        echo(f"--resume auto: no committed checkpoint in {job.checkpoint.dir}: starting at step 0")
    plan = make_plan(checked)
    out = open_run(job, resume=resume is not None, run_id=run_id)
    echo(f"run directory {out}")
    source = checked.data     # a DataPlan: each host that needs data opens its own reader
    samples = job.data.global_batch
    suffix = ".reference" if reference else ""
    # The run directory is this run's alone (after --resume the earlier record moved to previous/<k>/:
    # the summary carries the committed steps' losses, metrics.jsonl the steps run now).
    progress = Progress(job.run.steps, tty=tty, echo=echo, line=lambda rec: step_line(rec, samples))
    records = StepLog(out / f"metrics{suffix}.jsonl")
    losses: list[float] = list(ckpt.losses) if ckpt else []    # a resumed run: the committed steps' losses
    times: list[float] = []
    evals: list[list] = []     # [step, mean eval loss] (data.eval)
    extra: dict = {"mode": "reference" if reference else "pipeline"}

    def on_step(rec):
        rec = {**rec, "samples_per_s": samples / rec["step_time_s"] if rec["step_time_s"] else 0.0}
        if rec.get("loss_scale") is not None:      # precision.loss_scale: the scale used, whether skipped
            scaled = extra.setdefault("loss_scale", {"scales": [], "skipped_steps": []})
            scaled["scales"].append(rec["loss_scale"])
            if rec["skipped"]:
                scaled["skipped_steps"].append(rec["step"])
        losses.append(rec["loss"])
        times.append(rec["step_time_s"])
        if rec.get("eval_loss") is not None:
            evals.append([rec["step"], rec["eval_loss"]])
        records.append({**rec, "time": time.time()})
        progress.update(rec)

    def rollback(step: int, restart: int) -> None:
        """A restart from checkpoint `step`: the later steps' records go (they run again)."""
        lost = len(losses) - step
        del losses[step:]
        if lost > 0:
            del times[max(0, len(times) - lost):]
            scaled = extra.get("loss_scale")
            if scaled:                      # precision.loss_scale's per-step record goes the same way
                del scaled["scales"][max(0, len(scaled["scales"]) - lost):]
                scaled["skipped_steps"] = [s for s in scaled["skipped_steps"] if s < step]
        evals[:] = [e for e in evals if e[0] < step]
        records.append({"restart": restart, "resumed_from": step, "time": time.time()})

    def summary(status: str, param_norms: dict, error: str | None = None) -> dict:
        return {
            "run": job.run.name,
            "run_dir": str(out),
            "status": status,               # completed | failed | interrupted
            **({"error": error} if error is not None else {}),
            "steps_done": len(losses),
            "losses": losses,
            "step_times_s": times,
            "param_norms": param_norms,
            "eval_losses": evals,
            "plan": plan_json(plan),
            "config": json.dumps(redact(checked.to_dict()), indent=2),  # secrets never reach disk
            **extra,
        }

    path = out / f"summary{suffix}.json"
    try:
        if reference:
            from orchestrator.driver.reference import train_reference

            result = train_reference(checked.model, source, steps=job.run.steps, seed=job.run.seed,
                                     microbatches=job.pipeline.microbatches,
                                     optimizer=job.optimizer.spec(), on_step=on_step,
                                     eval_every=job.run.eval_every, loss_scale=job.precision.scaling())
            norms, arrays = result["param_norms"], result.get("params")
        else:
            norms, arrays = _run_pipeline(checked, plan, source, on_step, out, echo, extra, hooks, keep_params,
                                          ckpt, losses, rollback,
                                          resume_command or "meshpipe run <job.yaml> --resume")
    except BaseException as e:
        progress.close()
        _record_stop(e, summary, out, path, job.run.steps, echo)
        raise
    finally:
        progress.close()   # end the bar's line before anything else is printed
        records.close()
    done = summary("completed", norms)
    write_private(path, json.dumps(done, indent=1))  # 0o600, atomic
    echo(f"wrote {path}")
    if not reference:
        echo(summary_block(done, out))
    if keep_params:
        done["params"] = arrays
    return done


def _record_stop(e: BaseException, summary: Callable[..., dict], out: Path, path: Path, total: int,
                 echo) -> None:
    """The record of a run that stopped early: summary.json with status "failed" or
    "interrupted" (`summary` is run_job's, the one record-writing path), a stage's full
    traceback in error.txt; the record's path and the steps done go onto `e` for the CLI
    (`interrupt.stopped_message`, the stage-failure report)."""
    from orchestrator.driver.waiting import StageFailure

    status = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
    try:
        if isinstance(e, StageFailure) and e.detail:
            err = out / "error.txt"
            write_private(err, f"{e.message}\nwhere: {e.where}\n\n{e.detail}\n")
            e.error_file = str(err)
        rec = summary(status, {}, redact_text(f"{type(e).__name__}: {getattr(e, 'message', None) or e}"))
        write_private(path, json.dumps(rec, indent=1))
        echo(f"wrote {path} ({status} after {rec['steps_done']} of {total} steps)")
    except Exception as w:  # noqa: BLE001 - the record must not hide the run's own error
        log.warning("could not write %s: %s", path, w)
        return
    if isinstance(e, KeyboardInterrupt):
        e.steps_done, e.total_steps, e.record = rec["steps_done"], total, str(path)


def _run_pipeline(checked, plan, source, on_step, out: Path, echo, extra: dict, hooks: Sequence = (),
                  keep_params: bool = False, ckpt=None, losses: list | None = None, rollback=None,
                  resume_command: str = "meshpipe run <job.yaml> --resume") -> tuple[dict, dict | None]:
    """Run the pipeline; returns the final parameter norms (and arrays with `keep_params`). Fills
    `extra` (summary.json's pipeline fields) as it goes, so a failed run's summary has what was
    known. `ckpt`: the checkpoint plan (`checkpoint.prepare`); `losses`: the run's loss list,
    which the commit markers record; `rollback(step, restart)`: drop the records after `step`.
    Attempts run in a loop while `failure.max_restarts` allows (module docstring). On
    Ctrl-C/SIGTERM the actors are told to abandon their step before they are shut down."""
    from orchestrator.core.backends import PlacementError
    from orchestrator.core.health import HealthMonitor, HealthRule, skip_data
    from orchestrator.core.recovery import Decision, ProgressDeadline, RestartPolicy, failed_step, node_loss
    from orchestrator.driver import placement, recovery
    from orchestrator.driver.checkpoint import Committer, prepare, remove_probe, write_probe
    from orchestrator.driver.executor import PipelineExecutor
    from orchestrator.driver.interrupt import reinstall
    from orchestrator.driver.quiet import filter_worker_logs
    from orchestrator.driver.telemetry import RunTelemetry
    from orchestrator.driver.workers import write_workers

    job = checked.job
    run = job.run.name
    namespace = f"meshpipe-{run}"
    started = placement.connect(checked.cluster, namespace=namespace)
    reinstall()            # ray.init put absl's signal handler in place of ours (stack dump, abort)
    filter_worker_logs()
    ex = tel = metrics = None
    last_spans: list = []
    losses = losses if losses is not None else []
    first = resumed_from = ckpt.start if ckpt else 0
    committer = Committer(checked, job.pipeline.schedule, sum(len(s.hosts) for s in checked.stages),
                          losses) if ckpt else None
    if first:
        echo(f"resuming from checkpoint step {first} in {job.checkpoint.dir}")
    policy = RestartPolicy(job.failure.max_restarts)
    deadline = ProgressDeadline(checked.cluster.timeouts.step_s)     # shared by the attempts
    recoveries: list[dict] = []
    extra.update(restarts=0, recoveries=recoveries)
    monitor = HealthMonitor(HealthRule.from_job(job))     # training health (orchestrator.core.health)
    extra["health"] = {"on_nonfinite": job.failure.on_nonfinite, "skipped_steps": [],
                       "events": [], "divergence": None if job.failure.divergence is None
                       else job.failure.divergence.model_dump()}
    hung: list[str] = []       # after a timeout: the actors that did not answer a heartbeat (killed first)
    gone: set[str] = set()     # ids of nodes lost during the run (a restart's placement avoids them)
    wait_s = job.failure.placement_timeout_s or checked.cluster.timeouts.init_s   # a restart's placement
    ok = interrupted = False
    try:
        extra["ray"] = _ray_info(run, echo)
        tel = RunTelemetry(run, plan.schedule, plan.sim.bubble_fraction, job.data.global_batch)
        metrics = _metrics(run, plan.sim.bubble_fraction)
        recovering: dict | None = None      # the restart record waiting for its first step
        last = None                         # (failure, where) of the newest restart
        while True:
            ex = PipelineExecutor(checked, plan.schedule, source, run, plan.eval_schedule, hooks=hooks,
                                  checkpoint=ckpt.worker if ckpt else None, deadline=deadline,
                                  placement_wait=wait_s if recovering is not None else 0.0, avoid_nodes=gone)
            progress_at = time.monotonic()
            try:
                t0 = time.perf_counter()
                if ckpt is not None:
                    write_probe(ckpt)      # each stage host reads it back at set-up: checkpoint.dir is shared
                ex.start()
                remove_probe(ckpt)
                write_workers(out, run, ex.info, policy.restarts, echo)    # which process is which (workers.json)
                extra.setdefault("startup_s", time.perf_counter() - t0)
                if recovering is not None:   # placement + actors + restore + setup (compiling is in step 1)
                    recovering["start_s"] = time.perf_counter() - t0
                    recovering["placement_s"] = ex.placement_s
                    recovering["restore_s"] = max((w.get("restore_s") or 0.0 for w in ex.info), default=0.0)
                for r in ex.steps(job.run.steps - first, first):
                    progress_at = time.monotonic()
                    if recovering is not None:     # noticed → training again
                        recovering["recovery_s"] = time.time() - recovering["detected_at"]
                        recovering["first_step_s"] = r.wall_s    # with the recompilation
                        recovering["compile_s"] = max((st.get("compile_s") or 0.0 for st in r.stats), default=0.0)
                        recovering = None
                    last_spans = r.spans     # only the last step's spans are kept (trace.json: telemetry's own)
                    st = tel.add(r.step, r.wall_s, r.loss, r.spans, r.stats)
                    # what each stage actor last ran under, read back on it (stages.telemetry.conditions)
                    extra["conditions"] = [{k: s.get(k) for k in ("stage", "host", "affinity", "os_threads")}
                                           for s in r.stats if "affinity" in s]
                    if metrics is not None:
                        metrics.record(st, eval_loss=r.eval_loss)
                    event = _health(monitor, r, extra["health"], echo)
                    on_step({"step": r.step, "loss": r.loss, "step_time_s": r.wall_s, "eval_loss": r.eval_loss,
                             "span_s": st.span_s, "measured_bubble": st.measured_bubble,
                             **_scaling(r.step, r.stats),
                             **({"health": f"{event.action}: {event.kind}"} if event else {})})
                    healthy = event is None or event.action == "skip"     # else only saves from before it commit
                    if committer is not None:     # after on_step: the marker records the losses so far
                        for done in committer.add([c for c in r.checkpoints if healthy or c["step"] <= r.step]):
                            log.info("checkpoint step %d committed", done)
                    _act_on_health(event)     # stop, or roll back to the newest commit from before this step
                break
            except PlacementError as e:
                if last is None:
                    raise                           # the first placement: the error as it was
                failure, where = last
                committed = recovery.committed_step(checked)
                why = Decision(False, f"the placement could not be reserved again within {wait_s:g} s "
                                      f"(failure.placement_timeout_s): {e}")
                done = ckpt.start + (recovering or {}).get("steps_lost", 0)     # the steps done before the failure
                raise recovery.RecoveryStopped.after(recovery.stop_message(
                    failure, where, why, committed, done, resume_command), e) from e
            except recovery.RECOVERABLE as e:
                detected_at, waited = time.time(), time.monotonic() - progress_at
                hung[:] = ex.unresponsive(getattr(e, "labels", [])) if recovery.is_hang(e) else []
                failure = recovery.classify(e, len(losses), hung)
                lost = recovery.lost_nodes(ex.info)      # a node of the run gone: the failure is its loss
                failure = node_loss(failure, lost)
                gone.update(lost)
                hung += [lbl for n in lost.values() for lbl in n["labels"] if lbl not in hung]  # killed, not waited for
                if job.failure.max_restarts > 0:    # the step it failed in: the actors still answering
                    finished = ex.finished_steps(hung)   # say which steps they finished (a heartbeat, ≤ 2 s)
                    failure = dataclasses.replace(failure, step=failed_step(failure.step, finished))
                event = getattr(e, "health_event", None)     # a health rollback names its step exactly
                if event is not None:
                    failure = dataclasses.replace(failure, step=event.step)
                steps_done = max(len(losses), failure.step)     # finished before the failure, results or not
                where = ex.node_of(failure.stage, failure.host)
                recv_deadlines = {lbl: h.get("recv_s") for lbl, h in ex.heartbeats.items()}   # as the actors said
                committed = recovery.committed_step(checked)
                decision = policy.decide(failure, committed)
                if not decision.restart:
                    if job.failure.max_restarts == 0:
                        raise                       # no `failure:` section: the error as it was
                    raise recovery.RecoveryStopped.after(recovery.stop_message(
                        failure, where, decision, committed, steps_done, resume_command), e) from e
                t1 = time.perf_counter()
                torn = _shutdown(ex, extra, ckpt, committer, resumed_from, hung, after_failure=True)
                ex, hung[:] = None, []
                recovery.wait_released([f"{run}/stage{s.index}/host{h}" for s in checked.stages
                                        for h in range(len(s.hosts))], namespace,
                                       checked.cluster.timeouts.shutdown_s)
                teardown_s = time.perf_counter() - t1
                ckpt = prepare(checked, "latest")    # as --resume: checks, removes uncommitted saves
                if event is not None:     # a health rollback: skip the data from the commit through the bad step
                    restore = ckpt.worker["restore"]
                    restore["data"] = skip_data(restore["data"], ckpt.start, event.step)
                monitor.rollback(ckpt.start)     # the losses and skips from the commit on run again
                extra["health"]["skipped_steps"] = [s for s in extra["health"]["skipped_steps"] if s < ckpt.start]
                rec = recovery.record(failure, where, ckpt.start, detected_at, waited)
                rec.update(restart=policy.restarts, teardown_s=teardown_s, teardown_graceful_s=torn["graceful_s"],
                           teardown_stuck=torn["stuck"],
                           progress_deadline_s=deadline.call_s(checked.cluster.calls_of_steps),
                           step_deadline_s=deadline.step_s(),     # the heartbeats' (recovery.HeartbeatWatch)
                           recv_deadline_s=recv_deadlines)
                recoveries.append(rec)
                extra["restarts"] = policy.restarts
                if metrics is not None:
                    metrics.restarts.set(policy.restarts, tags={"run": run})
                msg = (f"restart {policy.restarts} of {job.failure.max_restarts}: {recovery.describe(failure, where)}"
                       f"; resuming from checkpoint step {ckpt.start} ({rec['steps_lost']} steps to run again)")
                log.info("%s", msg)      # echo prints it; a warning would reach the terminal a second time
                echo(msg)
                rollback(ckpt.start, policy.restarts)
                committer.pending.clear()       # saves of the failed attempt never commit
                first, recovering, last = ckpt.start, rec, (failure, where)
        if committer is not None:
            committer.add(ex.checkpoint_flush())
            if committer.incomplete():
                raise RuntimeError(f"checkpoint steps {committer.incomplete()} were not reported by every host")
        norms = ex.param_norms()
        arrays = ex.param_arrays() if keep_params else None
        ok = True
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        if ex is not None:
            if interrupted:   # (a failed step has told every actor already: worker._fail)
                ex.abort("the driver stopped the run")   # a step still running ends now, not at its deadline
            _shutdown(ex, extra, ckpt, committer, resumed_from, hung, after_failure=not ok and not interrupted)
        remove_probe(ckpt)
        if tel is not None:
            try:
                tel.write(out)
            except Exception as e:  # noqa: BLE001 - pictures must not hide the run's own error
                log.warning("could not write trace.json/timeline.png: %s", e)
            extra.update(last_step_spans=[list(s) for s in last_spans], telemetry=tel.summary())
        if ok and metrics is not None and checked.cluster.address is not None:
            metrics.flush()   # a long-lived cluster: let the last values reach its metrics agent
        if started:
            import ray

            ray.shutdown()
    return norms, arrays


def _health(monitor, r, record: dict, echo):
    """Training health of step result `r` (`orchestrator.core.health`): the event, if any, recorded
    in summary.json's `health` (every event; skipped steps listed) and said on the log."""
    last = max(s["stage"] for s in r.stats)
    by_stage = {s["stage"]: s["health"] for s in r.stats if s.get("health") is not None and s["host"] == 0}
    grad_sq = [by_stage.get(i, (None, None))[0] for i in range(last + 1)]
    params_bad = [by_stage.get(i, (None, None))[1] for i in range(last + 1)]
    event = monitor.observe(r.step, r.loss, grad_sq, params_bad)
    if event is None:
        return None
    record["events"].append(event.as_record())
    if event.action == "skip":
        record["skipped_steps"].append(event.step)
    msg = f"training health: {event.why}: {event.action}"
    log.warning("%s", msg)
    echo(msg)
    return event


def _act_on_health(event) -> None:
    """Stop (`HealthStop`: the run fails naming step, stage and kind) or roll back (a recoverable
    StageFailure carrying the event: the restart path restores the last commit, `skip_data`)."""
    from orchestrator.core.health import HealthStop
    from orchestrator.driver.waiting import StageFailure

    if event is None or event.action == "skip":
        return
    if event.action == "stop":
        raise HealthStop(event)
    e = StageFailure(f"training health: {event.why}: rolling back", label=f"stage {event.stage} host 0")
    e.health_event = event
    raise e


def _scaling(step: int, stats: list) -> dict:
    """Loss scaling's step record (`loss_scale`, `skipped`), checked to be the same on every actor:
    the skip decision is global, so a disagreement is a bug and fails the run."""
    seen = {(s["loss_scale"], s["skipped"]) for s in stats if "loss_scale" in s}
    if not seen:
        return {}
    if len(seen) > 1:
        by = {f"stage{s['stage']}/host{s['host']}": (s.get("loss_scale"), s.get("skipped")) for s in stats}
        raise RuntimeError(f"step {step}: stages disagree on loss scaling (scale, skipped): {by}")
    scale, skipped = seen.pop()
    return {"loss_scale": scale, "skipped": skipped}


def _shutdown(ex, extra: dict, ckpt, committer, resumed_from: int, unresponsive=(),
              after_failure: bool = False) -> dict:
    """Record what the attempt's executor knows into summary.json's fields, then shut it down
    (`unresponsive` actors killed first; `after_failure`: the survivors get a short grace, not
    `timeouts.shutdown_s`). Returns `PipelineExecutor.shutdown`'s record."""
    extra.update(workers=ex.info, executor=ex.dispatch_info)
    if ckpt is not None:
        extra["checkpoint"] = {"dir": ex.checked.job.checkpoint.dir, "resumed_from": resumed_from or None,
                               "commits": committer.commits,
                               "restore_s": max((w.get("restore_s") or 0.0 for w in ex.info), default=0.0)}
    return ex.shutdown(unresponsive, after_failure=after_failure)


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
    from orchestrator.driver.jobs import token_source

    from orchestrator.driver.ray_internals import token_auth_enabled

    if not token_auth_enabled():
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
