"""The job's own code at plan time — its model factory and grain data factory — under a deadline.

Describing a job means importing and calling the code it names (`check_job`: the model
described by shape evaluation, a grain source's first records read). That code may block (a
lock, the network, a prompt) or end the process (`os._exit(0)` in the factory or at import),
and before any deadline of Ray's exists: it hung `meshpipe run` forever, or made it exit 0 in
seconds with no record. So, for a job that names code (`check.job_code`):

  1. `guard(job, timeout_s)` runs that code once in a child process (`python -m
     orchestrator.driver.usercode`, its own session; the job as JSON on stdin,
     `check.check_code`), which reports on its stdout (JSON lines) when it begins each factory
     and how it ended. Each factory gets `cluster.timeouts.factory_s` from the moment it begins
     (the child's own start — interpreter, meshpipe, jax — gets STARTUP_S, or factory_s if longer);
     past that the child is killed (its whole process group) and the factory it was in is named. One that ends without reporting (exit code 0
     included) is a failure naming the key and the exit code; the problems it found are raised as
     the `ConfigError` `check_job` would give. Nothing crosses back but those JSON lines.
  2. `watchdog(seconds, what)` then bounds the in-process `check_job` that runs the same code
     again (a factory may block only sometimes): past the deadline the CLI prints why and exits 2
     (nothing has started yet: no Ray, no actors, no files).

The child costs one interpreter start plus the factory's own import and call (seconds), paid
only by jobs that name code; built-in models run no child.
"""
from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

from orchestrator.core.config import ConfigError
from orchestrator.core.config.check import job_code
from orchestrator.core.config.errors import problem

__all__ = ["guard", "watchdog"]

TAG = "meshpipe-usercode: "     # the child's report lines on its stdout
STARTUP_S = 120.0               # the child's own start (interpreter, meshpipe, jax): meshpipe's cost, not the job's


def _tail(text: str, lines: int = 12) -> str:
    kept = [ln for ln in text.strip().splitlines() if ln.strip()][-lines:]
    return ("; its last output: " + " | ".join(kept))[:2000] if kept else ""


def _drain(stream, sink: list, lines: "queue.Queue | None" = None) -> threading.Thread:
    """Read `stream` to its end in a daemon thread: every line into `sink` (and `lines`)."""
    def run():
        for line in stream:
            sink.append(line)
            if lines is not None:
                lines.put(line)
        if lines is not None:
            lines.put(None)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def guard(job, timeout_s: float) -> None:
    """Run the code `job` names in a child process, each factory within `timeout_s` from the moment the
    child says it begins it (module docstring); the child's own start (interpreter, meshpipe, jax)
    gets max(STARTUP_S, timeout_s).

    Raises:
      ConfigError: naming the key, the value and what happened (no return in time, the process
        ended early, or the problems the code's checks found).
    """
    refs = job_code(job)
    if not refs:
        return
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.driver.usercode"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    out, err, lines = [], [], queue.Queue()
    readers = [_drain(proc.stdout, out, lines), _drain(proc.stderr, err)]
    proc.stdin.write(json.dumps(job.to_dict()))
    proc.stdin.close()
    step, deadline, timed_out = None, time.monotonic() + max(STARTUP_S, timeout_s), False
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)     # the child and whatever the factory started
            break
        if line is None:
            break
        if line.startswith(TAG) and "key" in json.loads(line[len(TAG):]):
            step, deadline = json.loads(line[len(TAG):]), time.monotonic() + timeout_s
    proc.wait()
    for th in readers:
        th.join(5)
    reports = [json.loads(ln[len(TAG):]) for ln in out if ln.startswith(TAG)]
    key, value = (step["key"], step["value"]) if step else refs[0]
    end = next((r for r in reports if "ok" in r or "problems" in r), None)
    if timed_out and step is None:
        raise ConfigError(problem(key, value, f"the process that imports and calls it did not start within "
                                  f"{max(STARTUP_S, timeout_s):g} s: this machine is overloaded, or importing "
                                  "meshpipe and jax hangs" + _tail("".join(err))))
    if timed_out:
        raise ConfigError(problem(key, value, f"importing and calling it did not return within {timeout_s:g} s "
                                  "(cluster.timeouts.factory_s) while describing the job: it blocks (a lock, the "
                                  "network, input?); raise the deadline if it legitimately needs longer"
                                  + _tail("".join(err))))
    if end is None:
        raise ConfigError(problem(key, value, f"the process importing and calling it ended with exit code "
                                  f"{proc.returncode} before it returned (os._exit or sys.exit in the factory or "
                                  "at import, or a crash): a factory must return its model" + _tail("".join(err))))
    if end.get("problems"):
        raise ConfigError(end["problems"])


def watchdog(seconds: float, what: str):
    """A context in which the process exits with code 2, saying `what` did not finish, if it is still
    inside after `seconds` (the CLI's in-process `check_job`, after `guard`)."""
    def fire():
        sys.stderr.write(f"meshpipe: invalid configuration:\n{what} did not finish within {seconds:g} s "
                         "(twice cluster.timeouts.factory_s): the job's code blocked in this process although "
                         "it returned in a child process before; nothing was started\n")
        sys.stderr.flush()
        os._exit(2)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True

    @contextlib.contextmanager
    def ctx():
        timer.start()
        try:
            yield
        finally:
            timer.cancel()

    return ctx()


def _report(**fields) -> None:
    sys.stdout.write(TAG + json.dumps(fields) + "\n")
    sys.stdout.flush()


def main() -> None:
    """The child: parse the job from stdin, run its code (`check.check_code`), report on stdout."""
    import jax  # noqa: F401 - imported before the first factory's deadline starts: it is meshpipe's, not the job's
    import optax  # noqa: F401

    from orchestrator.core.config import parse_job
    from orchestrator.core.config.check import check_code

    job = parse_job(json.loads(sys.stdin.read()))
    try:
        check_code(job, step=lambda key, value: _report(key=key, value=value))
    except ConfigError as e:
        _report(problems=list(e.problems))
        return
    _report(ok=True)


if __name__ == "__main__":
    main()
