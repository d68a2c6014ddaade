"""A small decoder in equinox, and its meshpipe adapter (the last function).

The model is ordinary equinox code, per example as equinox writes it (a token
sequence in, logits out; `jax.vmap` over the batch is the caller's): RMSNorm,
causal `eqx.nn.MultiheadAttention` with rotary positions, an `eqx.nn.MLP`, an
untied LM head. Nothing in the model knows about meshpipe.

`pipeline(...)` is the adapter a job names (`model: {factory: "examples.eqx_model:pipeline"}`):
how the model splits (embedding, each block, final norm + head), the loss, and
logical axes by parameter path (equinox has no partitioning metadata), which the
job's `layout:` maps to mesh axes.
"""
from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp


class Block(eqx.Module):
    attn_norm: eqx.nn.RMSNorm
    attn: eqx.nn.MultiheadAttention
    rope: eqx.nn.RotaryPositionalEmbedding
    mlp_norm: eqx.nn.RMSNorm
    mlp: eqx.nn.MLP

    def __init__(self, d, heads, d_mlp, key):
        k1, k2 = jax.random.split(key)
        self.attn_norm = eqx.nn.RMSNorm(d)
        self.attn = eqx.nn.MultiheadAttention(heads, d, key=k1)
        self.rope = eqx.nn.RotaryPositionalEmbedding(d // heads)
        self.mlp_norm = eqx.nn.RMSNorm(d)
        self.mlp = eqx.nn.MLP(d, d, d_mlp, 1, activation=jax.nn.gelu, key=k2)

    def __call__(self, x):                       # x: (seq, d)
        def rotate(q, k, v):                     # (seq, heads, head_dim): rotary over each head
            turn = jax.vmap(self.rope, in_axes=1, out_axes=1)
            return turn(q), turn(k), v

        h = jax.vmap(self.attn_norm)(x)
        causal = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), dtype=bool))
        x = x + self.attn(h, h, h, mask=causal, process_heads=rotate)
        return x + jax.vmap(self.mlp)(jax.vmap(self.mlp_norm)(x))


class Decoder(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list
    norm: eqx.nn.RMSNorm
    head: eqx.nn.Linear

    def __init__(self, vocab, d, heads, d_mlp, blocks, key):
        keys = jax.random.split(key, blocks + 2)
        self.embed = eqx.nn.Embedding(vocab, d, key=keys[0])
        self.blocks = [Block(d, heads, d_mlp, k) for k in keys[1:-1]]
        self.norm = eqx.nn.RMSNorm(d)
        self.head = eqx.nn.Linear(d, vocab, use_bias=False, key=keys[-1])

    def __call__(self, tokens):                  # tokens: (seq,) int32 -> logits (seq, vocab)
        x = jax.vmap(self.embed)(tokens)
        for block in self.blocks:
            x = block(x)
        return jax.vmap(lambda v: self.head(self.norm(v)))(x)


def next_token_loss(logits, labels):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0])


# ----------------------------------------------------------------------------- the meshpipe adapter

def pipeline(vocab=64, d_model=32, heads=4, d_mlp=64, blocks=2, seq_len=16):
    """The Decoder above as a meshpipe PipelineModel: parts embed, blocks.0 … blocks.{n-1}, head."""
    from meshpipe import eqx_model

    def make(key):
        return Decoder(vocab, d_model, heads, d_mlp, blocks, key)

    # a block is applied per example (vmapped by the adapter); embed and head are per token
    parts = [("embed", "embed", lambda embed, x: jax.vmap(jax.vmap(embed))(x)),
             *[f"blocks.{i}" for i in range(blocks)],
             ("head", ("norm", "head"), lambda norm, head, x: jax.vmap(jax.vmap(lambda v: head(norm(v))))(x))]
    axes = [("embed/weight", ("vocab", "embed")), ("head/weight", ("vocab", "embed")),
            ("*/attn/output_proj/weight", ("embed", "heads")), ("*/attn/*_proj/weight", ("heads", "embed")),
            ("*/mlp/layers/0/weight", ("mlp", "embed")), ("*/mlp/layers/0/bias", ("mlp",)),
            ("*/mlp/layers/1/weight", ("embed", "mlp"))]
    return eqx_model(make, parts, loss=next_token_loss, input=((seq_len,), "int32", ("batch", "seq")),
                     label=((seq_len,), "int32", ("batch", "seq")), axes=axes, vocab=vocab,
                     out_axes=[("head/*", ("batch", "seq", "vocab")), ("*", ("batch", "seq", "embed"))])
