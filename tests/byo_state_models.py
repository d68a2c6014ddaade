"""Model factories with mutable (non-parameter) state for `tests.test_byo_state`: BatchNorm.

`nnx_bn_mlp`: a flax.nnx MLP whose residual blocks hold an `nnx.BatchNorm` (running mean and
variance are `nnx.BatchStat` variables); `linen_bn_mlp`: the same in flax.linen (`batch_stats`
collection); `eqx_bn_mlp`: the same in equinox (`eqx.nn.BatchNorm`, `eqx.nn.State`). Each is split
into in / block0 / block1 / out, so a two-stage job has BatchNorm state on each stage.
`nnx_counter` holds a variable kind meshpipe refuses.
"""
from __future__ import annotations

import jax.numpy as jnp

from tests.byo_models import D_IN, D_OUT, OUT_AXES, mse, nnx_blocks_adapter, nnx_blocks_mlp

MOMENTUM = 0.8      # running statistics move visibly in a few steps


def _nnx_classes():
    from flax import nnx

    class BNBlock(nnx.Module):
        def __init__(self, d, rngs):
            init = nnx.initializers.lecun_normal()
            self.up = nnx.Linear(d, 2 * d, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs)
            self.bn = nnx.BatchNorm(2 * d, momentum=MOMENTUM, rngs=rngs)
            self.down = nnx.Linear(2 * d, d, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), rngs=rngs)

        def __call__(self, x):
            return x + self.down(jnp.tanh(self.bn(self.up(x))))

    return nnx_blocks_mlp(BNBlock)


def nnx_bn_make(d=16, blocks=2):
    cls = _nnx_classes()
    return lambda rngs: cls(d, blocks, rngs)


def nnx_bn_mlp(d=16, blocks=2):
    return nnx_blocks_adapter(nnx_bn_make(d, blocks), blocks)


def _linen_class():
    import flax.linen as nn

    class LinenBNBlock(nn.Module):
        d: int

        @nn.compact
        def __call__(self, x, train=False):
            w = self.param("w", nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp")),
                           (self.d, 2 * self.d))
            v = self.param("v", nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("mlp", "embed")),
                           (2 * self.d, self.d))
            h = nn.BatchNorm(use_running_average=not train, momentum=MOMENTUM)(x @ w)
            return x + jnp.tanh(h) @ v

    class LinenBNMLP(nn.Module):
        d: int = 16
        blocks: int = 2

        def setup(self):
            self.inp = nn.Dense(self.d)
            self.body = [LinenBNBlock(self.d) for _ in range(self.blocks)]
            self.out = nn.Dense(D_OUT)

        def __call__(self, x, train=False):
            h = self.inp(x)
            for b in self.body:
                h = b(h, train=train)
            return self.out(h)

    return LinenBNMLP


def linen_bn_module(d=16, blocks=2):
    return _linen_class()(d=d, blocks=blocks)


def linen_bn_mlp(d=16, blocks=2):
    from orchestrator.core.model.adapters import linen_model

    parts = ([("in", ("inp",), lambda m, x: m.inp(x))]
             + [(f"block{i}", (f"body_{i}",), lambda m, x, train, i=i: m.body[i](x, train=train))
                for i in range(blocks)]
             + [("out", ("out",), lambda m, x: m.out(x))])
    return linen_model(linen_bn_module(d, blocks), parts, loss=mse, input=((D_IN,), "float32"),
                       label=((D_OUT,), "float32"), out_axes=OUT_AXES)


