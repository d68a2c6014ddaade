"""A small Llama-style decoder in flax.nnx, and its meshpipe adapter (the last function).

The model is ordinary nnx code: RMSNorm, rotary positions, grouped-query attention
(fewer key/value heads than query heads), SwiGLU MLP, untied LM head. Its parameters
carry logical axis names through `nnx.with_partitioning`; the job's `layout:` maps
them to mesh axes. Nothing in the model knows about meshpipe.

`pipeline(...)` is the adapter a job names (`model: {factory: "examples.llama_model:pipeline"}`):
it says how the model splits (embedding, each block, final norm + head) and what the
loss is. That is all meshpipe needs.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def _dense(d_in, d_out, axes, rngs, scale=1.0):
    init = nnx.initializers.variance_scaling(scale, "fan_in", "normal")
    return nnx.Linear(d_in, d_out, use_bias=False, kernel_init=nnx.with_partitioning(init, axes), rngs=rngs)


def rotary(x, base: float = 10000.0):
    """Rotary position embedding over the last dim of x: (batch, seq, heads, head_dim)."""
    seq, hd = x.shape[1], x.shape[-1]
    freq = base ** (-jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
    angle = jnp.arange(seq, dtype=jnp.float32)[:, None] * freq[None, :]
    cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
    x1, x2 = x[..., ::2], x[..., 1::2]
    out = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, d, heads, kv_heads, rngs):
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.q = _dense(d, heads * self.hd, ("embed", "heads"), rngs)
        self.k = _dense(d, kv_heads * self.hd, ("embed", "kv_heads"), rngs)
        self.v = _dense(d, kv_heads * self.hd, ("embed", "kv_heads"), rngs)
        self.o = _dense(heads * self.hd, d, ("heads", "embed"), rngs, scale=0.5)

    def __call__(self, x):
        b, s, _ = x.shape
        q = rotary(self.q(x).reshape(b, s, self.heads, self.hd))
        k = rotary(self.k(x).reshape(b, s, self.kv_heads, self.hd))
        v = self.v(x).reshape(b, s, self.kv_heads, self.hd)
        group = self.heads // self.kv_heads
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        scores = jnp.einsum("bqhk,bthk->bhqt", q, k) / jnp.sqrt(jnp.float32(self.hd)).astype(q.dtype)
        causal = jnp.tril(jnp.ones((s, s), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        w = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
        return self.o(jnp.einsum("bhqt,bthk->bqhk", w, v).reshape(b, s, -1))


class Block(nnx.Module):
    def __init__(self, d, heads, kv_heads, d_mlp, rngs):
        self.attn_norm = nnx.RMSNorm(d, scale_init=nnx.with_partitioning(nnx.initializers.ones, ("embed",)),
                                     rngs=rngs)
        self.attn = Attention(d, heads, kv_heads, rngs)
        self.mlp_norm = nnx.RMSNorm(d, scale_init=nnx.with_partitioning(nnx.initializers.ones, ("embed",)),
                                    rngs=rngs)
        self.gate = _dense(d, d_mlp, ("embed", "mlp"), rngs)
        self.up = _dense(d, d_mlp, ("embed", "mlp"), rngs)
        self.down = _dense(d_mlp, d, ("mlp", "embed"), rngs, scale=0.5)

    def __call__(self, x):
        x = x + self.attn(self.attn_norm(x))
        h = self.mlp_norm(x)
        return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class Llama(nnx.Module):
    def __init__(self, vocab, d, heads, kv_heads, d_mlp, blocks, rngs):
        self.embed = nnx.Embed(vocab, d, embedding_init=nnx.with_partitioning(
            nnx.initializers.normal(0.02), ("vocab", "embed")), rngs=rngs)
        self.blocks = nnx.List([Block(d, heads, kv_heads, d_mlp, rngs) for _ in range(blocks)])
        self.norm = nnx.RMSNorm(d, scale_init=nnx.with_partitioning(nnx.initializers.ones, ("embed",)), rngs=rngs)
        self.lm_head = _dense(d, vocab, ("embed", "vocab"), rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def next_token_loss(logits, labels):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0])


# ----------------------------------------------------------------------------- the meshpipe adapter

def pipeline(vocab=64, d_model=32, heads=4, kv_heads=2, d_mlp=64, blocks=2, seq_len=16):
    """The Llama above as a meshpipe PipelineModel: parts embed, blocks.0 … blocks.{n-1}, head."""
    from meshpipe import nnx_model

    def make(rngs):
        return Llama(vocab, d_model, heads, kv_heads, d_mlp, blocks, rngs)

    parts = ["embed", *[f"blocks.{i}" for i in range(blocks)],
             ("head", ("norm", "lm_head"), lambda norm, head, x: head(norm(x)))]
    return nnx_model(make, parts, loss=next_token_loss,
                     input=((seq_len,), "int32", ("batch", "seq")), label=((seq_len,), "int32", ("batch", "seq")),
                     out_axes=[("head/*", ("batch", "seq", "vocab")), ("*", ("batch", "seq", "embed"))],
                     vocab=vocab)
