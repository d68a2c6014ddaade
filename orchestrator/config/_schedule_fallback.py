"""Stand-in for `orchestrator.schedule.check_params` while that package is not written yet.

`check._schedule_api` uses this module only when `orchestrator.schedule` does not
exist (or is still an empty directory); once the package exports
`check_params`, `ScheduleError` and `SCHEDULES`, those are used instead.
"""
from __future__ import annotations

__all__ = ["ScheduleError", "SCHEDULES", "check_params"]


class ScheduleError(ValueError):
    """Schedule parameters that no schedule of that name can run."""


SCHEDULES = {"gpipe": None, "1f1b": None, "eager-1f1b": None, "interleaved-1f1b": None, "zb-h1": None}


def check_params(name: str, p: int, m: int, v: int = 1) -> None:
    """Basic rules: known name; p, m, v >= 1; v > 1 and m % p == 0 for interleaved-1f1b."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; known: {', '.join(sorted(SCHEDULES))}")
    if p < 1 or m < 1 or v < 1:
        raise ScheduleError(f"p={p}, m={m}, v={v}: all must be >= 1")
    if v != 1 and name != "interleaved-1f1b":
        raise ScheduleError(f"virtual stages v={v} need the 'interleaved-1f1b' schedule; {name!r} runs v=1")
    if name == "interleaved-1f1b" and m % p:
        raise ScheduleError(f"interleaved-1f1b needs m divisible by p: got m={m}, p={p}")
