"""A pipeline run as attempts: one executor lifetime each, and the loop recovery makes of them.

Basic flow (`orchestrator.driver.runner._run_pipeline`):
  `Session` — for the whole run: the run's telemetry and Ray metrics, the checkpoint
  committer, the progress deadline the attempts share, the nodes lost so far, the
  recoveries and the training-health monitor; `take(r)` feeds one step result to all of
  them and to the record (`orchestrator.driver.record.RunRecord`). A health event
  (`orchestrator.core.health`) is recorded with its step; then only the saves from before
  the bad step commit, and its action follows: stop (`HealthStop` ends the run) or roll back
  (`HealthRollback`: the attempt fails as a typed ROLLBACK at the bad step, and the restart
  skips the data from the commit through it; so does every later restart from that commit).
  `Attempt` — one executor lifetime: reserve the placement, start the actors (restoring the
  checkpoint it is given), run the steps from `first`, flush the last saves. A failure
  leaves it as `AttemptFailed`: a typed `orchestrator.core.recovery.Failure` (cause, stage,
  host, node, step) and what a recovery record reports, after the attempt looked at what it
  can still see (who answers a heartbeat, which node is gone, which steps finished).
  `run_attempts(start, first, policy, recovery)` — attempts until one finishes; on
  `AttemptFailed` the policy decides from the failure's fields alone: restart (tear the
  attempt down, prepare the newest commit as `--resume latest` would, roll the record back,
  start the next one) or stop (`RecoveryStopped`, saying why and how to continue). The loop
  knows attempts only through `run` and `close`, so a fake attempt tests it without Ray.

Elastic recovery (`failure.elastic`, `orchestrator.driver.elastic`):
  shrink — a restart's placement not had within `failure.placement_timeout_s`: `Session.replan`
    plans the job for the hosts the live cluster holds; at least `min_hosts` and fewer hosts than
    the plan that could not be placed, the session switches to it (`_switch`: plan, committer,
    the newest commit prepared onto it, telemetry, metrics, progress deadline) and the loop starts
    the next attempt on it; otherwise the run stops with the reason. A loss while re-planning is
    the next placement failing: the same path plans again for what is left (hosts only go down
    along it, so it ends).
  grow — at each commit on a smaller plan `Session.take` asks whether to grow back; yes raises
    `GrowBack` out of the step loop, and `Session.grow` ends the attempt at the commit and
    switches onto the larger plan (no failure: no restart counted).
  Every plan derives from the job's own (`Session.original`) and the host count; each re-plan is
  an entry of summary.json's `replans`, its times filled in at its first step trained.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

from orchestrator.core.health import ROLLBACK as ROLLBACK_ACTION
from orchestrator.core.health import SKIP, STOP, HealthRollback, HealthStop, skip_data
from orchestrator.core.recovery import NODE_LOST, ROLLBACK, STORAGE, Decision, Failure, RestartPolicy
from orchestrator.driver.elastic import GrowBack

log = logging.getLogger("meshpipe")

# Causes a run without restarts still reports as a stop (why, what is lost, the command that goes
# on) rather than as the error first seen: a lost node (the survivors' reset connections are its
# consequences) and a checkpoint.dir that refuses writes.
REPORTED = (NODE_LOST, STORAGE)


@dataclass(eq=False)       # an exception keeps its identity (hash, ==)
class AttemptFailed(Exception):
    """An attempt ended by a failure recovery may act on.

    Attributes:
      failure: what failed, where and in which step (the policy decides from it).
      where: the failed actor's place: {"cluster_host", "node_id"} as far as known.
      error: the error the driver saw (kept under a stop's message: its report and traceback).
      steps_done: the steps finished before the failure (results or not).
      detected_at: wall time the driver noticed it; waited_s: since the last progress.
      hung: actors that did not answer a heartbeat (killed at teardown, not waited for).
      recv_deadlines: each actor's RECV deadline as its heartbeat said.
    """

    failure: Failure
    where: dict
    error: BaseException
    steps_done: int = 0
    detected_at: float = 0.0
    waited_s: float = 0.0
    hung: list = field(default_factory=list)
    recv_deadlines: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.failure.cause}: {self.failure.who} in step {self.failure.step}: {self.failure.text}"


class AttemptLike(Protocol):
    def run(self) -> Any: ...

    def close(self, after_failure: bool, hung=(), interrupted: bool = False) -> dict: ...


class Recovery(Protocol):
    """What the loop asks of the run between attempts (`Session` is the real one)."""

    def committed(self) -> Optional[int]: ...

    def restart(self, failed: AttemptFailed, attempt: AttemptLike, restarts: int) -> tuple[int, dict]: ...

    def stop(self, failed: AttemptFailed, decision: Decision) -> BaseException: ...

    def replan(self, failed: AttemptFailed, recovering: dict) -> "tuple[int, dict] | Decision": ...

    def grow(self, grow: GrowBack, attempt: AttemptLike) -> tuple[int, dict]: ...


def run_attempts(start: Callable[[int, Optional[dict]], AttemptLike], first: int, policy: RestartPolicy,
                 recovery: Recovery):
    """Attempts from step `first` until one returns; see the module docstring. `start(first, recovering)`
    makes an attempt (`recovering`: the restart's record, None for the first attempt)."""
    from orchestrator.core.backends import PlacementError

    recovering: Optional[dict] = None
    last: Optional[AttemptFailed] = None
    while True:
        attempt = start(first, recovering)
        try:
            return attempt.run()
        except PlacementError as e:
            if last is None:
                raise                       # the first placement: the error as it was
            steps_done = first + recovering.get("steps_lost", 0)     # the steps done before the failure
            failed = dataclasses.replace(last, steps_done=steps_done, error=e)
            got = recovery.replan(failed, recovering)      # failure.elastic: a plan on the hosts left
            if isinstance(got, Decision):
                raise recovery.stop(failed, got) from e
            first, recovering = got
        except GrowBack as grow:
            first, recovering = recovery.grow(grow, attempt)
        except AttemptFailed as failed:
            decision = policy.decide(failed.failure, recovery.committed())
            if not decision.restart:
                if policy.max_restarts == 0 and failed.failure.cause not in REPORTED:    # the error as it was
                    raise failed.error from failed.error.__cause__
                raise recovery.stop(failed, decision) from failed.error
            first, recovering = recovery.restart(failed, attempt, policy.restarts)
            last = failed


class Session:
    """What a pipeline run keeps across its attempts (see the module docstring).

    Args:
      checked, plan: the job and its plan.
      record: the run's `RunRecord` (its `extra` is summary.json's pipeline fields).
      ckpt: the checkpoint plan (`orchestrator.driver.checkpoint.prepare`), or None.
      resume_command: the command that continues this run (for a stop's message).
      echo: where the run's lines go.
    """

    def __init__(self, checked, plan, record, ckpt, resume_command: str, echo: Callable[[str], None]):
        from orchestrator.core.health import HealthMonitor, HealthRule
        from orchestrator.core.recovery import ProgressDeadline
        from orchestrator.driver.checkpoint import Committer

        job = checked.job
        self.checked, self.plan, self.record, self.ckpt = checked, plan, record, ckpt
        self.original = checked         # the job's own plan: every elastic plan derives from it
        self.elastic = job.failure.elastic
        self.resume_command, self.echo = resume_command, echo
        self.run_name = job.run.name
        self.resumed_from = ckpt.start if ckpt else 0
        self.committer = Committer(checked, job.pipeline.schedule, sum(len(s.hosts) for s in checked.stages),
                                   record.losses) if ckpt else None
        self.deadline = ProgressDeadline(checked.cluster.timeouts.step_s)     # shared by the attempts
        self.gone: set[str] = set()     # ids of nodes lost during the run (a restart's placement avoids them)
        self.recoveries: list[dict] = []
        record.extra.update(restarts=0, recoveries=self.recoveries)
        self.skipped: dict[int, int] = {}   # commit step → batches training-health rollbacks to it skipped
        self.replans: list[dict] = []   # summary.json's `replans` (failure.elastic)
        self._pending = None            # the newest re-plan until its first step: (record, entry, times, rec)
        self._placing_since = 0.0       # when the newest restart began to wait for its placement
        self._profile = None            # replan: auto's layer profiler, made at the first re-plan
        if self.elastic is not None:
            from orchestrator.core.elastic import describe_plan

            record.extra.update(replans=self.replans, plan_in_use=describe_plan(checked))
        self.tel = self.metrics = None
        self.last_spans: list = []
        self.executor = None            # the newest attempt's executor (what summary.json describes)
        self.monitor = HealthMonitor(HealthRule.from_job(job))     # training health (orchestrator.core.health)
        divergence = job.failure.divergence
        record.extra["health"] = {"on_nonfinite": job.failure.on_nonfinite, "skipped_steps": [], "events": [],
                                  "divergence": None if divergence is None else divergence.model_dump()}

    def open(self) -> None:
        """The run's telemetry and Ray metrics (Ray is connected)."""
        from orchestrator.driver.telemetry import RunTelemetry

        plan = self.plan
        self.tel = RunTelemetry(self.run_name, plan.schedule, plan.sim.bubble_fraction,
                                self.checked.job.data.global_batch)
        self.metrics = _metrics(self.run_name, plan.sim.bubble_fraction)
        self._show_plan()

    # -- a step ------------------------------------------------------------
    def take(self, r) -> None:
        """One step result (`executor.StepResult`) into telemetry, metrics, the record, the committer."""
        self.last_spans = r.spans     # only the last step's spans are kept (trace.json: telemetry's own)
        st = self.tel.add(r.step, r.wall_s, r.loss, r.spans, r.stats)
        # what each stage actor last ran under, read back on it (stages.telemetry.conditions)
        self.record.extra["conditions"] = [{k: s.get(k) for k in ("stage", "host", "affinity", "os_threads")}
                                           for s in r.stats if "affinity" in s]
        if self.metrics is not None:
            self.metrics.record(st, eval_loss=r.eval_loss)
        event = self._health(r)
        self.record.step({"step": r.step, "loss": r.loss, "step_time_s": r.wall_s, "eval_loss": r.eval_loss,
                          "span_s": st.span_s, "measured_bubble": st.measured_bubble, **scaling(r.step, r.stats),
                          **({"health": f"{event.action}: {event.kind}"} if event else {})})
        if self._pending is not None:      # the first step on a new plan: its times are known now
            self._replanned()
        done: list[int] = []
        if self.committer is not None:     # after the record: the marker records the losses so far
            before = event is None or event.action == SKIP      # else only the saves from before it commit
            done = self.committer.add([c for c in r.checkpoints if before or c["step"] <= r.step])
            for step in done:
                log.info("checkpoint step %d committed", step)
        if event is not None and event.action == STOP:
            raise HealthStop(event)
        if event is not None and event.action == ROLLBACK_ACTION:
            raise HealthRollback(event)
        if done and self.elastic is not None and self.checked is not self.original:
            from orchestrator.driver import elastic

            grow = elastic.grow(self.original, self.checked, self.gone, done[-1], self._profiler())
            if grow is not None:
                raise grow          # ends the attempt here (`run_attempts` → `Session.grow`)

    def _health(self, r):
        """Training health of step result `r` (`orchestrator.core.health`): its event or None; an
        event goes into the record and onto the log."""
        last = max(s["stage"] for s in r.stats)
        by_stage = {s["stage"]: s["health"] for s in r.stats if s.get("health") is not None and s["host"] == 0}
        grad_sq = [by_stage.get(i, (None, None))[0] for i in range(last + 1)]
        params_bad = [by_stage.get(i, (None, None))[1] for i in range(last + 1)]
        event = self.monitor.observe(r.step, r.loss, grad_sq, params_bad)
        if event is not None:
            self.record.health(event.as_record())
            msg = f"training health: {event.why}: {event.action}"
            log.warning("%s", msg)
            self.echo(msg)
        return event

    def describe(self, ex) -> None:
        """What the attempt's executor knows, into summary.json's fields."""
        self.executor = ex
        extra = self.record.extra
        extra.update(workers=ex.info, executor=ex.dispatch_info)
        if self.ckpt is not None:
            extra["checkpoint"] = {"dir": self.checked.job.checkpoint.dir, "resumed_from": self.resumed_from or None,
                                   "commits": self.committer.commits,
                                   "restore_s": max((w.get("restore_s") or 0.0 for w in ex.info), default=0.0)}

    # -- between attempts (run_attempts' Recovery) ---------------------------
    def committed(self) -> Optional[int]:
        from orchestrator.driver import recovery

        return recovery.committed_step(self.checked)

    def restart(self, failed: AttemptFailed, attempt, restarts: int) -> tuple[int, dict]:
        """Tear the failed attempt down, prepare the newest commit (as --resume latest), record the
        restart and roll the record back; returns (the step to start at, the restart's record)."""
        from orchestrator.driver import recovery

        checked, job = self.checked, self.checked.job
        t1 = time.perf_counter()
        torn = attempt.close(after_failure=True, hung=failed.hung)
        recovery.wait_released(self._actor_names(), f"meshpipe-{self.run_name}", checked.cluster.timeouts.shutdown_s)
        recovery.wait_exited(_info(attempt), checked.cluster.timeouts.shutdown_s, self.gone)   # before prepare
        teardown_s = time.perf_counter() - t1
        self._latest(checked, rollback_at=failed.failure.step if failed.failure.cause == ROLLBACK else None)
        self.monitor.rollback(self.ckpt.start)       # the losses and skips from the commit on run again
        rec = recovery.record(failed.failure, failed.where, self.ckpt.start, failed.detected_at, failed.waited_s)
        rec.update(restart=restarts, teardown_s=teardown_s, teardown_graceful_s=torn["graceful_s"],
                   teardown_stuck=torn["stuck"],
                   progress_deadline_s=self.deadline.call_s(checked.cluster.calls_of_steps),
                   step_deadline_s=self.deadline.step_s(),     # the heartbeats' (recovery.HeartbeatWatch)
                   recv_deadline_s=failed.recv_deadlines)
        err = failed.error
        if getattr(err, "detail", ""):      # the failure's full traceback, kept (error.txt, error.1.txt, ...)
            rec["error_file"] = self.record.error_file(err.message, err.where, err.detail).name
        self.recoveries.append(rec)
        self.record.extra["restarts"] = restarts
        if self.metrics is not None:
            self.metrics.set_restarts(restarts)
        msg = (f"restart {restarts} of {job.failure.max_restarts}: {recovery.describe(failed.failure, failed.where)}"
               f"; resuming from checkpoint step {self.ckpt.start} ({rec['steps_lost']} steps to run again)")
        log.info("%s", msg)      # echo prints it; a warning would reach the terminal a second time
        self.echo(msg)
        self.record.rollback(self.ckpt.start, restarts)
        self.committer.pending.clear()       # saves of the failed attempt never commit
        self._placing_since = time.perf_counter()
        return self.ckpt.start, rec

    def _latest(self, checked, rollback_at: Optional[int] = None) -> None:
        """The newest commit prepared to restart from (as --resume latest: checked, uncommitted saves
        removed), skipping the batches every rollback to it skipped. `rollback_at`: this restart is a
        training-health rollback of that bad step, which skips the data from the commit through it.
        Kept per commit because any later restart from the same commit (a crash, a re-plan) must skip
        them again: that commit's checkpoint predates the skip (a later commit saves it in the stages'
        `data_offset`)."""
        from orchestrator.driver.checkpoint import prepare

        self.ckpt = prepare(checked, "latest")
        start = self.ckpt.start
        if rollback_at is not None:      # on top of earlier rollbacks to this commit (step n trained batch n + them)
            self.skipped[start] = self.skipped.get(start, 0) + skip_data(start, rollback_at)
        if self.skipped.get(start):
            spec = self.ckpt.spec
            self.ckpt.spec = dataclasses.replace(spec, restore=dataclasses.replace(
                spec.restore, skip_batches=self.skipped[start]))

    def placement_lost(self, e: BaseException) -> Decision:
        """Why a restart stops when its placement could not be reserved again (`e`)."""
        t = self.checked.cluster.timeouts
        wait_s = self.checked.job.failure.placement_timeout_s or t.init_s
        return Decision(False, f"the placement could not be reserved again within {wait_s:g} s "
                               f"(failure.placement_timeout_s): {e}")

    def replan(self, failed: AttemptFailed, recovering: dict) -> "tuple[int, dict] | Decision":
        """After a restart's placement could not be had (`failed.error`): with `failure.elastic`, switch
        to the plan for the hosts the live cluster holds and return (the step to start at, the
        restart's record); otherwise, or with no legal plan on fewer hosts than the one that could
        not be placed, the `Decision` to stop with."""
        from orchestrator.core.elastic import Timings, plan_hosts
        from orchestrator.driver import elastic

        lost = self.placement_lost(failed.error)
        if self.elastic is None:
            return lost
        wait_s = time.perf_counter() - self._placing_since
        r, planning_s = elastic.shrink(self.original, self.gone, self._profiler())
        if r.action == "stop":
            return Decision(False, f"{lost.reason}; failure.elastic: {r.reason}")
        if r.hosts >= plan_hosts(self.checked):
            return Decision(False, f"{lost.reason}; failure.elastic: the live cluster holds {r.capacity} host "
                                   f"bundle(s), and no legal plan is smaller than the {plan_hosts(self.checked)} "
                                   f"host(s) that could not be placed ({r.reason})")
        why = f"{failed.failure.cause}: {failed.failure.who}"
        node = failed.where.get("node_id")
        times = Timings(teardown_s=recovering.get("teardown_s"), wait_s=wait_s, planning_s=planning_s)
        self._switch("shrink", why + (f" (node {node[:12]})" if node else ""), r, times, recovering)
        recovering.update(replan=len(self.replans), resumed_from=self.ckpt.start)
        self._placing_since = time.perf_counter()
        return self.ckpt.start, recovering

    def grow(self, grow: GrowBack, attempt) -> tuple[int, dict]:
        """End `attempt` at the commit `grow` was raised at and switch onto the larger plan; returns
        (the step to start at, the record the next attempt fills with its times)."""
        from orchestrator.core.elastic import Timings
        from orchestrator.driver import recovery

        t1 = time.perf_counter()
        attempt.close(after_failure=False, interrupted=True)     # the step in flight abandoned
        recovery.wait_released(self._actor_names(), f"meshpipe-{self.run_name}",
                               self.checked.cluster.timeouts.shutdown_s)
        recovery.wait_exited(_info(attempt), self.checked.cluster.timeouts.shutdown_s, self.gone)
        times = Timings(teardown_s=time.perf_counter() - t1, planning_s=grow.planning_s)
        rec = {"detected_at": grow.at, "steps_lost": max(0, len(self.record.losses) - grow.step),
               "restart": self.record.extra["restarts"]}     # (the attempt's workers file is numbered by it)
        self._switch("grow", grow.decision.reason, grow.decision.replan, times, rec)
        self.record.rollback(self.ckpt.start, self.record.extra["restarts"], grow=True)
        self.monitor.rollback(self.ckpt.start)       # the losses from the commit on run again
        self._placing_since = time.perf_counter()
        return self.ckpt.start, rec

    def _switch(self, kind: str, why: str, replan, times, rec: dict) -> None:
        """Train on `replan.checked` from the newest commit: the plan, a committer for its hosts, the
        commit prepared onto it (as --resume latest), a fresh progress deadline, telemetry, metrics
        and the record of the re-plan (`times`: its parts known so far; `rec`: the dict the next
        attempt fills with the rest — placement, restore, compile, recovery_s)."""
        from orchestrator.core.elastic import ReplanRecord, plan_hosts
        from orchestrator.core.plan import make_plan
        from orchestrator.core.recovery import ProgressDeadline
        from orchestrator.driver.checkpoint import Committer

        before, checked = self.checked, replan.checked
        self.checked, self.plan = checked, make_plan(checked)
        self._latest(checked)
        commits = self.committer.commits
        self.committer = Committer(checked, checked.job.pipeline.schedule, plan_hosts(checked), self.record.losses)
        self.committer.commits = commits
        self.deadline = ProgressDeadline(checked.cluster.timeouts.step_s)   # step times of another plan
        done = ReplanRecord.of(kind, self.ckpt.start, why, before, replan, _predicted(before), times)
        entry = done.to_json()
        self.replans.append(entry)
        self._pending = (done, entry, rec)
        self.record.extra["plan_in_use"] = done.plans[1]
        if self.tel is not None:
            self.tel.replan(self.plan.schedule, self.plan.sim.bubble_fraction)
        self._show_plan()
        msg = f"elastic {kind}: {done.plans[0]} → {done.plans[1]} ({why}); resuming from checkpoint step {self.ckpt.start}"
        log.warning("%s", msg)
        self.echo(msg)

    def _replanned(self) -> None:
        """The newest re-plan's first step trained: its times into its record, its log line."""
        done, entry, rec = self._pending
        self._pending = None
        done = done.with_timings(dataclasses.replace(
            done.timings, placement_s=rec.get("placement_s"), restore_s=rec.get("restore_s"),
            compile_s=rec.get("compile_s"), total_s=rec.get("recovery_s")))
        entry.clear()
        entry.update(done.to_json())
        log.warning("%s", done.message())
        self.echo(done.message())

    def _show_plan(self) -> None:
        """The plan in use on the progress line and in the hosts metric (elastic runs)."""
        from orchestrator.core.elastic import plan_hosts, plan_line

        if self.elastic is None:
            return
        if self.record.progress is not None:
            self.record.progress.tag = plan_line(self.checked, plan_hosts(self.original))
        if self.metrics is not None:
            self.metrics.plan(plan_hosts(self.checked), len(self.replans), self.plan.sim.bubble_fraction)

    def _actor_names(self) -> list[str]:
        return [f"{self.run_name}/stage{s.index}/host{h}" for s in self.checked.stages for h in range(len(s.hosts))]

    def _profiler(self):
        from orchestrator.driver import elastic

        if self._profile is None and self.elastic is not None and self.elastic.replan == "auto":
            self._profile = elastic.layer_profiler(self.original)
        return self._profile

    def stop(self, failed: AttemptFailed, decision: Decision) -> BaseException:
        """The error that ends the run after `failed`: why, what is lost, the command that continues."""
        from orchestrator.driver import recovery

        from orchestrator.core.recovery import storage_stop

        f = failed.failure
        msg = recovery.stop_message(f, failed.where, decision, self.committed(), failed.steps_done, self.resume_command)
        if self.recoveries:      # what the restarts so far were for (all of them, when they are used up)
            msg = f"{msg}\n{recovery.earlier_restarts(self.recoveries)}"
        if f.cause == STORAGE:      # the directory, the step and the errno first; then what is lost, how to go on
            msg = f"{storage_stop(f, self.checked.job.checkpoint.dir)}\n{msg}"
        self.record.extra["failure"] = {**f.fields(), **failed.where}     # summary.json: the typed cause
        return recovery.RecoveryStopped.after(msg, failed.error)

    # -- at the end ----------------------------------------------------------
    def close(self, out, ok: bool) -> None:
        """The pictures and the telemetry summary (also after a failure); metrics flushed when the
        cluster outlives the run."""
        if self.tel is not None:
            try:
                self.tel.write(out)
            except Exception as e:  # noqa: BLE001 - pictures must not hide the run's own error
                log.warning("could not write trace.json/timeline.png: %s", e)
            self.record.extra.update(last_step_spans=[list(s) for s in self.last_spans], telemetry=self.tel.summary())
        if self.metrics is not None:
            try:
                if ok and self.checked.cluster.address is not None:
                    self.metrics.flush()   # a long-lived cluster: let the last values reach its metrics agent
            finally:
                self.metrics.close()       # the keeper stops: the run's gauges age out of the agent


def _info(attempt) -> list[dict]:
    """The attempt's actors as their setup reported them (pid, node): none for an attempt without an
    executor (a test's fake) or whose setup did not finish."""
    return list(getattr(getattr(attempt, "ex", None), "info", None) or [])


def _predicted(checked):
    """`predict_step(checked)`, or None where it cannot be had (a record's estimate never stops a re-plan)."""
    from orchestrator.core.elastic import predict_step

    try:
        return predict_step(checked)
    except Exception as e:  # noqa: BLE001 - see the docstring
        log.warning("no predicted step for plan %s: %s", checked.job.run.name, e)
        return None


def _metrics(run: str, simulated_bubble: float):
    from orchestrator.driver.metrics import RunMetrics

    try:
        return RunMetrics(run, simulated_bubble)
    except Exception as e:  # noqa: BLE001 - metrics are an aid, never a reason to fail a run
        log.warning("Ray metrics disabled for this run: %s", e)
        return None


class Attempt:
    """One executor lifetime (see the module docstring).

    Args:
      session: the run's `Session`.
      first: the first step to run (the checkpoint step restored, or 0).
      recovering: the restart's record (filled with the recovery's times), None for the first attempt.
      hooks: `stages.hooks.WorkerHook` objects every stage worker calls.
      keep_params: `run` also returns every parameter array.
    """

    def __init__(self, session: Session, first: int, recovering: Optional[dict], hooks=(), keep_params: bool = False):
        from orchestrator.driver.executor import PipelineExecutor

        s, checked = session, session.checked
        job = checked.job
        self.session, self.first, self.recovering, self.keep_params = s, first, recovering, keep_params
        wait_s = job.failure.placement_timeout_s or checked.cluster.timeouts.init_s   # a restart's placement
        self.ex = PipelineExecutor(checked, s.plan.schedule, checked.data, job.run.name, s.plan.eval_schedule,
                                   hooks=hooks, checkpoint=s.ckpt.spec if s.ckpt else None, deadline=s.deadline,
                                   placement_wait=wait_s if recovering is not None else 0.0, avoid_nodes=s.gone)
        self.hung: list = []        # after a failure: actors that did not answer a heartbeat (killed first)
        self.closed = False
        self._progress_at = time.monotonic()

    def run(self) -> tuple[dict, Optional[dict]]:
        """Start, run the steps, flush the saves; returns (param norms, param arrays or None).

        Raises:
          AttemptFailed: an actor's error or death, a lost node, or no progress within the deadline.
          PlacementError: the placement could not be reserved.
        """
        from orchestrator.driver import recovery
        from orchestrator.driver.checkpoint import CommitWriteError

        try:
            self._start()
            job = self.session.checked.job
            for r in self.ex.steps(job.run.steps - self.first, self.first):
                self._progress_at = time.monotonic()
                if self.recovering is not None:     # noticed → training again
                    self.recovering.update(recovery_s=time.time() - self.recovering["detected_at"],
                                           first_step_s=r.wall_s,    # with the recompilation
                                           compile_s=max((st.get("compile_s") or 0.0 for st in r.stats), default=0.0))
                    self.recovering = None
                self.session.take(r)
        except recovery.RECOVERABLE as e:
            raise self._failed(e) from e
        except HealthRollback as e:      # typed: the bad step, its stage; the actors are all well
            raise AttemptFailed(Failure(ROLLBACK, e.event.stage, 0, e.event.step, e.event.why),
                                self.ex.node_of(e.event.stage, 0), e, steps_done=e.event.step + 1,
                                detected_at=time.time()) from e
        except CommitWriteError as e:
            raise self._commit_failed(e) from e
        try:
            return self._finish()
        except CommitWriteError as e:
            raise self._commit_failed(e) from e

    def _commit_failed(self, e: OSError) -> AttemptFailed:
        """The driver's commit marker not written: a STORAGE failure (never restarted) when
        checkpoint.dir refused it with one of `STORAGE_ERRNOS`, else an ERROR (the usual rules)."""
        from orchestrator.core.recovery import ERROR, storage_error

        found = storage_error(e)
        step = len(self.session.record.losses)
        text = f"committing a checkpoint: {type(e).__name__}: {e}"
        failure = (Failure(STORAGE, None, None, step, text, errno=found[0], path=found[1]) if found
                   else Failure(ERROR, None, None, step, text))
        return AttemptFailed(failure, {}, e, steps_done=step, detected_at=time.time())

    def _start(self) -> None:
        from orchestrator.driver.checkpoint import remove_probe, write_probe
        from orchestrator.driver.workers import write_workers

        s, t0 = self.session, time.perf_counter()
        if s.ckpt is not None:
            write_probe(s.ckpt)      # each stage host reads it back at set-up: checkpoint.dir is shared
        self.ex.start()
        remove_probe(s.ckpt)
        restart = 0 if self.recovering is None else self.recovering["restart"]
        write_workers(s.record.out, s.run_name, self.ex.info, restart, s.echo)    # which process is which
        s.record.extra.setdefault("startup_s", time.perf_counter() - t0)
        if self.recovering is not None:   # placement + actors + restore + setup (compiling is in step 1)
            self.recovering.update(start_s=time.perf_counter() - t0, placement_s=self.ex.placement_s,
                                   restore_s=max((w.get("restore_s") or 0.0 for w in self.ex.info), default=0.0))

    def _failed(self, e: BaseException) -> AttemptFailed:
        """The typed failure behind `e`, from what the attempt can still see (module docstring)."""
        from orchestrator.core.recovery import failed_step, node_loss
        from orchestrator.driver import recovery

        s, ex = self.session, self.ex
        detected_at, waited = time.time(), time.monotonic() - self._progress_at
        self.hung = ex.unresponsive(getattr(e, "labels", [])) if recovery.is_hang(e) else []
        failure = recovery.classify(e, len(s.record.losses), self.hung)
        lost = recovery.lost_nodes(ex.info)      # a node of the run gone: the failure is its loss
        failure = node_loss(failure, lost)
        s.gone.update(lost)
        self.hung += [lbl for n in lost.values() for lbl in n["labels"] if lbl not in self.hung]  # killed, not waited for
        if s.checked.job.failure.max_restarts > 0:    # the step it failed in: the actors still answering
            finished = ex.finished_steps(self.hung)   # say which steps they finished (a heartbeat, ≤ 2 s)
            failure = dataclasses.replace(failure, step=failed_step(failure.step, finished))
        return AttemptFailed(failure, ex.node_of(failure.stage, failure.host), e,
                             steps_done=max(len(s.record.losses), failure.step),   # finished before it, results or not
                             detected_at=detected_at, waited_s=waited, hung=list(self.hung),
                             recv_deadlines={lbl: h.get("recv_s") for lbl, h in ex.heartbeats.items()})

    def _finish(self) -> tuple[dict, Optional[dict]]:
        committer = self.session.committer
        if committer is not None:
            committer.add(self.ex.checkpoint_flush())
            if committer.incomplete():
                raise RuntimeError(f"checkpoint steps {committer.incomplete()} were not reported by every host")
        norms = self.ex.param_norms()
        return norms, self.ex.param_arrays() if self.keep_params else None

    def close(self, after_failure: bool, hung=None, interrupted: bool = False) -> dict:
        """Record what the executor knows (summary.json's fields) and shut it down: `hung` actors
        killed first; `after_failure`: the survivors get a short grace; `interrupted`: every actor is
        told to abandon its step first. Idempotent; returns `PipelineExecutor.shutdown`'s record."""
        if self.closed:
            return {"graceful_s": 0.0, "stuck": []}
        self.closed = True
        if interrupted:   # (a failed step has told every actor already: worker._fail)
            self.ex.abort("the driver stopped the run")   # a step still running ends now, not at its deadline
        self.session.describe(self.ex)
        return self.ex.shutdown(self.hung if hung is None else hung, after_failure=after_failure)


def scaling(step: int, stats: list) -> dict:
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
