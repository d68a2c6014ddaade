"""Optimizer hyperparameters checked by their meaning, wherever they are written (pure; optax and jax
are imported inside functions, for CPU-side schedule evaluation only).

One rule table (`RULES`), keyed by the argument's name, applies to every place an optax argument
can appear: `optimizer.args`, each `optimizer.chain[i].args`, and the `args` of a schedule
(`{schedule: <optax schedule>, args: {...}}`). Basic flow of `problems(spec, steps, allow_ascent)`:

  1. every number anywhere in the section must be finite (no `.nan` / `.inf`);
  2. each named argument must hold its rule (`learning_rate` > 0 and at most MAX_LEARNING_RATE,
     `b1`/`b2`/`decay`/`momentum` in [0, 1), `eps` > 0, `weight_decay` >= 0, ...); a value equal
     to optax's own default for that function is always accepted (`lars` has eps 0);
  3. each schedule is built and evaluated at the run's steps (every step up to `DENSE_STEPS`,
     beyond that `DENSE_STEPS` evenly spaced steps plus the steps either side of every
     integer argument, where piecewise schedules change): the values must hold the rule of the
     argument the schedule stands for — a learning-rate schedule must be finite, >= 0 at every
     step (a warmup may start at 0), > 0 at some step and never above MAX_LEARNING_RATE;
  4. the chain's direction: optax updates are *added* to the parameters, so a chain descends
     only if an odd number of its functions turn the update around — an optimizer taking a
     `learning_rate` (adam, sgd, ... multiply by -learning_rate), `scale_by_learning_rate`
     (unless `flip_sign: false`), `scale` with a negative `step_size`, a negative
     `scale_by_schedule`. An even number (none: `[scale_by_adam, scale(+1e-3)]`; two:
     `[adam, sgd]`) climbs the loss: refused unless `optimizer.allow_ascent: true`.

Each problem is (key path, value, rule), in the style of the config errors.
"""
from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Iterator, Mapping, Optional

from orchestrator.core.model.optim import normalize, schedule_fn

__all__ = ["RULES", "MAX_LEARNING_RATE", "DENSE_STEPS", "problems"]

MAX_LEARNING_RATE = 100.0
DENSE_STEPS = 100_000        # a schedule is evaluated at every step up to this many steps


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_UNIT = (lambda v: 0 <= v < 1, "must be in [0, 1): it is a decay rate (the share of the running average kept "
         "each step; 1 or more never forgets or grows without bound)")
_POS = (lambda v: v > 0, "must be > 0")
_NONNEG = (lambda v: v >= 0, "must be >= 0")

# argument name -> (holds(value) -> bool, the rule). Numbers only; None (optax's "off") is always fine.
RULES: dict[str, tuple[Callable[[float], bool], str]] = {
    "learning_rate": (lambda v: 0 < v <= MAX_LEARNING_RATE, "must be a number > 0 (e.g. 0.001 or 1e-3) and at "
                      f"most {MAX_LEARNING_RATE:g} (a larger step diverges or overflows on the first update)"),
    "step_size": (lambda v: v != 0 and abs(v) <= MAX_LEARNING_RATE, "must be non-zero and at most "
                  f"{MAX_LEARNING_RATE:g} in size (it is the learning rate of a chain ending in `scale`)"),
    "b1": _UNIT, "b2": _UNIT, "b3": _UNIT, "decay": _UNIT, "rho": _UNIT, "momentum": _UNIT,
    "eps": (lambda v: v > 0, "must be > 0 (it keeps the division by the second moment finite; 0 is "
            "allowed with eps_root > 0 in the same entry, or where optax's own default is 0, as for lars)"),
    "epsilon": _POS, "eps_root": _NONNEG,
    "weight_decay": (lambda v: v >= 0, "must be >= 0 (a negative decay pushes the weights to grow)"),
    "weight_decay_rate": _NONNEG, "initial_accumulator_value": _NONNEG, "alpha": _NONNEG,
    "max_norm": _POS, "max_delta": _POS, "threshold": _POS, "clipping_threshold": _POS,
    "trust_coefficient": _POS, "decay_rate": _POS, "min_scale": _POS,
    "warmup_steps": _NONNEG, "decay_steps": _NONNEG, "transition_steps": _NONNEG, "transition_begin": _NONNEG,
}


