"""The benchmark's derived quantities, each written once (pure; no ray, jax or torch).

Every table of `benchmarks/run.py` and `benchmarks/executors.py`, and the
records `benchmarks/pipeline.py` writes, compute their figures here:

  efficiency         = ideal ÷ step (1.0: the runtime adds nothing to the schedule's own bubble)
  overhead/action    = (step − ideal) ÷ N, in ms (N: compute actions in one stage's list,
                       or actions on the simulated critical path)
  bound              = m ÷ (m + p − 1), a perfect GPipe / 1F1B pipeline's throughput fraction
  vs plain           = plain step ÷ pipelined step (same global batch)
  of bound           = vs plain ÷ bound
  F + B              = a microbatch's compute on one stage: F + B, or F + I + W (zero-bubble)

`ideal` is the simulated step of the lowered schedule with measured action
costs (`benchmarks/common.py` `sim_costs`). Times are in seconds unless the
name says ms.

Example:

    >>> round(efficiency(ideal_s=0.09, step_s=0.1), 3), round(overhead_ms(0.1, 0.09, 20), 3)
    (0.9, 0.5)
    >>> bound(m=8, p=2)
    0.8888888888888888
"""
from __future__ import annotations

from collections.abc import Mapping


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


def efficiency(ideal_s: float, step_s: float) -> float:
    """Simulated ideal step ÷ measured step."""
    _positive("step_s", step_s)
    return ideal_s / step_s


def overhead_ms(step_s: float, ideal_s: float, actions: int) -> float:
    """What the runtime adds per action: (measured step − ideal) ÷ `actions`, in ms."""
    _positive("actions", actions)
    return (step_s - ideal_s) / actions * 1e3


def bound(m: int, p: int) -> float:
    """m ÷ (m + p − 1): throughput of a perfect p-stage GPipe/1F1B pipeline of m microbatches,
    as a fraction of one unsplit program on the same work."""
    _positive("m", m)
    _positive("p", p)
    return m / (m + p - 1)


def vs_plain(plain_s: float, step_s: float) -> float:
    """Plain (unpipelined) step ÷ pipelined step of the same global batch (> 1: the pipeline is faster)."""
    _positive("step_s", step_s)
    return plain_s / step_s


def of_bound(vs_plain_ratio: float, bound_fraction: float) -> float:
    """vs plain ÷ bound (1.0: as fast as a perfect pipeline of the plain program)."""
    _positive("bound_fraction", bound_fraction)
    return vs_plain_ratio / bound_fraction


def fb(costs: Mapping[str, float]) -> float:
    """One microbatch's compute on a stage from per-kind costs: F + B, or F + I + W when split."""
    return costs.get("F", 0.0) + (costs["B"] if "B" in costs else costs.get("I", 0.0) + costs.get("W", 0.0))
