"""The elastic decisions, pure: how many hosts the live cluster holds, which plan to run on them,
whether to grow back at a commit, and the config cross-checks.

Basic flow (the driver's recovery loop calls these; it owns Ray, the placement and the restore):
  capacity = host_capacity(bundle, strategy, live node resources, limit)   how many host bundles fit
  r = plan_for(original, capacity, profile=...)                             keep | replan | stop
      keep:   the job's own plan fits (its hosts are all there): nothing to re-plan;
      replan: `r.checked` is the plan on fewer hosts (`replan: auto` → `auto.plan_by_search`, falling
              back to `rule.plan_by_rule` with the reason; `replan: rule` → the rule);
      stop:   fewer than `failure.elastic.min_hosts`, or no legal plan: `r.reason` says which.
  at each commit while shrunk: g = grow_decision(original, current, capacity, ...)   grow or not
      (`grow: never | next_commit | gain`; a grow's plan is `g.replan`, by the same `plan_for`).

Invariants: every plan comes from the job's ORIGINAL `Checked` and the host count alone — the
plan on n hosts is the same whether the run lost hosts at once or one by one, and once all its
hosts are back the job runs its own plan again. Every plan returned passed `check_job`. Nothing
here imports Ray; the live cluster comes in as plain resource mappings.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

from orchestrator.core.config.errors import problem
from orchestrator.core.elastic.predict import Prediction, predict_step, speedup

__all__ = ["Replan", "GrowDecision", "plan_for", "grow_decision", "host_capacity", "check_elastic", "plan_hosts"]


def plan_hosts(checked) -> int:
    """Hosts a checked plan uses (its placement group's bundles)."""
    return sum(len(s.hosts) for s in checked.stages)


@dataclass(frozen=True)
class Replan:
    """What to run on the hosts there are.

    Attributes:
      action: "keep" (the job's own plan fits), "replan" (`checked` is a plan on fewer hosts) or "stop".
      reason: why, in words (for the log and the record; with "stop", the message's cause).
      capacity: the host bundles the live cluster holds (as given).
      checked: the plan to run (the job's own for "keep"; None for "stop").
      method: "original", "rule" or "auto" (how `checked` was found).
      fallback: with `replan: auto`, why the rule made the plan instead (None: it did not).
      predicted: `predict_step(checked)` (None for "stop").
      planner_step_s: the planner's own predicted step (method "auto").
    """

    action: str
    reason: str
    capacity: int
    checked: Any = None
    method: Optional[str] = None
    fallback: Optional[str] = None
    predicted: Optional[Prediction] = None
    planner_step_s: Optional[float] = None

    @property
    def hosts(self) -> int:
        return 0 if self.checked is None else plan_hosts(self.checked)


@dataclass(frozen=True)
class GrowDecision:
    """Whether to re-plan onto more hosts at this commit; `replan` is the plan to grow onto."""

    grow: bool
    reason: str
    replan: Optional[Replan] = None


def _elastic(original):
    el = original.job.failure.elastic
    if el is None:
        raise ValueError(f"job {original.job.run.name!r} has no failure.elastic section")
    return el


def plan_for(original, capacity: int, *, profile: Optional[Callable] = None) -> Replan:
    """The plan for a live cluster that holds `capacity` host bundles (module docstring).

    Args:
      original: the job's own `Checked` (not the plan in use: plans always derive from the job's).
      capacity: host bundles the live cluster holds (`host_capacity`).
      profile: the planner's layer profiler, for `replan: auto`.

    Example:
        >>> from orchestrator.core.config import load_job, load_cluster, check_job
        >>> job = load_job("examples/gpt.yaml", overrides=["checkpoint={dir: /tmp/c, every_steps: 2}",
        ...                                                "failure={max_restarts: 1, elastic: {min_hosts: 1}}"])
        >>> original = check_job(job, load_cluster("cluster_configs/local.yaml"))
        >>> [(r.action, r.hosts) for r in (plan_for(original, c) for c in (3, 1, 0))]
        [('keep', 2), ('replan', 1), ('stop', 0)]
    """
    from orchestrator.core.elastic.auto import plan_by_search
    from orchestrator.core.elastic.rule import plan_by_rule

    el = _elastic(original)
    own = plan_hosts(original)
    if capacity >= own:
        return Replan("keep", f"the live cluster holds the job's own plan ({own} hosts)", capacity, original,
                      "original", predicted=predict_step(original))
    floor = el.min_hosts or 1
    if capacity < floor:
        what = (f"failure.elastic.min_hosts = {el.min_hosts}" if el.min_hosts else
                "one (no host left to train on)")
        return Replan("stop", f"the live cluster holds {capacity} host(s) of the {own} the job's plan uses, "
                              f"fewer than {what}", capacity)
    fallback = None
    if el.replan == "auto":
        checked, how, step_s = plan_by_search(original, capacity, profile, min_hosts=floor)
        if checked is not None:
            return Replan("replan", how, capacity, checked, "auto", predicted=predict_step(checked),
                          planner_step_s=step_s)
        fallback = how
    checked, how = plan_by_rule(original, capacity, floor)
    if checked is None:
        return Replan("stop", how, capacity, fallback=fallback)
    return Replan("replan", how, capacity, checked, "rule", fallback=fallback, predicted=predict_step(checked))


def grow_decision(original, current, capacity: int, *, profile: Optional[Callable] = None,
                  predicted_now: Optional[Prediction] = None) -> GrowDecision:
    """At a commit of a run on a re-planned (smaller) plan `current`: re-plan onto more hosts now?

    `grow: never` never does; `next_commit` does as soon as a legal plan on more hosts than
    `current` exists for `capacity`; `gain` only when that plan's predicted step is faster by at
    least `failure.elastic.min_gain` (steps per second, `predict.speedup`; `predicted_now` defaults
    to `predict_step(current)` — give the same estimator's figures for both).

    Example:
        >>> from orchestrator.core.config import load_job, load_cluster, check_job
        >>> job = load_job("examples/gpt.yaml", overrides=["checkpoint={dir: /tmp/c, every_steps: 2}",
        ...                                                "failure={max_restarts: 1, elastic: {}}"])
        >>> original = check_job(job, load_cluster("cluster_configs/local.yaml"))
        >>> small = plan_for(original, 1).checked
        >>> g = grow_decision(original, small, 4)
        >>> g.grow, g.replan.action, g.replan.hosts
        (True, 'keep', 2)
    """
    el = _elastic(original)
    now = plan_hosts(current)
    if el.grow == "never":
        return GrowDecision(False, "failure.elastic.grow is 'never'")
    if now >= plan_hosts(original):
        return GrowDecision(False, f"the job's own plan ({now} hosts) is in use")
    if capacity <= now:
        return GrowDecision(False, f"the live cluster holds {capacity} host(s); the plan in use has {now}")
    proposed = plan_for(original, capacity, profile=profile)
    if proposed.action == "stop":
        return GrowDecision(False, f"no plan for {capacity} hosts: {proposed.reason}", proposed)
    if proposed.hosts <= now:
        return GrowDecision(False, f"no legal plan on more than the {now} host(s) in use fits the {capacity} "
                                   f"there are ({proposed.reason})", proposed)
    more = f"{proposed.hosts} hosts instead of {now}"
    if el.grow == "next_commit":
        return GrowDecision(True, f"{capacity} hosts available: {more} (grow: next_commit)", proposed)
    before = predicted_now or predict_step(current)
    gain = speedup(before, proposed.predicted)
    if gain is None:
        return GrowDecision(False, "grow: gain needs both plans' predicted steps", proposed)
    figures = (f"predicted step {before.step_s * 1e3:.3g} → {proposed.predicted.step_s * 1e3:.3g} ms, "
               f"{gain:+.1%} steps per second; min_gain {el.gain_threshold:g}")
    if gain >= el.gain_threshold:
        return GrowDecision(True, f"{more}: {figures}", proposed)
    return GrowDecision(False, f"{more} gains too little: {figures}", proposed)


def host_capacity(bundle: Mapping[str, float], strategy: str, nodes: Sequence[Mapping[str, float]],
                  limit: int) -> int:
    """How many host bundles `bundle` the nodes hold (their total resources, as
    `orchestrator.driver.placement.check_fits` counts them), at most `limit` (the job's own hosts).

    PACK and SPREAD: the sum over nodes; STRICT_SPREAD: the nodes holding at least one;
    STRICT_PACK: the largest node's count. What other work uses now is not counted (the
    placement's wait is for that).

    Example:
        >>> host_capacity({"CPU": 1.0}, "STRICT_SPREAD", [{"CPU": 1}, {"CPU": 2}, {"GPU": 1}], 4)
        2
        >>> host_capacity({"CPU": 0.5}, "PACK", [{"CPU": 1}, {"CPU": 2}], 4)
        4
    """
    need = {r: float(v) for r, v in bundle.items() if v > 0}
    per = [min((math.floor(float(n.get(r, 0.0)) / v + 1e-6) for r, v in need.items()), default=limit)
           for n in nodes]
    if not per:
        return 0
    if strategy == "STRICT_SPREAD":
        held = sum(1 for k in per if k > 0)
    elif strategy == "STRICT_PACK":
        held = max(per)
    else:
        held = sum(per)
    return max(0, min(limit, held))


def check_elastic(checked) -> list[str]:
    """Problems of `failure.elastic` that need the model and the cluster (one `key = value: rule`
    line each); [] without the section. `check_job` adds them to `check_plan`'s (the rule's plans are
    what `min_hosts` is checked against: `replan: auto` falls back to the rule).

    Example:
        >>> from orchestrator.core.config import load_job, load_cluster, check_plan
        >>> job = load_job("examples/gpt.yaml", overrides=["checkpoint={dir: /tmp/c, every_steps: 2}",
        ...                                                "failure={max_restarts: 1, elastic: {min_hosts: 3}}"])
        >>> [p.split(": ")[0] for p in check_elastic(check_plan(job, load_cluster("cluster_configs/local.yaml")))]
        ['failure.elastic.min_hosts = 3']
    """
    from orchestrator.core.elastic.rule import plan_by_rule

    el = checked.job.failure.elastic
    if el is None:
        return []
    if checked.cluster.platform == "tpu":
        return [problem("failure.elastic", el.model_dump(mode="json", exclude_defaults=True),
                        "not supported on TPU yet: a TPU slice that loses a host holds no submesh, so a "
                        "re-plan must drop whole slices (remove failure.elastic)")]
    own = plan_hosts(checked)
    if el.min_hosts is None:
        return []
    key = "failure.elastic.min_hosts"
    if el.min_hosts > own:
        return [problem(key, el.min_hosts, f"more than the {own} hosts the job's plan uses; an elastic run "
                                           f"trains on at most the job's own plan (at least 1, at most {own})")]
    if el.min_hosts == own or plan_by_rule(checked, el.min_hosts, el.min_hosts)[0] is not None:
        return []
    smallest = next((t for t in range(el.min_hosts + 1, own) if plan_by_rule(checked, t, t)[0] is not None), own)
    return [problem(key, el.min_hosts, f"no legal plan of this job fits on {el.min_hosts} host(s) (the re-plan "
                                       f"rule's smallest is {smallest} host(s)); set min_hosts >= {smallest}")]
