"""jax code of the residual MLP (`mlp.py` describes its layers)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from stages.models.base import ModelImpl
from stages.sharding import constrain
from orchestrator.core.model.spec import LayerSpec, ModelSpec


def _rms(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def apply(layer: LayerSpec, p: dict, x: jax.Array) -> jax.Array:
    if layer.kind == "in":
        return constrain(x @ p["w"] + p["b"], ("batch", "embed"))
    if layer.kind == "block":
        h = constrain(jax.nn.gelu(_rms(x, p["scale"]) @ p["w1"] + p["b1"]), ("batch", "mlp"))
        return constrain(x + h @ p["w2"], ("batch", "embed"))
    if layer.kind == "out":
        return x @ p["w"]
    raise ValueError(f"mlp has no layer kind {layer.kind!r}")


def loss(y: jax.Array, labels: jax.Array) -> jax.Array:
    return jnp.mean(jnp.square(y - labels))


def impl(spec: ModelSpec) -> ModelImpl:
    return ModelImpl(apply=apply, loss=loss)
