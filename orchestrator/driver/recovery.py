"""The driver half of automatic recovery (`failure: {max_restarts: N}`).

Basic flow (`orchestrator.driver.runner._run_pipeline` runs attempts in a loop):
  1. an attempt (executor start → steps) raises `StageFailure` (an actor's error, or its
     death: Ray's actor-death error on the pending call; a lost node: `NodeWatch`) or
     `ProgressTimeout` (a hang: `HeartbeatWatch` — an actor silent, or at one action, for one
     step's progress deadline — or, as its backstop, no call result within the call's deadline;
     a heartbeat's actor-death error: a death, where the step's call does not show it, as under
     `compiled_graph`);
  2. `classify` turns it into an `orchestrator.core.recovery.Failure` naming the actor that
     failed first, from typed fields alone (the `StepFailure` an actor's error carries — on an
     aborted survivor's, the peer's that aborted it —, the `ActorId` of the call; after a
     timeout, the pending actor that does not answer a heartbeat is the hung one);
     — unless a node that held actors of the run is gone (`lost_nodes`: Ray marks it dead, or its
     raylet no longer accepts a connection): then the failure is that node's loss
     (`orchestrator.core.recovery.node_loss`), whichever error reached the driver first;
  3. the policy (`RestartPolicy.decide`) says restart or stop. Restart: the executor is shut
     down (survivors told to abort at once and killed after a short grace, placement group removed,
     `wait_released` until Ray has let their names go, `wait_exited` until their processes are
     gone), the newest committed checkpoint is
     prepared exactly as `--resume latest` would (`orchestrator.driver.checkpoint.prepare`),
     and a new attempt reserves the placement again — waiting up to `failure.placement_timeout_s`
     (default `timeouts.init_s`) for the cluster to fit it again, e.g. a replacement for a lost
     node; past that the run stops with the stop message — and restores it — data position and RNG
     state come with the checkpoint, so the run's losses and parameters are those of an
     uninterrupted run. Stop: `RecoveryStopped`, whose message says why, what was lost and
     the command that continues (`stop_message`).
Each restart is one record in summary.json's `recoveries` (cause, stage, host, node, step,
resumed-from step, steps lost — the finished steps that run again: the failure's step, as the
actors still answering tell it (`failed_step`), minus the step resumed from — detection and
recovery times).
"""
from __future__ import annotations

import logging
import time
from typing import Optional

from orchestrator.core.contract import ActorId, failure_of
from orchestrator.core.recovery import DIED, ERROR, HANG, STORAGE, Decision, Failure, actor_of
from orchestrator.driver.waiting import ProgressTimeout, StageFailure, stage_failure

log = logging.getLogger("meshpipe")

RECOVERABLE = (StageFailure, TimeoutError)


class RecoveryStopped(StageFailure):
    """A failure the run did not recover from; the message says why and how to continue."""

    @classmethod
    def after(cls, message: str, e: BaseException) -> "RecoveryStopped":
        """Keeps the failure's own report (where, the stage's traceback) under the new message."""
        return cls(message, detail=getattr(e, "detail", ""), where=getattr(e, "where", ""),
                   tail=getattr(e, "tail", ""), label=getattr(e, "label", None), died=getattr(e, "died", False),
                   origin=getattr(e, "origin", None))


def is_hang(e: BaseException) -> bool:
    return isinstance(e, TimeoutError) and not isinstance(e, StageFailure)


def classify(e: BaseException, next_step: int, hung: Optional[list[str]] = None) -> Failure:
    """The Failure behind `e`, from its typed fields (never its text); `next_step`: the first step
    the driver has no result for; `hung`: for a timeout, the pending actors that did not answer a
    heartbeat (`PipelineExecutor.unresponsive`) — when exactly one did not, the hang is its."""
    if is_hang(e):
        labels = getattr(e, "labels", [])
        culprits = hung or getattr(e, "culprits", None) or labels
        stage, host = actor_of(culprits[0] if len(culprits) == 1 else None)
        text = str(e) + (f"; not answering a heartbeat: {', '.join(hung)}" if hung else "")
        return Failure(HANG, stage, host, next_step, text)
    short = getattr(e, "message", None) or str(e)       # a StageFailure's first line, without its traceback
    short = short.split(" Some common causes include", 1)[0]    # Ray's advice after an actor death
    if isinstance(e, StageFailure) and e.died:
        stage, host = actor_of(e.label)
        return Failure(DIED, stage, host, next_step, short)
    found = getattr(e, "origin", None) or failure_of(e)
    if found is not None and found.kind == "storage":     # checkpoint.dir refused the write
        return Failure(STORAGE, found.stage, found.host, found.step, found.error, errno=found.errno, path=found.path)
    if found is not None:     # where the step failed first (a survivor told to abort: its peer)
        return Failure(ERROR, found.stage, found.host, found.step, found.error)
    stage, host = actor_of(getattr(e, "label", None))
    return Failure(ERROR, stage, host, next_step, short)


