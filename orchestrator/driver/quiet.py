"""Keeping known noise off the user's terminal (unless `meshpipe -v`).

Two kinds of line reach a terminal without telling the user anything:
  - jax's `os.fork() was called ... will likely lead to a deadlock` RuntimeWarning,
    printed when a process that has initialised jax starts a subprocess (Ray
    starting its processes, a data loader); the child execs at once, so the
    warning does not apply;
  - Gloo's ANSI-coloured `[Gloo] Rank 0 is connected to 1 peer ranks ...` lines
    from multi-host CPU stages (`jax.distributed` over gloo), printed by C++ in the
    stage actors and forwarded to the driver by Ray.

A third: after a failed or stopped step, the other actors' aborted calls end in
errors nobody fetches, and Ray prints each one with its whole traceback when its
reference is dropped ("Unhandled error (suppress with
'RAY_IGNORE_UNHANDLED_ERRORS=1')"); the cause itself is reported by the driver.

A fourth: under `compiled_graph`, after an actor died, Ray's teardown of the graph
logs "Error cancelling worker task" with two tracebacks for the dead actor (its
cancel call fails with the same actor-death error); the driver names the death.

`quiet()` filters the warning in this process and (through `actor_env`) in the
stage actors, sets RAY_IGNORE_UNHANDLED_ERRORS for this process and drops the fourth's
record; `filter_worker_logs()` drops both kinds from the actor output Ray forwards to the
driver. Everything still lands in Ray's log files
(`/tmp/ray/session_latest/logs`).
"""
from __future__ import annotations

import logging
import os
import re
import warnings

FORK_WARNING = "os.fork() was called"
# (Gloo's line also arrives cut where two of its threads wrote at once: "0 is connected to 1 peer ranks. ...")
NOISE = re.compile(r"^(\x1b\[[0-9;]*m)*\[Gloo\]|is connected to \d+ peer ranks\. Expected number of connected peer "
                   r"ranks is|os\.fork\(\) was called|^\s*self\.pid = os\.fork\(\)")
_ENV = "MESHPIPE_QUIET"

log = logging.getLogger("meshpipe")


def quiet() -> None:
    """Ignore jax's fork warning here and mark the run quiet (the stage actors follow, `actor_env`)."""
    warnings.filterwarnings("ignore", message=re.escape(FORK_WARNING), category=RuntimeWarning)
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")   # read by Ray each time (worker.raise_errors)
    os.environ[_ENV] = "1"
    graph_log = logging.getLogger(GRAPH_LOGGER)
    if not any(isinstance(f, _DeadActorCancel) for f in graph_log.filters):
        graph_log.addFilter(_DeadActorCancel())


GRAPH_LOGGER = "ray.dag.compiled_dag_node"


class _DeadActorCancel(logging.Filter):
    """Drops Ray's "Error cancelling worker task" record when the cancel failed because the actor is dead."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() != "Error cancelling worker task" or not record.exc_info:
            return True
        from ray.exceptions import RayActorError

        return not isinstance(record.exc_info[1], RayActorError)


def is_quiet() -> bool:
    return os.environ.get(_ENV) == "1"


def actor_env() -> dict[str, str]:
    """Environment for stage actors: the same warning filter when the run is quiet."""
    return {"PYTHONWARNINGS": f"ignore:{FORK_WARNING}:RuntimeWarning"} if is_quiet() else {}


def noise(line: str) -> bool:
    """True for a forwarded actor line that is known noise.

    Example:
        >>> noise("\\x1b[0m[Gloo] Rank 0 is connected to 1 peer ranks."), noise("step 1")
        (True, False)
        >>> noise("0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1")
        True
    """
    return bool(NOISE.search(line))


def filter_worker_logs() -> bool:
    """Drop known noise from the actor output Ray forwards to this driver (after `ray.init`).

    Wraps Ray's own log printer (a private hook of Ray's, reached through
    `orchestrator.driver.ray_internals.wrap_log_printer`: when it is not there or shaped
    differently, nothing changes and this returns False).
    """
    if not is_quiet():
        return False
    from orchestrator.driver.ray_internals import wrap_log_printer

    return wrap_log_printer(_filtered)


def _filtered(handler):
    def emit(data):
        lines = [ln for ln in data.get("lines", []) if not noise(ln)]
        if lines:
            handler({**data, "lines": lines})

    emit._meshpipe_filtered = True
    return emit
