"""Lowering passes: pure ``Schedule -> Schedule`` functions that make a schedule runnable.

Flow: ``lower = add_optimizer_step ∘ add_comms``.

`add_comms` takes a compute-only schedule whose slots are time steps (as the
generators produce) and, for every compute action whose result another
physical stage consumes, inserts the SEND right after the producer on its
stage *and* the matching RECV right before the consumer on the consumer's
stage, in one go, so a send never lacks its receive:

  F(s, mb, c)   -> SEND_F(s, mb, c)   ...  RECV_F(s', mb, c') -> F(s', mb, c')
  B/I(s, mb, c) -> SEND_B(s, mb, c)   ...  RECV_B(s', mb, c') -> B/I(s', mb, c')

where (s', c') is the next (forward) or previous (backward) virtual stage. No
comm action at the pipeline's ends, nor between virtual stages on the same
physical stage (only when p = 1). Compute slot t becomes the columns
``[RECV, compute, SEND]``; columns empty on every stage are dropped. Because
each producer sits in an earlier step than its consumer, a runtime that runs
each list in order (RECV blocks until its SEND ran, SEND never blocks) cannot
hang, whatever the compute durations.

`add_optimizer_step` appends one ``OPT(s)`` per stage in a final, shared
column, after the stage's last backward and last send. Gradient accumulation
is implicit: every B (or W) adds into the stage's gradient buffer; OPT applies
the accumulated gradient once and starts the next step from zero.
"""
from __future__ import annotations

from dataclasses import replace

from orchestrator.core.schedule.ir import (
    Action, Kind, Schedule, ScheduleError, next_virtual, prev_virtual,
)


def add_comms(schedule: Schedule) -> Schedule:
    """Insert matched SEND/RECV pairs around cross-stage dependencies.

    Example:
      >>> from orchestrator.core.schedule import generate
      >>> add_comms(generate("gpipe", 2, 1)).grid()
      [['0F0', '0SEND_F0', '.', '.', '.', '.', '0RECV_B0', '0B0'], ['.', '.', '1RECV_F0', '1F0', '1B0', '1SEND_B0', '.', '.']]
    """
    if schedule.lowered:
        raise ScheduleError(f"add_comms: schedule {schedule.name!r} already has comm actions")
    p, v = schedule.p, schedule.v
    cols: dict[tuple[int, int], Action] = {}     # (stage, column) -> action
    for s, t, a in schedule.cells():
        if a.kind in (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B):
            raise ScheduleError(f"add_comms: {a} is already a comm action in {schedule.name!r}")
        cols[(s, 3 * t + 1)] = a
    slot_of = {a: t for _, t, a in schedule.cells()}
    grad_of = {a.key: a for _, _, a in schedule.cells() if a.kind in (Kind.B, Kind.I)}
    for s, t, a in schedule.cells():
        if a.kind is Kind.F:
            dst = next_virtual(a.stage, a.chunk, p, v)
            consumer = None if dst is None else Action(dst[0], Kind.F, a.microbatch, dst[1])
            send, recv = Kind.SEND_F, Kind.RECV_F
        elif a.kind in (Kind.B, Kind.I):
            dst = prev_virtual(a.stage, a.chunk, p)
            consumer = None if dst is None else grad_of.get((dst[0], a.microbatch, dst[1]))
            send, recv = Kind.SEND_B, Kind.RECV_B
        else:
            continue
        if dst is None or dst[0] == s:
            continue                              # pipeline end, or same physical stage
        if consumer is None or consumer not in slot_of:
            raise ScheduleError(f"add_comms: {a} produces data for virtual stage "
                                f"{dst[1] * p + dst[0]} of microbatch {a.microbatch}, "
                                f"whose consumer is missing from the schedule; validate() it first")
        cols[(s, 3 * t + 2)] = Action(s, send, a.microbatch, a.chunk)
        cols[(consumer.stage, 3 * slot_of[consumer])] = Action(
            consumer.stage, recv, a.microbatch, consumer.chunk)
    return replace(schedule, actions=_compact(cols, p), lowered=True)


def add_optimizer_step(schedule: Schedule) -> Schedule:
    """Append OPT(s) to every stage, all in one final column.

    Example:
      >>> from orchestrator.core.schedule import generate
      >>> add_optimizer_step(generate("gpipe", 2, 1)).grid()
      [['0F0', '.', '.', '0B0', '0OPT'], ['.', '1F0', '1B0', '.', '1OPT']]
    """
    if any(a.kind is Kind.OPT for _, _, a in schedule.cells()):
        raise ScheduleError(f"add_optimizer_step: schedule {schedule.name!r} already has OPT")
    n = schedule.num_slots
    rows = tuple(row + (None,) * (n - len(row)) + (Action(s, Kind.OPT, None),)
                 for s, row in enumerate(schedule.actions))
    return replace(schedule, actions=rows)


def lower(schedule: Schedule) -> Schedule:
    """Make a compute-only schedule runnable: comm actions, then the optimizer step.

    Example:
      >>> from orchestrator.core.schedule import generate
      >>> low = lower(generate("1f1b", p=2, m=2))
      >>> [str(a) for a in low.actions[1] if a is not None]
      ['1RECV_F0', '1F0', '1B0', '1SEND_B0', '1RECV_F1', '1F1', '1B1', '1SEND_B1', '1OPT']
    """
    return add_optimizer_step(add_comms(schedule))


def _compact(cols: dict[tuple[int, int], Action], p: int) -> tuple[tuple[Action | None, ...], ...]:
    """Rows from a sparse (stage, column) map, dropping columns idle on every stage."""
    used = sorted({c for _, c in cols})
    new = {c: i for i, c in enumerate(used)}
    rows: list[list[Action | None]] = [[None] * len(used) for _ in range(p)]
    for (s, c), a in cols.items():
        rows[s][new[c]] = a
    return tuple(tuple(r) for r in rows)