def raylet_answers(address: str, port: int, timeout: float) -> bool:
    """Whether a node's raylet accepts a TCP connection (a node whose raylet is gone refuses it,
    or, when the machine is gone, lets it time out)."""
    import socket

    try:
        with socket.create_connection((address, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def lost_nodes(info: list[dict], timeout: float = 2.0) -> dict:
    """The nodes of the run's actors (`info`: the set-up records, with `node_id`) that are gone:
    {node id: {"labels": ["stage 0 host 1", ...], "why": ..., "address": ip}}; {} when every one
    is alive. A node is gone when Ray marks it dead, or when its raylet does not accept a
    connection within `timeout` (Ray's own health check takes longer to mark it dead)."""
    import ray

    by_node: dict[str, list[str]] = {}
    for w in info:
        node_id = w.get("node_id") or w.get("bundle_node_id")
        if node_id:
            by_node.setdefault(node_id, []).append(ActorId(w["stage"], w["host"]))
    if not by_node:
        return {}
    try:
        known = {n["NodeID"]: n for n in ray.nodes()}
    except Exception as e:  # noqa: BLE001 - the failure is reported as it is
        log.warning("could not list Ray's nodes to check for a lost one: %s", e)
        return {}
    lost = {}
    for node_id, labels in by_node.items():
        n = known.get(node_id)
        if n is None or not n.get("Alive"):
            why = "Ray marks it dead"
        elif (n.get("NodeManagerAddress") and n.get("NodeManagerPort")     # (a node without them is not probed)
              and not raylet_answers(n["NodeManagerAddress"], n["NodeManagerPort"], timeout)):
            why = "its raylet does not accept connections"
        else:
            continue
        lost[node_id] = {"labels": sorted(labels), "why": why, "address": (n or {}).get("NodeManagerAddress", "")}
    return lost


class NodeWatch:
    """While the driver waits on a step (`waiting.wait_all`'s `watch`), every `every` s: does each
    node holding actors of the run still accept a connection at its raylet? Two failed probes in a
    row (`every` apart) mean the node is gone: a `StageFailure` (a death) naming the node and its
    actors — seconds after the loss, where Ray's actor-death error waits for its health check to
    mark the node dead (tens of seconds). Runs in runs with restarts (`failure.max_restarts` > 0)
    and in every `compiled_graph` run.

    Args:
      info: the attempt's set-up records (`node_id`, `stage`, `host`).
    """

    def __init__(self, info: list[dict], every: float = 1.0, timeout: float = 2.0):
        import ray

        self.every, self.timeout = every, timeout
        self.labels: dict[str, list[str]] = {}
        for w in info:
            if w.get("node_id"):
                self.labels.setdefault(w["node_id"], []).append(ActorId(w["stage"], w["host"]))
        known = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
        self.addr = {nid: (known[nid]["NodeManagerAddress"], known[nid]["NodeManagerPort"])
                     for nid in self.labels
                     if nid in known and known[nid].get("NodeManagerAddress") and known[nid].get("NodeManagerPort")}
        self.failed: dict[str, int] = {}
        self.due = time.monotonic() + every

    def __call__(self) -> None:
        if time.monotonic() < self.due:
            return
        for nid, (ip, port) in self.addr.items():
            if raylet_answers(ip, port, self.timeout):
                self.failed.pop(nid, None)
                continue
            self.failed[nid] = self.failed.get(nid, 0) + 1
            if self.failed[nid] >= 2:
                labels = sorted(self.labels[nid])
                raise StageFailure(f"node {nid[:12]} ({ip}) is gone: its raylet has not accepted a connection "
                                   f"for {self.every:g} s; it held {', '.join(labels)}", label=labels[0], died=True)
        self.due = time.monotonic() + self.every


class HeartbeatWatch:
    """While the driver waits on a step (`waiting.wait_all`'s `watch`, beside `NodeWatch`), every
    `every` s: a heartbeat to each actor (in its "io" group, so it answers while its step runs),
    and the answers checked (`orchestrator.core.recovery.stalled`) against the per-step progress
    deadline `step_s` — an actor silent for it (a stopped process), or at one action for longer
    (a deadlock, a computation stuck in a collective): `ProgressTimeout` naming the culprits, one
    step's deadline after the step stopped moving instead of a whole call's. `step_s` is set by
    the executor: `timeouts.step_s` while an attempt's first step compiles, then the measured one.
    A heartbeat that fails with Ray's actor-death error is a `StageFailure` (`died`) naming that
    actor: what tells the driver of a death under `compiled_graph`, whose channel reads do not.
    Runs in runs with restarts (`failure.max_restarts` > 0) and in every `compiled_graph` run.

    Args:
      actors: label ("stage 1 host 0") -> actor handle.
    """

    def __init__(self, actors: dict, step_s: float, every: float = 1.0):
        self.actors, self.step_s, self.every = dict(actors), float(step_s), every
        self.beats: dict[str, dict | None] = {lbl: None for lbl in self.actors}
        self.asked: dict = {}        # ref of an unanswered heartbeat -> (label, driver time it was sent)
        self.due = time.monotonic()

    def __call__(self) -> None:
        import ray

        from orchestrator.core.recovery import stalled

        now = time.monotonic()
        if now < self.due:
            return
        if self.asked:
            ready, _ = ray.wait(list(self.asked), num_returns=len(self.asked), timeout=0)
            for r in ready:
                lbl, _ = self.asked.pop(r)
                self._answer(lbl, r)
        waiting = {lbl for lbl, _ in self.asked.values()}
        for lbl, actor in self.actors.items():
            if lbl not in waiting:      # one heartbeat in flight per actor
                self.asked[actor.heartbeat.options(concurrency_group="io").remote()] = (lbl, now)
        silent = {lbl: 0.0 for lbl in self.actors}
        for lbl, sent in self.asked.values():
            silent[lbl] = max(silent[lbl], now - sent)
        found = stalled(self.beats, silent, self.step_s)
        self.due = now + self.every
        if found is not None:
            culprits, why = found
            raise ProgressTimeout(f"no progress within the step deadline: {', '.join(culprits)} {why}",
                                  list(self.actors), culprits)

    def _answer(self, lbl: str, ref) -> None:
        """Record a ready heartbeat; raises the StageFailure of a dead actor."""
        import ray
        from ray.exceptions import ActorUnavailableError, RayActorError

        try:
            self.beats[lbl] = ray.get(ref, timeout=1.0)
        except RayActorError as e:
            if isinstance(e, ActorUnavailableError):    # unreachable for now, not dead: the deadlines judge
                log.debug("heartbeat of %s: %s", lbl, e)
                return
            raise stage_failure("heartbeat", lbl, e) from e
        except Exception as e:  # noqa: BLE001 - not a death; a hang is judged by `stalled`
            log.debug("heartbeat of %s failed: %s", lbl, e)

    def death(self, timeout: float):
        """A heartbeat to every actor, waited for up to `timeout` s: the StageFailure of the first
        that is dead, else None (after a survivor's own error — a reset connection — the death
        of its peer is the cause)."""
        import ray

        refs = {a.heartbeat.options(concurrency_group="io").remote(): lbl for lbl, a in self.actors.items()}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
        for r in ready:
            try:
                self._answer(refs[r], r)
            except StageFailure as e:
                return e
        return None


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


def wait_exited(info: list[dict], timeout: float, gone: set | frozenset = frozenset()) -> list[str]:
    """Wait (bounded) until the processes of an attempt's killed actors (`info`: their setup
    records, with `pid` and `node_id`) have exited; returns the labels of those still running at
    the deadline (logged, not an error). Ray frees a killed actor's name before its process ends,
    and the process runs on meanwhile (measured: still writing a file 50 ms after the name was
    free; longer under load) — a checkpoint save's last files or rename would land after the
    next attempt's `prepare` removed the uncommitted saves. The driver's own node is checked by
    pid, the others through Ray's state API; actors on the nodes in `gone` (lost) are not waited
    for, nor, when the state API does not answer, those on other nodes."""
    import psutil
    import ray

    me = ray.get_runtime_context().get_node_id()
    running = {(r.get("node_id"), int(r["pid"])): f"stage{r.get('stage')}/host{r.get('host')}"
               for r in info if r.get("pid") and r.get("node_id") not in gone}
    deadline = time.monotonic() + timeout
    while running:
        running = {k: v for k, v in running.items() if _process_running(k, me, psutil)}
        if any(node != me for node, _ in running):
            alive = _alive_remote_workers(max(1.0, deadline - time.monotonic()))
            running = {k: v for k, v in running.items() if k[0] == me or (alive is not None and k in alive)}
        if not running or time.monotonic() >= deadline:
            break
        time.sleep(0.02 if all(node == me for node, _ in running) else 0.25)
    if running:
        log.warning("recovery: the processes of %s still run %.0f s after they were killed",
                    ", ".join(sorted(running.values())), timeout)
    return sorted(running.values())


def _process_running(key: tuple, me: str, psutil) -> bool:
    node, pid = key
    if node != me:
        return True          # decided by the state API
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:     # gone (or no longer ours to see)
        return False


def _alive_remote_workers(timeout: float) -> Optional[set]:
    """(node id, pid) of every live Ray worker process, or None when the state API does not answer."""
    try:
        import ray
        from ray.util.state import list_workers

        rows = list_workers(address=ray.get_runtime_context().gcs_address, filters=[("is_alive", "=", "True")],
                            limit=10_000, timeout=int(min(timeout, 30)), raise_on_missing_output=False)
    except Exception as e:  # noqa: BLE001 - best effort: the deadline still bounds the wait
        log.debug("state API: %s", e)
        return None
    return {(w.node_id, int(w.pid)) for w in rows if w.pid is not None}


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
    """Why the run stops, what is lost and the command that continues it (`resume_command`, this
    run's own command with `--resume`). With nothing committed the command starts again: it is
    this run's command without `--resume` (a new run directory; the failed run's record stays).

    >>> from orchestrator.core.recovery import DIED
    >>> print(stop_message(Failure(DIED, 1, 0, 1, "killed"), {}, Decision(False, "no checkpoint is committed yet"),
    ...                    None, 1, "meshpipe run j.yaml --set run.steps=8 --resume"))
    actor died: stage 1 host 0 in step 1: killed
    not restarting: no checkpoint is committed yet.
    lost: all 1 steps done (no checkpoint was committed). Start again with: meshpipe run j.yaml --set run.steps=8
    """
    head = f"{describe(f, where)}\nnot restarting: {decision.reason}."
    if committed is None:
        again = resume_command.removesuffix(" --resume")
        return f"{head}\nlost: all {steps_done} steps done (no checkpoint was committed). Start again with: {again}"
    lost = steps_done - committed
    what = (f"the {lost} steps after it ({committed}..{steps_done - 1}) are lost" if lost > 0
            else "no completed step is lost")
    return f"{head}\nlast committed checkpoint: step {committed}; {what}. Continue with: {resume_command}"


def earlier_restarts(recoveries: list[dict], width: int = 160) -> str:
    """What the run was restarted for before the failure that stops it, a line each ('' for none;
    summary.json's `recoveries` has them whole). A run whose restarts are used up says what used them.

    >>> print(earlier_restarts([{"restart": 1, "cause": "error", "stage": 1, "host": 0, "step": 2,
    ...                          "error": "boom\\ntraceback"}]))
    restarted before: 1. error: stage 1 host 0 in step 2: boom
    """
    lines = []
    for i, r in enumerate(recoveries, 1):
        text = (str(r.get("error") or "").strip().splitlines() or [""])[0]
        line = f"{r.get('restart', i)}. {r.get('cause')}: stage {r.get('stage')} host {r.get('host')} in step {r.get('step')}: {text}"
        lines.append(line if len(line) <= width else line[:width - 1] + "…")
    if not lines:
        return ""
    return "restarted before: " + lines[0] if len(lines) == 1 else "\n".join(["restarted before:", *(f"  {ln}" for ln in lines)])


def record(f: Failure, where: dict, resumed_from: int, detected_at: float, waited_s: float) -> dict:
    """One restart's entry in summary.json's `recoveries` (recovery times are filled in later).
    `steps_lost`: the steps finished before the failure that run again — the failure's step (the
    one it happened in, `orchestrator.core.recovery.failed_step`) minus the step resumed from.

    >>> from orchestrator.core.recovery import DIED
    >>> record(Failure(DIED, 1, 0, 30, "killed"), {}, 20, 0.0, 0.1)["steps_lost"]      # 20..29 again
    10
    """
    return {"cause": f.cause, "stage": f.stage, "host": f.host, **where, "step": f.step, "error": f.text,
            "resumed_from": resumed_from, "steps_lost": max(0, f.step - resumed_from),
            "detected_at": detected_at, "since_last_progress_s": waited_s}


__all__ = ["RECOVERABLE", "HeartbeatWatch", "RecoveryStopped", "classify", "is_hang", "committed_step", "describe",
           "earlier_restarts",
           "lost_nodes", "NodeWatch",
           "raylet_answers", "record", "stop_message", "wait_exited", "wait_released"]
