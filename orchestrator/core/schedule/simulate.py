"""Discrete-event simulator for lowered schedules.

Flow: every stage runs its lowered list in order on its own clock. A compute
action (F, B, I, W, OPT) takes its cost. A SEND stamps the time its data leaves
(its start) and holds its own stage for the edge's `send_block` (0 by default: a
send that returns at once; a transport whose compute thread copies to the host or
waits for the wire holds it that long); its data reaches the peer at
start + max(transfer, send_block). A RECV waits for that arrival, then holds its
stage for the edge's `recv_block` (host-to-device copies on the receiver's compute
thread; 0 by default). Stages are advanced round-robin until all lists are done; a
round in which no stage moves while some still have actions is a deadlock, reported
with the action each stage is stuck at.

Numbers: costs and transfer times may be ints, floats or `fractions.Fraction`;
the arithmetic stays in the type given (Fractions give exact bubble
fractions, ints give float fractions). Results:
  step_time         latest end over all stages (all start at 0).
  bubble_per_stage  1 - busy(s) / step_time, busy = sum of compute durations (a
                    SEND's or RECV's hold on the thread is not compute: it counts
                    as bubble).
  bubble_fraction   1 - sum busy / (p * step_time).
  peak_inflight     per stage, the most (microbatch, chunk) pairs whose F ran
                    and whose B (or W) has not: stashed activations.
  spans             (action, start, end) for every action; a SEND's span is its
                    hold (`send_block`); a RECV's is its wait, from reaching it to
                    its data's arrival, plus its hold (`recv_block`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence, Union

from orchestrator.core.schedule.ir import (
    RECVS, RELEASES, SENDS, Action, Kind, Schedule, ScheduleError, comm_peer, edge_index,
)

Number = Union[int, float]
Costs = Union[Mapping[str, Number], Sequence[Mapping[str, Number]]]


@dataclass(frozen=True)
class SimResult:
    """What `simulate` found. See the module docstring for each field."""

    step_time: Number
    bubble_fraction: Number
    bubble_per_stage: list[Number]
    peak_inflight: list[int]
    spans: list[tuple[Action, Number, Number]]


def simulate(lowered: Schedule, costs: Costs, transfer: Number | Sequence[Number] = 0, *,
             send_block: Number | Sequence[Number] = 0, recv_block: Number | Sequence[Number] = 0) -> SimResult:
    """Play a lowered schedule on all stages.

    Args:
      lowered: output of `lower` (any schedule with comm actions where needed).
      costs: {"F": .., "B": ..} for all stages, or one such dict per stage.
        Keys F, B, I, W, OPT; I and W default to B/2, B to I+W, OPT to 0.
      transfer: seconds per send/recv pair, one number or one per edge (edge e
        joins stage e and e+1; edge p-1 is the wrap-around link of interleaved
        schedules, so give p values, or p-1 when v = 1).
      send_block: seconds a SEND holds its sender's thread, same forms as `transfer`
        (the data still leaves at the SEND's start; it arrives no earlier than the hold ends).
      recv_block: seconds a RECV holds its receiver's thread after the data arrived, same forms.

    Returns:
      A `SimResult`.

    Raises:
      ScheduleError: the schedule is not lowered, the costs are malformed, or
        it deadlocks (message names the stuck action of each stage).

    Example:
      >>> from orchestrator.core.schedule import generate, lower
      >>> r = simulate(lower(generate("1f1b", p=2, m=2)), {"F": 1, "B": 1})
      >>> r.step_time, round(r.bubble_fraction, 4), r.peak_inflight
      (6, 0.3333, [2, 1])
      >>> low = lower(generate("1f1b", p=2, m=2))
      >>> [simulate(low, {"F": 1, "B": 1}, 1, send_block=b).step_time for b in (0, 1)]   # a blocking send
      [8, 9]
    """
    if not lowered.lowered:
        raise ScheduleError(f"simulate needs a lowered schedule; {lowered.name!r} is compute-only: "
                            f"call lower() first")
    p = lowered.p
    stage_costs = _stage_costs(costs, p)
    link = _links(transfer, p, lowered.v)
    hold_send = _links(send_block, p, lowered.v, "send_block")
    hold_recv = _links(recv_block, p, lowered.v, "recv_block")
    rows = [[a for a in row if a is not None] for row in lowered.actions]
    pos, clock = [0] * p, [0] * p
    busy = [0] * p
    sent: dict[Action, Number] = {}
    spans: list[tuple[Action, Number, Number]] = []
    moved = True
    while moved:
        moved = False
        for s in range(p):
            while pos[s] < len(rows[s]):
                a = rows[s][pos[s]]
                start = clock[s]
                if a.kind in RECVS:
                    peer = comm_peer(a, p, lowered.v)
                    if peer not in sent:
                        break
                    e = edge_index(a, p)
                    end = max(start, sent[peer] + max(link[e], hold_send[e])) + hold_recv[e]
                elif a.kind in SENDS:
                    end = start + hold_send[edge_index(a, p)]
                    sent[a] = start
                else:
                    end = start + stage_costs[s][a.kind]
                    busy[s] += end - start
                spans.append((a, start, end))
                clock[s] = end
                pos[s] += 1
                moved = True
    stuck = [(s, rows[s][pos[s]]) for s in range(p) if pos[s] < len(rows[s])]
    if stuck:
        _deadlock(lowered, stuck, sent)
    step_time = max(clock, default=0)
    per_stage = [1 - _ratio(b, step_time) for b in busy]
    overall = 1 - _ratio(sum(busy), p * step_time)
    return SimResult(step_time, overall, per_stage, _peak_inflight(rows), spans)


def _ratio(a: Number, b: Number) -> Number:
    """a / b (a Fraction stays a Fraction); 1 when b is 0 (no time, so no bubble)."""
    return 1 if b == 0 else a / b


def _peak_inflight(rows: list[list[Action]]) -> list[int]:
    """Per stage, the most (microbatch, chunk) pairs between their F and their B/W."""
    peaks = []
    for row in rows:
        live, peak = 0, 0
        for a in row:
            if a.kind is Kind.F:
                live += 1
                peak = max(peak, live)
            elif a.kind in RELEASES:
                live -= 1
        peaks.append(peak)
    return peaks


def _stage_costs(costs: Costs, p: int) -> list[dict[Kind, Number]]:
    """One {Kind: duration} per stage, defaults filled in; errors name the key and value."""
    per_stage = [costs] * p if isinstance(costs, Mapping) else list(costs)
    if len(per_stage) != p:
        raise ScheduleError(f"costs: got {len(per_stage)} per-stage dicts for p={p} stages")
    out = []
    for s, c in enumerate(per_stage):
        unknown = set(c) - {"F", "B", "I", "W", "OPT"}
        if unknown:
            raise ScheduleError(f"costs[{s}]: unknown keys {sorted(unknown)}; "
                                f"known: F, B, I, W, OPT")
        if "F" not in c or not ({"B"} <= set(c) or {"I", "W"} <= set(c)):
            raise ScheduleError(f"costs[{s}]={dict(c)}: need F and B (or both I and W)")
        for k, val in c.items():
            if val < 0:
                raise ScheduleError(f"costs[{s}][{k!r}]={val}: durations must be >= 0")
        i, w = (c["I"], c["W"]) if "I" in c and "W" in c else (c["B"] / 2, c["B"] / 2)
        b = c.get("B", i + w)
        out.append({Kind.F: c["F"], Kind.B: b, Kind.I: i, Kind.W: w, Kind.OPT: c.get("OPT", 0)})
    return out


def _links(transfer: Number | Sequence[Number], p: int, v: int, what: str = "transfer") -> list[Number]:
    """Seconds per edge of `what` (p entries; edge p-1 is the wrap-around link)."""
    if isinstance(transfer, (int, float)) or not isinstance(transfer, Sequence):
        values = [transfer] * p
    else:
        values = list(transfer)
        if len(values) == p - 1 and v == 1:
            values.append(0)                     # wrap-around link unused without chunks
        if len(values) != p:
            raise ScheduleError(f"{what}: got {len(values)} per-edge values for p={p} stages, "
                                f"v={v}; need {p} (or {p - 1} when v == 1)")
    for e, val in enumerate(values):
        if val < 0:
            raise ScheduleError(f"{what}[{e}]={val}: {what} times must be >= 0")
    return values


def _deadlock(schedule: Schedule, stuck: list[tuple[int, Action]], sent: dict) -> None:
    from orchestrator.core.schedule.render import render_grid
    slot = {(s, a): t for s, t, a in schedule.cells()}
    parts = []
    for s, a in stuck:
        peer = comm_peer(a, schedule.p, schedule.v)
        why = f" waits for {peer}, which never ran" if a.kind in RECVS else ""
        parts.append(f"stage {s} at {a}{why}")
    cells = [(s, slot[(s, a)]) for s, a in stuck]
    raise ScheduleError(f"rule 'no-deadlock' broken: simulation deadlocked; stuck actions: "
                        f"{'; '.join(parts)}\n{render_grid(schedule, mark=cells)}",
                        rule="no-deadlock", cells=cells)
