"""Model factories: built-in names and `package.module:function` paths (pure: no jax here).

A factory returns a `PipelineModel` (`orchestrator.core.model.pipeline`); the
built-ins `gpt` and `mlp` are plain-JAX factories like any user's (their jax code
is in `stages/models/`, resolved by import path at call time, never imported by
this package). `build_spec` calls the factory and describes the model by shape
evaluation (`describe`); `build_model` calls it again on a worker to get the jax
functions.
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from orchestrator.core.extras import hinting
from orchestrator.core.model import gpt, mlp
from orchestrator.core.model.pipeline import ModelError, describe
from orchestrator.core.model.spec import ModelSpec


@dataclass(frozen=True)
class Builtin:
    """A built-in model: its factory's import path and its arguments' defaults."""

    factory: str
    defaults: Mapping[str, Any]


BUILTIN = {"mlp": Builtin("stages.models.mlp_impl:model", mlp.DEFAULTS),
           "gpt": Builtin("stages.models.gpt_impl:model", gpt.DEFAULTS)}

__all__ = ["BUILTIN", "Builtin", "build_model", "build_spec", "factory_args", "resolve"]


def resolve(path: str):
    """Import `package.module:attr` and return the attribute."""
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise ValueError(f"import path {path!r} must look like 'package.module:function'")
    with hinting():        # the user's module may import flax/equinox/... at its top: name the extra
        return getattr(importlib.import_module(module), attr)


def factory_args(fn, args: Mapping[str, Any], seq_len: Optional[int]) -> dict[str, Any]:
    """The factory's keyword arguments: `args`, plus `seq_len` when the factory takes it."""
    out = dict(args)
    try:
        takes = "seq_len" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        takes = False
    if takes and "seq_len" not in out and seq_len is not None:
        out["seq_len"] = seq_len
    return out


def build_model(factory: str, args: Mapping[str, Any]):
    """Call the factory (an import path) with keyword `args`; returns what it returns."""
    fn = resolve(factory)
    with hinting():
        return fn(**dict(args))


def build_spec(name: str, args: Mapping[str, Any], seq_len: Optional[int] = None) -> ModelSpec:
    """The ModelSpec of a built-in model name or a `package.module:factory` path.

    Raises KeyError (unknown built-in or argument), ImportError/AttributeError (the factory
    cannot be imported; a missing optional package as `extras.MissingExtra`, naming the extra), ModelError (the factory's result cannot be pipelined) or whatever
    the factory raised.

    Example:
        >>> build_spec("mlp", {"blocks": 2}).num_layers
        4
    """
    builtin = BUILTIN.get(name)
    if builtin is not None:
        unknown = set(args) - set(builtin.defaults)
        if unknown:
            raise KeyError(sorted(unknown)[0])
        factory = builtin.factory
    elif ":" in name:
        factory = name
    else:
        raise KeyError(name)
    fn = resolve(factory)
    kwargs = factory_args(fn, args, seq_len)
    with hinting():
        model = fn(**kwargs)
    return describe(model, name=name, factory=factory, args=kwargs)


__all__ += ["ModelError"]
