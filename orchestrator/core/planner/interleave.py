"""Interleaved-1F1B candidates for the search: p stages × v chunks, one host count for all. Pure.

Megatron's interleaved 1F1B gives each stage v > 1 non-adjacent chunks (chunk j of stage i
is virtual stage j·p + i), which divides the bubble by about v at the price of v times as
many stage-to-stage hops (and runtime actions) per microbatch. The stage DP (`search`) cuts
one contiguous range per stage, so interleaved plans are built here instead, as Megatron
lays them out:

  1. cut: the layers into p·v contiguous virtual stages whose slowest is cheapest (`balanced_cut`,
     weighted by each layer's F + B on the first mesh choice that runs every layer);
  2. place: every stage on k hosts (stage i on hosts [i·k, (i+1)·k), node-group aligned), for
     each k with p·k ≤ hosts;
  3. choose: per stage, the fastest mesh choice (of the k-host ones) whose memory fits — its
     parameters are all its chunks' (× (2 + optimizer slots)), its in-flight activations the
     schedule simulator's peak (microbatch, chunk) pairs at that stage × its largest chunk's
     residuals (`tables.stacked` arrays, all choices at once);
  4. estimate (m + (p − 1)/v) × the slowest stage's F + B per microbatch (each chunk's F and B
     paying the per-action overhead) plus every virtual boundary's transfers, and a lower bound
     m × that stage time that the search prunes against.
The search replays the kept plans in the schedule simulator (`search.evaluate_interleaved`),
each F / B costing its stage's mean chunk (as `meshpipe plan` does) and each physical edge
its slowest virtual boundary; the wrap-around edge (last stage → first) is a real link.
"""
from __future__ import annotations

import numpy as np

from orchestrator.core.memory import device_bytes
from orchestrator.core.planner.tables import stacked

__all__ = ["balanced_cut", "interleaved_plans", "edge_times", "edge_costs"]


def balanced_cut(weights, parts: int) -> list[int]:
    """Boundaries b_0 = 0 < … < b_parts = len(weights) of the contiguous cut whose heaviest part is lightest.

    Example:
        >>> balanced_cut([1, 1, 1, 1, 4, 4], 3)
        [0, 4, 5, 6]
    """
    w = np.asarray(weights, dtype=float)
    n = len(w)
    if not 1 <= parts <= n:
        raise ValueError(f"parts = {parts}: need 1 <= parts <= {n} layers")
    c = np.concatenate([[0.0], np.cumsum(w)])
    span = c[None, :] - c[:, None]                     # span[i, j] = w[i:j]
    best = np.where(np.arange(n + 1) >= 1, c, np.inf)   # one part: [0, j)
    back = []
    for q in range(2, parts + 1):
        cand = np.maximum(best[:, None], span)           # (i, j): parts before i, then [i, j)
        cand[np.tril_indices(n + 1)] = np.inf            # i < j
        arg = cand.argmin(axis=0)
        back.append(arg)
        best = cand[arg, np.arange(n + 1)]
        best[:q] = np.inf
    cut, j = [n], n
    for arg in reversed(back):          # back[q - 2][j]: where the last of q parts ending at j starts
        j = int(arg[j])
        cut.append(j)
    return [0] + cut[::-1]


def edge_times(model, topo, cut, p: int, k: int, micro: int) -> list[float]:
    """One-way seconds per physical edge e = 0..p-1 (e joins stage e and (e + 1) % p; p − 1 wraps):
    its slowest virtual boundary's delay (boundary q, between virtual stages q − 1 and q, uses edge
    (q − 1) % p), layouts not yet known (`EdgeLayout()`)."""
    return [max(c["transfer_s"], c["send_block_s"]) + c["recv_block_s"] for c in edge_costs(model, topo, cut, p, k, micro)]


