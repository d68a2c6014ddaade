"""Per-device memory of a pipeline stage: the one sum `meshpipe plan` and `plan --auto` both use. Pure.

A stage device holds, in bytes:

    params × (2 + optimizer slots)      its shard of every parameter its layers hold (a tied
                                        array's copy counts on each stage holding one: it is an
                                        array there), the gradient accumulator, the optimizer state
  + state                               the parts' mutable state (BatchNorm statistics, ...):
                                        replicated, all of it on every device
  + in-flight × activations             what one microbatch keeps between its F and its B
                                        (residuals), times the schedule's microbatches in flight
  + temp                                the largest temporary buffer of any of its programs

`meshpipe plan` (`config.limits.stage_memory`) calls it as a lower bound (no optimizer slots,
one microbatch of the stage's outputs, no temporaries); the auto-planner
(`planner.search`) with its compiled figures. Works on floats and numpy arrays alike.
"""
from __future__ import annotations

from typing import Mapping

__all__ = ["device_bytes", "optimizer_slots"]


def device_bytes(params, state, activations, *, slots=0, inflight=1, temp=0):
    """The module docstring's sum.

    Example:
        >>> device_bytes(100, 10, 5, slots=2, inflight=3, temp=7)
        432
    """
    return params * (2 + slots) + state + inflight * activations + temp


def optimizer_slots(name: str, args: Mapping[str, object] | None = None) -> int:
    """Per-parameter state arrays of an optax optimizer (sgd 0, momentum 1, adam-like 2)."""
    args = args or {}
    if name == "sgd":
        return 1 if args.get("momentum") else 0
    if name in ("adagrad", "rmsprop", "sm3", "lion", "adafactor"):
        return 1
    return 2
