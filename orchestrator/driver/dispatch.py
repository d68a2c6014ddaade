"""How the driver triggers steps on the stage actors — swappable (`cluster.executor`).

Every dispatcher runs the same per-actor lowered action lists (`stages.worker`);
tensors always go actor to actor through the stage transport. They differ only
in how the driver tells the actors to go and gets their results back:

  step_calls      one `run_steps(first, k)` Ray call per actor for every k steps
                  (`cluster.steps_per_call`, default 4); the next call is queued
                  before the current one is collected, so neither the driver's
                  round trip nor (inside a call) the Ray task boundary between
                  steps is on the critical path. The default.
  compiled_graph  the same call as a Ray Compiled Graph: `run_steps` bound once
                  per actor, executed through shared-memory channels (no Ray
                  task submission); compiled at the first step, torn down
                  (bounded: `close`) before the actors are killed. A channel
                  read does not see an actor die, so the driver waits on it in
                  `WATCH_SLICE_S` slices calling `watch` (the executor installs
                  the heartbeats under this executor always: a death is a
                  heartbeat's actor-death error, seconds after it).
  action_calls    the simple reference: one Ray call per action, the driver in
                  the loop (each actor gets its next action when it returned the
                  previous one). Slow by design; kept to measure against.

`steps(count, start)` yields (step, outs, wall_s) for steps start .. start+count-1 in order: outs is every actor's
result dict (`flat` order). wall_s is the step's period — for the batched
dispatchers, the largest over actors of the time between that actor's
consecutive step ends on its own clock (so also right across machines); for the
first step and for action_calls, driver time. Every wait has a deadline.
"""
from __future__ import annotations

import os
import sys
import time
from collections import deque

from orchestrator.driver.waiting import (DEATH_GRACE_S, WATCH_SLICE_S, ProgressTimeout, StageFailure,
                                         stage_failure, wait_all)

KINDS = ("step_calls", "compiled_graph", "action_calls")
TEARDOWN_AFTER_KILL_S = 5.0   # how long a compiled graph's teardown may still take once its actors are killed


def make(kind: str, actors: list, labels: list[str], action_counts: list[int], step_s: float,
         steps_per_call: int = 1):
    """A dispatcher over the flat actor list (one entry per stage host)."""
    if kind == "step_calls":
        return StepCalls(actors, labels, step_s, steps_per_call)
    if kind == "compiled_graph":
        return CompiledGraph(actors, labels, step_s, steps_per_call)
    if kind == "action_calls":
        return ActionCalls(actors, labels, step_s, action_counts)
    raise ValueError(f"executor {kind!r}: must be one of {', '.join(KINDS)}")


class _Batched:
    """Calls of `per_call` steps, one call queued ahead; subclasses submit and collect one call."""

    ahead = 1
    watch = None     # called while a call is awaited (waiting.wait_all); the executor sets its node watch
    death = None     # (seconds) -> StageFailure of a dead actor or None; the executor sets it (compiled_graph)

    def __init__(self, labels: list[str], step_s: float, per_call: int):
        self.labels, self.step_s, self.per_call = labels, step_s, per_call

    def call_s(self, n: int) -> float:
        """The deadline of a call of n steps; the executor swaps in the measured one
        (`orchestrator.core.recovery.ProgressDeadline.call_s`) once steps were measured."""
        return self.step_s * n

    def _submit(self, first: int, n: int):
        raise NotImplementedError

    def _collect(self, first: int, n: int, handle) -> list:
        """Every actor's list of n step results."""
        raise NotImplementedError

    def steps(self, count: int, start: int = 0):
        queued: deque = deque()
        nxt, count = start, start + count

        def submit() -> None:
            nonlocal nxt
            n = min(self.per_call, count - nxt)
            queued.append((nxt, n, self._submit(nxt, n)))
            nxt += n

        t_start = time.perf_counter()
        ends: list | None = None           # each actor's clock when its previous step ended
        while nxt < count and len(queued) < 1 + self.ahead:
            submit()
        while queued:
            first, n, handle = queued.popleft()
            outs = self._collect(first, n, handle)
            if nxt < count:
                submit()
            for j in range(n):
                step_outs = [o[j] for o in outs]
                stamps = [o["end"] for o in step_outs]
                if ends is None:
                    wall = time.perf_counter() - t_start
                else:
                    wall = max(e - e0 for e, e0 in zip(stamps, ends))
                ends = stamps
                yield first + j, step_outs, wall

    def close(self, timeout: float) -> list[str]:
        return []


class StepCalls(_Batched):
    def __init__(self, actors, labels, step_s: float, per_call: int = 1):
        super().__init__(labels, step_s, per_call)
        self.actors = actors

    def _submit(self, first, n):
        return [a.run_steps.remote(first, n) for a in self.actors]

    def _collect(self, first, n, refs):
        return wait_all(refs, self.call_s(n), f"steps {first}-{first + n - 1}", self.labels, watch=self.watch)


