"""Schedule generators: gpipe, 1f1b, eager-1f1b, interleaved-1f1b, zb-h1.

Flow: `generate(name, p, m, v)` checks the parameters (`check_params`), asks
the generator for each stage's compute order, written as three labelled
phases (warmup: forwards only; steady: one forward then one backward;
cooldown: the remaining backwards), then `_place` lays the orders on a common
step axis: every action takes one slot and starts as soon as its inputs were
produced in an earlier slot (same order, idle slots where a stage waits). The
result is a compute-only `Schedule` (no sends, receives or optimizer step;
see `lowering`).

Orders, per stage s (p stages, m microbatches, v chunks):
  gpipe            all m forwards, then all m backwards.
  1f1b             PipeDream-flush: min(p-1-s, m) warmup forwards, then 1F1B.
  eager-1f1b       Alpa's overlap-friendly 1F1B (jaxpp's Eager1F1B):
                   min(2(p-1-s), m) warmup forwards, i.e. 1f1b's warmup plus
                   one extra forward per later stage, so in the steady phase a
                   forward's output is sent a forward-backward pair before the
                   next stage needs it and the send overlaps compute. Same step
                   time as 1f1b without transfer cost, shorter with it; up to
                   2(p-s)-1 stashed activations instead of p-s.
  interleaved-1f1b Megatron: v chunks per stage; forwards go round the stages
                   in groups of p microbatches per chunk; warmup
                   (v-1)p + 2(p-1-s) forwards (capped at m*v). With v = 1 it
                   is eager-1f1b.
  zb-h1            Zero-bubble H1: 1f1b with B split into I (input grad, on
                   the critical path) then W (weight grad); stage s runs each W
                   `s` backwards late so the W fill the cooldown bubbles; peak
                   stash stays <= p, the peak of 1f1b's stage 0. With F=1,
                   I=W=1/2 and m >= p the bubble is the paper's
                   (p-1)/(2m+p-1), against 1f1b's (p-1)/(m+p-1).

Parameter rules (`check_params`): p >= 1, m >= 1, v >= 1; v must be 1 except
for interleaved-1f1b, which needs m divisible by p. m < p is allowed for
1f1b, eager-1f1b and zb-h1 (the warmup is capped at m, so the pipeline never
fills; the bubble is still (p-1)/(m+p-1) for 1f1b): torch rejects it for some
schedules, but a small m is a legitimate debugging and tuning setting, so we
allow it.
"""
from __future__ import annotations

from typing import Callable

from orchestrator.core.schedule.ir import (
    Action, Kind, Schedule, ScheduleError, next_virtual, prev_virtual,
)

Order = list[Action]


def _fwd(s: int, mb: int, c: int = 0) -> Action:
    return Action(s, Kind.F, mb, c)


def _bwd(s: int, mb: int, c: int = 0) -> Action:
    return Action(s, Kind.B, mb, c)


def _one_f_one_b(fwd: Order, bwd: Order, n_warmup: int) -> Order:
    """Warmup / steady / cooldown from a stage's forward and backward orders."""
    n_warmup = min(n_warmup, len(fwd))
    warmup = fwd[:n_warmup]
    steady = [a for f, b in zip(fwd[n_warmup:], bwd) for a in (f, b)]
    cooldown = bwd[len(fwd) - n_warmup:]
    return warmup + steady + cooldown


def gpipe(p: int, m: int, v: int = 1) -> Schedule:
    """GPipe: every stage runs all forwards, then all backwards.

    Example:
      >>> print(gpipe(2, 2).grid())
      [['0F0', '0F1', '.', '.', '0B0', '0B1'], ['.', '1F0', '1F1', '1B0', '1B1', '.']]
    """
    check_params("gpipe", p, m, v)
    orders = []
    for s in range(p):
        warmup = [_fwd(s, i) for i in range(m)]
        steady: Order = []
        cooldown = [_bwd(s, i) for i in range(m)]
        orders.append(warmup + steady + cooldown)
    return _place("gpipe", p, m, 1, orders)


