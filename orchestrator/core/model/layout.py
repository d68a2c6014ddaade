"""Layouts: logical axis names → mesh axes (Mesh-TensorFlow style), pure Python.

A layout is a mapping like ``{"batch": "data", "mlp": "model"}`` (written
``batch:data;mlp:model`` in Mesh-TF's notation). A logical name maps to one mesh
axis, a tuple of mesh axes (sharded over their product) or None (replicated).

`partition_spec(axes, layout, mesh_axes)` turns a tensor's logical axis names
into a PartitionSpec-shaped tuple for one mesh:
  - rules naming mesh axes that this mesh lacks are dropped for this mesh, so one
    job-wide layout serves stages whose meshes have different axes;
  - a mesh axis is used at most once per tensor (JAX's rule): a later dimension
    that asks for an axis already taken stays unsharded.
No jax here; workers wrap the result in `jax.sharding.PartitionSpec`.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Union

Rule = Union[str, tuple[str, ...], None]
SpecEntry = Union[str, tuple[str, ...], None]


def parse_layout(value: Union[str, Mapping[str, object], None]) -> dict[str, Rule]:
    """Normalise a layout written as a mapping or as Mesh-TF text.

    Example:
        >>> parse_layout("batch:data;mlp:model")
        {'batch': 'data', 'mlp': 'model'}
        >>> parse_layout({"embed": ["data", "model"], "vocab": None})
        {'embed': ('data', 'model'), 'vocab': None}
    """
    if value is None:
        return {}
    if isinstance(value, str):
        rules: dict[str, Rule] = {}
        for part in filter(None, (p.strip() for p in value.split(";"))):
            name, sep, target = part.partition(":")
            if not sep or not name.strip():
                raise ValueError(f"layout entry {part!r} must look like 'logical:mesh_axis'")
            targets = tuple(t.strip() for t in target.split(",") if t.strip())
            rules[name.strip()] = None if not targets else targets[0] if len(targets) == 1 else targets
        return rules
    out: dict[str, Rule] = {}
    for name, target in value.items():
        if target is None or isinstance(target, str):
            out[str(name)] = target
        elif isinstance(target, (list, tuple)) and all(isinstance(t, str) for t in target):
            out[str(name)] = target[0] if len(target) == 1 else tuple(target)
        else:
            raise ValueError(f"layout.{name}: {target!r} must be a mesh axis name, a list of them, or null")
    return out


def rule_axes(rule: Rule) -> tuple[str, ...]:
    if rule is None:
        return ()
    return (rule,) if isinstance(rule, str) else tuple(rule)


def stage_layout(global_layout: Mapping[str, Rule], override: Mapping[str, Rule] | None,
                 mesh_axes: Iterable[str]) -> dict[str, Rule]:
    """The effective layout of one stage: the job layout restricted to this mesh, then the override."""
    names = set(mesh_axes)
    out: dict[str, Rule] = {}
    for logical, rule in global_layout.items():
        kept = tuple(a for a in rule_axes(rule) if a in names)
        if kept:
            out[logical] = kept[0] if len(kept) == 1 else kept
    for logical, rule in (override or {}).items():
        out[logical] = rule
    return out


def partition_spec(axes: Iterable[str | None], layout: Mapping[str, Rule]) -> tuple[SpecEntry, ...]:
    """PartitionSpec entries for a tensor whose dims carry these logical names.

    Example:
        >>> partition_spec(("embed", "mlp"), {"embed": "model", "mlp": "model"})
        ('model', None)
    """
    used: set[str] = set()
    spec: list[SpecEntry] = []
    for name in axes:
        wanted = rule_axes(layout.get(name)) if name else ()
        free = tuple(a for a in wanted if a not in used)
        if free != wanted:  # part of the rule is taken: keep the dim whole rather than half-apply
            free = ()
        used.update(free)
        spec.append(None if not free else free[0] if len(free) == 1 else free)
    return tuple(spec)


def shard_count(entry: SpecEntry, mesh: Mapping[str, int]) -> int:
    """How many pieces a dim with this spec entry is cut into on `mesh`."""
    n = 1
    for a in rule_axes(entry):
        n *= mesh[a]
    return n


def format_layout(layout: Mapping[str, Rule]) -> str:
    """Mesh-TF text form, e.g. ``batch:data;mlp:model``."""
    parts = []
    for k, v in layout.items():
        parts.append(f"{k}:{','.join(rule_axes(v))}")
    return ";".join(parts)
