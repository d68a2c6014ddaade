"""Recovery rules, pure: what failed, whether to restart, and the progress deadline.

The driver's recovery loop (`orchestrator.driver.runner`, `orchestrator.driver.recovery`) asks
these questions; the answers depend only on the values passed in, so they test in milliseconds.

  - `Failure`: what failed (cause, stage, host, node, step), built by the driver from typed
    fields only — the actor's `orchestrator.core.contract.StepFailure` carried on its error (and
    on every survivor's it aborted), the `ActorId` of the call that failed — never from text.
  - `RestartPolicy.decide(failure, committed)`: restart while restarts are left, a checkpoint
    is committed, and the failure is not the same one at the same step as before (a
    deterministic failure — a NaN, a shape error, an injected fault, a deadlock — would fail
    forever). Deaths are never "the same": a killed process or lost node says nothing about
    the next attempt; repeated deaths count against `max_restarts` only.
  - `ProgressDeadline`: the seconds the driver gives one step before calling it a hang:
    the configured `timeouts.step_s` until steps have been measured, then
    min(step_s, max(30 s, 3 × the median measured step time)); a call of n steps (the driver
    learns results a call at a time) gets min(n × step_s, max(30 s, 3 × n × the median)).
  - `failed_step(step, done)`: the step a failure happened in, from the first step the driver
    has no result for and the steps the actors that still answer say they finished (with
    several steps per call the driver learns results a call at a time).
  - `stalled(beats, silent_s, deadline_s)`: whether the actors' heartbeats (taken while a step
    runs, `orchestrator.driver.recovery.HeartbeatWatch`) say the step hangs, and whose hang it
    is: one step's deadline, not a call's.
"""
from __future__ import annotations

import errno
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from orchestrator.core.contract import ActorId

DIED, NODE_LOST, HANG, ERROR = "actor died", "node lost", "hang", "error"
STORAGE = "checkpoint storage"      # checkpoint.dir refused a write: full, read-only, not permitted

# The errnos of a checkpoint write that a restart cannot help: the same directory is written
# again and refuses again (a full disk stays full; permissions and read-only mounts do not change
# by themselves; a file standing where a directory must go stays there).
STORAGE_ERRNOS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
                  errno.EACCES: "permission denied", errno.EPERM: "operation not permitted",
                  errno.EROFS: "read-only file system", errno.ENOTDIR: "a file stands where a directory must go"}
ROLLBACK = "training health"      # a health event whose action is rollback (orchestrator.core.health)


@dataclass(frozen=True)
class Failure:
    """One failure as the driver saw it.

    Attributes:
      cause: DIED (the actor's process is gone), NODE_LOST (a node that held actors of the run is
        gone), HANG (no progress within the deadline), STORAGE (`checkpoint.dir` refused a write
        with one of `STORAGE_ERRNOS`), ERROR, or ROLLBACK (a training-health event asked for one:
        `orchestrator.core.health.HealthRollback`; its step is the bad step).
      stage, host: the failed actor (None when unknown).
      step: the step it failed in (the first step the driver had no result for, unless the
        actor said which).
      text: the error, one line.
      node: the Ray node id of the failed actor (of the lost node for NODE_LOST), when known.
      errno, path: STORAGE: the write's errno and the path it refused.
      consequence: NODE_LOST: the failure first seen, which the loss caused (`node_loss`).
    """

    cause: str
    stage: Optional[int]
    host: Optional[int]
    step: int
    text: str
    node: Optional[str] = None
    errno: Optional[int] = None
    path: Optional[str] = None
    consequence: str = ""

    def fields(self) -> dict:
        """The typed fields, for summary.json's `failure` (None where not known)."""
        return {"cause": self.cause, "stage": self.stage, "host": self.host, "node": self.node, "step": self.step,
                "errno": errno.errorcode.get(self.errno) if self.errno is not None else None, "path": self.path,
                "consequence": self.consequence or None, "text": self.text}

    @property
    def who(self) -> str:
        if self.stage is None:
            return "the driver" if self.cause == STORAGE else "an unknown actor"     # (its commit marker)
        return f"stage {self.stage} host {self.host}"

    def key(self) -> Optional[tuple]:
        """What makes two failures "the same": cause, actor, step, and for errors their text. A death
        has no key: a killed process or a lost node says nothing about the next attempt (a death
        that repeats counts against `max_restarts` only). Nor has a rollback: it skips the bad
        step's data, so the step that follows is another."""
        if self.cause in (DIED, NODE_LOST, ROLLBACK):
            return None
        return (self.cause, self.stage, self.host, self.step, self.text if self.cause == ERROR else "")


