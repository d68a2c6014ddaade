"""The default stage cut, balanced by cost (pure; jax inside functions only, no devices).

A job that gives neither its stages' `layers` nor `pipeline.split_at` gets this cut
(`orchestrator.core.config.check`): every layer's cost, then the contiguous cut of the
layers into the job's (virtual) stages that makes the busiest one as cheap as it can be.

Basic flow:
  layer_costs(model)          per part, forward FLOPs counted from its jaxpr at the
                              describe batch (`jaxpr_flops`: a dot_general is 2·M·N·K, a
                              convolution 2 · output · kernel window · input features,
                              any other equation one per output element); the loss's
                              count is added to the last part. Tracing only (make_jaxpr of
                              shape structs): no device, no compile. A part whose trace
                              fails, or a model whose count is all zero, falls back to
                              parameter counts (`ModelSpec.param_count`).
  balanced_ranges(costs, k)   the cut into k contiguous ranges minimising the largest
                              range's cost; among cuts that reach it, the one with the
                              smallest sum of squared range costs, then the one whose
                              boundaries lie closest to the even cut by layer count
                              (`even_ranges`), so equal layers keep the even cut.

The cost is a proxy (the forward only; a backward is about twice it, the same ratio for
every layer; memory-bound elementwise work is counted per element). It decides where a
stage boundary falls, nothing else: explicit `layers` and `split_at` are never changed.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["balanced_ranges", "even_ranges", "jaxpr_flops", "layer_costs"]

_QUANTUM = 10 ** 6       # costs are compared as integers: the largest layer is this many units


def even_ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """`n` layers cut into `parts` contiguous ranges by layer count (the first n mod parts one longer).

    Example:
        >>> even_ranges(6, 4)
        [(0, 2), (2, 4), (4, 5), (5, 6)]
    """
    _check_parts(n, parts)
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def balanced_ranges(costs: Sequence[float], parts: int) -> list[tuple[int, int]]:
    """The cut of layers with `costs` into `parts` contiguous non-empty ranges whose largest
    cost is smallest (ties: smallest sum of squared range costs, then closest to `even_ranges`).

    O(parts · n²) in the number of layers n.

    Example:
        >>> balanced_ranges([1, 1, 1, 1, 1, 1], 2), balanced_ranges([1, 1, 1, 1, 1, 1], 4)
        ([(0, 3), (3, 6)], [(0, 2), (2, 4), (4, 5), (5, 6)])
        >>> balanced_ranges([1, 1, 1, 1, 1, 5], 2)
        [(0, 5), (5, 6)]
    """
    n = len(costs)
    _check_parts(n, parts)
    if any(not math.isfinite(c) or c < 0 for c in costs):
        raise ValueError(f"layer costs must be finite and >= 0, got {list(costs)}")
    top = max(costs)
    q = [round(c / top * _QUANTUM) if top > 0 else 1 for c in costs]     # exact integer arithmetic below
    pre = [0]
    for c in q:
        pre.append(pre[-1] + c)
    cap = _min_max(pre, parts)
    even = [b for _, b in even_ranges(n, parts)]
    # best[j][i]: (sum of squares, distance to the even boundaries) of the first i layers in j ranges,
    # every range at most `cap`; back[j][i]: where the j-th range starts
    inf = (math.inf, math.inf)
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    back = [[-1] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = (0, 0)
    for j in range(1, parts + 1):
        for i in range(j, n - (parts - j) + 1):
            for k in range(j - 1, i):
                cost = pre[i] - pre[k]
                if cost > cap or best[j - 1][k] == inf:
                    continue
                prev = best[j - 1][k]
                cand = (prev[0] + cost * cost, prev[1] + abs(i - even[j - 1]))
                if cand < best[j][i]:
                    best[j][i], back[j][i] = cand, k
    bounds, i = [], n
    for j in range(parts, 0, -1):
        k = back[j][i]
        bounds.append((k, i))
        i = k
    return bounds[::-1]


def _min_max(pre: list[int], parts: int) -> int:
    """The smallest possible largest range cost of a cut into `parts` ranges (prefix sums `pre`)."""
    n = len(pre) - 1
    inf = math.inf
    best = [inf] * (n + 1)
    best[0] = 0
    for j in range(1, parts + 1):
        nxt = [inf] * (n + 1)
        for i in range(j, n - (parts - j) + 1):
            nxt[i] = min(max(best[k], pre[i] - pre[k]) for k in range(j - 1, i))
        best = nxt
    return int(best[n])


def _check_parts(n: int, parts: int) -> None:
    if not 1 <= parts <= n:
        raise ValueError(f"cannot cut {n} layers into {parts} non-empty ranges (need 1 <= ranges <= layers)")


# -- costs -----------------------------------------------------------------------------

def jaxpr_flops(jaxpr) -> float:
    """Approximate FLOPs of a (closed) jaxpr: dot_general 2·out·contracted, convolution 2·out·window·in
    features, any other equation one per output element; sub-jaxprs counted inside (scan × its
    length, cond: its dearest branch, while: one trip).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> a = jax.ShapeDtypeStruct((4, 8), jnp.float32); b = jax.ShapeDtypeStruct((8, 3), jnp.float32)
        >>> jaxpr_flops(jax.make_jaxpr(lambda x, y: x @ y)(a, b))
        192.0
    """
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0.0
    for eqn in jaxpr.eqns:
        subs = _sub_jaxprs(eqn.params)
        name = eqn.primitive.name
        if subs:
            counts = [jaxpr_flops(s) for s in subs]
            if name == "cond":
                total += max(counts)
            else:
                total += sum(counts) * (eqn.params.get("length", 1) if name == "scan" else 1)
            continue
        out = sum(_size(v.aval) for v in eqn.outvars)
        if name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2.0 * out * math.prod(lhs[d] for d in lhs_contract)
        elif name == "conv_general_dilated":
            rhs = eqn.invars[1].aval.shape
            out_feature_dim = eqn.params["dimension_numbers"].rhs_spec[0]
            total += 2.0 * out * math.prod(rhs) / max(1, rhs[out_feature_dim])
        else:
            total += out
    return total


def _sub_jaxprs(params) -> list:
    out = []
    for v in params.values():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            inner = getattr(x, "jaxpr", x)
            if hasattr(inner, "eqns"):
                out.append(inner)
    return out


def _size(aval) -> int:
    return math.prod(getattr(aval, "shape", ()) or (1,))


def layer_costs(model, spec=None) -> tuple[list[float], str]:
    """Per part of the PipelineModel `model`, its forward FLOPs (`jaxpr_flops`; the loss on the last
    part), and "flops"; or, when a trace fails or every count is 0, per layer of `spec` (its
    ModelSpec) its parameter count, and "params"."""
    import jax
    import numpy as np

    from orchestrator.core.model.pipeline import DESCRIBE_BATCH, abstract_inits, run_part

    try:
        inp, lab = model.input.leaf(), model.label.leaf()
        x = jax.ShapeDtypeStruct(inp.batched(DESCRIBE_BATCH), np.dtype(inp.dtype))
        costs = []
        for part, (params, state) in zip(model.parts, abstract_inits(model.parts)):

            def fwd(p, x, s, part=part):
                return run_part(part, p, x, s, rng=jax.random.key(0), train=True)[0]

            closed, y = jax.make_jaxpr(fwd, return_shape=True)(params, x, state)
            costs.append(jaxpr_flops(closed))
            x = y
        labels = jax.ShapeDtypeStruct(lab.batched(DESCRIBE_BATCH), np.dtype(lab.dtype))
        costs[-1] += jaxpr_flops(jax.make_jaxpr(model.loss)(x, labels))
        if sum(costs) > 0:
            return costs, "flops"
    except Exception:  # noqa: BLE001 - the user's code; its parameter counts still order the layers
        if spec is None:
            raise
    if spec is None:
        raise ValueError("every layer counts 0 FLOPs and no ModelSpec was given for parameter counts")
    return [float(spec.param_count(i, i + 1)) for i in range(len(spec.layers))], "params"
