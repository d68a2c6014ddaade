"""A training run under a connection flood (marker `flood`, its own CI step).

While a 2-stage GPT run (one 2-device host per stage) trains, a local attacker without the run key keeps opening
connections to every transport listener of every stage actor (TCP and abstract Unix):
idle ones (twice the pending cap per listener), half-HELLOs, random bytes and a frame
header announcing 2 GiB. The run must train exactly as the single-process reference does
(same tolerance as tests/test_pipeline_numerics.py), every flood connection must be closed
by the listener within its handshake deadline (or evicted at once), and no actor's thread
count may grow with the flood.

Counts (sized for the shared 2-core CI machine, a few seconds of flooding per wave): per
listener and wave 2 × MAX_PENDING = 128 idle connections, 16 half-HELLOs, 8 random-byte
and 4 "2 GiB" connections; 4 listeners (2 actors × TCP + Unix), so 624 connections a wave,
waves repeated until the run ends.
"""
from __future__ import annotations

import os
import re
import socket
from pathlib import Path
import threading
import time

import numpy as np
import pytest

from orchestrator.core.config import check_job, parse_cluster, parse_job
from orchestrator.driver.runner import run_job
from stages.frames import FRAME, FRAME_MAGIC, HANDSHAKE_S, HELLO_MAGIC
from stages.socket_transport import MAX_PENDING
from tests.test_pipeline_numerics import CLUSTER, assert_same_training, gpt_job

pytestmark = [pytest.mark.ray, pytest.mark.flood]

ACTORS = 2             # one 2-device host per stage
THREAD_SLACK = 8      # reader threads a genuine peer may add after the baseline is read


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"^Threads:\s+(\d+)", f.read(), re.M).group(1))


def _pid_of_socket(inode: str) -> int | None:
    target = f"socket:[{inode}]"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    return int(pid)
        except OSError:
            continue
    return None


class Flood:
    """The attacker: finds the stage actors' listeners, then floods them in waves until stopped."""

    def __init__(self):
        self.stop = threading.Event()
        self.waves = 0
        self.targets: list[tuple] = []     # (family, address)
        self.pids: list[int] = []
        self.baseline: dict[int, int] = {}
        self.peak: dict[int, int] = {}
        self.unclosed = 0
        self.connected = self.not_connected = 0
        self.listeners: dict[tuple, tuple] = {}     # (ip, port) -> (pid, process name, cmdline)
        self.error: str | None = None

    def find(self) -> bool:
        """Every actor's listeners, the way a local user sees them: the stage actors are
        asked for their addresses through Ray (TCP port + abstract name)."""
        import ray

        names = [a for a in ray.util.list_named_actors(all_namespaces=True) if "/stage" in a["name"]]
        if len(names) < ACTORS:
            return False
        addresses = []
        for a in names:
            handle = ray.get_actor(a["name"], namespace=a["namespace"])
            try:    # (before its setup returns an actor has no transport yet)
                addr = ray.get(handle.transport_address.options(concurrency_group="io").remote(), timeout=60)
            except ray.exceptions.RayTaskError:
                return False
            if addr is None:
                return False
            addresses.append(addr)
        unix_inodes = {}
        with open("/proc/net/unix") as f:
            for line in f.read().splitlines()[1:]:
                parts = line.split()
                if len(parts) >= 8 and parts[7].startswith("@meshpipe-"):
                    unix_inodes[parts[7][1:]] = parts[6]
        for ip, port, _, unix in addresses:
            self.targets.append((socket.AF_INET, (ip, port)))
            if unix:
                self.targets.append((socket.AF_UNIX, "\0" + unix))
                pid = _pid_of_socket(unix_inodes[unix])
                if pid is not None:
                    self.pids.append(pid)
        self.baseline = {pid: _threads(pid) for pid in self.pids}
        self.peak = dict(self.baseline)
        return True

    def _open(self, family, address, payload: bytes = b""):
        s = socket.socket(family, socket.SOCK_STREAM)
        s.settimeout(5)
        try:
            s.connect(address)
            if payload:
                s.sendall(payload)
        except (BlockingIOError, ConnectionError, TimeoutError):   # backlog full, or already dropped
            s.close()
            self.not_connected += 1
            return None
        return s

    def wave(self, rng) -> None:
        socks = []
        for family, address in self.targets:
            socks += [self._open(family, address) for _ in range(2 * MAX_PENDING)]
            socks += [self._open(family, address, HELLO_MAGIC + rng.bytes(10)) for _ in range(16)]
            socks += [self._open(family, address, rng.bytes(200)) for _ in range(8)]
            socks += [self._open(family, address, FRAME.pack(FRAME_MAGIC, 8, 2 << 30) + b"{}      ")
                      for _ in range(4)]
        socks = [s for s in socks if s is not None]
        self.connected += len(socks)
        deadline = time.monotonic() + HANDSHAKE_S + 3
        for s in socks:            # every one must be closed by the listener by its deadline
            s.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                while s.recv(4096):
                    pass
            except ConnectionResetError:
                pass
            except TimeoutError:
                self.unclosed += 1
            finally:
                s.close()
            self._sample()
        self.waves += 1

    def census(self) -> None:
        """Every listening TCP socket of this run's processes (the driver and all it started)."""
        import psutil

        from orchestrator.driver.ray_internals import listening_sockets

        for ip, port, pid, name in listening_sockets():
            try:
                cmd = " ".join(psutil.Process(pid).cmdline())
            except psutil.Error:
                cmd = ""
            self.listeners[(ip, port)] = (pid, name, cmd)

    def _sample(self) -> None:
        for pid in self.pids:
            try:
                self.peak[pid] = max(self.peak[pid], _threads(pid))
            except OSError:
                pass

    def run(self) -> None:
        try:
            while not self.stop.is_set() and not self.find():
                time.sleep(0.5)
            rng = np.random.default_rng(0)
            while not self.stop.is_set():
                self.census()
                self.wave(rng)
        except Exception as e:  # noqa: BLE001 - reported by the test
            if not self.stop.is_set():
                self.error = f"{type(e).__name__}: {e}"