class CompiledGraph(_Batched):
    def __init__(self, actors, labels, step_s: float, per_call: int = 1):
        from ray.dag import InputNode, MultiOutputNode

        super().__init__(labels, step_s, per_call)
        self.actors = list(actors)
        with InputNode() as call:
            dag = MultiOutputNode([a.run_steps.bind(call[0], call[1]) for a in actors])
        self.graph = dag.experimental_compile(_submit_timeout=step_s * per_call,
                                              _max_inflight_executions=1 + self.ahead)

    def _submit(self, first, n):
        return self.graph.execute(first, n)

    def _collect(self, first, n, refs):
        """Ray 2.60's channel read polls (sched_yield) and would take a whole core from the stages
        while it waits (docs/decisions.md, "Executors"); the read runs on a thread at the lowest priority
        and this thread blocks on a queue."""
        import queue
        import threading

        box: queue.Queue = queue.Queue()

        def read():
            if sys.platform.startswith("linux"):    # per thread on Linux only (elsewhere: the whole process)
                os.setpriority(os.PRIO_PROCESS, 0, 19)
            try:
                box.put((True, self._read(first, n, refs)))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box.put((False, e))

        threading.Thread(target=read, name="meshpipe compiled-graph read", daemon=True).start()
        # _read has the call's deadline; this one only guards against a reader that never returns. The
        # wait goes in slices, `watch` between them: the channel read does not notice a dead actor.
        end = time.monotonic() + self.call_s(n) + 60.0
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"steps {first}-{first + n - 1}: the compiled graph's reader did not return "
                                   f"within {self.call_s(n) + 60.0:.0f} s")
            try:
                ok, value = box.get(timeout=min(left, WATCH_SLICE_S) if self.watch is not None else left)
                break
            except queue.Empty:
                if self.watch is not None:
                    self.watch()
        if not ok:
            if isinstance(value, StageFailure) and self.death is not None:
                # the actor that died, by a heartbeat: after a death Ray 2.60 fails every output of the
                # graph with it (the error names the output read, not the dead actor), and a survivor's
                # own error about its dead peer (a reset connection) is not the cause either
                dead = self.death(DEATH_GRACE_S)
                if dead is not None:
                    raise dead from value
            raise value
        return value

    def _read(self, first, n, refs) -> list:
        from ray.exceptions import RayChannelTimeoutError

        deadline = time.monotonic() + self.call_s(n)
        outs = []
        for ref, label in zip(refs, self.labels):
            try:   # a ref may be read once; each waits what is left of the call's deadline
                outs.append(ref.get(timeout=max(0.001, deadline - time.monotonic())))
            except RayChannelTimeoutError as e:
                raise ProgressTimeout(f"steps {first}-{first + n - 1}: no answer within "
                                      f"{self.call_s(n):.0f} s from {label}", [label]) from e
            except Exception as e:  # noqa: BLE001 - re-raised with the stage named
                raise stage_failure(f"steps {first}-{first + n - 1}", label, e) from e
        return outs

    def close(self, timeout: float) -> list[str]:
        """Tear the graph down within `timeout` s; the executor kills the actors next. Ray's teardown
        waits for every actor's execution loop to end, without a bound once its own
        `teardown_timeout` (30 s) has passed — a survivor in a RECV on a dead peer held it to that
        RECV's deadline (measured: 600 s) — so the executor tells the actors to abort first, and
        the teardown runs on a thread: past `timeout` the actors are killed, which ends it.
        Returns the labels of the actors killed here (none when the teardown ended in time)."""
        import threading

        import ray

        from orchestrator.driver.ray_internals import compiled_graph_proxy

        graph, self.graph = self.graph, None
        if graph is None:
            return []
        done = threading.Thread(target=graph.teardown, kwargs={"kill_actors": False},
                                name="meshpipe compiled-graph teardown", daemon=True)
        done.start()
        done.join(timeout)
        killed = []
        if done.is_alive():
            for actor, label in zip(self.actors, self.labels):
                try:
                    ray.kill(actor, no_restart=True)
                    killed.append(label)
                except Exception:  # noqa: BLE001 - already gone
                    pass
            done.join(TEARDOWN_AFTER_KILL_S)
        proxy = compiled_graph_proxy(graph)
        if proxy is not None:      # else it outlives the run until the graph is collected
            ray.kill(proxy, no_restart=True)
        return killed


class ActionCalls:
    watch = None     # as _Batched.watch

    def __init__(self, actors, labels, step_s: float, action_counts: list[int]):
        self.actors, self.labels, self.step_s, self.counts = actors, labels, step_s, action_counts

    def call_s(self, n: int) -> float:
        return self.step_s * n

    def steps(self, count: int, start: int = 0):
        import ray

        last = time.perf_counter()
        for i in range(start, start + count):
            deadline = time.monotonic() + self.call_s(1)
            nxt = [0] * len(self.actors)
            outs: list = [None] * len(self.actors)
            pending = {self.actors[j].run_action.remote(i, 0): j for j in range(len(self.actors))}
            while pending:
                left = max(0.0, deadline - time.monotonic())
                ready, _ = ray.wait(list(pending), num_returns=1,
                                    timeout=left if self.watch is None else min(left, WATCH_SLICE_S))
                if not ready and self.watch is not None and left > WATCH_SLICE_S:
                    self.watch()
                    continue
                if not ready:
                    stuck = [self.labels[j] for j in pending.values()]
                    raise ProgressTimeout(f"step {i}: no answer within {self.call_s(1):.0f} s from "
                                          f"{', '.join(stuck)}", stuck)
                j = pending.pop(ready[0])
                out = wait_all(ready, 1.0, f"step {i} action {nxt[j]}", [self.labels[j]])[0]
                nxt[j] += 1
                if nxt[j] < self.counts[j]:
                    pending[self.actors[j].run_action.remote(i, nxt[j])] = j
                else:
                    outs[j] = out
            now = time.perf_counter()
            yield i, outs, now - last
            last = now

    def close(self, timeout: float) -> list[str]:
        return []
