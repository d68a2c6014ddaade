"""jax code of the small GPT (`gpt.py` describes its layers).

Attention is causal multi-head, heads sharded along `heads`; the MLP hidden
dimension along `mlp`; logits along `vocab`. Activations are constrained to
(batch, seq, embed) between layers so GSPMD keeps the layout the job asked for.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from stages.models.base import ModelImpl
from stages.sharding import constrain
from orchestrator.core.model.spec import LayerSpec, ModelSpec

ACT = ("batch", "seq", "embed")


def _rms(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def _attention(p, x):
    q = jnp.einsum("bsd,dhk->bshk", x, p["wq"])
    k = jnp.einsum("bsd,dhk->bshk", x, p["wk"])
    v = jnp.einsum("bsd,dhk->bshk", x, p["wv"])
    q = constrain(q, ("batch", "seq", "heads", "head_dim"))
    scores = jnp.einsum("bqhk,bthk->bhqt", q, k) / jnp.sqrt(jnp.float32(q.shape[-1]))
    seq = x.shape[1]
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    scores = jnp.where(causal, scores, jnp.float32(-1e30))
    w = jax.nn.softmax(scores, axis=-1)
    o = jnp.einsum("bhqt,bthk->bqhk", w, v)
    return jnp.einsum("bshk,hkd->bsd", o, p["wo"])


def apply(layer: LayerSpec, p: dict, x: jax.Array) -> jax.Array:
    if layer.kind == "embed":
        h = jnp.take(p["tok"], x, axis=0) + p["pos"][None, : x.shape[1]]
        return constrain(h, ACT)
    if layer.kind == "block":
        x = constrain(x + _attention(p, _rms(x, p["ln1"])), ACT)
        h = constrain(jax.nn.gelu(_rms(x, p["ln2"]) @ p["w1"]), ("batch", "seq", "mlp"))
        return constrain(x + h @ p["w2"], ACT)
    if layer.kind == "head":
        return constrain(_rms(x, p["lnf"]) @ p["unembed"], ("batch", "seq", "vocab"))
    raise ValueError(f"gpt has no layer kind {layer.kind!r}")


def loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    return -jnp.mean(picked)


def impl(spec: ModelSpec) -> ModelImpl:
    return ModelImpl(apply=apply, loss=loss)
