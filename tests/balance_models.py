"""Plain-JAX models for the cost-balanced default cut (`tests/test_balance.py`): residual blocks
d → mlps[i] → d, so one wide entry of `mlps` makes one layer far dearer than the others."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from orchestrator.core.model.adapters import plain

D = 8


def widths_mlp(mlps=(16, 16, 16, 16)):
    def init(key):
        ks = jax.random.split(key, 2 * len(mlps))
        return {f"block{i}": {"w1": jax.random.normal(ks[2 * i], (D, h)) / D ** 0.5,
                              "w2": jax.random.normal(ks[2 * i + 1], (h, D)) / h ** 0.5}
                for i, h in enumerate(mlps)}

    def block(p, h):
        return h + jnp.tanh(h @ p["w1"]) @ p["w2"]

    return plain(init, [(f"block{i}", block) for i in range(len(mlps))],
                 loss=lambda y, t: jnp.mean(jnp.square(y - t)),
                 input=((D,), "float32"), label=((D,), "float32"),
                 axes=[("*", (None, None))], out_axes=[("*", ("batch", "embed"))])
