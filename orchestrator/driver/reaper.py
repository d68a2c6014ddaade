"""What an embedded Ray leaves behind when its driver is killed, and what cleans it up.

A driver that started its own Ray (`placement.connect` without `cluster.address`) and is then
SIGKILLed: Ray starts the GCS and the raylet with PR_SET_PDEATHSIG, so they die with the driver,
but the raylet's agents (`ray::DashboardAgent`, `ray::RuntimeEnvAgent`) are re-parented to init
and live on, and a Compiled Graph's channel semaphores (`/dev/shm/sem.hdr<raylet pid>-<n>`,
`sem.obj<raylet pid>-<n>`, created by the raylet's mutable-object manager) are never unlinked.

Basic flow:
  - `Reaper.start(log_path)` — right after the driver started Ray: a small child process in its
    own session (a terminal's signals do not reach it), its stdin a pipe from the driver, which
    writes the cluster's session directory and raylet pid (`ray_internals.embedded_session`).
    When the pipe closes — the driver ended, whatever way (the kernel closes a SIGKILLed
    process's descriptors) — the reaper kills the processes that still hold a file under that
    session directory and removes the semaphores named after that raylet pid; it appends what it
    removed to `log_path` (the run directory's `leftovers.txt`) and exits. `close()` — the driver
    shut Ray down — closes the pipe (then there is nothing left to find).
  - `sweep_semaphores()` — at every pipeline run's start: the channel semaphores of any raylet
    pid that is gone, which a reaper killed with its driver could not remove; the run says so.

Invariants:
  - Nothing of a live run is touched: a semaphore is removed only when the raylet pid in its name
    is dead and no live process maps it (`/proc/<pid>/maps`: a channel in use is mapped by its
    readers and writer); a process is killed only when it holds a file in the dead driver's own
    session directory (each embedded cluster has its own).
  - The reaper imports only the standard library and psutil (ray[default] installs it), so it
    starts in a fraction of a second and never loads Ray or JAX.
"""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, Optional

log = logging.getLogger("meshpipe")

SHM = Path("/dev/shm")
_SEM_RE = re.compile(r"^sem\.(?:hdr|obj)(\d+)-\d+$")     # Ray's channel semaphores: <kind><raylet pid>-<n>


def semaphore_owner(name: str) -> Optional[int]:
    """The raylet pid a `/dev/shm` entry is a Compiled Graph channel semaphore of, else None.

    >>> semaphore_owner("sem.hdr573-1796576769510737300"), semaphore_owner("sem.obj9-1")
    (573, 9)
    >>> semaphore_owner("sem.mp-abc"), semaphore_owner("meshpipe-run-1"), semaphore_owner("sem.hdr5-x")
    (None, None, None)
    """
    m = _SEM_RE.match(name)
    return int(m.group(1)) if m else None


def leftovers(names: Iterable[str], alive, mapped: set[str], owners: Optional[set[int]] = None) -> list[str]:
    """The semaphore entries of `names` that are left over, pure: a channel semaphore whose raylet
    pid is not `alive(pid)` and which no live process maps (`mapped`: the entry names found in
    every readable `/proc/<pid>/maps`); `owners`: only these raylet pids (None: any).

    >>> leftovers(["sem.hdr10-1", "sem.obj10-1", "sem.hdr11-2", "sem.hdr12-3", "x"],
    ...           alive=lambda pid: pid == 11, mapped={"sem.hdr12-3"})
    ['sem.hdr10-1', 'sem.obj10-1']
    """
    out = []
    for name in names:
        pid = semaphore_owner(name)
        if pid is None or (owners is not None and pid not in owners):
            continue
        if not alive(pid) and name not in mapped:
            out.append(name)
    return out


