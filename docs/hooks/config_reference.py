"""The job and cluster file references, generated from the pydantic models (never hand-copied).

Basic flow: `reference(JobConfig, ...)` walks the model's fields depth first; every nested
model becomes a section (its docstring, then one table row per key: type, default, rule,
description) reached at one or more key paths (`links.host`, `links.group` and `links.dcn`
share one section). A key's text is its `Field(description=...)`; its rule is what the type
says (bounds, choices); an example is the field's `examples=` where it has some, and each
section shows the section as a shipped file writes it (`examples/*.yaml`,
`cluster_configs/*.yaml`), read with the safe loader.

Invariant: a field without a description is an error (`MissingDescription`), so a model that
gains a key cannot build a reference without documenting it (`mkdocs build` fails, and so
does tests/test_docs_reference.py).
"""
from __future__ import annotations

import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo

ROOT = Path(__file__).resolve().parents[2]


class MissingDescription(ValueError):
    """Keys of a config model that have no description."""


@dataclass
class Section:
    """One model class as it appears in the file: the key paths that reach it, its rows."""

    model: type[BaseModel]
    paths: list[str] = field(default_factory=list)

    @property
    def anchor(self) -> str:
        return anchor_of(self.paths[0]) or "top"


def anchor_of(path: str) -> str:
    """The HTML id of a key path: `pipeline.stages[].mesh` -> `pipeline.stages.mesh`."""
    return path.replace("[]", "")


# ----------------------------------------------------------------------------- types

def _unwrap(tp: Any) -> tuple[Any, list]:
    """(the bare type, its constraint metadata) of a possibly Annotated type."""
    meta: list = []
    while typing.get_origin(tp) is typing.Annotated:
        args = typing.get_args(tp)
        tp, meta = args[0], meta + list(args[1:])
    return tp, meta


def _is_none(tp: Any) -> bool:
    return tp is type(None)


def _union_args(tp: Any) -> tuple | None:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return None


def models_in(tp: Any) -> Iterator[tuple[type[BaseModel], str]]:
    """Nested models in a field's type, each with its path suffix ('' or '[]' for a list item)."""
    tp, _ = _unwrap(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        yield tp, ""
        return
    for arg in _union_args(tp) or ():
        yield from models_in(arg)
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            for m, suffix in models_in(args[0]):
                yield m, "[]" + suffix


def _bounds(meta: list) -> list[str]:
    out = []
    for m in meta:
        items = m.metadata if isinstance(m, FieldInfo) else [m]
        for x in items:
            for cls, sym, attr in ((at.Ge, "≥", "ge"), (at.Gt, ">", "gt"), (at.Le, "≤", "le"), (at.Lt, "<", "lt")):
                if isinstance(x, cls):
                    v = getattr(x, attr)
                    out.append(f"{sym} {v:,}" if isinstance(v, int) and abs(v) >= 10**6 else f"{sym} {v:g}"
                               if isinstance(v, float) else f"{sym} {v}")
            if isinstance(x, at.MinLen):
                out.append(f"at least {x.min_length} entr{'y' if x.min_length == 1 else 'ies'}")
    return out


def type_text(tp: Any, links: dict[type, str], extra: list = ()) -> str:
    """A field type in words: `int (≥ 1)`, `"cpu" | "gpu"`, `list of [pipeline.stages](#pipeline.stages)`;
    `extra`: constraints pydantic moved from the field's Annotated type into its FieldInfo."""
    tp, meta = _unwrap(tp)
    meta = list(extra) + meta
    bounds = _bounds(meta)
    suffix = f" ({', '.join(bounds)})" if bounds else ""
    union = _union_args(tp)
    if union is not None:
        parts = [type_text(a, links) for a in union if not _is_none(a)]
        text = " or ".join(dict.fromkeys(parts))
        return (text + " or null" if any(_is_none(a) for a in union) else text) + suffix
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in typing.get_args(tp)) + suffix
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {type_text(args[0], links)}" + suffix
        return "[" + ", ".join(type_text(a, links) for a in args) + "]" + suffix
    if origin is dict:
        k, v = typing.get_args(tp)
        return f"mapping {type_text(k, links)} → {type_text(v, links)}" + suffix
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return f"[{links[tp]}](#{links[tp]})"
    if tp is Any:
        return "any" + suffix
    return getattr(tp, "__name__", str(tp)) + suffix


def default_text(info: FieldInfo) -> str:
    if info.is_required():
        return "**required**"
    value = info.default_factory() if info.default_factory is not None else info.default
    if isinstance(value, BaseModel):
        return "the section's defaults"
    if isinstance(value, float) and value.is_integer() and abs(value) >= 2**10:
        value = int(value)
    return f"`{json.dumps(value, default=list)}`"


# ----------------------------------------------------------------------------- walking

def sections(root: type[BaseModel]) -> list[Section]:
    """Every model reachable from `root`, depth first, each with the key paths that reach it."""
    found: dict[type, Section] = {}

    def walk(model: type[BaseModel], path: str) -> None:
        sec = found.setdefault(model, Section(model))
        sec.paths.append(path)
        for name, info in model.model_fields.items():
            key = info.alias or name
            for sub, suffix in models_in(info.annotation):
                walk(sub, f"{path}.{key}{suffix}" if path else f"{key}{suffix}")

    walk(root, "")
    return list(found.values())


