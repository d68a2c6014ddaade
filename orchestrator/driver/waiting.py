"""Bounded waits on Ray object refs: every remote wait in meshpipe goes through here."""
from __future__ import annotations

import time


class StageFailure(RuntimeError):
    pass


def wait_all(refs: list, timeout: float, what: str, labels: list[str] | None = None) -> list:
    """ray.get all refs, failing fast on the first error and raising TimeoutError at the deadline.

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
            stuck = ", ".join(labels[index[r]] for r in pending)
            raise TimeoutError(f"{what}: no answer within {timeout:.0f} s from {stuck}")
        ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
        for r in ready:
            try:
                results[index[r]] = ray.get(r, timeout=max(1.0, deadline - time.monotonic()))  # ready
            except Exception as e:  # noqa: BLE001 - re-raised with the stage named
                raise StageFailure(f"{what} failed on {labels[index[r]]}: {short_error(e)}") from e
    return results


def short_error(e: Exception) -> str:
    from orchestrator.core.redact import redact_text

    text = redact_text(str(e)).strip()
    noise = ("For simplicity, JAX has removed", "-----")
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith(noise)]
    # Ray wraps remote errors with the whole traceback; the last line holds the cause.
    return lines[-1] if lines else type(e).__name__