def actor_of(label) -> tuple[Optional[int], Optional[int]]:
    """(stage, host) of an `ActorId`; (None, None) for anything else."""
    actor = ActorId.of(label)
    return (actor.stage, actor.host) if actor is not None else (None, None)


def node_loss(failure: Failure, lost: dict) -> Failure:
    """`failure` as the loss of a node: `lost` maps each gone node's id to {"labels": the run's
    actors it held ("stage 0 host 1"), "why": how the driver knows, "address": its IP}. The
    failure then names the first actor of the first lost node (the record's node is that one's);
    the error first seen (a survivor's reset connection, its peer's death: what the loss caused)
    is kept as the `consequence` and in the text. The loss outranks whatever was seen first:
    the decision and the report are the loss's.

    >>> f = node_loss(Failure(ERROR, 0, 0, 5, "Gloo: Connection reset by peer"),
    ...               {"3f2a": {"labels": [ActorId(0, 1)], "why": "its raylet refuses connections",
    ...                         "address": "10.0.0.2"}})
    >>> (f.cause, f.stage, f.host, f.step, f.node)
    ('node lost', 0, 1, 5, '3f2a')
    >>> f.text
    'node 3f2a (10.0.0.2) is gone (its raylet refuses connections), with stage 0 host 1; a consequence, seen first: error: stage 0 host 0: Gloo: Connection reset by peer'
    """
    if not lost:
        return failure
    parts = []
    for node_id, n in lost.items():
        at = f" ({n['address']})" if n.get("address") else ""
        parts.append(f"node {node_id[:12]}{at} is gone ({n['why']}), with {', '.join(n['labels'])}")
    node, gone = next(iter(lost.items()))
    stage, host = actor_of(gone["labels"][0] if gone["labels"] else None)
    seen = f"{failure.cause}: {failure.who}: {failure.text}" if failure.text else ""
    text = "; ".join(parts) + (f"; a consequence, seen first: {seen}" if seen else "")
    return Failure(NODE_LOST, stage, host, failure.step, text, node=node, consequence=seen)


def storage_words(code: Optional[int]) -> str:
    """`ENOSPC: no space left on the device` for an errno of `STORAGE_ERRNOS`.

    >>> storage_words(errno.EROFS)
    'EROFS: read-only file system'
    """
    if code is None:
        return "errno unknown"
    return f"{errno.errorcode.get(code, code)}: {STORAGE_ERRNOS.get(code, 'errno ' + str(code))}"


