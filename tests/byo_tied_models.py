"""Model factories with tied weights for `tests.test_byo_ties`.

`tied_llama`: the example nnx Llama (examples/llama_model.py), unchanged, with its unembedding
tied to its token embedding: the head part names the embedding module too and calls
`embed.attend` (the Llama's own `lm_head` is then used by no part). The nnx adapter sees the
`embed` path in two parts and ties its Param leaves. `plain_tied(bad=...)`: a plain-JAX model
with an explicit `ties=` entry, broken on request for the plan-time errors.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def tied_head(norm, embed, x):
    return embed.attend(norm(x))


def tied_llama(vocab=64, d_model=32, heads=4, kv_heads=2, d_mlp=64, blocks=2, seq_len=16):
    from examples.llama_model import Llama, next_token_loss
    from orchestrator.core.model.adapters import nnx_model

    def make(rngs):
        return Llama(vocab, d_model, heads, kv_heads, d_mlp, blocks, rngs)

    parts = ["embed", *[f"blocks.{i}" for i in range(blocks)], ("head", ("norm", "embed"), tied_head)]
    return nnx_model(make, parts, loss=next_token_loss,
                     input=((seq_len,), "int32", ("batch", "seq")), label=((seq_len,), "int32", ("batch", "seq")),
                     out_axes=[("head/*", ("batch", "seq", "vocab")), ("*", ("batch", "seq", "embed"))],
                     vocab=vocab)


def plain_tied(bad: str = "", **_):
    """in: x @ w; out: h @ w.T with w tied ("in/w", "out/w"). `bad`: "unknown", "shape", "self", "twice"."""
    from orchestrator.core.model.adapters import plain

    def init(key):
        w = jax.random.normal(key, (8, 4)) / 8 ** 0.5
        return {"in": {"w": w}, "out": {"w": w, "v": w[:, :2]}}

    ties = {"": [("in/w", "out/w")], "unknown": [("in/w", "out/q")], "shape": [("in/w", "out/v")],
            "self": [("in/w", "in/w")], "twice": [("in/w", "out/w"), ("out/w", "in/w")]}[bad]
    return plain(init, [("in", lambda p, x: jnp.tanh(x @ p["w"])), ("out", lambda p, h: h @ p["w"].T + 0 * p["v"].sum())],
                 loss=lambda y, t: jnp.mean((y - t) ** 2), input=((8,), "float32"), label=((8,), "float32"),
                 ties=ties)
