"""The benchmark's derived quantities, each written once (pure; no ray, jax or torch).

Every table of `benchmarks/run.py` and `benchmarks/executors.py`, and the
records `benchmarks/pipeline.py` writes, compute their figures here:

  efficiency         = ideal ÷ step (1.0: the runtime adds nothing to the schedule's own bubble);
                       ideal = the lowered schedule simulated with each action's cost from a
                       STANDALONE timing of its stage program, so it is ≤ 1 by construction:
                       `checked_efficiency` raises `ImplausibleMeasurement` above 1
  overhead/action    = (step − ideal) ÷ N, in ms (N: compute actions in one stage's list,
                       or actions on the simulated critical path); ≥ 0 by the same argument
                       (`checked_overhead_ms` raises below 0)
  bound              = m ÷ (m + p − 1), a perfect GPipe / 1F1B pipeline's throughput fraction
  honest bound       = base₁ × (m + p − 1) ÷ (m · p): the step of a perfect p-stage pipeline of
                       the 1-core work (each stage gets 1/p of it, m + p − 1 slots); base₁ = the
                       1-core plain program's step, plain₁, or m × the stage programs' standalone
                       F + B summed over the stages when that is less (a framework whose stages
                       run faster apart than its whole model on one core — torch here — beat
                       plain₁'s pipeline by 1 %). With that minimum the bound is ≤ the ideal, so
                       ≤ the step whenever efficiency ≤ 1: `checked_of_honest_bound` raises above 1
  of honest bound    = honest bound ÷ step (1.0: as fast as that perfect pipeline)
  vs plain           = plain step ÷ pipelined step (same global batch; plain on all cores is
                       its own column, it is not a bound: plain does not scale perfectly)
  step (meshpipe)    = `call_period_s`: the median over complete executor calls of each call's mean
                       step period, so a cost paid once per Ray call is counted
  F + B              = a microbatch's compute on one stage: F + B, or F + I + W (zero-bubble)

Times are in seconds unless the name says ms.

Example:

    >>> round(efficiency(ideal_s=0.09, step_s=0.1), 3), round(overhead_ms(0.1, 0.09, 20), 3)
    (0.9, 0.5)
    >>> bound(m=8, p=2)
    0.8888888888888888
    >>> round(honest_bound_s(plain1_s=1.6, m=8, p=2), 3)      # 1.6 s × 9 / 16
    0.9
"""
from __future__ import annotations

from collections.abc import Mapping


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


class ImplausibleMeasurement(ValueError):
    """A derived figure that cannot be physically true (efficiency above 1, negative overhead):
    the measurement is wrong, and the benchmark run fails instead of publishing it."""