def storage_error(e: Optional[BaseException]) -> Optional[tuple[int, Optional[str]]]:
    """(errno, path) of the first `OSError` with an errno of `STORAGE_ERRNOS` in `e`'s chain of
    explicit causes (`raise ... from`; an error merely raised while handling another is not
    caused by it), else None. The errno is the error's field; the one
    exception is tensorstore (orbax writes through it), whose errors are `ValueError`s that carry
    the errno only as `[os_error_code='28']`: that token is read as the field it stands for.

    >>> storage_error(RuntimeError("save failed")) is None
    True
    >>> try:
    ...     try:
    ...         raise PermissionError(errno.EACCES, "Permission denied", "/ck/step_00000004")
    ...     except OSError as inner:
    ...         raise RuntimeError("checkpoint save of step 4 failed") from inner
    ... except RuntimeError as outer:
    ...     storage_error(outer)
    (13, '/ck/step_00000004')
    >>> storage_error(ValueError("RESOURCE_EXHAUSTED: writing x [os_error_code='28']"))
    (28, None)
    """
    import re

    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        code = getattr(e, "errno", None) if isinstance(e, OSError) else None
        if code is None and isinstance(e, ValueError):
            m = re.search(r"\[os_error_code='(\d+)'\]", str(e))
            code = int(m.group(1)) if m else None
        if code in STORAGE_ERRNOS:
            name = getattr(e, "filename", None)
            return code, (str(name) if name is not None else None)
        e = e.__cause__
    return None


def storage_stop(f: Failure, directory: str) -> str:
    """What a STORAGE failure's stop says first: the directory, the step, the errno, the path.

    >>> print(storage_stop(Failure(STORAGE, 0, 1, 4, "OSError: ...", errno=errno.ENOSPC,
    ...                            path="/ck/step_00000004/stage_0"), "/ck"))
    checkpoint.dir = /ck refused a checkpoint write in step 4: ENOSPC: no space left on the device (writing /ck/step_00000004/stage_0, stage 0 host 1)
    """
    at = ", ".join(x for x in (f"writing {f.path}" if f.path else "", f.who if f.stage is not None else "") if x)
    return (f"checkpoint.dir = {directory} refused a checkpoint write in step {f.step}: {storage_words(f.errno)}"
            + (f" ({at})" if at else ""))


def compiled_graph_restarts(executor: str, max_restarts: int, nodes: int) -> Optional[str]:
    """Why `cluster.executor: compiled_graph` with restarts is refused on a cluster of `nodes` alive
    nodes (None: allowed). A node lost under a Ray Compiled Graph crashed the head's raylet on a
    Ray-internal check while the driver tore the graph down (2 of 2 tries, `docs/guides/recovery.md`):
    a restart cannot be offered there. One node: a lost actor is a process, which recovers.

    >>> compiled_graph_restarts("step_calls", 3, 4) is None, compiled_graph_restarts("compiled_graph", 3, 1) is None
    (True, True)
    >>> print(compiled_graph_restarts("compiled_graph", 3, 2))
    cluster.executor = 'compiled_graph' with failure.max_restarts = 3 on a cluster of 2 nodes: refused — a node lost under a Ray Compiled Graph crashes the head's raylet, so no restart could recover it; use executor step_calls (recovers from node loss) or failure.max_restarts: 0
    """
    if executor != "compiled_graph" or max_restarts == 0 or nodes <= 1:
        return None
    return (f"cluster.executor = 'compiled_graph' with failure.max_restarts = {max_restarts} on a cluster of {nodes} "
            "nodes: refused — a node lost under a Ray Compiled Graph crashes the head's raylet, so no restart "
            "could recover it; use executor step_calls (recovers from node loss) or failure.max_restarts: 0")


def failed_step(step: int, done: dict) -> int:
    """The step a failure happened in: the first step that not every actor answering a heartbeat
    after the failure had finished, and never before `step`, the first step the driver has no
    result for. `done`: label -> the newest step that actor finished (its heartbeat's `done`;
    None: none in this attempt). With `cluster.steps_per_call` k the driver learns results a call
    at a time, so the steps finished inside the failed call are the actors' to tell; a restart
    from checkpoint step c then runs `failed_step - c` finished steps again.

    >>> failed_step(28, {"stage 0 host 0": 29})                 # 28 and 29 finished inside the call
    30
    >>> failed_step(28, {"stage 0 host 0": 29, "stage 1 host 1": 30})
    30
    >>> failed_step(5, {"stage 0 host 0": 4}), failed_step(4, {}), failed_step(4, {"stage 0 host 0": None})
    (5, 4, 4)
    """
    known = [d for d in done.values() if d is not None]
    return max(step, min(known) + 1) if known else step


