"""A keyed, thread-safe inbox with deadlines: where neighbours' pushes land.

Senders call the receiving actor's `deliver(key, payload)` (an I/O concurrency
group, so it runs while the compute thread executes the schedule); the compute
thread `take`s by key when it reaches the matching RECV action. Keys carry the
step, so nothing from one step can be mistaken for another's. A take that
outlives its deadline raises `TimeoutError` naming the key: no wait is unbounded.
A take on a closed mailbox raises `MailboxClosed` (the actor was told to stop:
the cause is on another actor, or the driver stopped the run).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Hashable

from orchestrator.core.contract import FAILURE_ATTR


_MISSING = object()


class MailboxClosed(RuntimeError):
    """This actor was told to stop (`Mailbox.close`): a consequence, not the cause, of a failure.
    The driver reports the actor that failed by itself in preference (`waiting.wait_all`); when
    a peer's failure closed it, the error carries that peer's `StepFailure`
    (`orchestrator.core.contract.FAILURE_ATTR`), so the driver names the peer from its fields."""


class Mailbox:
    def __init__(self, owner: str = ""):
        self._items: dict[Hashable, Any] = {}
        self._cv = threading.Condition()
        self._owner = owner
        self._closed: str | None = None
        self._failure = None       # the peer's StepFailure that closed it, if one did

    def put(self, key: Hashable, value: Any) -> None:
        with self._cv:
            if key in self._items:
                raise KeyError(f"{self._owner}: duplicate delivery for {key!r}")
            self._items[key] = value
            self._cv.notify_all()

    def take(self, key: Hashable, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        with self._cv:
            while key not in self._items:
                if self._closed:
                    e = MailboxClosed(f"{self._owner}: mailbox closed ({self._closed}) while waiting for {key!r}")
                    if self._failure is not None:
                        setattr(e, FAILURE_ATTR, self._failure)
                    raise e
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{self._owner}: nothing arrived for {key!r} within {timeout:.0f} s "
                                       f"(pending: {sorted(map(str, self._items))[:8]})")
                self._cv.wait(remaining)
            return self._items.pop(key)

    def discard(self, key: Hashable) -> bool:
        """Drop `key`'s item if it is there (a transport withdrawing what a rejected peer
        delivered); True if it was."""
        with self._cv:
            return self._items.pop(key, _MISSING) is not _MISSING

    def close(self, reason: str, failure=None) -> None:
        """Close: every wait, now and later, raises MailboxClosed saying `reason`; `failure`: the
        `StepFailure` behind it (a peer's), carried on those errors."""
        with self._cv:
            self._closed, self._failure = reason, failure
            self._cv.notify_all()

    @property
    def closed(self) -> str | None:
        """Why the mailbox was closed, or None while it is open."""
        return self._closed

    def __len__(self) -> int:
        with self._cv:
            return len(self._items)
