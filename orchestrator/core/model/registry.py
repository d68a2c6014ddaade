"""Model factories: built-in names and `package.module:function` paths (pure: no jax here).

A factory returns a `PipelineModel` (`orchestrator.core.model.pipeline`); the
built-ins `gpt` and `mlp` are plain-JAX factories like any user's. The package that
owns a model's code registers it under a name as an entry point of the group
`meshpipe.models` (meshpipe's own in pyproject.toml: their jax code is in the stage
runtime); `BUILTIN` reads the names and import paths from the installed metadata,
without importing them, and this package names no module of another layer.
`build_spec` calls the factory and describes the model by shape evaluation
(`describe`); `build_model` calls it again on a worker to get the jax functions.
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

from orchestrator.core.extras import hinting
from orchestrator.core.model import gpt, mlp
from orchestrator.core.model.pipeline import ModelError, describe
from orchestrator.core.model.spec import ModelSpec


@dataclass(frozen=True)
class Builtin:
    """A built-in model: its factory's import path and its arguments' defaults."""

    factory: str
    defaults: Mapping[str, Any]


ENTRY_POINTS = "meshpipe.models"      # the entry-point group a package registers its models in
DEFAULTS = {"mlp": mlp.DEFAULTS, "gpt": gpt.DEFAULTS}     # the built-ins' arguments (pure descriptions)


class Builtins(Mapping):
    """name -> `Builtin`, from the entry points of `ENTRY_POINTS` (read once, on first use)."""

    def __init__(self):
        self._found: Optional[dict[str, Builtin]] = None

    def _table(self) -> dict[str, Builtin]:
        if self._found is None:
            from importlib.metadata import entry_points

            found = {ep.name: Builtin(ep.value, DEFAULTS.get(ep.name, {})) for ep in entry_points(group=ENTRY_POINTS)}
            missing = sorted(set(DEFAULTS) - set(found))
            if missing:
                raise ModelError(f"the built-in models {', '.join(missing)} are not registered: this meshpipe's "
                                 f"install is older than its source (entry points {ENTRY_POINTS!r} in "
                                 "pyproject.toml); install it again: pip install -e .")
            self._found = found
        return self._found

    def __getitem__(self, name: str) -> Builtin:
        return self._table()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())


BUILTIN = Builtins()

__all__ = ["BUILTIN", "Builtin", "Builtins", "DEFAULTS", "ENTRY_POINTS", "build_model", "build_spec", "factory_args",
           "resolve"]


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
