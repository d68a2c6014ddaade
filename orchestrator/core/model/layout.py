"""Layouts: logical axis names → mesh axes (Mesh-TensorFlow style), pure Python.

A layout is a mapping like ``{"batch": "data", "mlp": "model"}`` (written
``batch:data;mlp:model`` in Mesh-TF's notation). A logical name maps to one mesh
axis, a tuple of mesh axes (sharded over their product) or None (replicated) — or
to candidates, `FirstOf` (``{"heads": {"first": ["model", "data"]}}``, text
``heads:model|data``): on each stage the first candidate whose mesh axes that stage's
mesh has and whose size divides every dim carrying the name there wins (as in flax's
`logical_axis_rules`, where a name may list several mesh axes); none fits: replicated.
`choose` makes that choice per stage, so the stage programs only ever see plain rules.

`partition_spec(axes, layout, mesh_axes)` turns a tensor's logical axis names
into a PartitionSpec-shaped tuple for one mesh:
  - rules naming mesh axes that this mesh lacks are dropped for this mesh, so one
    job-wide layout serves stages whose meshes have different axes;
  - a mesh axis is used at most once per tensor (JAX's rule): a later dimension
    that asks for an axis already taken stays unsharded.
No jax here; workers wrap the result in `jax.sharding.PartitionSpec`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Union

SpecEntry = Union[str, tuple[str, ...], None]


@dataclass(frozen=True)
class FirstOf:
    """Candidate rules for one logical axis, in order of preference (each a mesh axis, a tuple of
    them, or None); `choose` picks the first that fits a stage. JSON form: {"first": [...]}."""

    first: tuple[SpecEntry, ...]


Rule = Union[str, tuple[str, ...], None, FirstOf]


def _one(target, where: str) -> SpecEntry:
    if target is None or isinstance(target, str):
        return target
    if isinstance(target, (list, tuple)) and target and all(isinstance(t, str) for t in target):
        return target[0] if len(target) == 1 else tuple(target)
    raise ValueError(f"{where}: {target!r} must be a mesh axis name, a list of them, or null")


def parse_layout(value: Union[str, Mapping[str, object], None]) -> dict[str, Rule]:
    """Normalise a layout written as a mapping or as Mesh-TF text.

    Example:
        >>> parse_layout("batch:data;mlp:model")
        {'batch': 'data', 'mlp': 'model'}
        >>> parse_layout({"embed": ["data", "model"], "vocab": None})
        {'embed': ('data', 'model'), 'vocab': None}
        >>> parse_layout({"heads": {"first": ["model", "data"]}}) == parse_layout("heads:model|data")
        True
    """
    if value is None:
        return {}
    if isinstance(value, str):
        rules: dict[str, Rule] = {}
        for part in filter(None, (p.strip() for p in value.split(";"))):
            name, sep, target = part.partition(":")
            if not sep or not name.strip():
                raise ValueError(f"layout entry {part!r} must look like 'logical:mesh_axis'")
            options = []
            for option in target.split("|"):
                axes = tuple(t.strip() for t in option.split(",") if t.strip())
                options.append(None if not axes else axes[0] if len(axes) == 1 else axes)
            rules[name.strip()] = FirstOf(tuple(options)) if len(options) > 1 else options[0]
        return rules
    out: dict[str, Rule] = {}
    for name, target in value.items():
        if isinstance(target, FirstOf):
            out[str(name)] = target
        elif isinstance(target, str) and "|" in target:       # the text form's candidates
            out.update(parse_layout(f"{name}:{target}"))
        elif isinstance(target, Mapping):
            options = target.get("first")
            if set(target) != {"first"} or not isinstance(options, (list, tuple)) or not options:
                raise ValueError(f"layout.{name}: {target!r} must be {{first: [candidate, ...]}} (each "
                                 "candidate a mesh axis name, a list of them, or null)")
            out[str(name)] = FirstOf(tuple(_one(o, f"layout.{name}.first") for o in options))
        elif isinstance(target, list) and not target:
            raise ValueError(f"layout.{name}: {target!r} must be a mesh axis name, a list of them, or null")
        else:
            out[str(name)] = _one(target, f"layout.{name}")
    return out


def rule_axes(rule: Rule) -> tuple[str, ...]:
    """The mesh axes a rule names (for candidates: every candidate's, in order, once each)."""
    if rule is None:
        return ()
    if isinstance(rule, FirstOf):
        return tuple(dict.fromkeys(a for option in rule.first for a in rule_axes(option)))
    return (rule,) if isinstance(rule, str) else tuple(rule)


def stage_layout(global_layout: Mapping[str, Rule], override: Mapping[str, Rule] | None,
                 mesh_axes: Iterable[str]) -> dict[str, Rule]:
    """The effective layout of one stage: the job layout restricted to this mesh, then the override."""
    names = set(mesh_axes)
    out: dict[str, Rule] = {}
    for logical, rule in global_layout.items():
        if isinstance(rule, FirstOf):       # keep the candidates this mesh can take
            options = tuple(o for o in rule.first if all(a in names for a in rule_axes(o)))
            if any(o is not None for o in options):
                out[logical] = FirstOf(options)
            continue
        kept = tuple(a for a in rule_axes(rule) if a in names)
        if kept:
            out[logical] = kept[0] if len(kept) == 1 else kept
    for logical, rule in (override or {}).items():
        out[logical] = rule
    return out


def choose(layout: Mapping[str, Rule], mesh: Mapping[str, int],
           sizes: Mapping[str, Iterable[int]]) -> dict[str, Rule]:
    """The stage's plain layout: each `FirstOf` replaced by its first candidate whose mesh axes
    `mesh` has and whose shard count divides every size in `sizes[logical]` (the dims carrying
    that name on the stage); when none fits (or a None candidate comes first) it is replicated.

    Example:
        >>> choose({"heads": FirstOf(("model", "data")), "batch": "data"}, {"data": 2, "model": 3},
        ...        {"heads": [4, 8]})
        {'heads': 'data', 'batch': 'data'}
    """
    out: dict[str, Rule] = {}
    for logical, rule in layout.items():
        if not isinstance(rule, FirstOf):
            out[logical] = rule
            continue
        for option in rule.first:
            if not all(a in mesh for a in rule_axes(option)):
                continue
            n = shard_count(option, mesh)
            if all(s % n == 0 for s in sizes.get(logical, ())):
                if option is not None:
                    out[logical] = option
                break
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
        if isinstance(v, FirstOf):
            parts.append(f"{k}:{'|'.join(','.join(rule_axes(o)) for o in v.first)}")
        else:
            parts.append(f"{k}:{','.join(rule_axes(v))}")
    return ";".join(parts)
