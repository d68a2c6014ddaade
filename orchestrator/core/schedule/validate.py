"""Schedule validator: every rule a schedule must keep, each error with the marked grid.

Rules, checked in this order (the name is what `ScheduleError.rule` holds):
  stage-row            an action sits in its own stage's row.
  index-range          microbatch < m and chunk < v.
  exactly-once         no action appears twice.
  comm-in-compute      comm actions only in lowered schedules.
  complete             every (stage, microbatch, chunk) has one F and one
                       backward: a B, or an I and a W (B-or-IW: not both).
                       A forward_only schedule (evaluation) has every F and
                       no backward and no OPT at all (rule 'forward-only').
  F-before-B           on each stage, F precedes its B or I.
  I-before-W           on each stage, I precedes its W.
  OPT-last             at most one OPT per stage, after all its backwards.
  dependency           no stage consumes what was not produced: in a
                       compute-only schedule (slots are time steps) the
                       producer's slot is earlier; in a lowered one, producers
                       on the same stage come earlier in the list.
  sends-match-receives (lowered) every cross-stage dependency has exactly one
                       SEND and one RECV, and no SEND/RECV lacks its partner.
  send-after-produce   (lowered) a SEND follows the compute it sends.
  recv-before-consume  (lowered) a RECV precedes the compute that needs it.
  no-deadlock          (lowered) running the lists in order, RECV blocking
                       until its SEND ran, finishes.
"""
from __future__ import annotations

from collections.abc import Iterable

from orchestrator.core.schedule.ir import (
    COMM, Action, Kind, Schedule, ScheduleError, comm_peer, next_virtual, prev_virtual,
)
from orchestrator.core.schedule.render import render_grid


def validate(schedule: Schedule) -> None:
    """Raise `ScheduleError` naming the first broken rule, with the faulty cell marked.

    Works on compute-only and lowered schedules.

    Example:
      >>> from orchestrator.core.schedule import generate, lower
      >>> validate(lower(generate("zb-h1", p=4, m=8)))   # fine: returns None
      >>> bad = Schedule("bad", 1, 1, 1, ((Action.parse("0B0"), Action.parse("0F0")),))
      >>> validate(bad)
      Traceback (most recent call last):
      ...
      orchestrator.core.schedule.ir.ScheduleError: rule 'F-before-B' broken: 0B0 (stage 0, slot 0) comes before its forward 0F0 (slot 1)
      bad p=1 m=1 v=1 compute-only, 2 slots, [x] marks the faulty cell
      slot      0    1
      s0    [0B0]  0F0
    """
    where: dict[Action, tuple[int, int]] = {}
    for s, t, a in schedule.cells():
        if a.stage != s:
            _fail(schedule, "stage-row", f"{a} belongs to stage {a.stage} but sits in row {s}",
                  [(s, t)])
        if a.microbatch is not None and a.microbatch >= schedule.m or a.chunk >= schedule.v:
            _fail(schedule, "index-range", f"{a} is outside m={schedule.m}, v={schedule.v}",
                  [(s, t)])
        if a in where:
            _fail(schedule, "exactly-once", f"{a} appears twice (slots {where[a][1]} and {t})",
                  [where[a], (s, t)])
        if a.kind in COMM and not schedule.lowered:
            _fail(schedule, "comm-in-compute", f"{a} in a compute-only schedule "
                  f"(lowered=False); comm actions come from lower()", [(s, t)])
        where[a] = (s, t)
    _check_complete(schedule, where)
    _check_stage_order(schedule, where)
    _check_dependencies(schedule, where)
    if schedule.lowered:
        _check_comms(schedule, where)
        from orchestrator.core.schedule.simulate import simulate
        simulate(schedule, {"F": 0, "B": 0})      # raises rule 'no-deadlock'


def _check_complete(schedule: Schedule, where: dict[Action, tuple[int, int]]) -> None:
    if schedule.forward_only:
        for a, cell in where.items():
            if a.kind in (Kind.B, Kind.I, Kind.W, Kind.OPT, Kind.SEND_B, Kind.RECV_B):
                _fail(schedule, "forward-only", f"{a} in a forward-only schedule", [cell])
        for s in range(schedule.p):
            for c in range(schedule.v):
                for mb in range(schedule.m):
                    if Action(s, Kind.F, mb, c) not in where:
                        _fail(schedule, "complete", f"forward {Action(s, Kind.F, mb, c)} is missing "
                              f"on stage {s}", [])
        return
    for s in range(schedule.p):
        for c in range(schedule.v):
            for mb in range(schedule.m):
                f, b, i, w = (Action(s, k, mb, c) for k in (Kind.F, Kind.B, Kind.I, Kind.W))
                have = [a for a in (b, i, w) if a in where]
                if f not in where:
                    _fail(schedule, "complete", f"forward {f} is missing on stage {s}",
                          [where[a] for a in have])
                if b in where and (i in where or w in where):
                    _fail(schedule, "B-or-IW", f"{b} and a split backward ({i}/{w}) both "
                          f"appear for microbatch {mb}", [where[a] for a in have])
                if b not in where and not (i in where and w in where):
                    missing = b if not (i in where or w in where) else (w if i in where else i)
                    _fail(schedule, "complete", f"backward {missing} is missing on stage {s}",
                          [where[f]] + [where[a] for a in have])


