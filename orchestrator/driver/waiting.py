"""Bounded waits on Ray object refs: every remote wait in meshpipe goes through here.

A failure names the actor it came from: `StageFailure.label` (e.g. "stage 1 host 0") and
`died` (its process is gone: Ray's actor-death error); a deadline that passes raises
`ProgressTimeout` (a TimeoutError) with the labels still pending. When the first error is
not a death, the others that arrive within a short grace are looked at too, and a death is
preferred: a survivor's error about a dead peer must not be taken for the cause.
"""
from __future__ import annotations

import time

GRACE_S = 1.0      # after a non-death error: how long to look for a death among the rest


class StageFailure(RuntimeError):
    """A remote call failed. `label`: the actor's label (None: not known); `died`: its process died."""

    def __init__(self, message: str, label: str | None = None, died: bool = False):
        super().__init__(message)
        self.label, self.died = label, died


class ProgressTimeout(TimeoutError):
    """No answer within the deadline; `labels`: the actors whose calls were still pending."""

    def __init__(self, message: str, labels: list[str] | None = None):
        super().__init__(message)
        self.labels = list(labels or [])


def _died(e: Exception) -> bool:
    from ray.exceptions import RayActorError

    return isinstance(e, RayActorError)


def wait_all(refs: list, timeout: float, what: str, labels: list[str] | None = None) -> list:
    """ray.get all refs, failing fast on the first error and raising ProgressTimeout at the deadline.

    Errors name the label (e.g. "stage 1 host 0") of the call that failed or is stuck.
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
        ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
        for r in ready:
            try:
                results[index[r]] = ray.get(r, timeout=max(1.0, deadline - time.monotonic()))  # ready
            except Exception as e:  # noqa: BLE001 - re-raised with the stage named
                r, e = _cause(r, e, pending)
                label = labels[index[r]]
                raise StageFailure(f"{what} failed on {label}: {short_error(e)}", label, _died(e)) from e
    return results


def _cause(ref, error: Exception, pending: list):
    """The failure to report: `error`, unless a death among `pending` shows up within GRACE_S."""
    import ray

    if _died(error) or not pending:
        return ref, error
    ready, _ = ray.wait(pending, num_returns=len(pending), timeout=GRACE_S)
    for r in ready:
        try:
            ray.get(r, timeout=1.0)
        except Exception as e:  # noqa: BLE001 - only looking
            if _died(e):
                return r, e
    return ref, error


def short_error(e: Exception) -> str:
    from orchestrator.core.redact import redact_text

    text = redact_text(str(e)).strip()
    noise = ("For simplicity, JAX has removed", "-----")
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith(noise)]
    # Ray wraps remote errors with the whole traceback; the last line holds the cause.
    return lines[-1] if lines else type(e).__name__
