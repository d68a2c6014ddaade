"""Models whose pipeline parts include parameters held directly by the model (no submodule around
them): a flax.nnx Llama with top-level `embed` and `unembed` `nnx.Param`s, a flax.linen MLP with a
top-level `self.param` output matrix, an equinox MLP with array fields. Written the way a user
writes them, with nothing meshpipe-specific in the classes; the factories (`*_pipeline`) are the
adapters a job names. tests/test_byo_params.py checks them against their own whole-model training.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

D_IN, D_OUT = 8, 4
OUT_AXES = [("out/*", ("batch", None)), ("*", ("batch", "embed"))]


# ----------------------------------------------------------------------------- flax.nnx

def _nnx_llama_class():
    from flax import nnx

    from examples.llama_model import Block

    class ParamLlama(nnx.Module):
        """A Llama whose embedding and unembedding are plain parameters of the model itself."""

        def __init__(self, vocab, d, heads, kv_heads, d_mlp, blocks, rngs):
            self.embed = nnx.Param(0.02 * jax.random.normal(rngs.params(), (vocab, d)),
                                   out_sharding=("vocab", "embed"))
            self.blocks = nnx.List([Block(d, heads, kv_heads, d_mlp, rngs) for _ in range(blocks)])
            self.norm = nnx.RMSNorm(d, scale_init=nnx.with_partitioning(nnx.initializers.ones, ("embed",)),
                                    rngs=rngs)
            self.unembed = nnx.Param(jax.random.normal(rngs.params(), (d, vocab)) / jnp.sqrt(d),
                                     out_sharding=("embed", "vocab"))

        def __call__(self, tokens):
            x = self.embed[...][tokens]
            for block in self.blocks:
                x = block(x)
            return self.norm(x) @ self.unembed

    return ParamLlama


def nnx_llama_make(vocab=64, d_model=32, heads=4, kv_heads=2, d_mlp=64, blocks=2):
    cls = _nnx_llama_class()
    return lambda rngs: cls(vocab, d_model, heads, kv_heads, d_mlp, blocks, rngs)


def nnx_llama_pipeline(vocab=64, d_model=32, heads=4, kv_heads=2, d_mlp=64, blocks=2, seq_len=16):
    """Parts: embed (the top-level Param), blocks.0 … blocks.{n-1}, head (norm + the top-level unembed)."""
    from orchestrator.core.model.adapters import nnx_model

    from examples.llama_model import next_token_loss

    parts = [("embed", "embed", lambda table, tokens: table[...][tokens]),
             *[f"blocks.{i}" for i in range(blocks)],
             ("head", ("norm", "unembed"), lambda norm, w, x: norm(x) @ w)]
    return nnx_model(nnx_llama_make(vocab, d_model, heads, kv_heads, d_mlp, blocks), parts, loss=next_token_loss,
                     input=((seq_len,), "int32", ("batch", "seq")), label=((seq_len,), "int32", ("batch", "seq")),
                     out_axes=[("head/*", ("batch", "seq", "vocab")), ("*", ("batch", "seq", "embed"))],
                     vocab=vocab)


# ----------------------------------------------------------------------------- flax.linen

def _linen_class():
    import flax.linen as nn

    class ParamMLP(nn.Module):
        d: int = 16
        blocks: int = 2

        def setup(self):
            part = nn.with_logical_partitioning
            self.inp = nn.Dense(self.d, kernel_init=part(nn.initializers.lecun_normal(), (None, "embed")))
            self.body = [nn.Dense(self.d, kernel_init=part(nn.initializers.lecun_normal(), ("embed", "mlp")))
                         for _ in range(self.blocks)]
            self.w_out = self.param("w_out", part(nn.initializers.lecun_normal(), ("mlp", None)), (self.d, D_OUT))

        def __call__(self, x):
            h = self.inp(x)
            for b in self.body:
                h = h + jnp.tanh(b(h))
            return h @ self.w_out

    return ParamMLP


def linen_module(d=16, blocks=2):
    return _linen_class()(d=d, blocks=blocks)


def linen_pipeline(d=16, blocks=2):
    from orchestrator.core.model.adapters import linen_model

    from tests.byo_models import mse

    parts = ([("in", ("inp",), lambda m, x: m.inp(x))]
             + [(f"block{i}", (f"body_{i}",), lambda m, x, i=i: x + jnp.tanh(m.body[i](x))) for i in range(blocks)]
             + [("out", ("w_out",), lambda m, x: x @ m.w_out)])
    return linen_model(linen_module(d, blocks), parts, loss=mse, input=((D_IN,), "float32"),
                       label=((D_OUT,), "float32"), out_axes=OUT_AXES)


# ----------------------------------------------------------------------------- equinox

def _eqx_class():
    import equinox as eqx

    class ArrayMLP(eqx.Module):
        w_in: jax.Array
        blocks: list
        w_out: jax.Array

        def __init__(self, d, blocks, key):
            ks = jax.random.split(key, blocks + 2)
            self.w_in = jax.random.normal(ks[0], (D_IN, d)) / jnp.sqrt(D_IN)
            self.blocks = [eqx.nn.Linear(d, d, key=k) for k in ks[1:-1]]
            self.w_out = jax.random.normal(ks[-1], (d, D_OUT)) / jnp.sqrt(d)

        def __call__(self, x):       # one example, equinox's convention
            h = jnp.tanh(x @ self.w_in)
            for b in self.blocks:
                h = h + jnp.tanh(b(h))
            return h @ self.w_out

    return ArrayMLP


def eqx_make(d=16, blocks=2):
    cls = _eqx_class()
    return lambda key: cls(d, blocks, key)


def eqx_pipeline(d=16, blocks=2):
    from orchestrator.core.model.adapters import eqx_model

    from tests.byo_models import mse

    parts = [("in", "w_in", lambda w, x: jnp.tanh(x @ w)),
             *[(f"blocks.{i}", f"blocks.{i}", lambda b, x: x + jnp.tanh(jax.vmap(b)(x))) for i in range(blocks)],
             ("out", "w_out", lambda w, x: x @ w)]
    return eqx_model(eqx_make(d, blocks), parts, loss=mse, input=((D_IN,), "float32"), label=((D_OUT,), "float32"),
                     axes=[("w_in", (None, "embed")), ("blocks.*/weight", ("mlp", "embed")), ("w_out", ("embed", None))],
                     out_axes=OUT_AXES)