def _check_stage_order(schedule: Schedule, where: dict[Action, tuple[int, int]]) -> None:
    for a, (s, t) in where.items():
        if a.kind in (Kind.B, Kind.I):
            f = Action(s, Kind.F, a.microbatch, a.chunk)
            if where[f][1] > t:
                _fail(schedule, "F-before-B", f"{a} (stage {s}, slot {t}) comes before its "
                      f"forward {f} (slot {where[f][1]})", [(s, t)])
        elif a.kind is Kind.W:
            i = Action(s, Kind.I, a.microbatch, a.chunk)
            if where[i][1] > t:
                _fail(schedule, "I-before-W", f"{a} (stage {s}, slot {t}) comes before its "
                      f"input-grad backward {i} (slot {where[i][1]})", [(s, t)])
    for s, row in enumerate(schedule.actions):
        opts = [t for t, a in enumerate(row) if a is not None and a.kind is Kind.OPT]
        last_bwd = max((t for t, a in enumerate(row) if a is not None
                        and a.kind in (Kind.B, Kind.W)), default=-1)
        if opts and opts[0] < last_bwd:
            _fail(schedule, "OPT-last", f"{row[opts[0]]} (slot {opts[0]}) runs before the last "
                  f"backward {row[last_bwd]} (slot {last_bwd}) of stage {s}", [(s, opts[0])])


def _producer(schedule: Schedule, where: dict[Action, tuple[int, int]],
              a: Action) -> Action | None:
    """The compute action whose output `a` (an F, B or I) consumes, if any."""
    p, v = schedule.p, schedule.v
    if a.kind is Kind.F:
        src = prev_virtual(a.stage, a.chunk, p)
        return None if src is None else Action(src[0], Kind.F, a.microbatch, src[1])
    if a.kind in (Kind.B, Kind.I):
        src = next_virtual(a.stage, a.chunk, p, v)
        if src is None:
            return None
        b = Action(src[0], Kind.B, a.microbatch, src[1])
        return b if b in where else Action(src[0], Kind.I, a.microbatch, src[1])
    return None


def _check_dependencies(schedule: Schedule, where: dict[Action, tuple[int, int]]) -> None:
    for a, (s, t) in where.items():
        src = _producer(schedule, where, a)
        if src is None:
            continue
        ps, pt = where[src]
        if schedule.lowered and ps != s:
            continue                            # ordered by SEND/RECV, see _check_comms
        if pt >= t:
            _fail(schedule, "dependency", f"{a} (stage {s}, slot {t}) consumes the output of "
                  f"{src} (stage {ps}, slot {pt}), which is not produced in an earlier slot",
                  [(s, t), (ps, pt)])


def _check_comms(schedule: Schedule, where: dict[Action, tuple[int, int]]) -> None:
    p, v = schedule.p, schedule.v
    for a, (s, t) in where.items():            # every comm action has its partner and purpose
        if a.kind not in COMM:
            continue
        peer = comm_peer(a, p, v)
        if peer is None or peer.stage == s:
            _fail(schedule, "sends-match-receives", f"{a} has no partner: nothing crosses "
                  f"stages there (pipeline end or same physical stage)", [(s, t)])
        if peer not in where:
            other = _comm_compute(schedule, where, peer)      # the compute missing its partner
            _fail(schedule, "sends-match-receives", f"{a} has no matching {peer}",
                  [(s, t)] + ([where[other]] if other in where else []))
        compute = _comm_compute(schedule, where, a)
        ct = where[compute][1]
        if a.kind in (Kind.SEND_F, Kind.SEND_B) and ct > t:
            _fail(schedule, "send-after-produce", f"{a} (slot {t}) runs before {compute} "
                  f"(slot {ct}) produced its data", [(s, t), (s, ct)])
        if a.kind in (Kind.RECV_F, Kind.RECV_B) and ct < t:
            _fail(schedule, "recv-before-consume", f"{compute} (slot {ct}) runs before "
                  f"{a} (slot {t}) received its input", [(s, ct), (s, t)])
    for a, (s, t) in where.items():            # every cross-stage dependency has its pair
        src = _producer(schedule, where, a)
        if src is None or src.stage == s:
            continue
        recv = Action(s, Kind.RECV_F if a.kind is Kind.F else Kind.RECV_B, a.microbatch, a.chunk)
        if recv not in where:
            _fail(schedule, "sends-match-receives", f"{a} (stage {s}, slot {t}) needs data "
                  f"from {src} on stage {src.stage} but there is no {recv}", [(s, t)])


def _comm_compute(schedule: Schedule, where: dict[Action, tuple[int, int]], a: Action) -> Action:
    """The compute action on a's stage that a SEND sends from or a RECV feeds."""
    if a.kind in (Kind.SEND_F, Kind.RECV_F):
        return Action(a.stage, Kind.F, a.microbatch, a.chunk)
    b = Action(a.stage, Kind.B, a.microbatch, a.chunk)
    return b if b in where else Action(a.stage, Kind.I, a.microbatch, a.chunk)


def _fail(schedule: Schedule, rule: str, detail: str, cells: Iterable[tuple[int, int]]) -> None:
    cells = list(cells)
    raise ScheduleError(f"rule {rule!r} broken: {detail}\n{render_grid(schedule, mark=cells)}",
                        rule=rule, cells=cells)
