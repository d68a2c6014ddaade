"""Pure model descriptions: parts (pipeline layers), their parameter leaves and outputs.

A `ModelSpec` is what the planner knows about a model without running it: the
sequence of pipeline-able parts (`LayerSpec`; a stage takes a contiguous range of
them), each part's parameter leaves (path, shape, dtype, one logical axis name or
None per dimension) and each part's output leaves (the activation pytree that
crosses a stage edge: per-example shape, dtype, logical axes with `batch` first).
It is built from a `PipelineModel` (`orchestrator.core.model.pipeline`) by shape
evaluation only (`jax.eval_shape`), so `meshpipe plan` needs neither Ray nor
devices; the workers rebuild the model itself from `factory` and `args`.

Nothing here imports jax.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class ParamDef:
    """One parameter leaf: its shape, one logical name (or None) per dimension, its dtype."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    dtype: str = "float32"

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"ParamDef shape {self.shape} and axes {self.axes} differ in rank")


@dataclass(frozen=True)
class LeafSpec:
    """One array leaf of an activation (or the model input / labels).

    `path` is its place in the pytree (jax's key path, e.g. ``['h']`` or ``[0]``; "" for a
    bare array), `shape` the per-example shape (no batch dim), `axes` its logical axes
    including `batch` first.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    axes: tuple[str | None, ...]

    def __post_init__(self):
        if len(self.axes) != len(self.shape) + 1:
            raise ValueError(f"leaf {self.path or '(array)'}: axes {self.axes} must name the batch "
                             f"dim and each of the {len(self.shape)} dims of shape {self.shape}")

    def batched(self, batch: int) -> tuple[int, ...]:
        return (batch, *self.shape)

    def nbytes(self, batch: int) -> int:
        import numpy as np

        return int(np.prod(self.batched(batch), dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class LayerSpec:
    """A pipeline part: its name, its parameter leaves by path, its output leaves.

    `outputs` lists the output pytree's leaves in jax's flatten order; `out_tree` is
    that pytree with `LeafSpec`s as leaves (workers unflatten received leaves with it).
    `paths`: the model attribute paths the part holds, in order (nnx / equinox submodules,
    linen `params` keys; empty for plain JAX), so a split point may name the first one.
    `state`: the part's mutable (non-parameter) state leaves by path (BatchNorm's running
    statistics; checkpointed as `state:<layer>/<path>`), replicated over the stage's mesh.
    """

    name: str
    params: Mapping[str, ParamDef]
    outputs: tuple[LeafSpec, ...]
    out_tree: Any = None
    paths: tuple[str, ...] = ()
    state: Mapping[str, ParamDef] = field(default_factory=dict)

    def state_bytes(self) -> int:
        """Bytes of the part's mutable state (each stage device holds all of it: it is replicated)."""
        return sum(_nbytes(d.shape, d.dtype) for d in self.state.values())

    @property
    def out_axes(self) -> tuple[str | None, ...]:
        """The output's axes when it is a single array (the common case; errors otherwise)."""
        if len(self.outputs) != 1:
            raise ValueError(f"part {self.name!r} outputs {len(self.outputs)} leaves, not one array")
        return self.outputs[0].axes

    @property
    def out_shape(self) -> tuple[int, ...]:
        if len(self.outputs) != 1:
            raise ValueError(f"part {self.name!r} outputs {len(self.outputs)} leaves, not one array")
        return self.outputs[0].shape


@dataclass(frozen=True)
class ModelSpec:
    """A whole model as data.

    Attributes:
      name: model name (`mlp`, `gpt`, or the factory's import path).
      layers: the parts in order; pipeline stages take contiguous ranges.
      factory: "package.module:function" that builds the `PipelineModel` from `args`;
        the workers call it again to get the jax functions.
      input / label: one example's input and label (single arrays).
      vocab: for token inputs, the vocabulary size the data source draws ids below (0: none).
      args: the factory's keyword arguments.
      compute_dtype: the dtype parts compute in and floating activations cross in
        (`orchestrator.core.model.policy`); parameters stay float32.
      ties: tied parameters, each ((layer, leaf path), (layer, leaf path)) with the first side
        earlier: two copies of one array (e.g. a GPT's token embedding and its unembedding),
        initialised equal; their gradients are summed at the step's end (`stages.ties`).
    """

    name: str
    layers: tuple[LayerSpec, ...]
    factory: str
    input: LeafSpec
    label: LeafSpec
    vocab: int = 0
    args: Mapping[str, Any] = field(default_factory=dict)
    compute_dtype: str = "float32"
    ties: tuple = ()

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def impl(self) -> str:
        return self.factory

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.input.shape

    @property
    def input_dtype(self) -> str:
        return self.input.dtype

    @property
    def input_axes(self) -> tuple[str | None, ...]:
        return self.input.axes

    @property
    def label_shape(self) -> tuple[int, ...]:
        return self.label.shape

    @property
    def label_dtype(self) -> str:
        return self.label.dtype

    def logical_axes(self) -> set[str]:
        """Every logical axis name used by a parameter or an activation."""
        names: set[str] = {a for a in self.input.axes if a}
        for layer in self.layers:
            for leaf in layer.outputs:
                names.update(a for a in leaf.axes if a)
            for p in layer.params.values():
                names.update(a for a in p.axes if a)
        return names

    def param_count(self, start: int = 0, stop: int | None = None) -> int:
        """Parameter elements held by layers [start, stop): each copy of a tied array counts
        where it is held (it is memory there); `unique_param_count` counts the model's own."""
        total = 0
        for layer in self.layers[start:stop]:
            for p in layer.params.values():
                n = 1
                for d in p.shape:
                    n *= d
                total += n
        return total


    def unique_param_count(self) -> int:
        """The model's parameters, each tied array once (its later copy left out)."""
        dup = 0
        for _, (layer, path) in self.ties:
            n = 1
            for d in self.layers[layer].params[path].shape:
                n *= d
            dup += n
        return self.param_count() - dup

    def tie_groups(self) -> list[dict]:
        """Per tie: the two parameter names, the layers holding them, the array's shape, dtype and
        bytes (each copy is that many bytes, on the stage holding its layer)."""
        out = []
        for (la, pa), (lb, pb) in self.ties:
            d = self.layers[la].params[pa]
            out.append({"params": [param_name(la, self.layers[la], pa), param_name(lb, self.layers[lb], pb)],
                        "layers": [la, lb], "shape": list(d.shape), "dtype": d.dtype,
                        "bytes": _nbytes(d.shape, d.dtype)})
        return out


def _nbytes(shape, dtype: str) -> int:
    import numpy as np

    try:
        itemsize = np.dtype(dtype).itemsize
    except TypeError:       # bfloat16 and friends: ml_dtypes (jax's own)
        import ml_dtypes

        itemsize = np.dtype(getattr(ml_dtypes, dtype)).itemsize
    n = 1
    for d in shape:
        n *= int(d)
    return n * itemsize


def param_name(layer_index: int, layer: LayerSpec, param: str) -> str:
    """The stable name of a parameter leaf, e.g. `03.block2/wq` (used in summary.json)."""
    return f"{layer_index:02d}.{layer.name}/{param}"
