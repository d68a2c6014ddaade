"""Actor-side telemetry: compile time, memory in use, bytes sent per edge, and the conditions the
process runs under (CPU affinity and thread count, read back from the OS).

`watch_compiles()` once before jax compiles anything; `stage_stats(worker)` after
each step; the driver aggregates them (`orchestrator.driver.telemetry`).
"""
from __future__ import annotations

import math
import os

_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_compile_s = [0.0]
_watching = [False]


def watch_compiles() -> None:
    """Sum jax's tracing + lowering + XLA compile durations in this process (idempotent)."""
    if _watching[0]:
        return
    import jax.monitoring

    def listener(event: str, duration: float, **_: object) -> None:
        if event in _COMPILE_EVENTS:
            _compile_s[0] += duration

    jax.monitoring.register_event_duration_secs_listener(listener)
    _watching[0] = True


def memory_in_use(devices) -> tuple[int, str]:
    """(bytes, source): the devices' bytes_in_use when jax reports it (GPU/TPU), else process RSS.

    XLA:CPU devices report no memory_stats, so on CPU this is the actor process's
    resident set (Linux /proc), which includes the Python and jax runtime.
    """
    total, seen = 0, False
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001 - backends without stats raise or return None
            stats = None
        if stats and "bytes_in_use" in stats:
            total += int(stats["bytes_in_use"])
            seen = True
    if seen:
        return total, "device"
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"), "process_rss"
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process_peak_rss"


def live_device_bytes() -> int:
    """Bytes of live device buffers on this process's busiest device, from the runtime's own list
    (`jax.live_arrays()`: every array not yet freed — parameters, optimizer state, accumulators,
    residuals, inputs — each counted by its shard on every device holding one)."""
    import jax

    per: dict = {}
    for a in jax.live_arrays():
        n = int(math.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize
        for d in a.sharding.addressable_devices:
            per[d] = per.get(d, 0) + n
    return max(per.values(), default=0)


class LivePeak:
    """The live device bytes at the moments a step's kept bytes reach a new high for this process.

    `Stash` calls it when a step's stash passes its own peak; it measures only when that also
    passes every earlier step's (so after the first steps it costs nothing: steady steps repeat
    the same peak). `bytes` is the largest measured.
    """

    def __init__(self):
        self.stash_high, self.bytes = -1, 0

    def __call__(self, stash_now: int) -> None:
        if stash_now > self.stash_high:
            self.stash_high = stash_now
            self.bytes = max(self.bytes, live_device_bytes())


def stage_stats(worker) -> dict:
    """Per-host numbers a stage worker returns with each step (cumulative where it says so)."""
    import jax

    transport = getattr(worker, "transport", None)
    by_direction = dict(getattr(transport, "sent_bytes_to", {}) or {})
    mem, source = memory_in_use(jax.local_devices())
    return {
        "sent_bytes": int(getattr(transport, "sent_bytes", 0)),      # cumulative, both directions
        "sent_bytes_to": {k: int(v) for k, v in by_direction.items()},  # cumulative, per neighbour
        # the compute thread's time inside SEND (it only hands the tensor over), cumulative, and the SENDs
        "send_blocked_s": float(getattr(transport, "send_blocked_s", 0.0)),
        "send_calls": int(getattr(transport, "send_calls", 0)),
        "memory_bytes": int(mem),
        "memory_source": source,
        "compile_s": float(_compile_s[0]),                           # cumulative
        "live_peak_bytes": int(getattr(getattr(worker, "live_peak", None), "bytes", 0)),  # busiest device
        **conditions(),
    }


def conditions() -> dict:
    """What this process actually runs under, read back from the OS (not from any setting):
    `affinity`, the CPUs the calling (step) thread may run on (XLA:CPU sizes its thread pool from
    the affinity jax started with); `os_threads`, the process's thread count (/proc)."""
    threads = None
    try:
        with open("/proc/self/status") as f:
            threads = next((int(line.split()[1]) for line in f if line.startswith("Threads:")), None)
    except OSError:
        pass
    return {"affinity": sorted(os.sched_getaffinity(0)), "os_threads": threads}
