"""The sharding context of a stage: which mesh and layout model code sees.

Model code calls `constrain(x, ("batch", "seq", "embed"))` on activations; inside
`use(mesh, layout)` that becomes a `with_sharding_constraint` to the layout's
PartitionSpec on the stage's mesh, outside (the single-process reference) it is
a no-op. `named(mesh, layout, axes)` builds the NamedSharding for a tensor.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterable, Mapping

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from orchestrator.core.model.layout import partition_spec

_CURRENT: contextvars.ContextVar = contextvars.ContextVar("meshpipe_sharding", default=None)


@contextlib.contextmanager
def use(mesh: Mesh | None, layout: Mapping[str, object] | None):
    token = _CURRENT.set(None if mesh is None else (mesh, dict(layout or {})))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def spec(axes: Iterable[str | None], layout: Mapping[str, object]) -> PartitionSpec:
    return PartitionSpec(*partition_spec(tuple(axes), layout))


def named(mesh: Mesh, layout: Mapping[str, object], axes: Iterable[str | None]) -> NamedSharding:
    return NamedSharding(mesh, spec(axes, layout))


def constrain(x: jax.Array, axes: Iterable[str | None]) -> jax.Array:
    ctx = _CURRENT.get()
    if ctx is None:
        return x
    mesh, layout = ctx
    return jax.lax.with_sharding_constraint(x, named(mesh, layout, axes))
