"""The driver half of automatic recovery (`failure: {max_restarts: N}`).

Basic flow (`orchestrator.driver.runner._run_pipeline` runs attempts in a loop):
  1. an attempt (executor start → steps) raises `StageFailure` (an actor's error, or its
     death: Ray's actor-death error on the pending call) or `ProgressTimeout` (no step result
     within the progress deadline: a hang);
  2. `classify` turns it into an `orchestrator.core.recovery.Failure` naming the actor that
     failed first (an aborted survivor's error names the peer it was told about; after a
     timeout, the pending actor that does not answer a heartbeat is the hung one);
  3. the policy (`RestartPolicy.decide`) says restart or stop. Restart: the executor is shut
     down (survivors told to abort at once, actors killed, placement group removed,
     `wait_released` until Ray has let their names go), the newest committed checkpoint is
     prepared exactly as `--resume latest` would (`orchestrator.driver.checkpoint.prepare`),
     and a new attempt reserves the placement again and restores it — data position and RNG
     state come with the checkpoint, so the run's losses and parameters are those of an
     uninterrupted run. Stop: `RecoveryStopped`, whose message says why, what was lost and
     the command that continues (`stop_message`).
Each restart is one record in summary.json's `recoveries` (cause, stage, host, node, step,
resumed-from step, steps lost, detection and recovery times).
"""
from __future__ import annotations

import logging
import time
from typing import Optional

from orchestrator.core.recovery import DIED, ERROR, HANG, Decision, Failure, label_of, origin
from orchestrator.driver.waiting import ProgressTimeout, StageFailure

log = logging.getLogger("meshpipe")

RECOVERABLE = (StageFailure, TimeoutError)


class RecoveryStopped(StageFailure):
    """A failure the run did not recover from; the message says why and how to continue."""

    @classmethod
    def after(cls, message: str, e: BaseException) -> "RecoveryStopped":
        """Keeps the failure's own report (where, the stage's traceback) under the new message."""
        return cls(message, detail=getattr(e, "detail", ""), where=getattr(e, "where", ""),
                   tail=getattr(e, "tail", ""), label=getattr(e, "label", None), died=getattr(e, "died", False))


def is_hang(e: BaseException) -> bool:
    return isinstance(e, TimeoutError) and not isinstance(e, StageFailure)


def classify(e: BaseException, next_step: int, hung: Optional[list[str]] = None) -> Failure:
    """The Failure behind `e`; `next_step`: the first step the driver has no result for; `hung`:
    for a timeout, the pending actors that did not answer a heartbeat (`PipelineExecutor.unresponsive`)
    — when exactly one did not, the hang is its."""
    if is_hang(e):
        labels = getattr(e, "labels", [])
        culprits = hung if hung else labels
        stage, host = label_of(culprits[0] if len(culprits) == 1 else None)
        text = str(e) + (f"; not answering a heartbeat: {', '.join(hung)}" if hung else "")
        return Failure(HANG, stage, host, next_step, text)
    text = "\n".join(str(x) for x in (e.__cause__, getattr(e, "detail", ""), e) if x)
    short = getattr(e, "message", None) or str(e)       # a StageFailure's first line, without its traceback
    short = short.split(" Some common causes include", 1)[0]    # Ray's advice after an actor death
    if isinstance(e, StageFailure) and e.died:
        stage, host = label_of(e.label)
        return Failure(DIED, stage, host, next_step, short)
    found = origin(text)
    if found is not None:     # a survivor told to abort: the failure is its peer's
        stage, host, step, err = found
        return Failure(ERROR, stage, host, step, err.strip())
    stage, host = label_of(getattr(e, "label", None))
    return Failure(ERROR, stage, host, next_step, short)


def wait_released(names: list[str], namespace: str, timeout: float) -> None:
    """Wait (bounded) until Ray no longer knows live actors by these names (killed ones free
    their names asynchronously; the next attempt's actors take the same names)."""
    import ray

    deadline = time.monotonic() + timeout
    left = list(names)
    while left and time.monotonic() < deadline:
        still = []
        for name in left:
            try:
                ray.get_actor(name, namespace=namespace)
                still.append(name)
            except ValueError:
                pass
        left = still
        if left:
            time.sleep(0.05)
    if left:
        raise StageFailure(f"recovery: Ray still holds actors {', '.join(left)} {timeout:.0f} s after they "
                           "were killed; not starting new ones under the same names")


def committed_step(checked) -> Optional[int]:
    """The newest committed checkpoint step of the job (None: none, or no `checkpoint:`)."""
    from orchestrator.core.checkpoint import committed

    ck = checked.job.checkpoint
    if ck is None:
        return None
    found = committed(ck.dir)
    return found[-1]["step"] if found else None


def describe(f: Failure, where: dict) -> str:
    """`actor died: stage 1 host 0 (cluster host 1, node 3f2a…) in step 5` and the error."""
    place = []
    if where.get("cluster_host") is not None:
        place.append(f"cluster host {where['cluster_host']}")
    if where.get("node_id"):
        place.append(f"node {where['node_id'][:12]}")
    at = f" ({', '.join(place)})" if place else ""
    return f"{f.cause}: {f.who}{at} in step {f.step}: {f.text}"


def stop_message(f: Failure, where: dict, decision: Decision, committed: Optional[int], steps_done: int,
                 resume_command: str) -> str:
    """Why the run stops, what is lost and the command that continues it."""
    head = f"{describe(f, where)}\nnot restarting: {decision.reason}."
    if committed is None:
        return (f"{head}\nlost: all {steps_done} steps done (no checkpoint was committed). Start again with: "
                f"{resume_command.replace(' --resume', '')}")
    lost = steps_done - committed
    what = (f"the {lost} steps after it ({committed}..{steps_done - 1}) are lost" if lost > 0
            else "no completed step is lost")
    return f"{head}\nlast committed checkpoint: step {committed}; {what}. Continue with: {resume_command}"


def record(f: Failure, where: dict, resumed_from: int, steps_done: int, detected_at: float,
           waited_s: float) -> dict:
    """One restart's entry in summary.json's `recoveries` (recovery times are filled in later)."""
    return {"cause": f.cause, "stage": f.stage, "host": f.host, **where, "step": f.step, "error": f.text,
            "resumed_from": resumed_from, "steps_lost": max(0, steps_done - resumed_from),
            "detected_at": detected_at, "since_last_progress_s": waited_s}


__all__ = ["RECOVERABLE", "RecoveryStopped", "classify", "is_hang", "committed_step", "describe", "record",
           "stop_message", "wait_released"]
