"""Parameter initialisers shared by the built-in plain-JAX models.

`init_params(defs, key)` draws each parameter from `fold_in(key, i)` over the sorted
names, so a part's values depend only on (run seed, part index) — the same on a
stage worker and in a single process, whatever the sharding (jax's partitionable
threefry keeps values independent of the output sharding).
"""
from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp


def init_params(defs: Mapping[str, tuple], key: jax.Array) -> dict[str, jax.Array]:
    """defs: name -> (shape, "normal" | "zeros" | "ones", scale)."""
    out = {}
    for i, (name, (shape, kind, scale)) in enumerate(sorted(defs.items())):
        if kind == "zeros":
            out[name] = jnp.zeros(shape, jnp.float32)
        elif kind == "ones":
            out[name] = jnp.ones(shape, jnp.float32)
        else:
            out[name] = scale * jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)
    return out


def rms(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale
