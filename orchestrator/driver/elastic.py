"""Elastic recovery, the driver's half (`failure.elastic`): what the live cluster holds, and the
re-plan and grow-back decisions of `orchestrator.core.elastic` asked with it.

Basic flow (`orchestrator.driver.attempts.Session` calls these; it owns the switch of plans):
  after a restart's placement failed:   r = shrink(original, gone)    plan_for(capacity now)
  at each commit on a smaller plan:     g = grow(original, current, gone)   grow_decision(capacity now)
                                        g.grow → `GrowBack` raised from the step loop: the attempt
                                        ends at the commit and the next one starts on the larger plan
The capacity is `host_capacity` of the job's own host bundle over the live nodes' total resources,
nodes the run lost and nodes whose raylet does not answer left out (Ray marks a lost node dead
only after its health check, seconds later).
With `replan: auto` the planner profiles layers through the same worker and on-disk cache as
`meshpipe plan --auto` (`orchestrator.driver.autoplan`).
"""
from __future__ import annotations

import time
from typing import Callable, Optional

__all__ = ["GrowBack", "live_capacity", "shrink", "grow"]

PROFILE_WORKER = "stages.aot_profile"     # the layer profiler `meshpipe plan --auto` runs (autoplan.WORKER)


class GrowBack(Exception):
    """Raised at a commit when the run should grow onto more hosts: the attempt ends cleanly there
    (not a failure: no restart is counted) and the next one starts on `decision.replan.checked`.

    Attributes:
      decision: the `GrowDecision` (grow True).
      step: the commit that triggered it.
      at: wall time of the decision (a grow's times are counted from it).
      planning_s: the capacity count and `grow_decision`.
    """

    def __init__(self, decision, step: int, at: float, planning_s: float):
        super().__init__(f"elastic grow-back at commit {step}: {decision.reason}")
        self.decision, self.step, self.at, self.planning_s = decision, step, at, planning_s


def live_capacity(original, avoid=(), timeout: float = 1.0) -> int:
    """Host bundles of `original`'s plan the live Ray nodes hold (at most the job's own hosts).
    Not counted: nodes in `avoid` (ids the run lost) and nodes whose raylet does not accept a
    connection within `timeout` (gone, though Ray has not marked them dead yet: its health check
    takes longer, `recovery.lost_nodes`)."""
    import ray

    from orchestrator.core.backends import get_backend
    from orchestrator.core.elastic import host_capacity, plan_hosts
    from orchestrator.core.hosts import bundles
    from orchestrator.driver.recovery import raylet_answers

    def answers(n: dict) -> bool:
        where = n.get("NodeManagerAddress"), n.get("NodeManagerPort")
        return not all(where) or raylet_answers(*where, timeout)

    own = plan_hosts(original)
    wanted = bundles(original, get_backend(original.cluster).sites(own))
    common = {k: min(b.get(k, 0.0) for b in wanted) for k in wanted[0]}
    nodes = [dict(n.get("Resources") or {}) for n in ray.nodes()
             if n.get("Alive") and n["NodeID"] not in avoid and answers(n)]
    return host_capacity(common, original.cluster.placement_strategy, nodes, own)


def layer_profiler(original) -> Optional[Callable]:
    """The planner's layer profiler for `replan: auto` (None for `replan: rule`)."""
    if original.job.failure.elastic.replan != "auto":
        return None
    from orchestrator.core.planner import Profiler
    from orchestrator.core.planner.adapter import from_job
    from orchestrator.core.planner.profile import default_cache_dir

    profiler, source = Profiler(PROFILE_WORKER, default_cache_dir()), from_job(original.job).source
    return lambda requests: profiler.profile(source, requests)


def shrink(original, gone, profile: Optional[Callable] = None):
    """`plan_for` the hosts the live cluster holds now: (the `Replan`, seconds it took)."""
    from orchestrator.core.elastic import plan_for

    t0 = time.perf_counter()
    r = plan_for(original, live_capacity(original, gone), profile=profile)
    return r, time.perf_counter() - t0


def grow(original, current, gone, step: int, profile: Optional[Callable] = None) -> Optional[GrowBack]:
    """At commit `step` of a run on the smaller plan `current`: the `GrowBack` to raise, or None."""
    from orchestrator.core.elastic import grow_decision

    t0, at = time.perf_counter(), time.time()
    g = grow_decision(original, current, live_capacity(original, gone), profile=profile)
    return GrowBack(g, step, at, time.perf_counter() - t0) if g.grow else None
