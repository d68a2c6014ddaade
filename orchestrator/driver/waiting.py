"""Bounded waits on Ray object refs: every remote wait in meshpipe goes through here.

A call that fails on an actor becomes a `StageFailure` whose first line names the
stage/host and the exception (`short_error`), followed by where it ran (pid, node)
and the last frames of the stage's own traceback, redacted
(`orchestrator.core.redact`) and short enough for one screen; `detail` keeps the
whole (redacted) remote traceback, which the runner writes to `<run dir>/error.txt`.
For recovery (`orchestrator.driver.recovery`) a failure also says, in typed fields, which actor
it came from (`label`: an `orchestrator.core.contract.ActorId`, "stage 1 host 0" with `stage` and
`host`), whether its process died (`died`: Ray's actor-death error) and where the step failed
first (`origin`: the `StepFailure` the actor put on its error, or on a survivor's the one of
the peer that aborted it); a deadline that passes raises `ProgressTimeout` (a TimeoutError)
with the labels still pending. A survivor's own error (not a "told to stop") is not taken for the cause
while a peer's death shows up within `DEATH_GRACE_S`.
"""
from __future__ import annotations

import re
import time

SHORT_FRAMES_LINES = 16     # traceback lines kept in the short form (the ones nearest the error)
ROOT_CAUSE_GRACE_S = 5.0    # how long a peer's "told to stop" failure waits for the failing actor's own
DEATH_GRACE_S = 1.0         # after a survivor's own error: how long to look for a death among the rest
WATCH_SLICE_S = 1.0         # with a `watch` (e.g. recovery.NodeWatch): it is called at least this often


class StageFailure(RuntimeError):
    """A stage's call failed. `str()` is the short form; `detail` the full redacted traceback;
    `error_file` is set by the runner once `detail` is written to the run directory."""

    def __init__(self, message: str, detail: str = "", where: str = "", tail: str = "",
                 label: str | None = None, died: bool = False, origin=None):
        super().__init__(message)
        self.message, self.detail, self.where, self.tail = message, detail, where, tail
        self.label, self.died = label, died      # the actor (an ActorId: "stage 1 host 0"); its process died
        self.origin = origin     # orchestrator.core.contract.StepFailure: where the step failed first, or None
        self.error_file: str | None = None

    def __str__(self) -> str:
        parts = [self.message]
        if self.where:
            parts.append(f"  where: {self.where}")
        if self.tail:
            parts.append("  stage traceback (most recent call last; full: "
                         f"{self.error_file or 'error.txt in the run directory'}):")
            parts += [f"    {ln}" for ln in self.tail.splitlines()]
        return "\n".join(parts)


def stage_failure(what: str, label: str, e: BaseException) -> StageFailure:
    """The StageFailure for call `what` that raised `e` on actor `label` (e.g. "stage 1 host 0").

    Ray's error (`RayTaskError(...)`) carries the actor's own traceback in its text, after a
    header `ray::Class.method() (pid=…, ip=…, …)`; the pid and node come from there.
    """
    import traceback

    from orchestrator.core.contract import failure_of
    from orchestrator.core.redact import redact_text

    text = _ANSI.sub("", redact_text(str(e))).rstrip()
    head = _RAY_HEADER.search(text)
    where = label
    if head:
        detail = text[head.start():]
        where += f" (pid {head['pid']}, node {head['ip']}, in {head['call']})"
    else:
        detail = redact_text("".join(traceback.format_exception(type(e), e, e.__traceback__))).rstrip()
    return StageFailure(f"{what} failed on {label}: {short_error(e)}", detail=detail, where=where,
                        tail=_tail(detail), label=label, died=_died(e), origin=failure_of(e))


class ProgressTimeout(TimeoutError):
    """No answer within the deadline; `labels`: the actors whose calls were still pending;
    `culprits`: those the heartbeats name as hung (`orchestrator.core.recovery.stalled`), if any."""

    def __init__(self, message: str, labels: list[str] | None = None, culprits: list[str] | None = None):
        super().__init__(message)
        self.labels = list(labels or [])
        self.culprits = list(culprits or [])


