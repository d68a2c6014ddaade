"""The jax side of a model: parameter init from `ParamDef`s and the `ModelImpl` pair.

`init_layer(layer, key)` is deterministic in (run seed, layer index) only, so a
stage worker and the single-process reference produce identical parameters no
matter how they are sharded (jax's partitionable threefry keeps values
independent of the output sharding).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp

from orchestrator.core.model.spec import LayerSpec, ModelSpec


@dataclass(frozen=True)
class ModelImpl:
    """apply(layer, params, x) -> y for one layer; loss(y, labels) -> scalar mean."""

    apply: Callable[[LayerSpec, dict, jax.Array], jax.Array]
    loss: Callable[[jax.Array, jax.Array], jax.Array]


def layer_key(seed: int, layer_index: int) -> jax.Array:
    return jax.random.fold_in(jax.random.key(seed), layer_index)


def init_layer(layer: LayerSpec, key: jax.Array) -> dict[str, jax.Array]:
    out = {}
    for i, (name, p) in enumerate(sorted(layer.params.items())):
        if p.init == "zeros":
            out[name] = jnp.zeros(p.shape, jnp.float32)
        elif p.init == "ones":
            out[name] = jnp.ones(p.shape, jnp.float32)
        elif p.init == "normal":
            out[name] = p.scale * jax.random.normal(jax.random.fold_in(key, i), p.shape, jnp.float32)
        else:
            raise ValueError(f"unknown init {p.init!r} for parameter {layer.name}/{name}")
    return out


def load_impl(spec: ModelSpec) -> ModelImpl:
    from orchestrator.core.model.registry import resolve

    return resolve(spec.impl)(spec)