def edge_costs(model, topo, cut, p: int, k: int, micro: int, choices=None) -> list[dict]:
    """Per physical edge, `EdgeCost.to_dict()` parts, each the largest over its virtual boundaries and
    both directions; `choices` (one MeshChoice per stage) give the layouts (None: `EdgeLayout()`)."""
    from orchestrator.core.planner.transports import EdgeLayout, edge_layout

    out: list[dict] = [{} for _ in range(p)]
    for q in range(1, len(cut) - 1):
        e = (q - 1) % p
        src, dst = e * k + k - 1, ((e + 1) % p) * k
        cls = topo.class_of_hosts([src, dst])
        layer = model.layers[cut[q] - 1]
        if choices is None:
            layouts = [EdgeLayout()]
        else:
            a, b = choices[e], choices[(e + 1) % p]
            layouts = [edge_layout(a, b, layer.out_axes, topo.devices_per_host),
                       edge_layout(b, a, layer.out_axes, topo.devices_per_host)]
        for lay in layouts:
            for key, val in topo.edge(cls, layer.out_bytes(micro), lay).to_dict().items():
                out[e][key] = max(out[e].get(key, 0.0), val)
    empty = dict.fromkeys(("transfer_s", "send_block_s", "recv_block_s", "d2h_s", "wire_s", "h2d_s", "fanout_s"), 0.0)
    return [{**empty, **x} for x in out]


def interleaved_plans(model, topo, choices, tables, m: int, p: int, v: int, infl_fn, slots: int, memo,
                      cut, micro: int, keep: int = 2, bound: float = np.inf):
    """(estimate, lower bound, plan) of the best `keep` host counts; and the least memory any needs.

    A plan is [(chunks, first host, hosts, choice index)] per stage (module docstring).
    `infl_fn()` gives the schedule's in-flight pairs per stage; it is called (the schedule
    generated and simulated) only when some host count's lower bound, memory aside, is ≤ `bound`."""
    from orchestrator.core.planner.topology import aligned

    L, H = model.num_layers, topo.hosts
    over = topo.action_overhead_s
    a = np.array(cut[:-1])
    b = np.array(cut[1:])
    ks = [k for k in range(1, H // p + 1) if choices.get(k)
          and all(aligned(i * k, k, topo.hosts_per_group, H) for i in range(p))]
    for k in ks:
        if (k, m, False) not in memo:
            memo[(k, m, False)] = stacked(tables, k, len(choices[k]), m, L, False)
    low = [m * (memo[(k, m, False)][0][:, a, b].reshape(len(choices[k]), v, p).sum(axis=1).min(axis=0).max()
                + 2 * v * over) for k in ks]
    if not ks or min(low) > bound:
        return [], np.inf
    infl = infl_fn()
    if infl is None:
        return [], np.inf
    inflight = np.asarray(infl, dtype=float)[None, :]
    out, min_mem = [], np.inf
    for k in ks:
        cs = choices[k]
        T, P, S, R, TM, _ = memo[(k, m, False)]

        def per_stage(x, how):      # (C, p·v) virtual stages → (C, v, p) → over each stage's chunks
            return how(x[:, a, b].reshape(len(cs), v, p), axis=1)

        t = per_stage(T, np.sum)
        with np.errstate(invalid="ignore"):
            mem = device_bytes(per_stage(P, np.sum), per_stage(S, np.sum), per_stage(R, np.max),
                               slots=slots, inflight=inflight, temp=per_stage(TM, np.max))
        mem = np.where(np.isfinite(t), mem, np.inf)
        min_mem = min(min_mem, float(mem.min(axis=0).max()))
        t = np.where(mem <= topo.memory_bytes, t + 2 * v * over, np.inf)
        ci = t.argmin(axis=0)
        ts = t[ci, np.arange(p)]
        if not np.isfinite(ts).all():
            continue
        hops = sum(2 * e for e in edge_times(model, topo, cut, p, k, micro)) * v
        slow = float(ts.max())
        plan = [(tuple((int(cut[j * p + i]), int(cut[j * p + i + 1])) for j in range(v)), i * k, k, int(ci[i]))
                for i in range(p)]
        out.append(((m + (p - 1) / v) * slow + hops, m * slow, plan))
    out.sort(key=lambda x: x[0])
    return out[:keep], min_mem
