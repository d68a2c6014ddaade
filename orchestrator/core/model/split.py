"""Named split points: stage boundaries given by a part's name or attribute path (pure).

A job may cut the pipeline by naming where each stage after the first begins,
the way torch pipelining names module paths, instead of giving layer index ranges:

    pipeline:
      split_at: ["blocks.2", "head"]      # 3 stages: [embed, blocks.0, blocks.1] [blocks.2, blocks.3] [head]

A split point names a part (`LayerSpec.name`: "blocks.2", "head", a built-in's
"block1") or the first attribute path the part holds (`LayerSpec.paths[0]`: the
nnx head part ("head", ("norm", "lm_head")) starts at "norm"). A stage boundary
falls between parts, so a path inside a part ("lm_head") or the first part of the
model is refused with the valid names listed.

`split_ranges(model, names)` turns the names into half-open layer ranges, one per
(virtual) stage, in pipeline order. No jax here.
"""
from __future__ import annotations

import difflib
from typing import Sequence

from orchestrator.core.model.spec import ModelSpec

__all__ = ["SplitError", "split_names", "split_ranges"]


class SplitError(ValueError):
    """A split point that cannot be used: `index` into split_at, the `name`, the `rule` broken."""

    def __init__(self, index: int, name: str, rule: str):
        super().__init__(f"split_at[{index}] = {name!r}: {rule}")
        self.index, self.name, self.rule = index, name, rule


def split_names(model: ModelSpec) -> dict[str, int]:
    """Every name a split point may use → the index of the part it starts.

    Example:
        >>> from orchestrator.core.model.registry import build_spec
        >>> split_names(build_spec("mlp", {"blocks": 2}))
        {'block0': 1, 'block1': 2, 'out': 3}
    """
    out: dict[str, int] = {}
    for i, layer in enumerate(model.layers[1:], start=1):
        for name in (layer.name, *layer.paths[:1]):
            out.setdefault(name, i)
    return out


def _inside(model: ModelSpec, name: str) -> str | None:
    """The part that holds attribute path `name` (or a path below it) without starting there."""
    for i, layer in enumerate(model.layers):
        for j, path in enumerate(layer.paths):
            if name.startswith(path + ".") or (name == path and j > 0):
                return f"{i}:{layer.name}"
    return None


def split_ranges(model: ModelSpec, names: Sequence[str]) -> tuple[tuple[int, int], ...]:
    """The layer range [start, stop) of each stage cut at `names` (len(names) + 1 ranges).

    Raises:
      SplitError: a name that starts no part (the valid names are listed), the model's first
        part, or a point not after the previous one.

    Example:
        >>> from orchestrator.core.model.registry import build_spec
        >>> split_ranges(build_spec("mlp", {"blocks": 2}), ["block1"])
        ((0, 2), (2, 4))
    """
    valid = split_names(model)
    listing = ", ".join(valid)
    parts = " ".join(f"{i}:{layer.name}" for i, layer in enumerate(model.layers))
    starts: list[int] = []
    for k, name in enumerate(names):
        if name not in valid:
            first = model.layers[0]
            if name in (first.name, *first.paths[:1]):
                rule = (f"the first stage always starts at part 0 ({first.name}); split points name where "
                        f"the later stages begin (valid: {listing})")
            elif (holder := _inside(model, name)) is not None:
                rule = (f"is inside part {holder}, not where a part begins; a stage boundary falls between "
                        f"parts (valid split points: {listing})")
            else:
                close = difflib.get_close_matches(name, list(valid), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                rule = (f"no part of model {model.name!r} starts there{hint}; valid split points: {listing} "
                        f"(the model's parts: {parts})")
            raise SplitError(k, name, rule)
        at = valid[name]
        if starts and at <= starts[-1]:
            prev = names[k - 1]
            raise SplitError(k, name, f"starts part {at} ({model.layers[at].name}), not after the previous "
                                      f"split point {prev!r} (part {starts[-1]}); list split points in "
                                      "pipeline order, each once")
        starts.append(at)
    bounds = [0, *starts, model.num_layers]
    return tuple((a, b) for a, b in zip(bounds, bounds[1:]))
