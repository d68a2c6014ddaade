"""What the planner needs to know about a model: a small, explicit interface. Pure.

A `PlanModel` is a list of `PlanLayer`s in pipeline order. Each layer names its
parameters (shape, logical axes, bytes per element), the logical axes and
per-example shape of the activation it produces, its mutable state's bytes
(BatchNorm statistics; replicated, so every device of its stage holds all of it), and a `signature`: layers with
equal signatures compile to the same program (all blocks of a GPT), so their
profiles are shared. `source` is a JSON-able description from which the
profiling worker (a subprocess, `stages.aot_profile` today) rebuilds the layer's
jitted forward/backward for a mesh, a layout and a microbatch size.

Only `adapter.py` knows how a `ModelSpec` maps onto this; re-point it there when
the model front-end changes.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["ParamInfo", "PlanLayer", "PlanModel"]


@dataclass(frozen=True)
class ParamInfo:
    """One parameter: name, shape, a logical name (or None) per dim, bytes per element."""

    name: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    itemsize: int = 4

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class PlanLayer:
    """One pipeline-able layer (see the module docstring)."""

    index: int
    name: str
    params: tuple[ParamInfo, ...]
    out_axes: tuple[str | None, ...]
    out_shape: tuple[int, ...]        # per example (no batch dim)
    out_itemsize: int = 4
    signature: str = ""
    state_bytes: int = 0              # mutable (non-parameter) state, replicated on every stage device

    @property
    def param_bytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    def logical_axes(self) -> frozenset[str]:
        names = {a for p in self.params for a in p.axes if a}
        return frozenset(names | {a for a in self.out_axes if a})

    def out_bytes(self, batch: int) -> int:
        return batch * math.prod(self.out_shape) * self.out_itemsize


@dataclass(frozen=True)
class PlanModel:
    """A model for planning: layers, the input's axes, and how the worker rebuilds it."""

    name: str
    layers: tuple[PlanLayer, ...]
    input_axes: tuple[str | None, ...]
    source: Mapping[str, Any]         # JSON-able; what the profiling worker needs

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def logical_axes(self) -> frozenset[str]:
        out: set[str] = {a for a in self.input_axes if a}
        for layer in self.layers:
            out |= layer.logical_axes()
        return frozenset(out)


def signature_of(payload: Any) -> str:
    """A short stable hash of a JSON-able payload."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]
