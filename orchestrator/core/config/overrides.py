"""Command-line overrides: `key.path=value`, applied to the raw YAML dict before validation.

Syntax: `pipeline.stages[1].mesh.model=2` or `pipeline.stages.1.mesh.model=2`.
The value is YAML read with the safe loader (`3` is an int, `'3'` a string,
`[0, 2]` a list, `null` None, an empty value None).

Rules: every segment must be a key the schema knows (else `ConfigError` with
the closest valid key), list indices must exist, and only free-form mappings
(`model.args`, `optimizer.args`, `layout`, a stage's `mesh` / `layout`,
`resources_per_host`) accept new keys. A schema key missing from the YAML is
created (`data.seq_len=32` works when the file has no `seq_len`).
"""
from __future__ import annotations

import copy
import re
from typing import Any, Iterable, Mapping

from pydantic import BaseModel

from orchestrator.core.config.errors import ConfigError, fmt_path, fmt_value, suggest
from orchestrator.core.config.schema import JobConfig, field_kind, unknown_key_hint
from orchestrator.core.redact import REDACTED, is_secret_key, redact
from orchestrator.core.safe_yaml import YamlError, safe_load_value
from orchestrator.core.model.layout import parse_layout

__all__ = ["apply_overrides", "parse_key_path", "shown"]

_SEGMENT_RE = re.compile(r"^([^\[\]]*)((?:\[\d+\])*)$")


def parse_key_path(key: str) -> list[str | int]:
    """`"pipeline.stages[1].mesh.model"` → `["pipeline", "stages", 1, "mesh", "model"]`.

    Example:
        >>> parse_key_path("pipeline.stages.1.layers")
        ['pipeline', 'stages', 1, 'layers']
    """
    tokens: list[str | int] = []
    for piece in key.split("."):
        m = _SEGMENT_RE.match(piece)
        if not m or (not m.group(1) and not m.group(2)):
            raise ValueError(f"malformed key path {key!r}: empty or bad segment {piece!r}")
        name, idx = m.group(1), m.group(2)
        if name:
            tokens.append(int(name) if name.isdigit() else name)
        tokens.extend(int(i) for i in re.findall(r"\[(\d+)\]", idx))
    return tokens


def shown(item: str) -> str:
    """An override as it may be printed: the value of a secret-looking key is redacted.

    Example:
        >>> shown("cluster.env_vars.HF_TOKEN=hf_x"), shown("run.steps=3")
        ('cluster.env_vars.HF_TOKEN=<redacted>', 'run.steps=3')
    """
    if not isinstance(item, str) or "=" not in item:
        return item
    key, _, _ = item.partition("=")
    parts = key.strip().replace("[", ".").split(".")
    return f"{key}={REDACTED}" if any(is_secret_key(p) for p in parts) else item


def _shown_value(node: Any, path: list) -> str:
    names = [t for t in path if isinstance(t, str)]
    return fmt_value(redact(node, names[-1] if names else None))


def _fail(item: str, path: list, rule: str) -> ConfigError:
    return ConfigError(f"override {shown(item)!r}: {fmt_path(path)}: {rule}")


def _set(root: dict, tokens: list, value: Any, schema: type[BaseModel], item: str) -> None:
    node: Any = root
    kind, cls = "model", schema
    for i, tok in enumerate(tokens):
        here, last = tokens[: i + 1], i == len(tokens) - 1
        if kind == "model":
            if not isinstance(node, dict):
                raise _fail(item, tokens[:i],
                            f"is {_shown_value(node, tokens[:i])}, not a mapping; set it whole instead")
            fields = list(cls.model_fields)
            if not isinstance(tok, str) or tok not in cls.model_fields:
                hint = suggest(tok, fields) or unknown_key_hint(schema, tuple(here), fields)
                raise _fail(item, here, f"unknown key{hint}")
            child_kind, child_cls = field_kind(cls, tok)
            if last:
                node[tok] = value
                return
            if node.get(tok) is None:
                if child_kind == "list":
                    raise _fail(item, here, "index out of range; the list is empty or missing")
                if child_kind == "leaf":
                    raise _fail(item, here, f"is a single value, not a section; set it whole: "
                                            f"{fmt_path(here)}=<value>")
                node[tok] = {}
            elif tok == "layout" and isinstance(node[tok], str):  # Mesh-TF text → mapping
                try:
                    node[tok] = {k: list(v) if isinstance(v, tuple) else v
                                 for k, v in parse_layout(node[tok]).items()}
                except ValueError as e:
                    raise _fail(item, here, f"cannot edit this layout text: {e}") from None
            node, kind, cls = node[tok], child_kind, child_cls
            if kind == "leaf":
                raise _fail(item, here, f"is a single value, not a section; set it whole: "
                                        f"{fmt_path(here)}=<value>")
        elif kind == "list":
            if not isinstance(node, list):
                raise _fail(item, tokens[:i], f"is {_shown_value(node, tokens[:i])}, not a list; set it whole instead")
            if not isinstance(tok, int):
                raise _fail(item, here, f"expected a list index (0..{len(node) - 1}), got {tok!r}")
            if not 0 <= tok < len(node):
                raise _fail(item, here, f"index out of range; the list has {len(node)} item(s)")
            if last:
                node[tok] = value
                return
            node, kind = node[tok], "model"
        else:  # free-form mapping: any key, created on demand
            if not isinstance(node, dict):
                raise _fail(item, tokens[:i],
                            f"is {_shown_value(node, tokens[:i])}, not a mapping; set it whole instead")
            key = str(tok)
            if last:
                node[key] = value
                return
            if node.get(key) is None:
                node[key] = {}
            node = node[key]


def apply_overrides(raw: Mapping[str, Any], overrides: Iterable[str] | None,
                    schema: type[BaseModel] = JobConfig) -> dict[str, Any]:
    """A deep copy of `raw` with each `key.path=value` applied in order.

    Raises:
      ConfigError: malformed item (no `=`), unknown key (closest one suggested),
        index out of range, unsafe or invalid YAML value.

    Example:
        >>> apply_overrides({"run": {"steps": 20}}, ["run.steps=3", "model.args.blocks=4"])
        {'run': {'steps': 3}, 'model': {'args': {'blocks': 4}}}
    """
    out = copy.deepcopy(dict(raw))
    for item in overrides or ():
        if not isinstance(item, str) or "=" not in item:
            raise ConfigError(f"override {shown(item)!r}: malformed; write key.path=value, e.g. run.steps=3")
        key, _, text = item.partition("=")
        key = key.strip()
        try:
            tokens = parse_key_path(key)
        except ValueError as e:
            raise ConfigError(f"override {shown(item)!r}: {e}; write key.path=value, e.g. "
                              "pipeline.stages[1].mesh.model=2") from None
        try:
            value = safe_load_value(text, source=f"override {key}")
        except YamlError as e:
            raise ConfigError(f"override {shown(item)!r}: {key}: value is not valid safe YAML: {e}") from None
        _set(out, tokens, value, schema, item)
    return out
