"""Elastic recovery, the pure half (`failure.elastic`): when a lost node cannot be replaced, train
on the hosts that are left; when hosts come back, grow onto them at a commit.

The training stays the job's: the global batch and the data order (a function of the seed, the
step and the global batch: `orchestrator.core.data.sampler`) are kept, a plan on fewer hosts
takes more microbatches or a smaller data-parallel degree, and the last commit is restored onto
the new plan by name (parameters and optimizer state move together: `stages.checkpoint.restore`).
What changes is the order floating-point sums are taken in (docs/guides/elastic.md).

Modules:
  replan   host_capacity, plan_for (keep | replan | stop), grow_decision, check_elastic
  rule     `replan: rule`: the job's own plan shrunk by a documented deterministic rule
  auto     `replan: auto`: the `meshpipe plan --auto` search on the hosts that are left
  predict  a plan's predicted step (schedule simulator over FLOPs), for records and `grow: gain`
  record   summary.json's re-plan record, the log line, the progress line, the Ray metrics

Nothing here imports Ray, the actor runtime or the driver (tests/test_layers.py).
"""
from orchestrator.core.elastic.auto import plan_by_search, uncalibrated
from orchestrator.core.elastic.predict import Prediction, predict_step, speedup
from orchestrator.core.elastic.record import METRICS, MetricSpec, ReplanRecord, Timings, describe_plan, plan_line
from orchestrator.core.elastic.replan import (GrowDecision, Replan, check_elastic, grow_decision, host_capacity,
                                              plan_for, plan_hosts)
from orchestrator.core.elastic.rule import plan_by_rule

__all__ = ["Replan", "GrowDecision", "plan_for", "grow_decision", "host_capacity", "check_elastic", "plan_hosts",
           "plan_by_rule", "plan_by_search", "uncalibrated", "Prediction", "predict_step", "speedup",
           "ReplanRecord", "Timings", "describe_plan", "plan_line", "MetricSpec", "METRICS"]