def _doc_table() -> dict[str, str]:
    """docs/security.md's listener table: first backticked name of a row -> its 'binds' cell."""
    rows = {}
    for line in (Path(__file__).resolve().parents[1] / "docs" / "security.md").read_text().splitlines():
        m = re.match(r"^\| `([^`]+)`[^|]*\| ([^|]+) \|", line)
        if m:
            rows.setdefault(m.group(1), m.group(2))
    return rows


def _kind(pid: int, name: str, cmd: str, transport_ports: set, port: int) -> str:
    """Which row of the table a listening socket belongs to."""
    if port in transport_ports:
        return "meshpipe transport"
    if name == "gcs_server":
        return "gcs_server"
    if name == "raylet":
        return "raylet"
    if "dashboard/dashboard.py" in cmd:
        return "ray dashboard"
    if "agent" in cmd or "monitor" in cmd or "reaper" in cmd:
        return "ray agents"
    if pid == os.getpid() or name.startswith("ray::") or "default_worker.py" in cmd:
        return "ray worker"
    return f"unknown ({name}: {cmd[:120]})"


def test_a_run_under_a_connection_flood_trains_as_the_reference(tmp_path, no_leaks):
    """Also the listener census: every socket the run's processes listen on is a row of
    docs/security.md's table and binds loopback, as the table says for an embedded cluster."""
    checked = check_job(parse_job(gpt_job(tmp_path, "1f1b", steps=40)), parse_cluster(CLUSTER))
    flood = Flood()
    attacker = threading.Thread(target=flood.run, daemon=True)
    attacker.start()
    t0 = time.perf_counter()
    try:
        pipe = run_job(checked, echo=lambda s: None)
    finally:
        waves_in_run = flood.waves
        flood.stop.set()
        attacker.join(HANDSHAKE_S + 30)
    wall = time.perf_counter() - t0
    ref = run_job(checked, reference=True, echo=lambda s: None)
    print(f"flooded run: {wall:.1f} s, {waves_in_run} complete waves of {len(flood.targets)} listeners, "
          f"{flood.connected} connections made ({flood.not_connected} refused by a full backlog), "
          f"thread counts {flood.baseline} -> peak {flood.peak}")
    assert flood.error is None, flood.error
    assert len(flood.targets) == 2 * ACTORS and len(flood.pids) == ACTORS
    assert waves_in_run >= 1, "the run ended before one flood wave completed (raise run.steps)"
    assert flood.connected > 2 * MAX_PENDING * len(flood.targets)     # the pending cap was exceeded
    assert_same_training(pipe, ref)
    assert flood.unclosed == 0, f"{flood.unclosed} flood connections outlived the handshake deadline"
    for pid, base in flood.baseline.items():
        assert flood.peak[pid] <= base + THREAD_SLACK, (pid, base, flood.peak[pid])

    table = _doc_table()
    assert {"gcs_server", "raylet", "ray worker", "meshpipe transport", "jax coordinator"} <= set(table), table
    transport_ports = {address[1] for family, address in flood.targets if family == socket.AF_INET}
    kinds = {}
    for (ip, port), (pid, name, cmd) in flood.listeners.items():
        kinds.setdefault(_kind(pid, name, cmd, transport_ports, port), set()).add(ip)
    print("listeners by kind:", kinds)
    assert set(kinds) <= set(table), f"listening, but not in docs/security.md: {set(kinds) - set(table)}"
    assert {"gcs_server", "raylet", "ray worker", "meshpipe transport"} <= set(kinds), kinds
    for kind, ips in kinds.items():
        assert "127.0.0.1" in table[kind] or "dashboard_host" in table[kind], (kind, table[kind])
        assert ips <= {"127.0.0.1", "::1", "::ffff:127.0.0.1"}, (kind, ips)
