"""Stage tables for the search: per (hosts k, choice, microbatches m) the time and memory of
every layer range [i, j), under the memory sum `meshpipe plan` uses too. Pure.

`layer_table` turns one (k, choice, m)'s `LayerCost`s into arrays over layers; `stacked`
turns those into (i, j) arrays by prefix sums; `stage_tables` keeps, per (k, in-flight n),
each range's fastest choice that fits the device (`orchestrator.core.memory.device_bytes`:
parameters × (2 + slots) + mutable state + n × residuals + the largest temporary).

`fuse_loss_chunk`: where the schedule runs the last stage's every F directly before the B of
the same microbatch (`fuses`, the rule of `stages.actions.fused_chunks`: 1F1B's last stage, not
GPipe's, not zero-bubble's), the runtime runs the loss layer's F and B as one program: that
layer keeps no residuals between actions, and its one program's temporary
(`LayerCost.fused_temp_bytes`) counts instead of its separate F / B temporaries. Only ranges
ending at the last layer change (only the last stage holds it). Its time is not changed: the
search keeps the separate F and B costs for it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from orchestrator.core.memory import device_bytes

__all__ = ["Table", "layer_table", "stacked", "stage_tables", "fuses", "stage_memory"]


@dataclass
class Table:
    """Per (k, choice, m): arrays over layers of F, B, OPT, memory parts (inf where impossible)."""

    fwd: np.ndarray
    bwd: np.ndarray
    opt: np.ndarray
    params: np.ndarray
    resid: np.ndarray
    temp: np.ndarray
    state: np.ndarray
    fused_temp: np.ndarray
    parts: list


def layer_table(cols, slots: int, memory_bandwidth: float) -> Table:
    """The `Table` of one (k, choice, m) from its per-layer `LayerCost`s (None: impossible)."""
    inf = float("inf")

    def arr(attr):
        return np.array([getattr(x, attr) if x else inf for x in cols])

    pb = arr("param_bytes")
    return Table(arr("fwd_s"), arr("bwd_s"), pb * (3 + 2 * slots) / memory_bandwidth, pb, arr("residual_bytes"),
                 arr("temp_bytes"), arr("state_bytes"), arr("fused_temp_bytes"), cols)


def stage_memory(cols, slots: int, inflight: int, fused: bool, stash: float | None = None) -> float:
    """Per-device bytes of a stage running layers `cols` (their `LayerCost`s), `fused`: the last
    of them is the loss layer and its F+B run as one program (module docstring).

    `stash`: a zero-bubble stage's peak of what it keeps between actions (`stash_timeline` over
    the F residuals and I's held-for-W bytes) in place of `inflight` × residuals; the temporary
    is then the largest of its F, I and W programs'."""
    if stash is not None:
        return device_bytes(sum(c.param_bytes for c in cols), sum(c.state_bytes for c in cols), stash,
                            slots=slots, inflight=1, temp=max(c.split_temp_bytes for c in cols))
    resid = [c.residual_bytes for c in cols]
    temps = [c.temp_bytes for c in cols]
    if fused:
        resid[-1], temps[-1] = 0.0, cols[-1].fused_temp_bytes
    return device_bytes(sum(c.param_bytes for c in cols), sum(c.state_bytes for c in cols), sum(resid),
                        slots=slots, inflight=inflight, temp=max(temps))


@functools.lru_cache(maxsize=512)
def fuses(schedule: str, p: int, m: int) -> bool:
    """Whether the last stage's every F is directly followed by the B of the same microbatch."""
    from orchestrator.core.schedule import Kind, ScheduleError, generate, lower

    try:
        row = [a for a in lower(generate(schedule, p, m)).actions[p - 1] if a is not None]
    except ScheduleError:
        return False
    fs = [i for i, a in enumerate(row) if a.kind is Kind.F]
    return bool(fs) and all(i + 1 < len(row) and row[i + 1].kind is Kind.B
                            and row[i + 1].microbatch == row[i].microbatch for i in fs)


def _ranges(x: np.ndarray) -> np.ndarray:
    """(i, j) sums of x[i:j] by prefix sums."""
    c = np.concatenate([[0], np.cumsum(x)])
    with np.errstate(invalid="ignore"):
        return c[None, :] - c[:, None]


def stacked(tables, k, count, m, L, fused: bool):
    """Per choice, (i, j) arrays: time, parameter bytes, state, residuals per microbatch, largest temp, bad."""
    fs, ps, ss, rs, tms = [], [], [], [], []
    upper = np.triu(np.ones((L + 1, L + 1), bool), 1)
    for ci in range(count):
        t = tables[(k, ci, m)]
        fs.append(_ranges(t.fwd) + _ranges(t.bwd))
        ps.append(_ranges(t.params))
        ss.append(_ranges(t.state))
        r = _ranges(t.resid)
        # tm[i, j] = max(temp[i:j]) for j > i: a running max along j over temp[j - 1] (j > i), -inf before
        tm = np.maximum.accumulate(np.where(upper, np.concatenate([[-np.inf], t.temp])[None, :], -np.inf), axis=1)
        tm[~upper] = np.inf
        if fused:       # ranges ending at the loss layer: its residuals inside its one program
            r[:, L] -= t.resid[L - 1]
            tm[L - 1, L] = t.fused_temp[L - 1]
            tm[:L - 1, L] = np.maximum(tm[:L - 1, L - 1], t.fused_temp[L - 1])
        rs.append(r)
        tms.append(tm)
    T = np.stack(fs)
    bad = ~np.isfinite(T) | (np.triu(np.ones((L + 1, L + 1), bool), 1)[None] == 0)
    return np.where(bad, np.inf, T), np.stack(ps), np.stack(ss), np.stack(rs), np.stack(tms), bad


def stage_tables(model, topo, choices, tables, m, ns, slots, memo, fused: bool = False):
    """Best (time, choice index, least memory) per (k, n) over stages [i, j) on k hosts, n microbatches in flight."""
    L = model.num_layers
    out = {}
    for k, cs in choices.items():
        if not cs:
            continue
        if (k, m, fused) not in memo:
            memo[(k, m, fused)] = stacked(tables, k, len(cs), m, L, fused)
        T, P, S, R, TM, bad = memo[(k, m, fused)]
        for n in ns:
            if (k, m, n, fused) not in memo:
                with np.errstate(invalid="ignore"):
                    mem = np.where(bad, np.inf, device_bytes(P, S, R, slots=slots, inflight=n, temp=TM))
                # each microbatch's F and B each pay the runtime's fixed per-action cost
                Tn = np.where(mem <= topo.memory_bytes, T + 2 * topo.action_overhead_s, np.inf)
                best = Tn.argmin(axis=0)
                memo[(k, m, n, fused)] = (np.take_along_axis(Tn, best[None], 0)[0], best, mem.min(axis=0))
            out[(k, n)] = memo[(k, m, n, fused)]
    return out
