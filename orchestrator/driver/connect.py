"""Connecting to a running Ray cluster (`cluster.address`, `meshpipe run --address`) within a deadline.

`ray.init(address=...)` has no deadline of its own. Against an address where nothing listens it
retries for many minutes (`127.0.0.1:1`: still retrying after 5 minutes, against `192.0.2.2:1`:
Ray replaces a loopback host by this machine's routable address before it connects), and against
a port that accepts connections but is not a Ray GCS (the dashboard's 8265 given by mistake) it
waits as long. A healthy connect takes well under 3 s here (0.1-2.3 s measured on a loaded 2-core
machine), so `cluster.timeouts.connect_s` (default 30 s) bounds both:

  1. `reach`: the address Ray will really dial (`ray_internals.bootstrap_address`: "auto" read
     from RAY_ADDRESS or the last cluster started here, a loopback host rewritten) is probed with
     plain TCP connects until one succeeds or the deadline passes;
  2. `init`: `ray.init` runs in a daemon thread joined with what is left of the deadline (off the
     main thread Ray installs no SIGTERM handler of its own; the driver's is the one that counts,
     `orchestrator.driver.interrupt`).

Either failure raises `PlacementError` naming the address as given, the one Ray tried, the key
and the deadline. A `ray.init` cut off this way is abandoned in its thread (it holds no actors or
placement groups yet); `meshpipe run` then exits 1.
"""
from __future__ import annotations

import logging
import socket
import threading
import time

from orchestrator.core.backends import PlacementError   # pure: no ray, no jax

log = logging.getLogger("meshpipe")

__all__ = ["init", "reach"]


def _host_port(target: str) -> tuple[str, int] | None:
    """(host, port) of 'host:port' / '[v6]:port' / 'ray://host:port'; None when there is no port."""
    rest = target.split("://", 1)[-1].rstrip("/")
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _where(given: str, tried: str) -> str:
    if tried == given:
        return f"cluster.address = {given!r}"
    return f"cluster.address = {given!r} (Ray connects to {tried}: it reads 'auto' from RAY_ADDRESS or the " \
           "last cluster started on this machine, and replaces a loopback host by this machine's address)"


def reach(address: str, deadline_s: float) -> str:
    """Probe the address Ray will dial for `address` with TCP connects until one succeeds or
    `deadline_s` passes; returns that address ('host:port'), or `address` when Ray will not dial
    one ("auto" with no cluster found: `ray.init` says so itself, at once).

    Raises:
      PlacementError: nothing accepted a connection there within the deadline.
    """
    from orchestrator.driver.ray_internals import bootstrap_address

    tried = bootstrap_address(address) or address
    hp = _host_port(tried)
    if hp is None:
        return tried
    end, last = time.monotonic() + deadline_s, None
    while True:
        left = end - time.monotonic()
        try:
            with socket.create_connection(hp, timeout=max(0.05, min(2.0, left))):
                return tried
        except OSError as e:
            last = e
        if time.monotonic() + 0.2 > end:
            break
        time.sleep(0.2)
    raise PlacementError(f"cannot reach a Ray cluster at {_where(address, tried)}: {last.strerror or last} "
                         f"for {deadline_s:g} s (cluster.timeouts.connect_s); is the cluster up and is this its "
                         "GCS address (`ray start --head` prints it; the default port is 6379)?")


def _no_sigterm_note(record: logging.LogRecord) -> bool:
    """Drop Ray's note that `ray.init` off the main thread sets no SIGTERM handler: the driver's
    own handler (`orchestrator.driver.interrupt`) is the one that counts."""
    return not str(record.msg).startswith("SIGTERM handler is not set")


def init(address: str, namespace: str, deadline_s: float) -> None:
    """`ray.init(address=address)` bounded by `deadline_s` (module docstring).

    Raises:
      PlacementError: the address is unreachable, or Ray did not finish connecting in time.
    """
    import ray

    t0 = time.monotonic()
    tried = reach(address, deadline_s)
    box: dict = {}

    def connect():
        try:
            ray.init(address=address, namespace=namespace, logging_level=logging.WARNING)
            box["ok"] = True
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = e

    ray_log = logging.getLogger("ray._private.worker")
    ray_log.addFilter(_no_sigterm_note)
    try:
        th = threading.Thread(target=connect, name="meshpipe-ray-connect", daemon=True)
        th.start()
        th.join(max(0.0, deadline_s - (time.monotonic() - t0)))
    finally:
        ray_log.removeFilter(_no_sigterm_note)
    if "error" in box:
        raise box["error"]
    if th.is_alive():
        raise PlacementError(f"connecting to Ray at {_where(address, tried)} did not finish within {deadline_s:g} s "
                             "(cluster.timeouts.connect_s): something accepts connections there but does not "
                             "answer as a Ray GCS (a dashboard or another service's port?); give the GCS address "
                             "(`ray start --head` prints it; the default port is 6379), or raise the deadline")
