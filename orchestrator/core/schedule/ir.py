"""Pipeline-schedule IR: actions, schedules, their text form and dependencies.

A schedule is data. An `Action` says what one physical stage
does at one point of its program: a forward or backward of one microbatch
through one virtual chunk, a send or receive, or the optimizer step. A
`Schedule` holds one ordered action list per physical stage; `None` is an idle
slot. Everything here is pure and immutable.

Text form: ``{stage}{kind}{microbatch}`` plus ``c{chunk}`` when chunk > 0, e.g.
``1F0``, ``0B3``, ``2SEND_F1``, ``1F3c1``; the optimizer step has no
microbatch: ``0OPT``. `Action.parse` reads it back exactly.

Virtual stages: with v chunks per physical stage and p stages, chunk c of
stage s is virtual stage ``c * p + s`` (Megatron's round-robin placement), so
with v = 1 virtual = physical. Data flows forward through virtual stages
0 .. v*p-1 and gradients flow back. `prev_virtual` / `next_virtual` give the
neighbours, `comm_peer` the matching half of a send/receive pair.

Slots: in a compute-only schedule (``lowered=False``) the slot index is a time
step on a common axis: an action may only depend on actions in earlier slots.
A lowered schedule is a program: each stage runs its list in order, a RECV
blocks until its matching SEND ran, a SEND never blocks; its slots only align
the grid for reading.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable, Sequence


class ScheduleError(ValueError):
    """A schedule, or the parameters asked of one, breaks a rule.

    `rule` names the broken rule (e.g. ``"F-before-B"``), `cells` the marked
    (stage, slot) cells; the message already contains the rendered grid.
    """

    def __init__(self, message: str, rule: str | None = None,
                 cells: Sequence[tuple[int, int]] = ()):
        super().__init__(message)
        self.rule = rule
        self.cells = tuple(cells)


class Kind(str, Enum):
    """What an action does. See the module docstring for the data flow."""

    F = "F"            # forward of (microbatch, chunk)
    B = "B"            # full backward: input grad and weight grad
    I = "I"            # noqa: E741  backward, input grad only (zero-bubble)
    W = "W"            # backward, weight grad only (zero-bubble)
    SEND_F = "SEND_F"  # send F's output to the next virtual stage
    RECV_F = "RECV_F"  # receive F's input from the previous virtual stage
    SEND_B = "SEND_B"  # send the input grad of B/I to the previous virtual stage
    RECV_B = "RECV_B"  # receive the output grad B/I needs from the next virtual stage
    OPT = "OPT"        # optimizer step of the stage, after all its backwards

    def __str__(self) -> str:
        return self.value


COMPUTE = frozenset({Kind.F, Kind.B, Kind.I, Kind.W})
COMM = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})
SENDS = frozenset({Kind.SEND_F, Kind.SEND_B})
RECVS = frozenset({Kind.RECV_F, Kind.RECV_B})
RELEASES = frozenset({Kind.B, Kind.W})         # last use of stashed activations

_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|OPT|F|B|I|W)(\d*)(?:c(\d+))?$")


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one stage's program.

    Attributes:
      stage: physical stage index (0 .. p-1).
      kind: what to do.
      microbatch: microbatch index; None only for OPT.
      chunk: virtual chunk on this stage (0 .. v-1); virtual stage is chunk*p + stage.

    Example:
      >>> a = Action(1, Kind.F, 3, chunk=1)
      >>> str(a), Action.parse("1F3c1") == a, str(Action(0, Kind.OPT, None))
      ('1F3c1', True, '0OPT')
    """

    stage: int
    kind: Kind
    microbatch: int | None
    chunk: int = 0

    def __post_init__(self):
        object.__setattr__(self, "kind", Kind(self.kind))
        if not isinstance(self.stage, int) or self.stage < 0:
            raise ScheduleError(f"Action stage must be an int >= 0, got stage={self.stage!r}")
        if not isinstance(self.chunk, int) or self.chunk < 0:
            raise ScheduleError(f"Action chunk must be an int >= 0, got chunk={self.chunk!r}")
        if self.kind is Kind.OPT:
            if self.microbatch is not None or self.chunk != 0:
                raise ScheduleError(f"OPT takes no microbatch or chunk, got "
                                    f"microbatch={self.microbatch!r} chunk={self.chunk!r}")
        elif not isinstance(self.microbatch, int) or self.microbatch < 0:
            raise ScheduleError(f"{self.kind.value} needs a microbatch int >= 0, "
                                f"got microbatch={self.microbatch!r}")

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        suffix = f"c{self.chunk}" if self.chunk else ""
        return f"{self.stage}{self.kind.value}{mb}{suffix}"

    @staticmethod
    def parse(text: str) -> "Action":
        """Parse the text form (inverse of `str`).

        Example:
          >>> Action.parse("2SEND_F1")
          Action(stage=2, kind=<Kind.SEND_F: 'SEND_F'>, microbatch=1, chunk=0)
        """
        match = _ACTION_RE.match(text.strip())
        if not match:
            raise ScheduleError(f"cannot parse action {text!r}: expected e.g. '1F0', '0B3', "
                                f"'2SEND_F1', '1F3c1' or '0OPT'")
        stage, kind, mb, chunk = match.groups()
        if (kind == "OPT") != (mb == ""):
            raise ScheduleError(f"cannot parse action {text!r}: OPT has no microbatch, "
                                f"every other kind needs one")
        if kind == "OPT" and chunk is not None:
            raise ScheduleError(f"cannot parse action {text!r}: OPT has no chunk")
        return Action(int(stage), Kind(kind), int(mb) if mb else None, int(chunk or 0))

    @property
    def key(self) -> tuple[int, int | None, int]:
        """(stage, microbatch, chunk): the unit of work this action belongs to."""
        return (self.stage, self.microbatch, self.chunk)