def _mapped(shm: Path) -> set[str]:
    """Names of `shm` entries mapped by some process (its `/proc/<pid>/maps`)."""
    prefix, found = str(shm) + "/", set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:        # gone meanwhile, or not ours to read
            continue
        for line in text.splitlines():
            at = line.find(prefix)
            if at >= 0:
                found.add(line[at + len(prefix):].split(" ")[0])
    return found


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def sweep_semaphores(shm: Path = SHM, owners: Optional[set[int]] = None) -> list[str]:
    """Remove the left-over Compiled Graph channel semaphores in `shm` (`leftovers`); returns their
    names. Only entries this user owns are looked at."""
    try:
        names = [n for n in os.listdir(shm) if semaphore_owner(n) is not None
                 and (shm / n).stat().st_uid == os.getuid()]
    except OSError:
        return []
    dead = leftovers(names, _alive, set(), owners)        # the /proc scan only when some owner is gone
    if not dead:
        return []
    removed = []
    for name in leftovers(dead, _alive, _mapped(shm), owners):
        try:
            (shm / name).unlink()
            removed.append(name)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.debug("could not remove %s: %s", shm / name, e)
    return removed


def session_processes(session: str, spare: set[int]) -> list:
    """Processes (psutil) not in `spare` holding a file under the session directory `session`."""
    import psutil

    root, found = session.rstrip("/") + "/", []
    for p in psutil.process_iter():
        if p.pid in spare:
            continue
        try:
            if any(f.path.startswith(root) for f in p.open_files()):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def reap(session: Optional[str], raylet: Optional[int], log_path: Optional[str], driver: Optional[int] = None,
         grace_s: float = 5.0) -> list[str]:
    """What the reaper does once its driver has let go: kill what holds a file in `session` (never
    the `driver` itself, which is still alive after a normal `close`), remove `raylet`'s channel
    semaphores; returns one line per thing removed (also appended to `log_path`)."""
    import psutil

    done: list[str] = []
    spare = {os.getpid()} | ({driver} if driver else set())
    if session:
        deadline = time.monotonic() + grace_s     # a normal exit's shutdown may still be finishing
        procs = session_processes(session, spare)
        while procs and time.monotonic() < deadline:
            time.sleep(0.5)
            procs = session_processes(session, spare)
        for p in procs:
            try:
                name = p.name()
                p.kill()
                done.append(f"killed {name} (pid {p.pid}), a process of the embedded Ray session {session}")
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=10)
    if raylet is not None:
        deadline = time.monotonic() + 10      # the raylet dies with the driver (PR_SET_PDEATHSIG): soon
        while _alive(raylet) and time.monotonic() < deadline:
            time.sleep(0.2)
        for name in sweep_semaphores(owners={raylet}):
            done.append(f"removed {SHM / name}, a Compiled Graph channel semaphore of raylet {raylet}")
    if done and log_path:
        try:
            with open(log_path, "a") as f:
                stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
                f.writelines(f"{stamp} the driver is gone: {line}\n" for line in done)
        except OSError:
            pass
    return done


class Reaper:
    """The driver's handle on its reaper process (see the module docstring)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    @classmethod
    def start(cls, log_path: Optional[str]) -> Optional["Reaper"]:
        """A reaper for the cluster this process started; None when Ray does not say its session."""
        from orchestrator.driver.ray_internals import embedded_session

        found = embedded_session()
        if found is None:
            return None
        session, raylet = found
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator.driver.reaper", log_path or ""],
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, close_fds=True, env=env, cwd=root)
        proc.stdin.write(f"{session}\n{raylet if raylet is not None else ''}\n{os.getpid()}\n".encode())
        proc.stdin.flush()
        return cls(proc)

    def close(self, timeout: float = 1.0) -> None:
        """Ray is shut down: the reaper checks once and exits (on its own: waited for `timeout` s)."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout)
        except (OSError, subprocess.TimeoutExpired) as e:
            log.debug("reaper %d: %s", self.proc.pid, e)


def _main(argv: list[str]) -> int:
    session = sys.stdin.readline().strip() or None
    raylet_line, driver_line = sys.stdin.readline().strip(), sys.stdin.readline().strip()
    sys.stdin.read()                   # until the driver is gone (EOF)
    reap(session, int(raylet_line) if raylet_line else None, argv[1] if len(argv) > 1 and argv[1] else None,
         int(driver_line) if driver_line else None)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv))
