"""Adapter: today's `ModelSpec` (orchestrator.core.model) → the planner's `PlanModel`. Pure.

The one module that knows both sides; when the model front-end changes, re-point
`from_spec` (and the worker's `build_layer`, `stages.aot_profile`) and nothing else.
A layer's signature covers what its compiled program depends on: its kind, its
parameters' shapes and axes, its input and output shapes and whether it is the
first layer (takes tokens, no input gradient) or the last (computes the loss), and its
parameters' dtypes, its output's itemsize and mutable state where they are not plain
float32 / absent. Each layer's mutable state bytes (`LayerSpec.state_bytes`) go into
`PlanLayer.state_bytes`, which the search's memory sum counts (`orchestrator.core.memory`);
its output's itemsize (the job's compute dtype for floating outputs) sizes its stage edge.
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Optional

from orchestrator.core.edges import leaf_dtype
from orchestrator.core.model.policy import with_compute_dtype
from orchestrator.core.model.registry import build_spec
from orchestrator.core.model.spec import ModelSpec
from orchestrator.core.planner.model import ParamInfo, PlanLayer, PlanModel, signature_of

__all__ = ["from_spec", "from_job"]


def from_spec(spec: ModelSpec, model_name: str, model_args: Mapping[str, Any],
              seq_len: Optional[int]) -> PlanModel:
    """The `PlanModel` of a `ModelSpec` built from (model_name, model_args, seq_len)."""
    layers = []
    n = spec.num_layers
    for i, layer in enumerate(spec.layers):
        params = tuple(ParamInfo(name, tuple(p.shape), tuple(p.axes), leaf_dtype(p.dtype).itemsize)
                       for name, p in sorted(layer.params.items()))   # a tied array's copy is one of them
        in_shape = spec.input_shape if i == 0 else spec.layers[i - 1].out_shape
        in_axes = spec.input_axes if i == 0 else spec.layers[i - 1].out_axes
        act = leaf_dtype(layer.outputs[0].dtype).itemsize if len(layer.outputs) == 1 else 4
        kind = re.sub(r"\d+", "#", layer.name)   # block0, block1, ...: one program when shapes agree
        sig = signature_of({"model": spec.name, "factory": spec.factory, "kind": kind,
                            "params": [(p.name, p.shape, p.axes) for p in params],
                            "in": (tuple(in_shape), tuple(in_axes)), "out": (tuple(layer.out_shape), layer.out_axes),
                            "first": i == 0, "last": i == n - 1, "label": tuple(spec.label_shape),
                            **({"dtypes": [p.itemsize for p in params]} if any(p.itemsize != 4 for p in params) else {}),
                            **({"out_itemsize": act} if act != 4 else {}),
                            **({"state": sorted((k, tuple(d.shape), d.dtype) for k, d in layer.state.items())}
                               if layer.state else {})})
        layers.append(PlanLayer(i, layer.name, params, tuple(layer.out_axes), tuple(layer.out_shape), act, sig,
                                layer.state_bytes()))
    source = {"kind": "modelspec", "name": model_name, "args": dict(model_args), "seq_len": seq_len,
              **({"compute": spec.compute_dtype} if spec.compute_dtype != "float32" else {})}
    return PlanModel(spec.name, tuple(layers), tuple(spec.input_axes), source)


def from_job(job) -> PlanModel:
    """The `PlanModel` of a `JobConfig`'s model, its activations in the job's compute dtype
    (what crosses a stage edge: bfloat16 halves the bytes)."""
    spec = with_compute_dtype(build_spec(job.model.ref, job.model.args, seq_len=job.data.seq_len),
                              job.precision.compute)
    return from_spec(spec, job.model.ref, job.model.args, job.data.seq_len)
