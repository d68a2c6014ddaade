"""Built-in models and the model registry (pure: no jax imported here).

`build_spec(name, args, seq_len)` returns the `ModelSpec` of a built-in model
(`mlp`, `gpt`) or calls a user factory given as `package.module:function`.
"""
from __future__ import annotations

import importlib
from typing import Any, Mapping

from orchestrator.core.model.spec import ModelSpec
from orchestrator.core.model import gpt, mlp

BUILTIN = {"mlp": mlp.spec, "gpt": gpt.spec}

__all__ = ["BUILTIN", "build_spec", "resolve"]


def resolve(path: str):
    """Import `package.module:attr` and return the attribute."""
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise ValueError(f"import path {path!r} must look like 'package.module:function'")
    return getattr(importlib.import_module(module), attr)


def build_spec(name: str, args: Mapping[str, Any], seq_len: int | None = None) -> ModelSpec:
    """The ModelSpec for a built-in model name or a `package.module:factory` path.

    Example:
        >>> build_spec("mlp", {"blocks": 2}).num_layers
        4
    """
    if name in BUILTIN:
        return BUILTIN[name](dict(args), seq_len=seq_len)
    if ":" in name:
        spec = resolve(name)(dict(args), seq_len=seq_len)
        if not isinstance(spec, ModelSpec):
            raise TypeError(f"model factory {name!r} returned {type(spec).__name__}, not ModelSpec")
        return spec
    raise KeyError(name)