def call_period_s(walls_s: list[float], first_step: int, per_call: int) -> float:
    """The step period with the executor's call boundaries counted: the steps first_step,
    first_step + 1, … (periods `walls_s`) grouped by the call that ran them (step // per_call);
    the median over the complete calls of each call's mean period. A plain median of the
    steps would hide a cost paid once per call (the Ray task boundary: one step in four is
    ~2.5 ms slower at `tiny` here); a window without a complete call falls back to the mean.

    Example:
        >>> call_period_s([1.0, 1.0, 1.0, 5.0, 1.0, 1.0, 1.0, 5.0], 0, 4)   # median 1.0 would hide it
        2.0
        >>> call_period_s([3.0, 1.0, 2.0], 7, 1)                            # one step per call
        2.0
    """
    _positive("per_call", per_call)
    if not walls_s:
        raise ValueError("call_period_s: no step periods")
    calls: dict[int, list[float]] = {}
    for i, w in enumerate(walls_s):
        calls.setdefault((first_step + i) // per_call, []).append(w)
    means = sorted(sum(c) / len(c) for c in calls.values() if len(c) == per_call)
    if not means:
        return sum(walls_s) / len(walls_s)
    mid = len(means) // 2
    return means[mid] if len(means) % 2 else (means[mid - 1] + means[mid]) / 2


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


def checked_efficiency(ideal_s: float, step_s: float, what: str) -> float:
    """`efficiency`, raising `ImplausibleMeasurement` (naming `what` and both times) above 1."""
    e = efficiency(ideal_s, step_s)
    if e > 1.0:
        raise ImplausibleMeasurement(
            f"{what}: efficiency {e:.4f} > 1 (ideal {ideal_s * 1e3:.3f} ms from standalone action costs, "
            f"measured step {step_s * 1e3:.3f} ms): a step cannot beat its own schedule run at standalone "
            f"speed; the costs or the step are mis-measured (a loaded machine?), not published")
    return e


def checked_overhead_ms(step_s: float, ideal_s: float, actions: int, what: str) -> float:
    """`overhead_ms`, raising `ImplausibleMeasurement` (naming `what`) when negative."""
    o = overhead_ms(step_s, ideal_s, actions)
    if o < 0.0:
        raise ImplausibleMeasurement(
            f"{what}: overhead {o:.4f} ms per action < 0 (step {step_s * 1e3:.3f} ms, ideal "
            f"{ideal_s * 1e3:.3f} ms, {actions} actions): mis-measured, not published")
    return o


# The honest bound's (m + p − 1) is the GPipe/1F1B bubble. ZB-H1 (W fills the bubble) and interleaved
# 1F1B ((p − 1)/v) shrink it by design and may beat it, so it is reported only for these schedules.
HONEST_BOUND_SCHEDULES = ("gpipe", "1f1b", "eager-1f1b")


def honest_base_s(plain1_s: float, m: int, stages_fb_s: float | None = None) -> tuple[float, str]:
    """The 1-core work a perfect pipeline splits, and which it is: ("plain1", plain₁) or, when
    less, ("stages", m × `stages_fb_s`, one microbatch's standalone F + B summed over the stages).

    Example:
        >>> honest_base_s(1.6, 8, 0.19), honest_base_s(1.6, 8, 0.21)
        ((1.52, 'stages'), (1.6, 'plain1'))
    """
    _positive("plain1_s", plain1_s)
    _positive("m", m)
    if stages_fb_s is not None:
        _positive("stages_fb_s", stages_fb_s)
        if m * stages_fb_s < plain1_s:
            return m * stages_fb_s, "stages"
    return plain1_s, "plain1"


def honest_bound_s(plain1_s: float, m: int, p: int, stages_fb_s: float | None = None) -> float:
    """base₁ × (m + p − 1) ÷ (m · p): the step time of a perfect p-stage pipeline of the 1-core
    work (`honest_base_s`: plain₁, or the stage programs' standalone F + B when less; each stage
    1/p of the work per microbatch, m + p − 1 slots)."""
    _positive("p", p)
    return honest_base_s(plain1_s, m, stages_fb_s)[0] * (m + p - 1) / (m * p)


def of_honest_bound(plain1_s: float, m: int, p: int, step_s: float, stages_fb_s: float | None = None) -> float:
    """honest bound ÷ step: throughput against a perfect pipeline of the 1-core work."""
    _positive("step_s", step_s)
    return honest_bound_s(plain1_s, m, p, stages_fb_s) / step_s


def checked_of_honest_bound(plain1_s: float, m: int, p: int, step_s: float, stages_fb_s: float,
                            what: str) -> float:
    """`of_honest_bound`, raising `ImplausibleMeasurement` (naming `what`) above 1: a pipeline
    faster than a perfect pipeline of its own 1-core work is mis-measured, not published."""
    r = of_honest_bound(plain1_s, m, p, step_s, stages_fb_s)
    if r > 1.0:
        raise ImplausibleMeasurement(
            f"{what}: {r:.4f} of the honest bound > 1 (bound {honest_bound_s(plain1_s, m, p, stages_fb_s) * 1e3:.3f} "
            f"ms, step {step_s * 1e3:.3f} ms): a bound that is beaten is mis-measured, not published")
    return r


def fb(costs: Mapping[str, float]) -> float:
    """One microbatch's compute on a stage from per-kind costs: F + B, or F + I + W when split."""
    return costs.get("F", 0.0) + (costs["B"] if "B" in costs else costs.get("I", 0.0) + costs.get("W", 0.0))
