"""Walking the config schema (which keys live where, for hints and overrides) and turning pydantic's
validation errors into meshpipe's `key.path = value: rule` lines.

Generic over the section models: nothing here imports a section.
"""
from __future__ import annotations

import re
import typing
from typing import Annotated, Any, Mapping, Optional, Union

from pydantic import BaseModel, ValidationError

from orchestrator.core.config.errors import ConfigError, Problem, fmt_value, problem, problem_nv, suggest
from orchestrator.core.redact import redact



def _unwrap(tp: Any) -> Any:
    while True:
        origin = typing.get_origin(tp)
        if origin is Annotated:
            tp = typing.get_args(tp)[0]
        elif origin is Union:
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) != 1:
                return tp
            tp = args[0]
        else:
            return tp


def field_kind(cls: type[BaseModel], name: str) -> tuple[str, Any]:
    """What a field holds: ("model", cls) | ("list", item_cls) | ("free", None) | ("leaf", None).

    "free" fields are mappings whose keys the user chooses (model.args, layout, mesh, ...).
    """
    tp = _unwrap(cls.model_fields[name].annotation)
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return "model", tp
    if origin in (tuple, list):
        item = _unwrap(typing.get_args(tp)[0])
        if isinstance(item, type) and issubclass(item, BaseModel):
            return "list", item
    if origin is dict or tp is dict:
        return "free", None
    return "leaf", None


def key_homes(root: type[BaseModel], name: Any, prefix: str = "") -> list[str]:
    """Every section of the schema that has a key `name` (`steps` → `['run']`).

    Example:
        >>> key_homes(JobConfig, "global_batch"), key_homes(JobConfig, "hosts")
        (['data'], ['pipeline.stages[i]'])
    """
    out: list[str] = []
    for field in root.model_fields:
        kind, cls = field_kind(root, field)
        if kind not in ("model", "list"):
            continue
        path = (f"{prefix}.{field}" if prefix else field) + ("[i]" if kind == "list" else "")
        if name in cls.model_fields:
            out.append(path)
        out += key_homes(cls, name, path)
    return out


def unknown_key_hint(root: type[BaseModel], loc: tuple, valid: list[str]) -> str:
    """`"; did you mean 'x'?"`, or where the key belongs when it is misplaced, or the valid keys."""
    name = loc[-1]
    homes = key_homes(root, name)
    if name in root.model_fields and loc[:-1]:
        homes.insert(0, "the top level")
    if homes:
        where = homes[0] if len(homes) == 1 else ", ".join(homes[:-1]) + " or " + homes[-1]
        first = str(name) if homes[0] == "the top level" else f"{homes[0]}.{name}"
        return f"; '{name}' is a key of {where} (wrong nesting?), e.g. {first}"
    return suggest(name, valid) or (f"; valid keys: {', '.join(valid)}" if valid else "")


def _model_at(root: type[BaseModel], loc: tuple) -> Optional[type[BaseModel]]:
    """The model class that holds the last element of `loc`, or None if not a model."""
    cls: Any = root
    kind = "model"
    for part in loc[:-1]:
        if kind == "model" and isinstance(part, str) and part in cls.model_fields:
            kind, cls = field_kind(cls, part)
        elif kind == "list" and isinstance(part, int):
            kind = "model"
        else:
            return None
    return cls if kind == "model" else None


# ----------------------------------------------------------------------------- error conversion

def _type_name(v: Any) -> str:
    return {bool: "a boolean", str: "a string", int: "an integer", float: "a number",
            list: "a list", dict: "a mapping", type(None): "null"}.get(type(v), type(v).__name__)


def _rule_for(err: dict) -> str:
    t, ctx, v = err["type"], err.get("ctx") or {}, err.get("input")
    if t == "int_type":
        return f"must be an integer, not {_type_name(v)}"
    if t in ("float_type", "finite_number"):
        return ("must be a finite number" if t == "finite_number"
                else f"must be a number, not {_type_name(v)}")
    if t == "string_type":
        return f"must be a string, not {_type_name(v)}"
    if t == "bool_type":
        return f"must be true or false, not {_type_name(v)}"
    if t == "greater_than_equal":
        return f"must be >= {ctx.get('ge')}"
    if t == "greater_than":
        return f"must be > {ctx.get('gt')}"
    if t in ("dict_type", "model_type", "model_attributes_type"):
        return f"must be a mapping (key: value), not {_type_name(v)}"
    if t in ("list_type", "tuple_type"):
        return f"must be a list, not {_type_name(v)}"
    if t == "too_short":
        return f"must have at least {ctx.get('min_length')} item(s)"
    if t == "literal_error":
        choices = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        return f"must be one of {', '.join(repr(c) for c in choices)}{suggest(v, choices)}"
    return err["msg"]


def _convert(exc: ValidationError, root: type[BaseModel]) -> list[str]:
    out: list[str] = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        t = err["type"]
        if t == "extra_forbidden":
            cls = _model_at(root, loc)
            valid = list(cls.model_fields) if cls else []
            hint = suggest(loc[-1], valid) or unknown_key_hint(root, loc, valid)
            value = fmt_value(redact(err.get("input"), loc[-1]))
            out.append(f"{problem_nv(loc, 'unknown key' + hint)} (value {value})")
            continue
        if t == "missing":
            out.append(problem_nv(loc, "required key is missing"))
            continue
        if loc and loc[-1] == "[key]":
            out.append(problem(loc[:-2], loc[-2], "keys must be strings"))
            continue
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, Problem):
            value = cause.value if cause.has_value else err.get("input")
            value = list(value) if isinstance(value, tuple) else value
            out.append(problem(loc + cause.sub, value, cause.rule))
            continue
        value = err.get("input")
        out.append(problem(loc, list(value) if isinstance(value, tuple) else value, _rule_for(err)))
    return out


_CONTROL_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")   # tab and newline allowed
_KEY_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _control_characters(raw: Any, loc: tuple = ()) -> list[str]:
    """A problem line per key or string value holding a control character (YAML lets a
    double-quoted string spell any character as an escape; values may hold tabs and newlines)."""
    out = []
    if isinstance(raw, Mapping):
        for k, v in raw.items():
            if isinstance(k, str) and _KEY_CONTROL_RE.search(k):
                out.append(problem(loc + (repr(k),), v, "a key must not contain control characters"))
            else:
                out += _control_characters(v, loc + (k,))
    elif isinstance(raw, (list, tuple)):
        for i, v in enumerate(raw):
            out += _control_characters(v, loc + (i,))
    elif isinstance(raw, str) and _CONTROL_RE.search(raw):
        c = _CONTROL_RE.search(raw).group()
        what = "a NUL byte (U+0000)" if c == "\x00" else f"control character U+{ord(c):04X}"
        out.append(problem(loc, raw, f"contains {what}; names, paths and values must be printable text"))
    return out


def parse_model(cls: type[BaseModel], raw: Any, source: Optional[str]) -> Any:
    if not isinstance(raw, Mapping):
        raise ConfigError(problem("<top level>", raw, "must be a mapping of sections"), source)
    bad = _control_characters(raw)
    if bad:
        raise ConfigError(bad, source)
    try:
        return cls.model_validate(dict(raw))
    except ValidationError as e:
        raise ConfigError(_convert(e, cls), source) from None