def key_paths(root: type[BaseModel]) -> list[str]:
    """Every key path of a config file (`pipeline.stages[].mesh`), from the models alone."""
    out = []
    for sec in sections(root):
        for path in sec.paths:
            for name, info in sec.model.model_fields.items():
                key = info.alias or name
                out.append(f"{path}.{key}" if path else key)
    return out


def missing_descriptions(root: type[BaseModel]) -> list[str]:
    return [f"{sec.model.__name__}.{name}" for sec in sections(root)
            for name, info in sec.model.model_fields.items() if not (info.description or "").strip()]


# ----------------------------------------------------------------------------- markdown

def _doc(model: type[BaseModel]) -> str:
    import inspect

    return inspect.cleandoc(model.__doc__ or "").strip()


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def shipped_example(files: list[Path], path: str) -> tuple[Path, Any] | None:
    """The first shipped file that writes the section at `path` (no list items), and its value."""
    from orchestrator.core.safe_yaml import safe_load_file

    if "[]" in path:
        return None
    for f in files:
        value: Any = safe_load_file(f)
        for key in path.split(".") if path else []:
            value = value.get(key) if isinstance(value, dict) else None
        if value not in (None, {}, []):
            return f, value
    return None


def _yaml(path: str, value: Any) -> str:
    import yaml

    for key in reversed(path.split(".")):
        value = {key: value}
    return yaml.safe_dump(value, sort_keys=False, default_flow_style=None, width=100).rstrip()


def reference(root: type[BaseModel], *, title: str, intro: str, example_files: list[Path]) -> str:
    """The reference page of one config file, as markdown. Raises MissingDescription."""
    missing = missing_descriptions(root)
    if missing:
        raise MissingDescription("config keys without a description (add Field(description=...)): "
                                 + ", ".join(missing))
    secs = sections(root)
    links = {s.model: s.anchor for s in secs}
    out = [f"# {title}", "", intro.strip(), ""]
    for sec in secs:
        shown = ", ".join(f"`{p}`" for p in sec.paths) if sec.paths[0] else "top level"
        heading = sec.paths[0] or "Top-level keys"
        out += [f"## {heading} {{#{sec.anchor}}}", ""]
        if len(sec.paths) > 1:
            out += [f"Reached at: {shown}.", ""]
        out += [_doc(sec.model), ""]
        out += ["| key | type | default | what it does |", "|---|---|---|---|"]
        for name, info in sec.model.model_fields.items():
            key = info.alias or name
            text = _cell(info.description or "")
            if info.examples:
                text += " E.g. " + ", ".join(f"`{json.dumps(e)}`" for e in info.examples) + "."
            nested = [links[m] for m, _ in models_in(info.annotation)]
            if nested:                          # a section: its heading is the anchor
                cell = f"[`{key}`](#{nested[0]})"
            else:
                anchor = f"{sec.anchor}.{key}" if sec.paths[0] else key
                cell = f"[`{key}`](#{anchor}){{#{anchor}}}"
            out.append(f"| {cell} | {_cell(type_text(info.annotation, links, info.metadata))} "
                       f"| {default_text(info)} | {text} |")
        found = shipped_example(example_files, sec.paths[0])
        if found is not None and sec.paths[0]:
            f, value = found
            out += ["", f"As `{f.relative_to(ROOT)}` writes it:", "", "```yaml", _yaml(sec.paths[0], value), "```"]
        out.append("")
    return "\n".join(out)


JOB_INTRO = """
Every key of a job file (`meshpipe run JOB.yaml`), generated from the pydantic models in
`orchestrator/core/config/schema.py`. Unknown keys are refused (with the closest valid key
suggested), integers are strict (`"3"`, `3.0` and `true` are not integers), and every
problem is reported as `key.path = value: rule` before anything starts. The checks that need
the model or the cluster too (meshes against devices, layers against the model, layouts
against dims) run in `check_job`; [the job file guide](../guides/job-file.md) walks through
them. Any key can be overridden on the command line: `--set run.steps=3`.
"""

CLUSTER_INTRO = """
Every key of a cluster file (`--cluster CLUSTER.yaml`), generated from the pydantic models in
`orchestrator/core/config/cluster_schema.py`. Without `--cluster`, meshpipe uses
`cluster_configs/local.yaml` (an embedded Ray with 4 simulated hosts of 2 CPU devices).
Cluster keys are overridden with a `cluster.` prefix: `--set cluster.timeouts.step_s=60`.
[The cluster file guide](../guides/cluster-file.md) explains hosts, devices and platforms.
"""


def job_reference() -> str:
    from orchestrator.core.config import JobConfig

    files = [ROOT / "examples" / n for n in ("gpt.yaml", "llama.yaml", "gpt_tokens.yaml", "eqx.yaml", "mlp.yaml")]
    return reference(JobConfig, title="Job file reference", intro=JOB_INTRO, example_files=files)


def cluster_reference() -> str:
    from orchestrator.core.config import ClusterConfig

    files = [ROOT / "cluster_configs" / n for n in ("local.yaml", "gpu-2x8.yaml", "tpu-v5e-16.yaml",
                                                      "sim-multinode.yaml")]
    return reference(ClusterConfig, title="Cluster file reference", intro=CLUSTER_INTRO, example_files=files)
