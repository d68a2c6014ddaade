"""Training health as a policy, pure: what went wrong in a step, and what the run does about it.

A step that trains to garbage is an event, not a success. The stages check on the device, inside
the programs that already run (the optimizer update also returns the stage's squared gradient norm
and its count of non-finite parameters; `stages.program.StageProgram.update_checked`), and hand the
two numbers back with the step's result, beside the losses the driver already receives — no extra
host synchronisation. The driver's `HealthMonitor.observe` turns each step's numbers into at most
one `Event` and the action the job's `failure:` section names for it:

  - non-finite, in the order the step computes them: the loss (last stage), a stage's gradient
    norm (the backward runs from the last stage to the first, so the highest such stage is where
    it began), a stage's parameters after the update. Action `failure.on_nonfinite`.
  - divergence (`failure.divergence`): a finite loss above `factor` × the median of the last
    `window` healthy losses (`diverged`). Action `failure.divergence.action`.

Actions: STOP (the run fails, the message names step, stage, kind and values), SKIP (the stages
have already dropped the update — the decision was global, taken on the device values before any
stage updated, `stages.actions.optimizer_step` — and the driver counts it; more than
`max_skips` in a row become STOP), ROLLBACK (restore the last commit and advance the data past the
bad step: `skip_data`; the driver raises `HealthRollback`). A parameter that is already non-finite
cannot be skipped: under `skip` it stops the run.

Invariants: the monitor's state (the loss history, the skips in a row) is explicit and is rolled
back with the run (`rollback`); a skipped, diverged or non-finite step never enters the median.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

STOP, SKIP, ROLLBACK = "stop", "skip", "rollback"
LOSS, GRAD, PARAMS, DIVERGENCE = "loss", "gradient norm", "parameters", "divergence"


@dataclass(frozen=True)
class HealthRule:
    """The `failure:` keys the monitor reads (`from_job`)."""

    on_nonfinite: str = STOP
    max_skips: int = 3
    divergence_factor: Optional[float] = 100.0      # None: no divergence test
    divergence_window: int = 50
    divergence_action: str = STOP

    @classmethod
    def from_job(cls, job) -> "HealthRule":
        f, d = job.failure, job.failure.divergence
        return cls(f.on_nonfinite, f.max_skips, None if d is None else d.factor,
                   50 if d is None else d.window, STOP if d is None else d.action)


@dataclass(frozen=True)
class Event:
    """One training-health event, as summary.json records it (`as_record`).

    Attributes:
      step: the step it happened in.
      kind: LOSS, GRAD, PARAMS (went non-finite) or DIVERGENCE.
      stage: the stage it was seen on first (LOSS, DIVERGENCE: the last stage).
      values: what was seen: the mean loss, and per stage the gradient norm / non-finite parameters.
      action: STOP, SKIP or ROLLBACK.
      why: one line for the log and the error message.
    """

    step: int
    kind: str
    stage: int
    values: dict
    action: str
    why: str

    def as_record(self) -> dict:
        return {"step": self.step, "kind": self.kind, "stage": self.stage, "values": self.values,
                "action": self.action, "why": self.why}


def _finite(x: Optional[float]) -> bool:
    return x is None or math.isfinite(x)


def first_nonfinite(loss: float, grad_sq: Sequence[Optional[float]],
                    params_bad: Sequence[Optional[float]]) -> Optional[tuple[str, int]]:
    """(kind, stage) of what went non-finite first in a step, or None when all is finite.
    `grad_sq` / `params_bad`: per stage, its squared gradient norm and its count of non-finite
    parameters after the update (None: not known, e.g. the update was skipped).

    >>> first_nonfinite(float("nan"), [1.0, 2.0], [0, 0])
    ('loss', 1)
    >>> first_nonfinite(1.0, [float("inf"), float("nan"), 2.0], [0, 0, 0])    # began at stage 1
    ('gradient norm', 1)
    >>> first_nonfinite(1.0, [1.0, 2.0], [0, 3]), first_nonfinite(1.0, [1.0, None], [0, None])
    (('parameters', 1), None)
    """
    last = len(grad_sq) - 1
    if not math.isfinite(loss):
        return LOSS, last
    bad = [s for s, g in enumerate(grad_sq) if not _finite(g)]
    if bad:
        return GRAD, bad[-1]
    bad = [s for s, n in enumerate(params_bad) if n]
    if bad:
        return PARAMS, bad[0]
    return None


def diverged(loss: float, history: Sequence[float], factor: float) -> Optional[float]:
    """The running median `loss` is judged against when it exceeds `factor` × it, else None
    (no history yet, or a median ≤ 0, judges nothing).

    >>> diverged(127982.0, [5.19], 100.0), diverged(6.0, [5.19, 4.9], 100.0), diverged(1.0, [], 100.0)
    (5.19, None, None)
    """
    if not history:
        return None
    median = statistics.median(history)
    return median if median > 0 and loss > factor * median else None


@dataclass
class HealthMonitor:
    """The driver's view of training health: `observe` each step's result in order.

    >>> m = HealthMonitor(HealthRule(on_nonfinite="skip", max_skips=1))
    >>> m.observe(0, 2.0, [1.0, 1.0], [0, 0]) is None
    True
    >>> m.observe(1, 2.0, [float("nan"), 1.0], [None, None]).action
    'skip'
    >>> e = m.observe(2, 2.0, [float("nan"), 1.0], [None, None]); e.action, e.why
    ('stop', 'step 2: gradient norm non-finite on stage 0 (2 steps in a row; failure.max_skips = 1)')
    >>> m.observe(3, 900.0, [1.0, 1.0], [0, 0]).why
    'step 3: divergence: loss 900 > 100 × the running median 2 (failure.divergence)'
    """

    rule: HealthRule
    history: deque = field(default=None)      # (step, loss) of the latest healthy steps
    skips_in_row: int = 0
    events: list = field(default_factory=list)

    def __post_init__(self):
        if self.history is None:
            self.history = deque(maxlen=self.rule.divergence_window)

    def observe(self, step: int, loss: float, grad_sq: Sequence[Optional[float]],
                params_bad: Sequence[Optional[float]]) -> Optional[Event]:
        """The event of step `step` (None: a healthy step, whose loss joins the history)."""
        rule = self.rule
        values = {"loss": loss, "grad_norm": [None if g is None else math.sqrt(g) if g >= 0 else g for g in grad_sq],
                  "nonfinite_params": list(params_bad)}
        found = first_nonfinite(loss, grad_sq, params_bad)
        if found is not None:
            kind, stage = found
            action = rule.on_nonfinite
            why = f"step {step}: {kind} non-finite on stage {stage}"
            if action == SKIP and kind == PARAMS:
                action, why = STOP, why + " (parameters already updated cannot be skipped)"
            elif action == SKIP:
                self.skips_in_row += 1
                if self.skips_in_row > rule.max_skips:
                    action = STOP
                    why += f" ({self.skips_in_row} steps in a row; failure.max_skips = {rule.max_skips})"
            return self._event(Event(step, kind, stage, values, action, why))
        self.skips_in_row = 0
        median = None if rule.divergence_factor is None else diverged(
            loss, [x for _, x in self.history], rule.divergence_factor)
        if median is not None:
            values["median"] = median
            why = (f"step {step}: divergence: loss {loss:.6g} > {rule.divergence_factor:g} × the running median "
                   f"{median:.6g} (failure.divergence)")
            return self._event(Event(step, DIVERGENCE, len(grad_sq) - 1, values, rule.divergence_action, why))
        self.history.append((step, loss))
        return None

    def _event(self, e: Event) -> Event:
        self.events.append(e)
        return e

    def rollback(self, step: int) -> None:
        """The run goes back to commit `step`: forget the losses of the steps from there on."""
        kept = [(s, x) for s, x in self.history if s < step]
        self.history.clear()
        self.history.extend(kept)
        self.skips_in_row = 0


def skip_data(step: int, bad_step: int) -> int:
    """The batches a rollback to commit `step` skips: `step` … `bad_step`, so the restored step
    `step` trains on batch `bad_step` + 1 (on top of any earlier skip: the stages add it to their
    `stages.state.StageState.data_offset`, `orchestrator.core.contract.RestorePlan.skip_batches`).

    >>> skip_data(4, 6), skip_data(8, 8)
    (3, 1)
    """
    if bad_step < step:
        raise ValueError(f"the bad step {bad_step} is before the commit {step} it rolls back to")
    return bad_step + 1 - step


class HealthStop(RuntimeError):
    """A training-health event whose action is STOP: the run fails with this message."""

    def __init__(self, event: Event):
        super().__init__(f"training health: {event.why}; values: {_short(event.values)}")
        self.event = event


class HealthRollback(RuntimeError):
    """A training-health event whose action is ROLLBACK: the driver restarts from the last commit
    (`orchestrator.core.recovery.ROLLBACK`) with the data through `event.step` skipped."""

    def __init__(self, event: Event):
        super().__init__(f"training health: {event.why}: rolling back")
        self.event = event


def _short(values: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in values.items())


__all__ = ["HealthRule", "HealthMonitor", "Event", "HealthStop", "HealthRollback", "first_nonfinite", "diverged", "skip_data",
           "STOP", "SKIP", "ROLLBACK", "LOSS", "GRAD", "PARAMS", "DIVERGENCE"]
