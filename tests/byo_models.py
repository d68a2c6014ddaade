"""Model factories the bring-your-own-model tests name in their jobs (`tests.byo_models:...`).

`pytree_mlp` is a plain-JAX model whose activations are a dict of a float32 hidden
state and an int32 counter (a non-differentiable leaf that crosses stages); its
whole-model functions (`pytree_init`, `pytree_forward`) are what the test oracle
differentiates. The others are deliberately broken factories for plan-time errors.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from orchestrator.core.model.adapters import plain

D_IN, D_OUT = 8, 4
OUT_AXES = [("out/*", ("batch", None)), ("*", ("batch", "embed"))]


def pytree_init(key, d=16, blocks=2):
    ks = jax.random.split(key, blocks + 2)
    out = {"in": {"w": jax.random.normal(ks[0], (D_IN, d)) / D_IN ** 0.5, "b": jnp.zeros((d,))}}
    for i in range(blocks):
        out[f"block{i}"] = {"w": jax.random.normal(ks[i + 1], (d, d)) / d ** 0.5, "g": jnp.ones((d,))}
    out["out"] = {"w": jax.random.normal(ks[-1], (d, D_OUT)) / d ** 0.5}
    return out


def first(p, x):
    return {"h": jnp.tanh(x @ p["w"] + p["b"]), "count": jnp.ones((x.shape[0], 1), jnp.int32)}


def block(p, a):
    # the integer leaf changes the math, so a wrong count on the wire changes the result
    scale = a["count"].astype(jnp.float32) * 0.5
    return {"h": a["h"] + scale * jnp.tanh((a["h"] * p["g"]) @ p["w"]), "count": a["count"] + 1}


def last(p, a):
    return a["h"] @ p["w"]


def mse(y, t):
    return jnp.mean(jnp.square(y - t))


def pytree_forward(params, x, blocks=2):
    """The whole model in one function (the oracle's)."""
    a = first(params["in"], x)
    for i in range(blocks):
        a = block(params[f"block{i}"], a)
    return last(params["out"], a)


def pytree_mlp(d=16, blocks=2):
    parts = [("in", first)] + [(f"block{i}", block) for i in range(blocks)] + [("out", last)]
    return plain(lambda key: pytree_init(key, d, blocks), parts, loss=mse,
                 input=((D_IN,), "float32"), label=((D_OUT,), "float32"),
                 axes=[("*/w", (None, None))],
                 out_axes=[("*/h", ("batch", "embed")), ("*/count", ("batch", None))])


def raises():
    raise RuntimeError("boom: the user's factory failed")


def not_a_model():
    return {"layers": 3}


def bad_feed():
    """Part 1 wants 6 features; part 0 gives 16."""
    def init(key):
        return {"a": {"w": jnp.ones((D_IN, 16))}, "b": {"w": jnp.ones((6, D_OUT))}}
    return plain(init, [("a", lambda p, x: x @ p["w"]), ("b", lambda p, x: x @ p["w"])], loss=mse,
                 input=((D_IN,), "float32"), label=((D_OUT,), "float32"))


# ----------------------------------------------------------------------------- flax.linen

def _linen_classes():
    import flax.linen as nn

    class LinenBlock(nn.Module):
        d: int

        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp")),
                           (self.d, 2 * self.d))
            v = self.param("v", nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("mlp", "embed")),
                           (2 * self.d, self.d))
            return x + jnp.tanh(x @ w) @ v

    class LinenMLP(nn.Module):
        d: int = 16
        blocks: int = 2

        def setup(self):
            part = nn.with_logical_partitioning
            self.inp = nn.Dense(self.d, kernel_init=part(nn.initializers.lecun_normal(), (None, "embed")))
            self.body = [LinenBlock(self.d) for _ in range(self.blocks)]
            self.out = nn.Dense(D_OUT, kernel_init=part(nn.initializers.lecun_normal(), ("embed", None)))

        def __call__(self, x):
            h = self.inp(x)
            for b in self.body:
                h = b(h)
            return self.out(h)

    return LinenMLP


