"""Model factories the training-health tests name in their jobs (`tests.health_models:...`).

Faults are injected by the model itself, from the data, with no hook in product code:
`poisoned_mlp(poison=v)` is `tests.byo_models.pytree_mlp` whose first part has an identity
with a custom backward that turns its cotangent NaN when a row of the microbatch's input starts
with the value `v` (the tests pick `v` from one step's synthetic batch, so exactly that step's
gradient on stage 0 is non-finite while every loss stays finite). `nan_loss_mlp` has a loss that
is NaN from the first step. `poisoned_forward` is the whole model in one function, for the oracle.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from orchestrator.core.model.adapters import plain
from tests.byo_models import D_IN, D_OUT, block, first, last, mse, pytree_init


def poisoned_first(v: float):
    poison = jax.custom_vjp(lambda h, x: h)
    poison.defvjp(lambda h, x: (h, jnp.any(jnp.abs(x[:, 0] - v) < 1e-6)),
                  lambda bad, g: (jax.tree.map(lambda t: t * jnp.where(bad, jnp.nan, 1.0).astype(t.dtype), g),
                                  None))

    def apply(p, x):
        a = first(p, x)
        return {**a, "h": poison(a["h"], x)}

    return apply


def poisoned_forward(params, x, poison: float, blocks=2):
    a = poisoned_first(poison)(params["in"], x)
    for i in range(blocks):
        a = block(params[f"block{i}"], a)
    return last(params["out"], a)


def _mlp(first_part, loss, d, blocks):
    parts = [("in", first_part)] + [(f"block{i}", block) for i in range(blocks)] + [("out", last)]
    return plain(lambda key: pytree_init(key, d, blocks), parts, loss=loss,
                 input=((D_IN,), "float32"), label=((D_OUT,), "float32"),
                 axes=[("*/w", (None, None))],
                 out_axes=[("*/h", ("batch", "embed")), ("*/count", ("batch", None))])


def poisoned_mlp(poison: float, d=16, blocks=2):
    return _mlp(poisoned_first(poison), mse, d, blocks)


def nan_loss(y, t):
    return mse(y, t) + jnp.sqrt(jnp.float32(-1.0))      # NaN, whatever the parameters


def nan_loss_mlp(d=16, blocks=2):
    return _mlp(first, nan_loss, d, blocks)
