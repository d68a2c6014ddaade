"""A plan's predicted step time, for the re-plan record and the `grow: gain` decision. Pure.

`predict_step(checked)` plays the plan's lowered schedule in the schedule simulator
(`orchestrator.core.schedule.simulate`) with each stage's F and B from forward FLOPs:

    F(stage) = Σ FLOPs of the layers of one chunk × microbatch rows ÷ (devices × device FLOP/s)
    B = 2 F (a backward is about twice its forward)

The per-layer FLOPs are `orchestrator.core.model.balance.layer_costs` (counted from each part's
jaxpr, tracing only: no device, no compile), the device FLOP/s the cluster's (`device.tflops`, or
the platform's nominal figure; `device.shared_slowdown` charged to plans on more than one host, as
the planner does). It leaves out communication (stage edges, data-parallel all-reduce,
tensor-parallel collectives) and assumes a stage's devices split its work perfectly, so it
favours plans on more devices: it is a comparison of plans of one job on one cluster — the
same estimator for the plan before and after a re-plan — not a promise of seconds. Where the
planner chose the plan (`replan: auto`), its own prediction is recorded beside it.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Optional

__all__ = ["Prediction", "predict_step", "layer_flops"]


@dataclass(frozen=True)
class Prediction:
    """A plan's predicted step.

    Attributes:
      step_s: the simulated step time, seconds.
      bubble: the simulated bubble fraction.
      estimator: how it was predicted ("flops": `predict_step`; "planner": the auto-planner's cost model).
    """

    step_s: float
    bubble: float
    estimator: str = "flops"

    def to_json(self) -> dict:
        return {"step_s": self.step_s, "bubble": self.bubble, "estimator": self.estimator}


@functools.lru_cache(maxsize=16)
def _layer_flops(factory: str, args_json: str, num_layers: int) -> tuple[float, ...]:
    from orchestrator.core.model.balance import layer_costs
    from orchestrator.core.model.registry import build_model

    costs, kind = layer_costs(build_model(factory, json.loads(args_json)))
    if len(costs) != num_layers:
        raise ValueError(f"the model has {len(costs)} parts but its description {num_layers} layers")
    return tuple(float(c) for c in costs)


def layer_flops(model) -> tuple[float, ...]:
    """Per layer of `model` (a `ModelSpec`), forward FLOPs per example (`balance.layer_costs`, at its
    describe batch, divided by it); parameter counts when the FLOPs cannot be counted."""
    from orchestrator.core.model.pipeline import DESCRIBE_BATCH

    try:
        args = json.dumps(dict(model.args), sort_keys=True)
        return tuple(c / DESCRIBE_BATCH for c in _layer_flops(model.factory, args, model.num_layers))
    except Exception:  # noqa: BLE001 - arguments that are not JSON, a trace that fails: params order layers too
        return tuple(float(max(1, model.param_count(i, i + 1))) for i in range(model.num_layers))


def predict_step(checked) -> Prediction:
    """The predicted step of a checked plan (see the module docstring).

    Example:
        >>> from orchestrator.core.config import load_job, load_cluster, check_job
        >>> checked = check_job(load_job("examples/gpt.yaml"), load_cluster("cluster_configs/local.yaml"))
        >>> p = predict_step(checked)
        >>> p.step_s > 0 and 0 <= p.bubble < 1 and p.estimator
        'flops'
    """
    from orchestrator.core.planner.topology import from_cluster
    from orchestrator.core.schedule import generate, lower, simulate

    job = checked.job
    topo = from_cluster(checked.cluster)
    hosts = sum(len(s.hosts) for s in checked.stages)
    if hosts > 1:
        topo = topo.shared()
    flops = layer_flops(checked.model)
    rows = checked.microbatch_size
    costs = []
    for s in checked.stages:
        chunks = s.chunks or (s.layers,)
        per_chunk = sum(sum(flops[a:b]) for a, b in chunks) / len(chunks)
        f = per_chunk * rows / (s.num_devices * topo.flops)
        costs.append({"F": f, "B": 2 * f})
    p, m, v = len(checked.stages), job.pipeline.microbatches, job.pipeline.virtual_stages
    sim = simulate(lower(generate(job.pipeline.schedule, p, m, v)), costs)
    return Prediction(float(sim.step_time), float(sim.bubble_fraction))


def speedup(before: Optional[Prediction], after: Optional[Prediction]) -> Optional[float]:
    """after's steps per second ÷ before's − 1 (0.25: 25 % faster); None when either is unknown."""
    if before is None or after is None or after.step_s <= 0:
        return None
    return before.step_s / after.step_s - 1.0
