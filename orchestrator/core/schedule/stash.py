"""What a stage keeps between its actions, action by action: the memory timeline of a schedule. Pure.

A stage runs its lowered list in order, so what it holds between actions depends on that
order alone, not on timing. The rules are the stage worker's (`stages.actions`, whose
`Stash` measures the same quantity on the arrays):

  F   keeps its residuals, `kept["F"]` bytes, until the microbatch's B or I;
  B   releases them;
  I   releases them and keeps what W reads, `kept["I"]` bytes (zero-bubble: per layer
      the inputs and output cotangents of its weight gradients, `stages.zb_split`),
      until the microbatch's W;
  W   releases that.

So 1F1B-style counting (peak in-flight microbatches × residual bytes) is the special case
`kept["I"] == kept["F"]`; under ZB-H1 a microbatch between its I and its W holds only
`kept["I"]`. A loss chunk the worker runs as one fused F+B program keeps nothing: give its
F 0 bytes. Sizes come from the caller (e.g. `jax.eval_shape` of the stage programs), so
this module needs no devices.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence, Union

from orchestrator.core.schedule.ir import Action, Kind, Schedule, ScheduleError

Number = Union[int, float]
Size = Union[Number, Sequence[Number]]       # one value, or one per chunk
Kept = Union[Mapping[str, Size], Sequence[Mapping[str, Size]]]


@dataclass(frozen=True)
class StashResult:
    """Per stage: `peak` bytes kept at once, `peak_items` microbatch entries held at once (an
    entry per microbatch between its F and its B or W), and `timeline`: (action, bytes kept
    after it) for each F, B, I and W in program order."""

    peak: list[Number]
    peak_items: list[int]
    timeline: list[list[tuple[Action, Number]]]


def stash_timeline(lowered: Schedule, kept: Kept) -> StashResult:
    """Play each stage's list and sum what it keeps (see the module docstring).

    Args:
      lowered: a schedule (lowered or compute-only: only the order of each stage's list counts).
      kept: {"F": bytes an F keeps until its B or I, "I": bytes an I keeps until its W}, for
        every stage, or one such mapping per stage; a value may be a list with one entry per
        chunk (virtual stages). "I" is needed only where the schedule has I actions.

    Returns:
      A `StashResult`.

    Raises:
      ScheduleError: `kept` is malformed (the message names the stage and key).

    Example:
      >>> from orchestrator.core.schedule import generate
      >>> one = stash_timeline(generate("1f1b", 2, 3), {"F": 10})
      >>> zb = stash_timeline(generate("zb-h1", 2, 3), {"F": 10, "I": 4})
      >>> one.peak, zb.peak          # stage 1: one microbatch's residuals + one held for W
      ([20, 10], [20, 14])
    """
    p = lowered.p
    per_stage = [kept] * p if isinstance(kept, Mapping) else list(kept)
    if len(per_stage) != p:
        raise ScheduleError(f"kept: got {len(per_stage)} per-stage mappings for p={p} stages")
    peaks, items_peaks, timelines = [], [], []
    for s, row in enumerate(lowered.actions):
        sizes = per_stage[s]
        unknown = set(sizes) - {"F", "I"}
        if unknown:
            raise ScheduleError(f"kept[{s}]: unknown keys {sorted(unknown)}; known: F (residuals until B "
                                f"or I), I (what W reads, until W)")
        held: dict = {}          # (microbatch, chunk) -> bytes it keeps now
        now, peak, items_peak, line = 0, 0, 0, []
        for a in row:
            if a is None or a.kind not in (Kind.F, Kind.B, Kind.I, Kind.W):
                continue
            key = (a.microbatch, a.chunk)
            if a.kind is not Kind.F:
                now -= held.pop(key, 0)
            if a.kind in (Kind.F, Kind.I):
                held[key] = _size(sizes, a.kind.value, a.chunk, s)
                now += held[key]
                peak, items_peak = max(peak, now), max(items_peak, len(held))
            line.append((a, now))
        peaks.append(peak)
        items_peaks.append(items_peak)
        timelines.append(line)
    return StashResult(peaks, items_peaks, timelines)


def _size(sizes: Mapping[str, Size], kind: str, chunk: int, stage: int) -> Number:
    if kind not in sizes:
        raise ScheduleError(f"kept[{stage}]: no {kind!r} size, but the schedule runs {kind} actions "
                            f"(give the bytes one {kind} keeps)")
    value = sizes[kind]
    if isinstance(value, Sequence):
        if chunk >= len(value):
            raise ScheduleError(f"kept[{stage}][{kind!r}]: {len(value)} per-chunk values, but the "
                                f"schedule runs chunk {chunk}")
        value = value[chunk]
    if value < 0:
        raise ScheduleError(f"kept[{stage}][{kind!r}]={value}: sizes must be >= 0")
    return value
