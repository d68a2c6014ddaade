"""Stopping a run on Ctrl-C (SIGINT) or SIGTERM (what `ray job stop` sends).

Flow: `stop_on_signals()` installs a handler for both signals for the length of a
run and yields a `Stop` that records which signal came. The first signal raises
`Interrupted` (a KeyboardInterrupt, so no `except Exception` on the way swallows
it; Ray's blocking calls turn it into a plain KeyboardInterrupt, hence the
`Stop` record) in the main thread; the runner's
`finally` blocks then tell the actors to abandon their step (`abort_step`), shut
them down, remove the placement group, write the record (summary.json with the
steps done) and attach the step reached and the record's path to the exception,
which the CLI prints before exiting 130. Signals that arrive while that cleanup
runs are reported and otherwise ignored, so a second Ctrl-C cannot interrupt the
cleanup half-way (no traceback, nothing left behind); a third exits at once.
Ray's core worker installs absl's failure-signal handler in the driver when
`ray.init` runs (it prints `*** SIGTERM received ... PC: @ ...` and aborts, exit
-6), replacing ours at the C level; the runner calls `reinstall()` right after
connecting, which puts the Python handler back.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys

NAMES = {signal.SIGINT: "Ctrl-C (SIGINT)", signal.SIGTERM: "SIGTERM"}


class Interrupted(KeyboardInterrupt):
    """Raised by the handler at the first signal."""


class Stop:
    """Which signals arrived (`seen`), as the CLI reports them."""

    def __init__(self):
        self.seen: list[int] = []

    @property
    def what(self) -> str:
        return NAMES.get(self.seen[0], f"signal {self.seen[0]}") if self.seen else "Ctrl-C (SIGINT)"


def stopped_message(stop: Stop, e: BaseException) -> str:
    """`stopped by SIGTERM after 3 of 100 steps; record: runs/x/summary.json` (what the runner
    attached to the exception: `steps_done`, `total_steps`, `record`)."""
    done, total, record = (getattr(e, k, None) for k in ("steps_done", "total_steps", "record"))
    where = f" after {done} of {total} steps" if done is not None else ""
    return f"stopped by {stop.what}{where}" + (f"; record: {record}" if record else "")


_active = []    # the handler of the innermost stop_on_signals() (module state: signals are per process)


def reinstall() -> bool:
    """Put the active handler back for SIGINT/SIGTERM (after something, e.g. `ray.init`, replaced it
    at the C level). Returns False when no `stop_on_signals()` is active (library use: nothing done)."""
    if not _active:
        return False
    for s in NAMES:
        signal.signal(s, _active[-1])
    return True


@contextlib.contextmanager
def stop_on_signals():
    """SIGINT/SIGTERM → `Interrupted` once; later ones are reported, a third exits 130 at once."""
    stop = Stop()
    seen = stop.seen

    def handler(signum, frame):
        seen.append(signum)
        if len(seen) == 1:
            raise Interrupted(NAMES.get(signum, str(signum)))
        if len(seen) == 2:
            sys.stderr.write(f"\nmeshpipe: {NAMES.get(signum, signum)} again: still stopping the run "
                             "(once more to quit without cleaning up)\n")
            sys.stderr.flush()
            return
        os._exit(130)

    old = {s: signal.signal(s, handler) for s in NAMES}
    _active.append(handler)
    try:
        yield stop
    finally:
        _active.remove(handler)
        for s, h in old.items():
            signal.signal(s, h)