def prev_virtual(stage: int, chunk: int, p: int) -> tuple[int, int] | None:
    """(stage, chunk) of the previous virtual stage, or None at the pipeline's start.

    Example:
      >>> prev_virtual(0, 1, p=4), prev_virtual(0, 0, p=4)
      ((3, 0), None)
    """
    vs = chunk * p + stage - 1
    return None if vs < 0 else (vs % p, vs // p)


def next_virtual(stage: int, chunk: int, p: int, v: int) -> tuple[int, int] | None:
    """(stage, chunk) of the next virtual stage, or None at the pipeline's end.

    Example:
      >>> next_virtual(3, 0, p=4, v=2), next_virtual(3, 1, p=4, v=2)
      ((0, 1), None)
    """
    vs = chunk * p + stage + 1
    return None if vs >= p * v else (vs % p, vs // p)


def comm_peer(action: Action, p: int, v: int) -> Action | None:
    """The other half of a send/receive pair, or None if there is none.

    Example:
      >>> str(comm_peer(Action.parse("0SEND_F2"), p=2, v=1))
      '1RECV_F2'
    """
    s, mb, c = action.key
    if action.kind in (Kind.SEND_F, Kind.RECV_B):
        other = next_virtual(s, c, p, v)
    elif action.kind in (Kind.RECV_F, Kind.SEND_B):
        other = prev_virtual(s, c, p)
    else:
        return None
    if other is None:
        return None
    partner = {Kind.SEND_F: Kind.RECV_F, Kind.RECV_F: Kind.SEND_F,
               Kind.SEND_B: Kind.RECV_B, Kind.RECV_B: Kind.SEND_B}[action.kind]
    return Action(other[0], partner, mb, other[1])


def edge_index(action: Action, p: int) -> int:
    """Link a send or receive uses: virtual boundary (vs, vs+1) maps to edge vs % p.

    Edge e joins stage e and stage (e + 1) % p; edge p-1 is the wrap-around
    link that only interleaved schedules use.

    Example:
      >>> edge_index(Action.parse("1SEND_F0"), p=4), edge_index(Action.parse("1RECV_F0"), p=4)
      (1, 0)
    """
    vs = action.chunk * p + action.stage
    low = vs if action.kind in (Kind.SEND_F, Kind.RECV_B) else vs - 1
    return low % p


@dataclass(frozen=True)
class Schedule:
    """One ordered action list per physical stage.

    Attributes:
      name: generator name (or any label).
      stages: p, the number of physical stages.
      microbatches: m.
      chunks: v, virtual chunks per stage (1 unless interleaved).
      actions: ``actions[s]`` is stage s's list; None is an idle slot (trailing
        idle slots are dropped on construction).
      lowered: True once communication actions were inserted (`lower`).
      forward_only: True for an evaluation schedule (`forward_only`): forwards and their
        comms only, no backward, no OPT; the validator holds it to that.

    Example:
      >>> s = Schedule("toy", 1, 1, 1, ((Action(0, Kind.F, 0), None, Action(0, Kind.B, 0)),))
      >>> s.grid()
      [['0F0', '.', '0B0']]
      >>> Schedule.from_json(s.to_json()) == s
      True
    """

    name: str
    stages: int
    microbatches: int
    chunks: int
    actions: tuple[tuple[Action | None, ...], ...] = field(repr=False)
    lowered: bool = False
    forward_only: bool = False

    def __post_init__(self):
        rows = []
        for row in self.actions:   # normalise: tuples, no trailing idle slots
            row = list(row)
            while row and row[-1] is None:
                row.pop()
            rows.append(tuple(row))
        object.__setattr__(self, "actions", tuple(rows))
        if len(self.actions) != self.stages:
            raise ScheduleError(f"schedule {self.name!r} has {len(self.actions)} action rows "
                                f"but stages={self.stages}")

    @property
    def p(self) -> int:
        return self.stages

    @property
    def m(self) -> int:
        return self.microbatches

    @property
    def v(self) -> int:
        return self.chunks

    @property
    def num_slots(self) -> int:
        """Length of the longest stage list."""
        return max((len(row) for row in self.actions), default=0)

    def cells(self) -> Iterable[tuple[int, int, Action]]:
        """Yield (stage, slot, action) for every non-idle slot, stage by stage."""
        for s, row in enumerate(self.actions):
            for t, a in enumerate(row):
                if a is not None:
                    yield s, t, a

    def grid(self) -> list[list[str]]:
        """Action strings per stage, '.' for idle slots, rows padded to equal length."""
        n = self.num_slots
        return [[str(a) if a is not None else "." for a in row] + ["."] * (n - len(row))
                for row in self.actions]

    def to_json(self) -> dict[str, Any]:
        """Plain dict: name, p, m, v, lowered and the grid of action strings."""
        out = {"name": self.name, "p": self.p, "m": self.m, "v": self.v,
               "lowered": self.lowered, "grid": self.grid()}
        if self.forward_only:
            out["forward_only"] = True
        return out

    @staticmethod
    def from_json(data: dict[str, Any]) -> "Schedule":
        """Inverse of `to_json`; '', '.' and None are idle slots."""
        rows = [[None if cell in (None, "", ".") else Action.parse(cell) for cell in row]
                for row in data["grid"]]
        return Schedule(data["name"], data["p"], data["m"], data.get("v", 1), tuple(rows),
                        bool(data.get("lowered", False)), bool(data.get("forward_only", False)))

    def __str__(self) -> str:
        from orchestrator.core.schedule.grid import render_grid
        return render_grid(self)
