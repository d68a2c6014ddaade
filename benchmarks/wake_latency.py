"""What waking the other core costs: a one-byte ping-pong over a Unix socket pair between two
processes, one pinned to each of the first two cores, with the receiver blocking in `recv` or
spinning on a non-blocking `recv`.

    python -m benchmarks.wake_latency [--rounds 3000]

On a VM an idle vCPU halts, and a blocking receiver costs the hypervisor a wake-up per message;
a spinning one never halts. The difference is the floor under every hop between two stage actors
that wait for each other (the pipeline benchmark's reading, `docs/benchmarks/notes/pipeline.md`). Affinity is read back in both processes.
Writes benchmarks/results/wake_latency.json. A diagnostic, not part of `benchmarks.run`.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import time

from benchmarks.common import RESULTS, machine_info

TIMEOUT_S = 30.0      # the whole ping-pong takes well under a second; a silent peer ends it


def _recv(sock: socket.socket, spin: bool, deadline: float) -> bytes:
    """One message. A blocking socket waits in the kernel under its own timeout; a spinning one
    is non-blocking (no timeout: Python would wait in poll() before each recv) and checks
    `deadline` itself."""
    while True:
        try:
            got = sock.recv(64)
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError("wake_latency: the peer stopped answering") from None
            continue
        if not got:
            raise ConnectionError("wake_latency: the peer closed the socket")
        return got


def ping_pong(rounds: int, spin: bool, cores: tuple[int, int]) -> dict:
    """Median, p10 and p90 round trip in µs, and the affinity each side read back."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:                                   # the echoing side
        try:
            a.close()
            b.settimeout(TIMEOUT_S)
            os.sched_setaffinity(0, {cores[1]})
            b.sendall(json.dumps(sorted(os.sched_getaffinity(0))).encode() + b"\n")
            if spin:
                b.setblocking(False)
            deadline = time.monotonic() + TIMEOUT_S
            for _ in range(rounds):
                _recv(b, spin, deadline)
                b.sendall(b"x")
        finally:
            os._exit(0)
    b.close()
    os.sched_setaffinity(0, {cores[0]})
    a.settimeout(TIMEOUT_S)
    peer = json.loads(a.recv(64).decode())
    if spin:
        a.setblocking(False)      # sendall of one byte to an empty socket buffer never waits
    deadline, times = time.monotonic() + TIMEOUT_S, []
    for _ in range(rounds):
        t = time.perf_counter()
        a.sendall(b"x")
        _recv(a, spin, deadline)
        times.append(time.perf_counter() - t)
    os.waitpid(pid, 0)
    a.close()
    times.sort()
    us = [times[int(q * (rounds - 1))] * 1e6 for q in (0.5, 0.1, 0.9)]
    return {"receiver": "spins" if spin else "blocks", "median_us": us[0], "p10_us": us[1], "p90_us": us[2],
            "affinity": [sorted(os.sched_getaffinity(0)), peer]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3000)
    args = ap.parse_args()
    cores = tuple(sorted(os.sched_getaffinity(0))[:2])
    if len(cores) < 2:
        raise SystemExit("wake_latency needs two cores in this process's affinity")
    before = os.getloadavg()
    rows = [ping_pong(args.rounds, spin, cores) for spin in (False, True, False, True)]
    out = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "rounds": args.rounds, "load": [before, os.getloadavg()],
           "machine": machine_info(), "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "wake_latency.json").write_text(json.dumps(out, indent=1) + "\n")
    for r in rows:
        print(f"receiver {r['receiver']:6s}: round trip median {r['median_us']:.1f} µs "
              f"(p10 {r['p10_us']:.1f}, p90 {r['p90_us']:.1f}), affinity {r['affinity']}")


if __name__ == "__main__":
    main()