def one_f_one_b(p: int, m: int, v: int = 1) -> Schedule:
    """1F1B (PipeDream-flush): p-1-s warmup forwards, then alternate, then drain.

    Example:
      >>> print(one_f_one_b(2, 2).grid())
      [['0F0', '0F1', '.', '0B0', '.', '0B1'], ['.', '1F0', '1B0', '1F1', '1B1', '.']]
    """
    check_params("1f1b", p, m, v)
    orders = []
    for s in range(p):
        fwd = [_fwd(s, i) for i in range(m)]
        bwd = [_bwd(s, i) for i in range(m)]
        orders.append(_one_f_one_b(fwd, bwd, n_warmup=p - 1 - s))
    return _place("1f1b", p, m, 1, orders)


def eager_one_f_one_b(p: int, m: int, v: int = 1) -> Schedule:
    """Eager 1F1B (Alpa's overlap-friendly PipeDream-flush): 2(p-1-s) warmup forwards.

    Example:
      >>> print(eager_one_f_one_b(2, 3).grid()[0])
      ['0F0', '0F1', '0F2', '0B0', '.', '0B1', '.', '0B2']
    """
    check_params("eager-1f1b", p, m, v)
    orders = []
    for s in range(p):
        fwd = [_fwd(s, i) for i in range(m)]
        bwd = [_bwd(s, i) for i in range(m)]
        orders.append(_one_f_one_b(fwd, bwd, n_warmup=2 * (p - 1 - s)))
    return _place("eager-1f1b", p, m, 1, orders)


