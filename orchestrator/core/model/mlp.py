"""A residual MLP as pure layer descriptions (jax code: `mlp_impl.py`).

Layers: `in` (d_in → embed), `blocks` × residual block (embed → mlp → embed),
`out` (embed → d_out). Loss: mean squared error against a fixed random teacher.
"""
from __future__ import annotations

from typing import Any

from orchestrator.core.model.spec import LayerSpec, ModelSpec, ParamDef

DEFAULTS = {"d_in": 32, "d_model": 64, "d_mlp": 256, "d_out": 8, "blocks": 2}


def spec(args: dict[str, Any], seq_len: int | None = None) -> ModelSpec:
    unknown = set(args) - set(DEFAULTS)
    if unknown:
        raise KeyError(sorted(unknown)[0])
    a = {**DEFAULTS, **args}
    d_in, d, h, d_out = a["d_in"], a["d_model"], a["d_mlp"], a["d_out"]
    act = ("batch", "embed")
    layers = [LayerSpec("in", "in", {"w": ParamDef((d_in, d), (None, "embed"), scale=d_in**-0.5),
                                     "b": ParamDef((d,), ("embed",), "zeros")}, act, (d,))]
    for i in range(a["blocks"]):
        layers.append(LayerSpec(f"block{i}", "block", {
            "scale": ParamDef((d,), ("embed",), "ones"),
            "w1": ParamDef((d, h), ("embed", "mlp"), scale=d**-0.5),
            "b1": ParamDef((h,), ("mlp",), "zeros"),
            "w2": ParamDef((h, d), ("mlp", "embed"), scale=h**-0.5 / 2),
        }, act, (d,)))
    layers.append(LayerSpec("out", "out", {"w": ParamDef((d, d_out), ("embed", None), scale=d**-0.5)},
                            ("batch", None), (d_out,)))
    return ModelSpec("mlp", tuple(layers), "stages.models.mlp_impl:impl", (d_in,), "float32",
                     ("batch", None), (d_out,), "float32", a)
