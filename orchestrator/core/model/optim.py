"""Optimizers as optax chains from YAML (pure description; optax imported inside functions).

The job's `optimizer:` is either one optax function (`{name: adam, args: {...}}`) or a chain:

    optimizer:
      chain:
        - {name: clip_by_global_norm, args: {max_norm: 1.0}}      # GLOBAL across stages
        - name: adamw
          args:
            learning_rate: {schedule: warmup_cosine_decay_schedule,
                            args: {init_value: 0.0, peak_value: 3e-3, warmup_steps: 10, decay_steps: 100}}
            weight_decay: 0.01
            mask: {exclude: ["*norm*", "*/bias", "*/b"]}          # no decay on norms and biases

An argument written `{schedule: <optax schedule function>, args: {...}}` becomes that
schedule; `mask: {exclude: [patterns]}` / `{include: [...]}` becomes a mask over the
parameter names ("<part name>/<leaf path>", fnmatch patterns).

`clip_by_global_norm` may only come first. It is taken out of the chain and done by the
stages together: every stage's squared gradient norm is exchanged (one scalar per stage)
before any stage updates, so the norm is that of the whole model's gradients — the
single-process `optax.clip_by_global_norm` value — and the same scale applies everywhere.

What each hyperparameter means (ranges, schedules' values, the chain's direction) is checked at
plan time by `orchestrator.core.model.optim_rules`; `build` reports only what optax itself rejects.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

__all__ = ["Built", "OptimError", "build", "normalize", "schedule_fn"]


class OptimError(ValueError):
    """A bad optimizer entry: the key path, the value and the rule."""

    def __init__(self, key: str, value: Any, rule: str):
        super().__init__(f"{key} = {value!r}: {rule}")
        self.key, self.value, self.rule = key, value, rule


@dataclass(frozen=True)
class Built:
    """The stage-local optax transformation, and the global clip threshold (None: no clipping)."""

    tx: Any
    clip: Optional[float]


def normalize(spec: Any) -> list[dict]:
    """The chain as [{name, args}]: from {name, args}, {chain: [...]} or a (name, args) pair."""
    if isinstance(spec, (tuple, list)) and len(spec) == 2 and isinstance(spec[0], str):
        return [{"name": spec[0], "args": dict(spec[1] or {})}]
    if isinstance(spec, Mapping) and spec.get("chain"):
        return [{"name": e["name"], "args": dict(e.get("args") or {})} for e in spec["chain"]]
    return [{"name": spec["name"], "args": dict(spec.get("args") or {})}]


def schedule_fn(value: Mapping[str, Any]):
    """The optax schedule function `{schedule: name, args: {...}}` names, or ValueError (the rule)."""
    import optax

    name = str(value["schedule"])
    fn = getattr(optax, name, None)
    if fn is None or not callable(fn) or not name.endswith("schedule"):
        raise ValueError("not an optax schedule function (e.g. warmup_cosine_decay_schedule, "
                         "cosine_decay_schedule)")
    return fn


def _mask(rule: Mapping[str, Any], names: Callable) -> Callable:
    include = list(rule.get("include") or [])
    exclude = list(rule.get("exclude") or [])

    def mask(params):
        import jax

        def keep(name: str) -> bool:
            if include and not any(fnmatch.fnmatchcase(name, p) for p in include):
                return False
            return not any(fnmatch.fnmatchcase(name, p) for p in exclude)

        return jax.tree.map(keep, names(params))

    return mask


def _value(key: str, value: Any, names: Callable):
    if isinstance(value, Mapping) and "schedule" in value:
        try:
            fn = schedule_fn(value)
        except ValueError as e:
            raise OptimError(f"{key}.schedule", value["schedule"], str(e)) from None
        return fn(**dict(value.get("args") or {}))
    if key.endswith("mask") and isinstance(value, Mapping):
        unknown = set(value) - {"include", "exclude"}
        if unknown:
            raise OptimError(key, dict(value), f"unknown keys {sorted(unknown)} (use include / exclude pattern lists)")
        return _mask(value, names)
    return value


def build(spec: Any, names: Callable = lambda params: params, *, where: str = "optimizer") -> Built:
    """The optax chain of `spec` (see the module docstring).

    Args:
      spec: the job's optimizer section (mapping) or a (name, args) pair.
      names: params -> the same pytree with each leaf's name (for masks).
      where: the key prefix errors name.

    Raises OptimError naming `where.chain[i]...` for an unknown optax name, a schedule that is
    not one, arguments optax rejects, or clip_by_global_norm anywhere but first.
    """
    import optax

    chain = normalize(spec)
    clip = None
    parts = []
    for i, entry in enumerate(chain):
        key = f"{where}.chain[{i}]" if len(chain) > 1 or (isinstance(spec, Mapping) and "chain" in spec) else where
        name, args = entry["name"], entry["args"]
        fn = getattr(optax, name, None) if isinstance(name, str) and not name.startswith("_") else None
        if fn is None or not callable(fn) or isinstance(fn, type):
            raise OptimError(f"{key}.name", name, "not an optax function")
        if name == "clip_by_global_norm":
            if i != 0:
                raise OptimError(f"{key}.name", name, "must come first in the chain (the global norm is "
                                 "taken over the raw gradients of every stage)")
            try:
                clip = float(args["max_norm"])
            except (KeyError, TypeError, ValueError):
                raise OptimError(f"{key}.args", args, "clip_by_global_norm needs a number max_norm") from None
            if not clip > 0:
                raise OptimError(f"{key}.args.max_norm", args["max_norm"], "must be > 0")
            continue
        resolved = {k: _value(f"{key}.args.{k}", v, names) for k, v in args.items()}
        try:
            tx = fn(**resolved)
        except (TypeError, ValueError) as e:
            raise OptimError(f"{key}.args", args, f"optax.{name} rejects these arguments: {e}") from None
        if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
            raise OptimError(f"{key}.name", name, f"optax.{name}(...) returned {type(tx).__name__}, not a "
                             "GradientTransformation")
        parts.append(tx)
    tx = parts[0] if len(parts) == 1 else optax.chain(*parts)
    return Built(tx, clip)
