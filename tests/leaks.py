"""What a run may not leave behind in the operating system (beside `conftest.no_leaks`'s actors and
placement groups, which the state API sees).

    pids = tmp_path / "pids"
    run_job(checked, hooks=[RecordPid(str(pids))])      # every stage process of every attempt
    assert_nothing_left(pids, run_name)

After a run, `assert_nothing_left` checks (Linux; /proc and psutil, which Ray ships):
  - no process of the run: every stage process the run started (recorded at each actor's setup by
    `RecordPid`, in every recovery attempt) has exited (waited for, bounded: killed actors exit
    asynchronously), and no `ray::StageWorker` process is left under this test process;
  - no shared-memory block of the run: the socket transport's blocks are anonymous memfds named
    `meshpipe-block-<n>` (`stages/bufpool.py`): no process under this test process (itself
    included) holds one; and /dev/shm has no entry named after meshpipe or the run;
  - no socket of the run: no abstract Unix socket `@meshpipe-<hex>` (the transport's listener,
    `stages/socket_conn.py`) is held by a process under this test process, and this process
    (the driver) listens on no TCP port it did not listen on before the run (`listening()`).
Only processes under this one are searched: other test sessions on the machine run their own.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from stages.hooks import WorkerHook
from tests.conftest import wait_until

SHM_BLOCK = "memfd:meshpipe-block-"
UNIX_PREFIX = "@meshpipe-"


@dataclass(frozen=True)
class RecordPid(WorkerHook):
    """Each stage actor writes `<dir>/<pid>` (its wall-clock time then) at setup: the run's processes."""

    dir: str

    def on_setup(self, cfg) -> None:
        os.makedirs(self.dir, exist_ok=True)
        Path(self.dir, str(os.getpid())).write_text(repr(time.time()))


@dataclass(frozen=True)
class RecordListeners(WorkerHook):
    """At the start of step `step` each stage actor writes `<dir>/<pid>.json`: the "ip:port" addresses
    its process listens on then (its transport's, JAX's and the collectives' sockets all open by then)."""

    dir: str
    step: int = 1

    def on_step(self, cfg, step: int) -> None:
        if step == self.step:
            import json

            os.makedirs(self.dir, exist_ok=True)
            found = sorted(f"{ip}:{port}" for ip, port in listening())
            Path(self.dir, f"{os.getpid()}.json").write_text(json.dumps({"who": cfg.who, "listening": found}))


def listening(pid: int | None = None) -> set:
    """The TCP (ip, port) pairs process `pid` (default: this one) listens on."""
    import psutil

    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}


def _ours() -> list:
    """This process and every process under it (the session's Ray: raylet, workers, stage actors)."""
    import psutil

    me = psutil.Process()
    return [me] + me.children(recursive=True)


def _fd_links(pid: int) -> list[str]:
    base = f"/proc/{pid}/fd"
    links = []
    try:
        names = os.listdir(base)
    except OSError:        # gone meanwhile, or not ours to read
        return links
    for name in names:
        try:
            links.append(os.readlink(f"{base}/{name}"))
        except OSError:
            pass
    return links


def _transport_socket_inodes() -> set[str]:
    """Inodes of the abstract Unix sockets named like the transport's (`/proc/net/unix`)."""
    found = set()
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            parts = line.split()
            if len(parts) >= 8 and parts[7].startswith(UNIX_PREFIX):
                found.add(parts[6])
    return found


def alive(pid: int, since: float) -> bool:
    """Whether `pid` is still the process that recorded itself at `since` (not a reused pid)."""
    import psutil

    try:
        p = psutil.Process(pid)
        return p.create_time() <= since + 1.0 and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_nothing_left(pids_dir: Path, run: str, listening_before: set | None = None,
                        timeout: float = 30.0) -> None:
    """Assert the run (its stage processes recorded in `pids_dir`) left no process, shared-memory
    block or socket (module docstring); `listening_before`: `listening()` taken before the run."""
    recorded = {int(p.name): float(p.read_text()) for p in Path(pids_dir).iterdir()}
    assert recorded, f"no stage process of {run} recorded in {pids_dir} (RecordPid not passed?)"
    wait_until(lambda: not [pid for pid, at in recorded.items() if alive(pid, at)], timeout,
               f"the stage processes of {run} {sorted(recorded)} to exit")
    problems = left_over(run, listening_before)
    assert not problems, f"{run} left: " + "; ".join(problems)


def left_over(run: str, listening_before: set | None = None) -> list[str]:
    """What of a run is still there, searched now (no waiting): stage workers, memfd blocks and
    transport sockets under this process, /dev/shm entries, new listening ports of this process."""
    import psutil

    problems = []
    procs = _ours()
    for p in procs:
        try:
            if " ".join(p.cmdline()).startswith("ray::StageWorker"):
                problems.append(f"stage worker process {p.pid}")
        except psutil.Error:
            pass
    socks = _transport_socket_inodes()
    for p in procs:
        for link in _fd_links(p.pid):
            if SHM_BLOCK in link:
                problems.append(f"shared-memory block {link} held by process {p.pid}")
            elif link.startswith("socket:[") and link[8:-1] in socks:
                problems.append(f"transport socket {UNIX_PREFIX}… ({link}) held by process {p.pid}")
    if os.path.isdir("/dev/shm"):
        problems += [f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if "meshpipe" in n or run in n]
    if listening_before is not None:
        problems += [f"the driver listens on {ip}:{port}" for ip, port in sorted(listening() - listening_before)]
    return problems