def linen_module(d=16, blocks=2):
    return _linen_classes()(d=d, blocks=blocks)


def linen_mlp(d=16, blocks=2):
    from orchestrator.core.model.adapters import linen_model

    parts = ([("in", ("inp",), lambda m, x: m.inp(x))]
             + [(f"block{i}", (f"body_{i}",), lambda m, x, i=i: m.body[i](x)) for i in range(blocks)]
             + [("out", ("out",), lambda m, x: m.out(x))])
    return linen_model(linen_module(d, blocks), parts, loss=mse, input=((D_IN,), "float32"),
                       label=((D_OUT,), "float32"), out_axes=OUT_AXES)


# ----------------------------------------------------------------------------- equinox

def _eqx_class():
    import equinox as eqx

    class EqxMLP(eqx.Module):
        inp: eqx.nn.Linear
        blocks: list
        out: eqx.nn.Linear

        def __init__(self, d, blocks, key):
            ks = jax.random.split(key, blocks + 2)
            self.inp = eqx.nn.Linear(D_IN, d, key=ks[0])
            self.blocks = [eqx.nn.MLP(d, d, 2 * d, 1, key=k) for k in ks[1:-1]]
            self.out = eqx.nn.Linear(d, D_OUT, key=ks[-1])

        def __call__(self, x):      # one example, equinox's convention
            h = self.inp(x)
            for b in self.blocks:
                h = h + b(h)
            return self.out(h)

    return EqxMLP


def eqx_make(d=16, blocks=2):
    cls = _eqx_class()
    return lambda key: cls(d, blocks, key)


def eqx_mlp(d=16, blocks=2):
    from orchestrator.core.model.adapters import eqx_model

    # the residual lives in EqxMLP.__call__, not in the blocks, so the adapter says it
    parts = ["inp", *[(f"blocks.{i}", f"blocks.{i}", lambda b, x: x + jax.vmap(b)(x)) for i in range(blocks)], "out"]
    return eqx_model(eqx_make(d, blocks), parts, loss=mse, input=((D_IN,), "float32"), label=((D_OUT,), "float32"),
                     axes=[("blocks.*/layers/0/weight", ("mlp", "embed")), ("blocks.*/layers/0/bias", ("mlp",)),
                           ("blocks.*/layers/1/weight", ("embed", "mlp"))],
                     out_axes=OUT_AXES)


# ----------------------------------------------------------------------------- dropout (rng, train)

KEEP = 0.75


def dropout_block(p, x, *, rng, train):
    h = jnp.tanh(x @ p["w"])
    if train and rng is not None:
        h = jnp.where(jax.random.bernoulli(rng, KEEP, h.shape), h / KEEP, 0.0)
    return x + h


def dropout_init(key, d=16, blocks=2):
    ks = jax.random.split(key, blocks + 2)
    out = {"in": {"w": jax.random.normal(ks[0], (D_IN, d)) / D_IN ** 0.5}}
    for i in range(blocks):
        out[f"block{i}"] = {"w": jax.random.normal(ks[i + 1], (d, d)) / d ** 0.5}
    out["out"] = {"w": jax.random.normal(ks[-1], (d, D_OUT)) / d ** 0.5}
    return out


def dropout_mlp(d=16, blocks=2):
    parts = ([("in", lambda p, x: x @ p["w"])] + [(f"block{i}", dropout_block) for i in range(blocks)]
             + [("out", lambda p, x: x @ p["w"])])
    return plain(lambda key: dropout_init(key, d, blocks), parts, loss=mse, input=((D_IN,), "float32"),
                 label=((D_OUT,), "float32"), out_axes=[("out/*", ("batch", None)), ("*", ("batch", "embed"))])


# ----------------------------------------------------------------------------- flax.nnx with dropout (RNG state)

NNX_DROP = 0.25


def _nnx_dropout_class():
    from flax import nnx

    class DropBlock(nnx.Module):
        def __init__(self, d, rngs):
            init = nnx.initializers.lecun_normal()
            self.up = nnx.Linear(d, 2 * d, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs)
            self.down = nnx.Linear(2 * d, d, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), rngs=rngs)
            self.drop = nnx.Dropout(NNX_DROP, rngs=rngs)      # holds an RNG stream (nnx.RngState)

        def __call__(self, x):
            return x + self.drop(self.down(jnp.tanh(self.up(x))))

    return nnx_blocks_mlp(DropBlock)


def nnx_blocks_mlp(block):
    """An nnx MLP: a D_IN → d input layer, `blocks` residual blocks `block(d, rngs)`, a d → D_OUT head."""
    from flax import nnx

    class BlocksMLP(nnx.Module):
        def __init__(self, d, blocks, rngs):
            self.inp = nnx.Linear(D_IN, d, rngs=rngs)
            self.blocks = nnx.List([block(d, rngs) for _ in range(blocks)])
            self.out = nnx.Linear(d, D_OUT, rngs=rngs)

        def __call__(self, x):
            h = self.inp(x)
            for b in self.blocks:
                h = b(h)
            return self.out(h)

    return BlocksMLP


def nnx_blocks_adapter(make, blocks):
    """`nnx_model` of a `nnx_blocks_mlp` model, split into inp / blocks.0 … / out, loss mse."""
    from orchestrator.core.model.adapters import nnx_model

    return nnx_model(make, ["inp", *[f"blocks.{i}" for i in range(blocks)], "out"],
                     loss=mse, input=((D_IN,), "float32"), label=((D_OUT,), "float32"), out_axes=OUT_AXES)


def nnx_dropout_make(d=16, blocks=2):
    cls = _nnx_dropout_class()
    return lambda rngs: cls(d, blocks, rngs)


def nnx_dropout_mlp(d=16, blocks=2):
    return nnx_blocks_adapter(nnx_dropout_make(d, blocks), blocks)


# ----------------------------------------------------------------------------- flax.linen with dropout

def _linen_dropout_class():
    import flax.linen as nn

    class LinenDropBlock(nn.Module):
        d: int

        @nn.compact
        def __call__(self, x, train=False):
            w = self.param("w", nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp")),
                           (self.d, 2 * self.d))
            v = self.param("v", nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("mlp", "embed")),
                           (2 * self.d, self.d))
            return x + nn.Dropout(NNX_DROP, deterministic=not train)(jnp.tanh(x @ w) @ v)

    class LinenDropMLP(nn.Module):
        d: int = 16
        blocks: int = 2

        def setup(self):
            self.inp = nn.Dense(self.d)
            self.body = [LinenDropBlock(self.d) for _ in range(self.blocks)]
            self.out = nn.Dense(D_OUT)

        def __call__(self, x, train=False):
            h = self.inp(x)
            for b in self.body:
                h = b(h, train=train)
            return self.out(h)

    return LinenDropMLP


def linen_dropout_module(d=16, blocks=2):
    return _linen_dropout_class()(d=d, blocks=blocks)


def linen_dropout_mlp(d=16, blocks=2):
    from orchestrator.core.model.adapters import linen_model

    parts = ([("in", ("inp",), lambda m, x: m.inp(x))]
             + [(f"block{i}", (f"body_{i}",), lambda m, x, train, i=i: m.body[i](x, train=train)) for i in range(blocks)]
             + [("out", ("out",), lambda m, x: m.out(x))])
    return linen_model(linen_dropout_module(d, blocks), parts, loss=mse, input=((D_IN,), "float32"),
                       label=((D_OUT,), "float32"), out_axes=OUT_AXES, rngs=("dropout",))
