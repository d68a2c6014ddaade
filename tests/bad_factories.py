"""Model and data factories that misbehave the ways a user's can (tests/test_deadlines.py)."""
from __future__ import annotations

import os
import threading
import time


def blocks(**kwargs):
    """Waits forever on a lock nobody releases (a factory stuck on the network or a prompt)."""
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()


def exits(**kwargs):
    """Ends the process with exit code 0 before returning (it made `meshpipe run` exit 0, no record)."""
    os._exit(0)


def grain_blocks(**kwargs):
    time.sleep(3600)
