"""A driver SIGKILLed under `executor: compiled_graph` leaves nothing of what it started (#35, 7c;
`-m chaos`, own CI step), and the reaper's rules (pure, and on real files).

The real run: `meshpipe run` in its own process with an embedded Ray and a Compiled Graph. Once
a step is recorded the driver is SIGKILLed; then within a deadline no process holds a file of its
Ray session (the agents Ray re-parents to init lived on before: `docs/decisions.md`)
and no channel semaphore of its raylet is left in /dev/shm.
"""
from __future__ import annotations

import os

import pytest

from orchestrator.driver import reaper


def test_only_semaphores_of_a_dead_raylet_that_no_process_maps_are_leftovers():
    names = ["sem.hdr10-1", "sem.obj10-1", "sem.hdr11-2", "sem.obj12-3", "sem.mp-4", "psm_x"]
    assert reaper.leftovers(names, alive=lambda pid: pid == 11, mapped={"sem.obj12-3"}) == ["sem.hdr10-1",
                                                                                             "sem.obj10-1"]
    assert reaper.leftovers(names, alive=lambda pid: False, mapped=set(), owners={12}) == ["sem.obj12-3"]


def test_the_sweep_removes_a_dead_owners_file_and_keeps_a_mapped_one_and_a_live_ones(tmp_path):
    """Real files and real mappings: a file named after a pid that is gone is removed; the same kind
    of file while this process maps it, and one named after this (live) process, are kept."""
    import mmap

    import psutil

    dead = max(psutil.pids()) + 100000          # above every pid in use (pid_max allows it or none uses it)
    while psutil.pid_exists(dead):
        dead += 1
    gone, held, live = (tmp_path / f"sem.hdr{dead}-1"), (tmp_path / f"sem.obj{dead}-2"), (tmp_path / f"sem.hdr{os.getpid()}-3")
    for p in (gone, held, live):
        p.write_bytes(b"\0" * 32)
    with open(held, "r+b") as f, mmap.mmap(f.fileno(), 32):
        removed = reaper.sweep_semaphores(tmp_path)
        assert removed == [gone.name] and not gone.exists() and held.exists() and live.exists()
    assert reaper.sweep_semaphores(tmp_path) == [held.name]      # unmapped now
    assert live.exists()


@pytest.mark.chaos
def test_a_driver_killed_under_compiled_graph_leaves_no_process_and_no_semaphore(tmp_path):
    import glob
    import json
    import signal
    import subprocess
    import sys

    import psutil

    from tests.conftest import ROOT, wait_until
    from tests.test_checkpoint import CLUSTER, gpt_job

    job = gpt_job(tmp_path, "killed-cg", tmp_path / "ck", steps=400)
    (tmp_path / "job.json").write_text(json.dumps(job))
    (tmp_path / "cluster.json").write_text(json.dumps({**CLUSTER, "executor": "compiled_graph"}))
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.driver.cli", "run", str(tmp_path / "job.json"),
                             "--cluster", str(tmp_path / "cluster.json")], cwd=ROOT,
                            env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    tree: list = []
    try:
        def stepping():
            return any(open(m).read().count('"step"') >= 2 for m in glob.glob(f"{tmp_path}/runs/**/metrics.jsonl",
                                                                                recursive=True))
        wait_until(lambda: stepping() or proc.poll() is not None, 900, "the run's first steps", every=0.2)
        assert proc.poll() is None, f"the run ended before it was killed (exit {proc.returncode})"
        (session,) = glob.glob(f"/tmp/ray/session_*_{proc.pid}")
        tree = psutil.Process(proc.pid).children(recursive=True)
        (raylet,) = [p.pid for p in tree if p.name() == "raylet"]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(60)

        def left() -> tuple[list, list]:
            procs = reaper.session_processes(session, {os.getpid()})
            sems = [n for n in os.listdir("/dev/shm") if reaper.semaphore_owner(n) == raylet]
            return procs, sems
        try:
            wait_until(lambda: left() == ([], []), 60, "the killed driver's processes and semaphores to be gone",
                       every=0.5)
        except (AssertionError, TimeoutError):
            procs, sems = left()
            pytest.fail(f"left behind 60 s after the driver's SIGKILL: processes "
                        f"{[(p.pid, p.name()) for p in procs]}, {len(sems)} semaphores of raylet {raylet}")
        logs = glob.glob(f"{tmp_path}/runs/**/leftovers.txt", recursive=True)
        assert logs and "the driver is gone" in open(logs[0]).read()       # the reaper says what it removed
    finally:
        for p in tree:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        if proc.poll() is None:
            proc.kill()
