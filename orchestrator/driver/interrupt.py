"""Stopping a run on Ctrl-C (SIGINT) or SIGTERM (what `ray job stop` sends).

Flow: `stop_on_signals()` installs a handler for both signals for the length of a
run. The first signal raises `Interrupted` (a KeyboardInterrupt, so no
`except Exception` on the way swallows it) in the main thread; the runner's
`finally` blocks then tell the actors to abandon their step (`abort_step`), shut
them down, remove the placement group, write the record (summary.json with the
steps done) and attach the step reached and the record's path to the exception,
which the CLI prints before exiting 130. Signals that arrive while that cleanup
runs are reported and otherwise ignored, so a second Ctrl-C cannot interrupt the
cleanup half-way (no traceback, nothing left behind); a third exits at once.
A Python handler also replaces any C-level handler (absl's failure-signal
handler from jaxlib, which dumps a stack on SIGTERM).
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys

NAMES = {signal.SIGINT: "Ctrl-C (SIGINT)", signal.SIGTERM: "SIGTERM"}


class Interrupted(KeyboardInterrupt):
    """The run was stopped by a signal; the runner fills in `step` and `record`."""

    def __init__(self, signum: int):
        super().__init__(NAMES.get(signum, f"signal {signum}"))
        self.signum = signum
        self.what = NAMES.get(signum, f"signal {signum}")
        self.steps_done: int | None = None
        self.total_steps: int | None = None
        self.record: str | None = None

    def __str__(self) -> str:
        where = (f" after {self.steps_done} of {self.total_steps} steps" if self.steps_done is not None else "")
        rec = f"; record: {self.record}" if self.record else ""
        return f"stopped by {self.what}{where}{rec}"


@contextlib.contextmanager
def stop_on_signals():
    """SIGINT/SIGTERM → `Interrupted` once; later ones are reported, a third exits 130 at once."""
    seen = []

    def handler(signum, frame):
        seen.append(signum)
        if len(seen) == 1:
            raise Interrupted(signum)
        if len(seen) == 2:
            sys.stderr.write(f"\nmeshpipe: {NAMES.get(signum, signum)} again: still stopping the run "
                             "(once more to quit without cleaning up)\n")
            sys.stderr.flush()
            return
        os._exit(130)

    old = {s: signal.signal(s, handler) for s in NAMES}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
