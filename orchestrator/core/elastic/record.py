"""What a re-plan leaves behind, pure: its summary.json record and log line, the progress line's
description of the plan in use, and the Ray metrics' definitions.

  describe_plan(checked)        "2 stages 1f1b m=4 on 2 hosts: [0,2) data=2 | [2,4) model=2"
  plan_line(checked, own)       "plan: 1 stage on 1 of 2 hosts, m=4"  (the progress display's tag)
  ReplanRecord.of(...)          one entry of summary.json's `replans`; `.to_json()`, `.message()`
  Timings                       from the loss (or the commit, growing) to training again, by part
  METRICS                       the gauges the driver registers (`ray_meshpipe_hosts`, `..._replans`)

A record holds text and numbers only (no `Checked`), so summary.json and metrics.jsonl take it as
it is, and a failed run's summary still carries every re-plan made before the failure.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from orchestrator.core.elastic.predict import Prediction

__all__ = ["describe_plan", "plan_line", "Timings", "ReplanRecord", "MetricSpec", "METRICS"]


def _stage_text(s) -> str:
    chunks = "+".join(f"[{a},{b})" for a, b in (s.chunks or (s.layers,)))
    mesh = ",".join(f"{k}={v}" for k, v in s.mesh.items())
    return f"{chunks} {mesh}" + (f" x{len(s.hosts)}h" if len(s.hosts) > 1 else "")


def describe_plan(checked) -> str:
    """A plan in one short line: stages, schedule, microbatches, hosts, and per stage its layers and mesh.

    Example:
        >>> from orchestrator.core.config import load_job, load_cluster, check_job
        >>> describe_plan(check_job(load_job("examples/gpt.yaml"), load_cluster("cluster_configs/local.yaml")))
        '2 stages 1f1b m=4 on 2 hosts: [0,2) data=2 | [2,4) model=2'
    """
    pc = checked.job.pipeline
    p, h = len(checked.stages), sum(len(s.hosts) for s in checked.stages)
    sched = pc.schedule + (f" v={pc.virtual_stages}" if pc.virtual_stages > 1 else "")
    return (f"{p} stage{'s' if p > 1 else ''} {sched} m={pc.microbatches} on {h} host{'s' if h > 1 else ''}: "
            + " | ".join(_stage_text(s) for s in checked.stages))


def plan_line(checked, own_hosts: int) -> str:
    """The plan in use, for the progress display: stages, hosts (of the job's own), microbatches.

    Example:
        >>> from orchestrator.core.config import load_job, load_cluster, check_job
        >>> plan_line(check_job(load_job("examples/gpt.yaml"), load_cluster("cluster_configs/local.yaml")), 4)
        'plan: 2 stages on 2 of 4 hosts, m=4'
    """
    p, h = len(checked.stages), sum(len(s.hosts) for s in checked.stages)
    hosts = f"{h} of {own_hosts} hosts" if h != own_hosts else f"{h} host{'s' if h > 1 else ''}"
    return f"plan: {p} stage{'s' if p > 1 else ''} on {hosts}, m={checked.job.pipeline.microbatches}"


@dataclass(frozen=True)
class Timings:
    """Seconds from the loss (a shrink) or the commit (a grow) to training again, by part.

    Attributes:
      detection_s: the failure until the driver noticed it (None for a grow: nothing failed).
      teardown_s: the old attempt's actors and placement group gone.
      wait_s: the wait for the old plan's placement to fit again (`failure.placement_timeout_s`; a
        replacement node would have been taken), before re-planning (None for a grow).
      planning_s: `plan_for` / `grow_decision` (the placement's wait for the old plan not included).
      placement_s: the new plan's placement group reserved.
      restore_s: the last commit read into the new plan's shardings (the slowest host).
      compile_s: jax's tracing + lowering + compiling in the new attempt (the slowest actor).
      total_s: noticed (or the commit) until the first step trained again; the parts above are its
        pieces (detection_s before it), the rest is actor start-up, set-up and the step itself.
    """

    detection_s: Optional[float] = None
    teardown_s: Optional[float] = None
    wait_s: Optional[float] = None
    planning_s: Optional[float] = None
    placement_s: Optional[float] = None
    restore_s: Optional[float] = None
    compile_s: Optional[float] = None
    total_s: Optional[float] = None

    def to_json(self) -> dict[str, Optional[float]]:
        return {"detection": self.detection_s, "teardown": self.teardown_s, "wait": self.wait_s,
                "planning": self.planning_s,
                "placement": self.placement_s, "restore": self.restore_s, "compile": self.compile_s,
                "total": self.total_s}

    def text(self, since: str = "the loss") -> str:
        """e.g. `training again 31.2 s after the loss (detection 1.1, teardown 0.3, ... s)`; parts not
        known are left out."""
        parts = ", ".join(f"{k} {v:.1f}" for k, v in self.to_json().items() if k != "total" and v is not None)
        head = f"training again {self.total_s:.1f} s after {since}" if self.total_s is not None else "times"
        return f"{head} ({parts} s)" if parts else head


@dataclass(frozen=True)
class ReplanRecord:
    """One re-plan, as summary.json's `replans` lists it.

    Attributes:
      kind: "shrink" (after a failure the old plan could not be placed again) or "grow".
      step: the committed step training resumed from (the steps after it run again on the new plan).
      why: the cause (the failure's description; for a grow, the decision's reason).
      capacity: host bundles the live cluster held.
      hosts: (before, after).
      plans: (before, after), `describe_plan`'s text.
      method: "rule", "auto" or "original" (back on the job's own plan).
      fallback: `replan: auto` fell back to the rule: why.
      predicted: (before, after) predicted steps (`predict.Prediction`), the same estimator both.
      planner_step_s: the planner's own prediction of the new plan (method "auto").
      timings: `Timings`.
    """

    kind: str
    step: int
    why: str
    capacity: int
    hosts: tuple[int, int]
    plans: tuple[str, str]
    method: str
    fallback: Optional[str] = None
    predicted: tuple[Optional[Prediction], Optional[Prediction]] = (None, None)
    planner_step_s: Optional[float] = None
    timings: Timings = field(default_factory=Timings)

    @classmethod
    def of(cls, kind: str, step: int, why: str, before, replan, predicted_before: Optional[Prediction] = None,
           timings: Optional[Timings] = None) -> "ReplanRecord":
        """The record of re-planning from plan `before` (a `Checked`) to `replan` (a `replan.Replan`,
        action "replan" or, growing back to the job's own plan, "keep")."""
        if replan.checked is None:
            raise ValueError(f"a {kind} record needs the new plan; the decision was {replan.action!r}: {replan.reason}")
        return cls(kind, step, why, replan.capacity, (sum(len(s.hosts) for s in before.stages), replan.hosts),
                   (describe_plan(before), describe_plan(replan.checked)), replan.method or "rule", replan.fallback,
                   (predicted_before, replan.predicted), replan.planner_step_s, timings or Timings())

    def with_timings(self, timings: Timings) -> "ReplanRecord":
        from dataclasses import replace

        return replace(self, timings=timings)

    def to_json(self) -> dict[str, Any]:
        before, after = self.predicted
        return {"kind": self.kind, "step": self.step, "why": self.why, "capacity": self.capacity,
                "hosts": {"before": self.hosts[0], "after": self.hosts[1]},
                "plan": {"before": self.plans[0], "after": self.plans[1]},
                "method": self.method, "fallback": self.fallback,
                "predicted_step_s": {"before": None if before is None else before.step_s,
                                     "after": None if after is None else after.step_s,
                                     "estimator": (after or before).estimator if (after or before) else None,
                                     "planner": self.planner_step_s},
                "times_s": self.timings.to_json()}

    def message(self) -> str:
        """The run log's line, e.g. `elastic shrink at step 8 (node lost ...): 2 stages ... → 1 stage ...;
        predicted step 10.2 → 19.8 ms; training again 31.2 s after the loss (...)`."""
        before, after = self.predicted
        pred = (f"; predicted step {before.step_s * 1e3:.3g} → {after.step_s * 1e3:.3g} ms"
                if before is not None and after is not None else "")
        how = f" [{self.method}" + (f"; auto fell back: {self.fallback}" if self.fallback else "") + "]"
        return (f"elastic {self.kind} at step {self.step} ({self.why}): {self.plans[0]} → {self.plans[1]}{how}"
                f"{pred}; {self.timings.text('the loss' if self.kind == 'shrink' else 'the commit')}")


@dataclass(frozen=True)
class MetricSpec:
    """A Ray metric the driver registers (`ray.util.metrics`; scraped with Ray's `ray_` prefix)."""

    name: str
    kind: str
    description: str
    tags: tuple[str, ...] = ("run",)

    @property
    def scraped(self) -> str:
        return f"ray_meshpipe_{self.name}"


METRICS = (
    MetricSpec("hosts", "gauge", "Hosts the run trains on now (failure.elastic re-plans change it)"),
    MetricSpec("replans", "gauge", "Elastic re-plans so far (shrinks and grow-backs)"),
)
