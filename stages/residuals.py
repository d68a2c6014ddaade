"""Checks that a stage's forward never returns a parameter as a VJP residual.

`stages.program` drops the residuals that *are* the parameters from the forward's
outputs (matched by object identity of their tracers inside `jax.vjp`'s closure) and
re-inserts the live parameters in the backward, so a forward never copies weights
(returning the whole VJP would make XLA copy every weight per microbatch). That matching relies on how JAX builds the closure; if
a JAX release wraps the parameters differently, the match fails silently and every
microbatch's forward would return (copy) the weights. `forwarded_params` verifies it on
the traced program: no output of the forward's jaxpr may be one of its parameter inputs
passed straight through. `stages.program.StageProgram` runs it when the forward is first
compiled and, if it finds any, warns and switches to recomputing the forward inside the
backward (residuals: the stage input only), which never copies weights either.
"""
from __future__ import annotations

import jax


def forwarded_params(fn, params, *args) -> list[int]:
    """Output positions (flattened) of `fn(params, *args)` that are parameter leaves of
    `params` returned unchanged (traced with `jax.make_jaxpr`, nothing runs).

    Example:
        >>> import jax.numpy as jnp
        >>> forwarded_params(lambda p, x: (x * p["w"], [p["w"]]), {"w": jnp.ones(2)}, jnp.ones(2))
        [1]
        >>> forwarded_params(lambda p, x: (x * p["w"], [x]), {"w": jnp.ones(2)}, jnp.ones(2))
        []
    """
    jaxpr = jax.make_jaxpr(fn)(params, *args).jaxpr
    inputs = jaxpr.invars[:len(jax.tree.leaves(params))]
    return [i for i, v in enumerate(jaxpr.outvars) if any(v is p for p in inputs)]