def compile_cache_dir(job) -> Optional[str]:
    """The stage actors' JAX persistent-compilation-cache directory for `job` (None: off):
    `failure.compile_cache` "auto" is `<run.output_dir>/<run.name>/compile_cache` when restarts
    are allowed (a restarted stage loads its programs instead of compiling them) and off
    otherwise; a path is used as it is (made absolute against the driver's directory); null is off."""
    import os

    want = job.failure.compile_cache
    if want is None or (want == "auto" and job.failure.max_restarts == 0):
        return None
    path = os.path.join(job.run.output_dir, job.run.name, "compile_cache") if want == "auto" else want
    return os.path.abspath(os.path.expanduser(path))


@dataclass(frozen=True)
class Decision:
    restart: bool
    reason: str        # why not (empty when restarting)


@dataclass
class RestartPolicy:
    """`failure.max_restarts`, the failures seen so far and the restarts granted.

    A STORAGE failure is never restarted, whatever is left: the next attempt writes the same
    directory (and would spend every restart the same way).

    >>> p = RestartPolicy(3)
    >>> p.decide(Failure(ERROR, 1, 0, 3, "NaN loss"), committed=2).restart
    True
    >>> p.decide(Failure(ERROR, 1, 0, 3, "NaN loss"), committed=2).reason
    'the same failure (error, stage 1 host 0) happened at step 3 before: it is deterministic'
    """

    max_restarts: int
    seen: list = field(default_factory=list)      # every Failure, in order
    restarts: int = 0

    def decide(self, failure: Failure, committed: Optional[int]) -> Decision:
        """Restart after `failure`? `committed`: the newest committed checkpoint step (None: none)."""
        repeat = failure.key() is not None and any(f.key() == failure.key() for f in self.seen)
        self.seen.append(failure)
        if failure.cause == STORAGE:
            return Decision(False, f"checkpoint.dir refused the write ({storage_words(failure.errno)}): "
                                   "a restart would write the same directory and fail the same way")
        if self.max_restarts == 0:
            return Decision(False, "failure.max_restarts is 0")
        if repeat:
            return Decision(False, f"the same failure ({failure.cause}, {failure.who}) happened at step "
                                   f"{failure.step} before: it is deterministic")
        if self.restarts >= self.max_restarts:
            return Decision(False, f"all failure.max_restarts = {self.max_restarts} restarts are used up")
        if committed is None:
            return Decision(False, "no checkpoint is committed yet (nothing to restart from)")
        self.restarts += 1
        return Decision(True, "")


class ProgressDeadline:
    """Seconds one step may take before the driver calls it a hang.

    Args:
      configured_s: `timeouts.step_s`: the deadline until steps have been measured, and its cap.
      floor_s: the deadline is never below this once measured.
      factor: times the median measured step time.
      window: how many recent step times the median is over.

    >>> d = ProgressDeadline(600.0)
    >>> d.step_s()
    600.0
    >>> for t in (0.1, 0.2, 30.0): d.observe(t)
    >>> d.step_s()        # max(30, 3 x 0.2)
    30.0
    >>> for t in (20.0, 20.0, 20.0): d.observe(t)
    >>> d.step_s()        # 3 x median 20
    60.0
    """

    def __init__(self, configured_s: float, floor_s: float = 30.0, factor: float = 3.0, window: int = 256):
        self.configured_s, self.floor_s, self.factor = float(configured_s), float(floor_s), float(factor)
        self.times: deque[float] = deque(maxlen=window)

    def observe(self, wall_s: float) -> None:
        """A measured step time (not an attempt's first step, which compiles)."""
        if wall_s > 0:
            self.times.append(float(wall_s))

    def step_s(self) -> float:
        return self.call_s(1)

    def call_s(self, n: int) -> float:
        """The deadline of a call of `n` steps (the driver learns results a call at a time):
        n × step_s until measured, then min(n × step_s, max(floor, factor × n × median))."""
        if not self.times:
            return self.configured_s * n
        return min(self.configured_s * n, max(self.floor_s, self.factor * n * statistics.median(self.times)))


def stalled(beats: dict, silent_s: dict, deadline_s: float, slow_s: float = 5.0) -> tuple[list, str] | None:
    """Whether the actors' heartbeats say the step hangs, pure: (culprits, why) or None.

    Args:
      beats: label -> the actor's newest heartbeat answer (`StageWorker.heartbeat`: `doing`, the
        action under way or None between steps; `waiting`, whether that is a RECV; `busy_s`, the
        seconds it has been at it, on its own clock), or None before its first answer.
      silent_s: label -> seconds its oldest unanswered heartbeat has waited (0: none waits).
      deadline_s: the per-step progress deadline (`ProgressDeadline.step_s`).
      slow_s: an answer this late marks the actor as the likely culprit of a hang found otherwise.

    An actor that has not answered for the deadline is hung (a stopped process: its "io" thread
    does not run); else an actor at one action for longer than the deadline means the step
    hangs: the culprit is the one longest at an action that is not a RECV (a deadlock in a
    collective, a stuck computation — the actors waiting on it sit in RECVs); when every busy
    actor waits in a RECV, the actors whose answers are `slow_s` late (a process stopped after
    the others began to wait on it), else all the busy ones (a message that never comes). Between
    steps an actor is never busy (the driver is the slow one).

    >>> stalled({"a": {"doing": "0F1", "waiting": False, "busy_s": 2.0}}, {"a": 0.0}, 30.0) is None
    True
    >>> stalled({"a": {"doing": "0RECV_B0", "waiting": True, "busy_s": 41.0},
    ...          "b": {"doing": "1B0", "waiting": False, "busy_s": 45.0}}, {"a": 0.0, "b": 0.0}, 30.0)
    (['b'], 'at 1B0 for 45 s (deadline 30 s)')
    >>> stalled({"a": None, "b": {"doing": None, "waiting": False, "busy_s": 99.0}}, {"a": 31.0, "b": 0.0}, 30.0)
    (['a'], 'not answering a heartbeat for 31 s (deadline 30 s)')
    """
    silent = sorted(lbl for lbl, t in silent_s.items() if t > deadline_s)
    if silent:
        longest = max(silent_s[lbl] for lbl in silent)
        return silent, f"not answering a heartbeat for {longest:.0f} s (deadline {deadline_s:g} s)"
    busy = {lbl: b for lbl, b in beats.items() if b and b.get("doing") is not None and b["busy_s"] > deadline_s}
    if not busy:
        return None
    working = {lbl: b for lbl, b in busy.items() if not b.get("waiting")}
    if working:
        lbl = max(working, key=lambda k: working[k]["busy_s"])
        return [lbl], f"at {working[lbl]['doing']} for {working[lbl]['busy_s']:.0f} s (deadline {deadline_s:g} s)"
    longest = max(b["busy_s"] for b in busy.values())
    slow = sorted(lbl for lbl, t in silent_s.items() if t >= slow_s and lbl not in busy)
    if slow:
        return slow, (f"not answering a heartbeat for {max(silent_s[lbl] for lbl in slow):.0f} s while the "
                      f"others wait in a RECV for {longest:.0f} s (deadline {deadline_s:g} s)")
    return sorted(busy), f"every busy actor waits in a RECV, the longest for {longest:.0f} s (deadline {deadline_s:g} s)"


__all__ = ["DIED", "ERROR", "HANG", "NODE_LOST", "ROLLBACK", "STORAGE", "STORAGE_ERRNOS", "storage_error",
           "storage_stop", "storage_words", "Decision", "Failure", "ProgressDeadline", "RestartPolicy",
           "actor_of", "compile_cache_dir", "compiled_graph_restarts", "failed_step", "node_loss", "stalled"]
