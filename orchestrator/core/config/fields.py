"""Shared pieces of the config schema: the frozen base model, value types, limits and name rules.

Every section model (`schema`, `cluster_schema`) builds on these; nothing here knows a section.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Mapping, Union

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.core.config.errors import Problem
from orchestrator.core.model.layout import FirstOf, parse_layout

PosInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
PosFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Rule = Union[str, tuple[str, ...], None]
MAX_STEPS = 10**9          # ~11 days at 1 ms a step; more is a typo, not a run
MAX_SEED = 2**32 - 1       # JAX PRNG keys and numpy seed sequences take it without overflow
MAX_RESTARTS = 1000        # a run that fails more often than this is not recovering

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
FACTORY_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
HOSTPORT_RE = re.compile(r"^(ray://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


def check_axis_name(name: Any, what: str, sub: tuple = ()) -> str:
    if not isinstance(name, str) or not IDENT_RE.match(name):
        raise Problem(f"{what} {name!r} must be an identifier (letters, digits, '_'; not starting "
                      "with a digit)", sub, name)
    return name


def layout_value(value: Any) -> dict[str, Rule]:
    """Validate and normalise a layout (mapping or Mesh-TF text) with per-key errors."""
    if value is None:
        return {}
    if isinstance(value, str):
        names = [p.partition(":")[0].strip() for p in value.split(";") if p.strip()]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise Problem(f"logical axis {dups[0]!r} has more than one rule in the layout text; "
                          "write each logical axis once")
        try:
            rules = parse_layout(value)
        except ValueError as e:
            raise Problem(f"invalid Mesh-TF layout text ({e}); write 'logical:mesh_axis;...', "
                          "e.g. 'batch:data;mlp:model'") from None
    elif isinstance(value, Mapping):
        for k, v in value.items():
            ok = v is None or isinstance(v, (str, FirstOf, Mapping)) or (
                isinstance(v, (list, tuple)) and v and all(isinstance(t, str) for t in v))
            if ok and isinstance(v, Mapping) and (set(v) != {"first"} or not isinstance(v.get("first"), list)
                                                  or not v["first"]):
                ok = False
            if not ok:
                raise Problem("must be a mesh axis name, a non-empty list of them (sharded over their "
                              "product), {first: [candidate, ...]} (the first that fits each stage) or null",
                              (k,), v)
        try:
            rules = parse_layout(value)
        except ValueError as e:
            raise Problem(str(e).partition(": ")[2] or str(e)) from None
    else:
        raise Problem(f"must be a mapping (logical: mesh_axis) or Mesh-TF text like "
                      f"'batch:data;mlp:model', not {type(value).__name__}")
    for logical, rule in rules.items():
        check_axis_name(logical, "logical axis", (logical,))
        for option in rule.first if isinstance(rule, FirstOf) else (rule,):
            axes = (option,) if isinstance(option, str) else tuple(option or ())
            for a in axes:
                check_axis_name(a, "mesh axis", (logical,))
            if len(set(axes)) != len(axes):
                raise Problem("a mesh axis may appear only once in a rule", (logical,), option)
    return rules