def _died(e: BaseException) -> bool:
    from ray.exceptions import RayActorError

    return isinstance(e, RayActorError)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RAY_HEADER = re.compile(r"ray::(?P<call>[\w.]+)\(\) \(pid=(?P<pid>\d+), ip=(?P<ip>[^,)]+)")


def _tail(detail: str) -> str:
    """The traceback lines nearest the error: no header, no `^^^^` marker lines."""
    lines = detail.splitlines()[1:] if _RAY_HEADER.match(detail) else detail.splitlines()
    body = [ln for ln in lines if ln.strip() and not ln.startswith("Traceback") and set(ln.strip()) != {"^"}]
    return "\n".join(body[-SHORT_FRAMES_LINES:])


def wait_all(refs: list, timeout: float, what: str, labels: list[str] | None = None, watch=None) -> list:
    """ray.get all refs, failing fast on the first error and raising ProgressTimeout at the deadline.

    `watch`: called at least every `WATCH_SLICE_S` while waiting; it raises to end the wait (the
    run's node watch: a lost node is noticed in seconds, not when Ray's health check marks it dead).

    Errors name the label (e.g. "stage 1 host 0") of the call that failed or is stuck. An actor
    that failed only because it was told to stop (`stages.mailbox.MailboxClosed`: a peer failed
    first and aborted it) often answers before the peer that failed by itself, whose error
    carries its whole traceback; then the other calls get up to `ROOT_CAUSE_GRACE_S` (within the
    deadline) and the first failure of their own is the one raised.
    """
    import ray

    labels = labels or [str(i) for i in range(len(refs))]
    index = {r: i for i, r in enumerate(refs)}
    results: list = [None] * len(refs)
    pending = list(refs)
    deadline = time.monotonic() + timeout
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            stuck = [labels[index[r]] for r in pending]
            raise ProgressTimeout(f"{what}: no answer within {timeout:.0f} s from {', '.join(stuck)}", stuck)
        ready, pending = ray.wait(pending, num_returns=1,
                                  timeout=remaining if watch is None else min(remaining, WATCH_SLICE_S))
        if watch is not None and not ready:
            watch()
        for r in ready:
            try:
                results[index[r]] = ray.get(r, timeout=max(1.0, deadline - time.monotonic()))  # ready
            except Exception as e:  # noqa: BLE001 - re-raised with the stage named
                if _told_to_stop(e):
                    cause = _own_failure(pending, deadline)
                elif not _died(e):
                    cause = _death(pending)
                else:
                    cause = None
                r, e = cause or (r, e)
                raise stage_failure(what, labels[index[r]], e) from e
    return results


def _told_to_stop(e: BaseException) -> bool:
    from stages.mailbox import MailboxClosed

    return isinstance(e, MailboxClosed) or isinstance(getattr(e, "cause", None), MailboxClosed)


def _own_failure(pending: list, deadline: float):
    """(ref, error) of the first of `pending` to fail by itself within the grace, else None."""
    import ray

    end = min(deadline, time.monotonic() + ROOT_CAUSE_GRACE_S)
    while pending and time.monotonic() < end:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, end - time.monotonic()))
        for r in ready:
            try:
                ray.get(r, timeout=1.0)
            except Exception as e:  # noqa: BLE001 - the candidate cause
                if not _told_to_stop(e):
                    return r, e
    return None


def _death(pending: list):
    """(ref, error) of a death among `pending` within DEATH_GRACE_S, else None: a survivor's own
    error about a dead peer (a reset connection) must not be taken for the cause."""
    import ray

    if not pending:
        return None
    ready, _ = ray.wait(pending, num_returns=len(pending), timeout=DEATH_GRACE_S)
    for r in ready:
        try:
            ray.get(r, timeout=1.0)
        except Exception as e:  # noqa: BLE001 - only looking
            if _died(e):
                return r, e
    return None


def short_error(e: Exception) -> str:
    from orchestrator.core.redact import redact_text

    text = redact_text(str(e)).strip()
    noise = ("For simplicity, JAX has removed", "-----")
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith(noise)]
    # Ray wraps remote errors with the whole traceback; the last line holds the cause.
    return lines[-1] if lines else type(e).__name__