def _numbers(value: Any, loc: str) -> Iterator[tuple[str, Any]]:
    """(key path, number) of every int/float inside `value` (dicts and lists walked)."""
    if _number(value):
        yield loc, value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _numbers(v, f"{loc}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _numbers(v, f"{loc}[{i}]")


def _is_schedule(v: Any) -> bool:
    return isinstance(v, Mapping) and "schedule" in v


def _defaults(fn) -> dict[str, Any]:
    """optax's own default of each argument of `fn` (a value equal to it is never refused: e.g.
    `lars` defaults to eps 0)."""
    try:
        return {k: p.default for k, p in inspect.signature(fn).parameters.items() if p.default is not p.empty}
    except (TypeError, ValueError):
        return {}


def _arg_problems(key: str, args: Mapping[str, Any], out: list, defaults: Mapping[str, Any]) -> None:
    """Rules 1 and 2 over one `args` mapping (a schedule's args included, recursively)."""
    import optax

    for k, v in args.items():
        where = f"{key}.{k}"
        if _is_schedule(v):
            sched_args = v.get("args") or {}
            if not isinstance(sched_args, Mapping):
                out.append((f"{where}.args", sched_args, "must be a mapping of the schedule's keyword arguments"))
                continue
            _arg_problems(f"{where}.args", sched_args, out, _defaults(getattr(optax, str(v["schedule"]), None)))
            continue
        bad = [(loc, n) for loc, n in _numbers(v, where) if isinstance(n, float) and not math.isfinite(n)]
        for loc, n in bad:
            out.append((loc, n, "must be a finite number (not NaN or infinity)"))
        if bad or k not in RULES or v is None or k == "mask" or (_number(v) and v == defaults.get(k)):
            continue
        holds, rule = RULES[k]
        if not _number(v):
            out.append((where, v, f"must be a number; {rule}" if k != "learning_rate" else rule))
        elif k == "eps" and v == 0 and _number(args.get("eps_root")) and args["eps_root"] > 0:
            continue
        elif not holds(v):
            out.append((where, v, rule))


def _marks(args: Mapping[str, Any]) -> list[int]:
    """Integer-valued arguments of a schedule (and keys of boundaries_and_scales): where it may change."""
    out = [int(v) for _, v in _numbers(dict(args), "") if isinstance(v, int)]
    bs = args.get("boundaries_and_scales")
    if isinstance(bs, Mapping):
        out += [int(k) for k in bs if isinstance(k, int) or (isinstance(k, str) and k.isdigit())]
    return out


def _values(fn, steps: int, marks: list[int]):
    """(steps evaluated, the schedule's values there) as numpy arrays (module docstring, step 3)."""
    import jax
    import numpy as np

    if steps <= DENSE_STEPS:
        xs = np.arange(steps)
    else:
        near = [m + d for m in marks for d in (-1, 0, 1) if 0 <= m + d < steps]
        xs = np.unique(np.concatenate([np.linspace(0, steps - 1, DENSE_STEPS).astype(np.int64),
                                       np.asarray(near, dtype=np.int64)]))
    f = jax.jit(fn)
    try:
        vals = np.broadcast_to(np.asarray(f(xs), dtype=np.float64), xs.shape)
    except (TypeError, ValueError):      # a schedule written for one step at a time (e.g. the onecycles)
        xs = xs[np.unique(np.linspace(0, len(xs) - 1, min(len(xs), 4096)).astype(np.int64))]
        vals = np.array([float(f(int(x))) for x in xs])
    return xs, vals


def _schedule_problems(key: str, name: str, value: Mapping[str, Any], steps: int, out: list):
    """Rule 3 for the schedule written at `key` (argument `name`); its values, or None after a problem."""
    try:
        fn = schedule_fn(value)
    except ValueError as e:
        out.append((f"{key}.schedule", value["schedule"], str(e)))
        return None
    args = dict(value.get("args") or {})
    try:
        xs, vals = _values(fn(**args), steps, _marks(args))
    except Exception as e:  # noqa: BLE001 - optax raises several types for arguments it rejects
        out.append((key, dict(value), f"optax.{value['schedule']} rejects these arguments: {type(e).__name__}: {e}"))
        return None
    import numpy as np

    bad = np.flatnonzero(~np.isfinite(vals))
    where = f"the schedule over run.steps = {steps}"
    if len(bad):
        out.append((key, dict(value), f"{where} is {vals[bad[0]]} at step {xs[bad[0]]}: must be finite"))
        return None
    if name == "learning_rate":
        if (vals < 0).any():
            i = int(np.argmax(vals < 0))
            out.append((key, dict(value), f"{where} is {vals[i]:g} at step {xs[i]}: a learning rate must be >= 0 "
                        "at every step (a negative one climbs the loss)"))
        elif not (vals > 0).any():
            out.append((key, dict(value), f"{where} is 0 at every step: nothing would be learned"))
        elif vals.max() > MAX_LEARNING_RATE:
            i = int(np.argmax(vals))
            out.append((key, dict(value), f"{where} reaches {vals[i]:g} at step {xs[i]}: a learning rate must "
                        f"be at most {MAX_LEARNING_RATE:g}"))
    elif name in RULES:
        holds, rule = RULES[name]
        ok = np.array([holds(float(v)) for v in vals])
        if not ok.all():
            i = int(np.argmin(ok))
            out.append((key, dict(value), f"{where} is {vals[i]:g} at step {xs[i]}: {name} {rule}"))
    return vals


def _direction(name: str, args: Mapping[str, Any], fn, sched_vals: dict) -> tuple[int, Optional[str]]:
    """(+1 / -1: whether this function keeps or turns the update's sign, why it turns it)."""
    if name == "scale_by_learning_rate":
        return (-1, "scale_by_learning_rate") if args.get("flip_sign", True) else (1, None)
    if name == "scale":
        v = args.get("step_size")
        return (-1, f"scale (step_size {v:g})") if _number(v) and v < 0 else (1, None)
    if name == "normalize_by_update_norm":
        v = args.get("scale_factor", 1.0)
        return (-1, f"normalize_by_update_norm (scale_factor {v:g})") if _number(v) and v < 0 else (1, None)
    if name == "scale_by_schedule":
        vals = sched_vals.get("step_size_fn")
        return (-1, "scale_by_schedule (a negative schedule)") if vals is not None and (vals < 0).all() else (1, None)
    try:
        takes_lr = "learning_rate" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        takes_lr = False
    return (-1, f"{name} (learning_rate)") if takes_lr else (1, None)


def _ascent(spec: Any, entries: list[dict], turns: list[str], out: list) -> None:
    chain = isinstance(spec, Mapping) and "chain" in spec
    key, value = ("optimizer.chain", [e["name"] for e in entries]) if chain else ("optimizer.name", entries[0]["name"])
    ask = "or set optimizer.allow_ascent: true to climb on purpose"
    if not turns:
        what = "the chain" if chain else f"optax.{entries[0]['name']}"
        out.append((key, value, f"{what} takes no learning_rate and scales by no negative step: the updates "
                    "follow the gradient up, so training would climb the loss (gradient ascent); use an "
                    "optimizer such as 'adam', 'adamw' or 'sgd', end a chain with {name: scale, args: "
                    f"{{step_size: -0.001}}}}, {ask}"))
    else:
        out.append((key, value, f"{len(turns)} functions each turn the update downhill ({', '.join(turns)}), so "
                    "together they turn it back uphill (gradient ascent); keep one of them (an optimizer "
                    f"already applies its learning rate), {ask}"))


def problems(spec: Any, steps: int, allow_ascent: bool = False) -> list[tuple[str, Any, str]]:
    """Every rule the optimizer section `spec` breaks (see the module docstring), as (key, value, rule).

    Args:
      spec: the job's `optimizer.spec()`: {name, args} or {chain: [{name, args}, ...]}.
      steps: `run.steps` (schedules are evaluated at steps 0 .. steps - 1).
      allow_ascent: `optimizer.allow_ascent` (a chain that climbs the loss is then accepted).

    Example:
        >>> [k for k, _, _ in problems({"name": "adam", "args": {"learning_rate": 1e-3, "b1": 1.0}}, 10)]
        ['optimizer.args.b1']
        >>> problems({"chain": [{"name": "scale_by_adam", "args": {}},
        ...                     {"name": "scale", "args": {"step_size": 1e-3}}]}, 10)[0][0]
        'optimizer.chain'
    """
    import optax

    entries = normalize(spec)
    chain = isinstance(spec, Mapping) and "chain" in spec
    out: list[tuple[str, Any, str]] = []
    turns: list[str] = []
    known = True
    for i, entry in enumerate(entries):
        key = f"optimizer.chain[{i}]" if chain else "optimizer"
        name, args = entry["name"], entry["args"]
        before = len(out)
        fn = getattr(optax, name, None) if isinstance(name, str) and not name.startswith("_") else None
        _arg_problems(f"{key}.args", args, out, _defaults(fn) if callable(fn) else {})
        sched_vals = {}
        for k, v in args.items():
            if _is_schedule(v) and len(out) == before:
                sched_vals[k] = _schedule_problems(f"{key}.args.{k}", k, v, steps, out)
        known = known and fn is not None and callable(fn)
        if not known or len(out) > before or name == "clip_by_global_norm":
            continue           # an unknown name is `optim.build`'s to report; a broken entry has no direction
        sign, why = _direction(name, args, fn, sched_vals)
        if sign < 0:
            turns.append(why)
    if known and not out and not allow_ascent and len(turns) % 2 == 0:
        _ascent(spec, entries, turns, out)
    return out
