"""The built-in residual MLP as a plain-JAX `PipelineModel` (arguments: `orchestrator.core.model.mlp`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from orchestrator.core.model.adapters import plain
from orchestrator.core.model.mlp import DEFAULTS
from stages.models.base import init_params, rms
from stages.sharding import constrain

AXES = [("in/w", (None, "embed")), ("in/b", ("embed",)), ("*/scale", ("embed",)),
        ("*/w1", ("embed", "mlp")), ("*/b1", ("mlp",)), ("*/w2", ("mlp", "embed")), ("out/w", ("embed", None))]


def first(p, x):
    return constrain(x @ p["w"] + p["b"], ("batch", "embed"))


def block(p, x):
    h = constrain(jax.nn.gelu(rms(x, p["scale"]) @ p["w1"] + p["b1"]), ("batch", "mlp"))
    return constrain(x + h @ p["w2"], ("batch", "embed"))


def last(p, x):
    return x @ p["w"]


def loss(y, labels):
    return jnp.mean(jnp.square(y.astype(jnp.float32) - labels))


def model(**args):
    """The MLP of `args` (keys and defaults: `DEFAULTS`)."""
    a = {**DEFAULTS, **args}
    d_in, d, h, d_out, n = a["d_in"], a["d_model"], a["d_mlp"], a["d_out"], a["blocks"]
    defs = {"in": {"w": ((d_in, d), "normal", d_in**-0.5), "b": ((d,), "zeros", 1.0)}}
    for i in range(n):
        defs[f"block{i}"] = {"scale": ((d,), "ones", 1.0), "w1": ((d, h), "normal", d**-0.5),
                             "b1": ((h,), "zeros", 1.0), "w2": ((h, d), "normal", h**-0.5 / 2)}
    defs["out"] = {"w": ((d, d_out), "normal", d**-0.5)}
    names = list(defs)

    def init(key):
        return {name: init_params(defs[name], jax.random.fold_in(key, i)) for i, name in enumerate(names)}

    parts = [("in", first)] + [(f"block{i}", block) for i in range(n)] + [("out", last)]
    return plain(init, parts, loss=loss, input=((d_in,), "float32"), label=((d_out,), "float32"),
                 axes=AXES, out_axes=[("out/*", ("batch", None)), ("*", ("batch", "embed"))])