def nnx_counter(**_):
    """An nnx model holding a variable of the user's own kind (not Param / BatchStat / RNG): refused."""
    from flax import nnx
    from orchestrator.core.model.adapters import nnx_model

    class Counter(nnx.Variable):
        pass

    class Counted(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(D_IN, D_OUT, rngs=rngs)
            self.calls = Counter(jnp.zeros((), jnp.int32))

        def __call__(self, x):
            return self.lin(x)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.inp = nnx.Linear(D_IN, D_IN, rngs=rngs)
            self.head = Counted(rngs)

        def __call__(self, x):
            return self.head(self.inp(x))

    return nnx_model(Model, ["inp", "head"], loss=mse, input=((D_IN,), "float32"), label=((D_OUT,), "float32"))


def linen_orphan_stats(**_):
    """A linen model whose batch_stats entry no part owns (parts name other keys): refused."""
    import flax.linen as nn
    from orchestrator.core.model.adapters import linen_model

    class M(nn.Module):
        def setup(self):
            self.inp = nn.Dense(D_IN)
            self.bn = nn.BatchNorm(use_running_average=False, use_scale=False, use_bias=False)
            self.out = nn.Dense(D_OUT)

        def __call__(self, x):
            return self.out(self.bn(self.inp(x)))

    return linen_model(M(), [("in", ("inp",), lambda m, x: m.bn(m.inp(x))), ("out", ("out",), lambda m, x: m.out(x))],
                       loss=mse, input=((D_IN,), "float32"), label=((D_OUT,), "float32"))


def _eqx_classes():
    import equinox as eqx
    import jax

    class EqxBNBlock(eqx.Module):
        up: eqx.nn.Linear
        bn: eqx.nn.BatchNorm
        down: eqx.nn.Linear

        def __init__(self, d, key):
            k1, k2 = jax.random.split(key)
            self.up = eqx.nn.Linear(d, 2 * d, key=k1)
            self.bn = eqx.nn.BatchNorm(2 * d, axis_name="batch", momentum=MOMENTUM, mode="ema")
            self.down = eqx.nn.Linear(2 * d, d, key=k2)

        def __call__(self, x, state):         # one example, equinox's convention
            h, state = self.bn(self.up(x), state)
            return x + self.down(jnp.tanh(h)), state

    class EqxBNMLP(eqx.Module):
        inp: eqx.nn.Linear
        blocks: list
        out: eqx.nn.Linear

        def __init__(self, d, blocks, key):
            ks = jax.random.split(key, blocks + 2)
            self.inp = eqx.nn.Linear(D_IN, d, key=ks[0])
            self.blocks = [EqxBNBlock(d, k) for k in ks[1:-1]]
            self.out = eqx.nn.Linear(d, D_OUT, key=ks[-1])

        def __call__(self, x, state):
            h = self.inp(x)
            for b in self.blocks:
                h, state = b(h, state)
            return self.out(h), state

    return EqxBNMLP


def eqx_bn_make(d=16, blocks=2):
    """key -> (model, state): the equinox BatchNorm MLP as `eqx.nn.make_with_state` builds it."""
    import equinox as eqx

    cls = _eqx_classes()
    return lambda key: eqx.nn.make_with_state(cls)(d, blocks, key)


EQX_BN_AXES = [("blocks.*/up/weight", ("mlp", "embed")), ("blocks.*/up/bias", ("mlp",)),
               ("blocks.*/bn/weight", ("mlp",)), ("blocks.*/bn/bias", ("mlp",)),
               ("blocks.*/down/weight", ("embed", "mlp"))]


def eqx_block_call(block, x, state):
    """A stateful part's own call: (submodule, batch, eqx.nn.State) -> (y, state)."""
    import jax

    return jax.vmap(block, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)


def eqx_bn_mlp(d=16, blocks=2, bare=False):
    """The equinox BatchNorm MLP split into inp / blocks.0 / blocks.1 / out (default calls: each
    block is vmapped over the batch with its state). `bare`: `make` returns the model alone (the
    adapter applies `eqx.nn.make_with_state` itself) and the blocks are parts with their own call
    (`eqx_block_call`)."""
    from orchestrator.core.model.adapters import eqx_model

    if bare:
        cls = _eqx_classes()
        make = lambda key: cls(d, blocks, key)
        body = [(f"blocks.{i}", f"blocks.{i}", eqx_block_call) for i in range(blocks)]
    else:
        make, body = eqx_bn_make(d, blocks), [f"blocks.{i}" for i in range(blocks)]
    return eqx_model(make, ["inp", *body, "out"], loss=mse, input=((D_IN,), "float32"),
                     label=((D_OUT,), "float32"), axes=EQX_BN_AXES, out_axes=OUT_AXES)


def eqx_stateful(**_):
    """An equinox model made by eqx.nn.make_with_state whose factory drops the state: refused."""
    from orchestrator.core.model.adapters import eqx_model

    make = eqx_bn_make(D_IN, 1)
    return eqx_model(lambda key: make(key)[0], ["inp", "blocks.0", "out"], loss=mse,
                     input=((D_IN,), "float32"), label=((D_OUT,), "float32"))
