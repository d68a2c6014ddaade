"""A small GPT as pure layer descriptions (jax code: `gpt_impl.py`).

Layers: `embed` (token + position), `blocks` × pre-LN transformer block
(attention split over `heads`, MLP split over `mlp`), `head` (final LN + LM head
over `vocab`). Loss: next-token cross-entropy, mean over tokens.
"""
from __future__ import annotations

from typing import Any

from orchestrator.core.model.spec import LayerSpec, ModelSpec, ParamDef

DEFAULTS = {"vocab": 128, "d_model": 64, "heads": 4, "d_mlp": 256, "blocks": 2}


def spec(args: dict[str, Any], seq_len: int | None = None) -> ModelSpec:
    unknown = set(args) - set(DEFAULTS)
    if unknown:
        raise KeyError(sorted(unknown)[0])
    a = {**DEFAULTS, **args}
    if seq_len is None:
        raise ValueError("gpt needs data.seq_len")
    v, d, nh, h = a["vocab"], a["d_model"], a["heads"], a["d_mlp"]
    if d % nh:
        raise ValueError(f"model.args.d_model={d} is not divisible by model.args.heads={nh}")
    hd = d // nh
    act = ("batch", "seq", "embed")
    layers = [LayerSpec("embed", "embed", {
        "tok": ParamDef((v, d), ("vocab", "embed"), scale=0.02),
        "pos": ParamDef((seq_len, d), (None, "embed"), scale=0.01),
    }, act, (seq_len, d))]
    for i in range(a["blocks"]):
        layers.append(LayerSpec(f"block{i}", "block", {
            "ln1": ParamDef((d,), ("embed",), "ones"),
            "wq": ParamDef((d, nh, hd), ("embed", "heads", "head_dim"), scale=d**-0.5),
            "wk": ParamDef((d, nh, hd), ("embed", "heads", "head_dim"), scale=d**-0.5),
            "wv": ParamDef((d, nh, hd), ("embed", "heads", "head_dim"), scale=d**-0.5),
            "wo": ParamDef((nh, hd, d), ("heads", "head_dim", "embed"), scale=d**-0.5 / 2),
            "ln2": ParamDef((d,), ("embed",), "ones"),
            "w1": ParamDef((d, h), ("embed", "mlp"), scale=d**-0.5),
            "w2": ParamDef((h, d), ("mlp", "embed"), scale=h**-0.5 / 2),
        }, act, (seq_len, d)))
    layers.append(LayerSpec("head", "head", {
        "lnf": ParamDef((d,), ("embed",), "ones"),
        "unembed": ParamDef((d, v), ("embed", "vocab"), scale=d**-0.5),
    }, ("batch", "seq", "vocab"), (seq_len, v)))
    return ModelSpec("gpt", tuple(layers), "stages.models.gpt_impl:impl", (seq_len,), "int32",
                     ("batch", "seq"), (seq_len,), "int32", {**a, "seq_len": seq_len})
