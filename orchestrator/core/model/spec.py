"""Pure model descriptions: layers, parameter shapes and their logical axis names.

A model is a list of layers. Each layer declares its parameters as `ParamDef`s
(shape, logical axis names, initialiser) and names the logical axes of the
activation it produces. Nothing here imports jax: the driver validates a job
(layer ranges, layout divisibility) and plans from these descriptions alone.
The jax code that applies a layer lives beside each model (`stages/models/`)
and is found through `ModelSpec.impl`, an import path resolved on the workers.

Logical axis names used by the built-in models:
  batch, seq, embed, heads, head_dim, mlp, vocab, in, out.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class ParamDef:
    """One parameter: its shape, one logical name (or None) per dimension, its init.

    init is "normal" (scaled by `scale`), "zeros" or "ones".
    """

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: str = "normal"
    scale: float = 0.02

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"ParamDef shape {self.shape} and axes {self.axes} differ in rank")


@dataclass(frozen=True)
class LayerSpec:
    """A layer: a name, a kind its model's implementation knows, its parameters.

    `out_axes` names the output activation's dims (batch first); `out_shape` is
    its per-example shape (everything after the batch dim).
    """

    name: str
    kind: str
    params: Mapping[str, ParamDef]
    out_axes: tuple[str | None, ...]
    out_shape: tuple[int, ...] = ()


@dataclass(frozen=True)
class ModelSpec:
    """A whole model as data.

    Attributes:
      name: model name (`mlp`, `gpt`, or the factory's import path).
      layers: the layers in order; pipeline stages take contiguous ranges.
      impl: "package.module:function" returning the jax implementation
        (`stages.models.base.ModelImpl`) for this spec; imported on workers only.
      input_shape / input_dtype / input_axes: one example's input (no batch dim
        in the shape; axes include `batch` first).
      label_shape / label_dtype: one example's label.
      args: the resolved model arguments (sizes).
    """

    name: str
    layers: tuple[LayerSpec, ...]
    impl: str
    input_shape: tuple[int, ...]
    input_dtype: str
    input_axes: tuple[str | None, ...]
    label_shape: tuple[int, ...]
    label_dtype: str
    args: Mapping[str, Any] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def logical_axes(self) -> set[str]:
        """Every logical axis name used by a parameter or an activation."""
        names: set[str] = {a for a in self.input_axes if a}
        for layer in self.layers:
            names.update(a for a in layer.out_axes if a)
            for p in layer.params.values():
                names.update(a for a in p.axes if a)
        return names

    def param_count(self, start: int = 0, stop: int | None = None) -> int:
        total = 0
        for layer in self.layers[start:stop]:
            for p in layer.params.values():
                n = 1
                for d in p.shape:
                    n *= d
                total += n
        return total


def param_name(layer_index: int, layer: LayerSpec, param: str) -> str:
    """The stable name of a parameter leaf, e.g. `03.block2/wq` (used in summary.json)."""
    return f"{layer_index:02d}.{layer.name}/{param}"