def interleaved_one_f_one_b(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B (Megatron): v chunks per stage, virtual stage = chunk * p + stage.

    The k-th forward of a stage is microbatch ``(k // (p*v)) * p + k % p`` on
    chunk ``(k // p) % v``; backwards use the same microbatch order with the
    chunks reversed.

    Example:
      >>> print(interleaved_one_f_one_b(2, 2, 2).grid()[0])
      ['0F0', '0F1', '0F0c1', '0F1c1', '.', '0B0c1', '.', '0B1c1', '0B0', '0B1']
    """
    check_params("interleaved-1f1b", p, m, v)
    n = m * v

    def mb(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def chunk(k: int) -> int:
        return (k // p) % v

    orders = []
    for s in range(p):
        fwd = [_fwd(s, mb(k), chunk(k)) for k in range(n)]
        bwd = [_bwd(s, mb(k), v - 1 - chunk(k)) for k in range(n)]
        orders.append(_one_f_one_b(fwd, bwd, n_warmup=(v - 1) * p + 2 * (p - 1 - s)))
    return _place("interleaved-1f1b", p, m, v, orders)


def zb_h1(p: int, m: int, v: int = 1) -> Schedule:
    """Zero-bubble H1: 1F1B with B split into I then W; stage s runs each W s backwards late.

    Example:
      >>> for row in zb_h1(2, 2).grid(): print(row)
      ['0F0', '0F1', '.', '0I0', '0W0', '0I1', '0W1']
      ['.', '1F0', '1I0', '1F1', '1I1', '1W0', '1W1']
    """
    check_params("zb-h1", p, m, v)
    orders = []
    for s in range(p):
        lag = s
        n_warmup = min(p - 1 - s, m)
        warmup = [_fwd(s, i) for i in range(n_warmup)]
        steady: Order = []
        cooldown: Order = []
        for j in range(m):          # the j-th input-grad backward, and the W it releases
            phase = steady if j < m - n_warmup else cooldown
            if phase is steady:
                phase.append(_fwd(s, n_warmup + j))
            phase.append(Action(s, Kind.I, j))
            if j >= lag:
                phase.append(Action(s, Kind.W, j - lag))
        cooldown += [Action(s, Kind.W, j) for j in range(max(m - lag, 0), m)]
        orders.append(warmup + steady + cooldown)
    return _place("zb-h1", p, m, 1, orders)


def forward_only(p: int, m: int, v: int = 1) -> Schedule:
    """Evaluation: every stage runs the forwards of all m microbatches (all v chunks), nothing else.

    Not a training schedule (not in SCHEDULES); lower it with `add_comms` only (no OPT).

    Example:
      >>> print(forward_only(2, 2).grid())
      [['0F0', '0F1', '.'], ['.', '1F0', '1F1']]
    """
    for label, value in (("p", p), ("m", m), ("v", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"forward-only: {label} must be an int >= 1, got {label}={value!r}")
    orders = []
    for s in range(p):
        warmup: Order = []
        steady = [_fwd(s, mb, c) for c in range(v) for mb in range(m)]   # chunk-major: chunk c after c-1
        cooldown: Order = []
        orders.append(warmup + steady + cooldown)
    placed = _place("forward-only", p, m, v, orders)
    return Schedule("forward-only", p, m, v, placed.actions, forward_only=True)


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "eager-1f1b": eager_one_f_one_b,
    "interleaved-1f1b": interleaved_one_f_one_b,
    "zb-h1": zb_h1,
}


def check_params(name: str, p: int, m: int, v: int = 1) -> None:
    """Raise `ScheduleError` naming the offending value and the rule it breaks.

    Example:
      >>> check_params("interleaved-1f1b", p=4, m=6, v=2)
      Traceback (most recent call last):
      ...
      orchestrator.core.schedule.ir.ScheduleError: interleaved-1f1b needs m divisible by p (microbatches go round the stages in groups of p): got m=6, p=4
    """
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; known schedules: {', '.join(SCHEDULES)}")
    for label, value, what in (("p", p, "stages"), ("m", m, "microbatches"),
                               ("v", v, "virtual chunks per stage")):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ScheduleError(f"{name}: {label} ({what}) must be an int, got {label}={value!r}")
        if value < 1:
            raise ScheduleError(f"{name}: {label} ({what}) must be >= 1, got {label}={value}")
    if name != "interleaved-1f1b" and v != 1:
        raise ScheduleError(f"{name} has no virtual chunks: v must be 1, got v={v} "
                            f"(use 'interleaved-1f1b' for v > 1)")
    if name == "interleaved-1f1b" and m % p:
        raise ScheduleError(f"interleaved-1f1b needs m divisible by p (microbatches go round "
                            f"the stages in groups of p): got m={m}, p={p}")


def generate(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The compute-only schedule `name` for p stages, m microbatches, v chunks.

    Example:
      >>> s = generate("1f1b", p=4, m=8)
      >>> (s.name, s.p, s.m, s.v, s.lowered)
      ('1f1b', 4, 8, 1, False)
    """
    check_params(name, p, m, v)
    return SCHEDULES[name](p, m, v)


def _place(name: str, p: int, m: int, v: int, orders: list[Order]) -> Schedule:
    """Lay per-stage orders on one step axis: one slot per action, as early as inputs allow.

    An F needs the previous virtual stage's F of its microbatch in an earlier
    slot; a B or I needs the next virtual stage's B or I. Same-stage order is
    kept, so F before B and I before W come from the order itself.
    """
    done: dict[tuple[str, int, int, int], int] = {}   # ("F"|"G", stage, mb, chunk) -> slot
    pos = [0] * p
    rows: list[list[Action | None]] = [[] for _ in range(p)]
    step = 0
    while any(pos[s] < len(orders[s]) for s in range(p)):
        placed = []
        for s in range(p):
            if pos[s] == len(orders[s]):
                continue
            a = orders[s][pos[s]]
            if a.kind is Kind.F:
                dep = prev_virtual(a.stage, a.chunk, p)
                need = None if dep is None else ("F", dep[0], a.microbatch, dep[1])
            elif a.kind in (Kind.B, Kind.I):
                dep = next_virtual(a.stage, a.chunk, p, v)
                need = None if dep is None else ("G", dep[0], a.microbatch, dep[1])
            else:
                need = None
            if need is None or done.get(need, step) < step:
                rows[s] += [None] * (step - len(rows[s])) + [a]
                placed.append(a)
                pos[s] += 1
        if not placed:   # nothing new becomes ready later either: the orders deadlock
            stuck = [str(orders[s][pos[s]]) for s in range(p) if pos[s] < len(orders[s])]
            raise ScheduleError(f"{name}: generator orders cannot be placed, stuck at {stuck}",
                                rule="placement")
        for a in placed:
            if a.kind is not Kind.W:
                done[("F" if a.kind is Kind.F else "G", a.stage, a.microbatch, a.chunk)] = step
        step += 1
    return Schedule(name, p, m, v, tuple(tuple(r) for r in rows))
