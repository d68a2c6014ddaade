"""Automatic recovery (`failure: {max_restarts}`): config (pure), the restart rules (pure), and on Ray
a deterministic failure (default suite); `chaos` (own CI step): a real kill -9 of a stage actor,
exhausted restarts, a SIGSTOPped actor, and a second kill while recovering.

The Ray tests train the tiny GPT of tests/test_checkpoint.py (2 stages, {data: 2} | {model: 2},
a checkpoint every 2 steps). A recovered run must give the uninterrupted run's per-step losses
and final parameters exactly (same schedule and layout: equality, no tolerance) — the restart
restores the committed checkpoint through the `--resume` path, data and RNG state with it.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.core.config import parse_job
from tests.leaks import listening
from tests.test_bad_input import error_of, has_all
from tests.test_checkpoint import gpt_job


pytestmark = [pytest.mark.needs_checkpoint]


# ----------------------------------------------------------------------------- config (pure)

def test_failure_section_keys_and_rules(tmp_path):
    raw = gpt_job(tmp_path, "f", tmp_path / "ck")
    assert parse_job(raw).failure.max_restarts == 0            # default: any failure ends the run
    raw["failure"] = {"max_restarts": 2}
    job = parse_job(raw)
    assert job.failure.max_restarts == 2 and parse_job(job.to_dict()) == job
    for value, rule in [(-1, "must be >= 0"), ("2", "must be an integer"), (True, "must be an integer"),
                        (10**6, "less than or equal to 1000")]:
        raw["failure"] = {"max_restarts": value}
        has_all(error_of(parse_job, raw), "failure.max_restarts", repr(value), rule)
    raw["failure"] = {"max_retries": 1}
    has_all(error_of(parse_job, raw), "failure.max_retries", "unknown key", "max_restarts")
    no_ckpt = gpt_job(tmp_path, "f", tmp_path / "ck")
    del no_ckpt["checkpoint"]
    no_ckpt["failure"] = {"max_restarts": 1}
    has_all(error_of(parse_job, no_ckpt), "failure.max_restarts = 1", "checkpoint:")
    no_ckpt["failure"] = {"max_restarts": 0}
    assert parse_job(no_ckpt).checkpoint is None


def test_placement_timeout_and_compile_cache_keys(tmp_path):
    from orchestrator.core.recovery import compile_cache_dir

    raw = gpt_job(tmp_path, "f", tmp_path / "ck")
    job = parse_job(raw)
    assert (job.failure.placement_timeout_s, job.failure.compile_cache) == (None, "auto")
    assert compile_cache_dir(job) is None                       # auto: off without restarts
    raw["failure"] = {"max_restarts": 1, "placement_timeout_s": 45}
    job = parse_job(raw)
    assert job.failure.placement_timeout_s == 45.0 and parse_job(job.to_dict()) == job
    assert compile_cache_dir(job) == str((tmp_path / "runs" / "f" / "compile_cache").resolve())
    raw["failure"] = {"max_restarts": 1, "compile_cache": None}
    assert compile_cache_dir(parse_job(raw)) is None
    raw["failure"] = {"compile_cache": str(tmp_path / "cc")}       # a path: on, restarts or not
    assert compile_cache_dir(parse_job(raw)) == str(tmp_path / "cc")
    for key, value, rule in [("placement_timeout_s", 0, "must be > 0"), ("placement_timeout_s", "x", ""),
                             ("compile_cache", "", "a directory path"), ("compile_cache", 3, "")]:
        raw["failure"] = {"max_restarts": 1, key: value}
        has_all(error_of(parse_job, raw), f"failure.{key}", repr(value), rule)


def test_compile_cache_directory_is_private(tmp_path):
    """The worker refuses a cache directory others may write (its entries are loaded as programs)."""
    import os

    import jax

    from stages.worker import use_compile_cache

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(RuntimeError, match="not be writable by others"):
        use_compile_cache(jax, str(shared), "r stage 0 host 0")
    assert jax.config.jax_compilation_cache_dir != str(shared)


def test_restarts_accepted_under_every_executor(tmp_path):
    from orchestrator.core.config import check_job, parse_cluster
    from orchestrator.driver.dispatch import KINDS

    raw = gpt_job(tmp_path, "f", tmp_path / "ck")
    raw["failure"] = {"max_restarts": 1}
    cluster = {"hosts": 2, "devices_per_host": 2}
    for executor in KINDS:        # compiled_graph too: its teardown is bounded (dispatch.CompiledGraph.close)
        assert check_job(parse_job(raw), parse_cluster({**cluster, "executor": executor})).cluster.executor == executor


# ----------------------------------------------------------------------------- restart rules (pure)

def test_policy_restarts_until_used_up_and_stops_a_repeated_failure():
    from orchestrator.core.recovery import DIED, ERROR, HANG, Failure, RestartPolicy

    p = RestartPolicy(2)
    assert p.decide(Failure(DIED, 1, 0, 4, "x"), committed=None).reason.startswith("no checkpoint is committed")
    p = RestartPolicy(2)
    assert p.decide(Failure(DIED, 1, 0, 4, "pid 1"), committed=4).restart
    assert p.decide(Failure(ERROR, 0, 0, 5, "boom"), committed=4).restart
    d = p.decide(Failure(DIED, 1, 0, 6, ""), committed=6)
    assert not d.restart and "max_restarts = 2" in d.reason and p.restarts == 2
    p = RestartPolicy(5)
    assert p.decide(Failure(ERROR, 1, 0, 5, "NaN"), committed=4).restart
    assert p.decide(Failure(ERROR, 1, 0, 5, "other"), committed=4).restart    # another error: not the same
    d = p.decide(Failure(ERROR, 1, 0, 5, "NaN"), committed=4)
    assert not d.restart and "deterministic" in d.reason and "step 5" in d.reason
    assert not RestartPolicy(0).decide(Failure(DIED, 0, 0, 1, ""), committed=1).restart
    p = RestartPolicy(3)      # deaths are never "the same failure": a second kill while recovering is survived
    assert all(p.decide(Failure(DIED, 1, 0, 4, ""), committed=4).restart for _ in range(3))
    assert "used up" in p.decide(Failure(DIED, 1, 0, 4, ""), committed=4).reason
    p = RestartPolicy(3)
    assert p.decide(Failure(HANG, 1, 0, 6, "a"), committed=6).restart
    assert "deterministic" in p.decide(Failure(HANG, 1, 0, 6, "b"), committed=6).reason


def test_classify_names_the_peer_that_failed_not_the_one_told_to_abort():
    """The driver decides from typed fields (the actor's StepFailure, the call's ActorId), never from
    the words: rewording a message changes no decision, and text that reads like an origin is none."""
    import pickle

    from orchestrator.core.contract import FAILURE_ATTR, ActorId, StepFailure, failure_of
    from orchestrator.core.recovery import DIED, ERROR, HANG
    from orchestrator.driver.recovery import classify
    from orchestrator.driver.waiting import ProgressTimeout, StageFailure

    peer = StepFailure(1, 0, 5, "RuntimeError: r stage 1 host 0: boom")
    for message in ("steps 4-7 failed on stage 0 host 0: RuntimeError: r stage 0 host 0: mailbox closed (r stage 1 "
                    "host 0 failed in step 5: RuntimeError: r stage 1 host 0: boom) while waiting for (5, 'B', 1)",
                    "told to stop, in other words"):
        f = classify(StageFailure(message, label=ActorId(0, 0), origin=peer), next_step=4)
        assert (f.cause, f.stage, f.host, f.step, f.text) == (ERROR, 1, 0, 5, "RuntimeError: r stage 1 host 0: boom")
    looks_like = StageFailure("steps 4-7 failed on stage 0 host 0: r stage 1 host 0 failed in step 5: boom",
                              label=ActorId(0, 0))
    f = classify(looks_like, 4)                     # no record on it: the call's own actor, the driver's step
    assert (f.cause, f.stage, f.host, f.step) == (ERROR, 0, 0, 4)
    f = classify(StageFailure("steps 4-7 failed on stage 1 host 0: ActorDiedError", label=ActorId(1, 0), died=True), 4)
    assert (f.cause, f.stage, f.host, f.step) == (DIED, 1, 0, 4)
    own = RuntimeError("r stage 1 host 0: boom")          # the record travels on the error, pickled (Ray)
    setattr(own, FAILURE_ATTR, peer)
    wrapped = RuntimeError("the transport's error")
    wrapped.__cause__ = pickle.loads(pickle.dumps(own))
    assert failure_of(wrapped) == peer and failure_of(RuntimeError("x")) is None
    f = classify(ProgressTimeout("no answer", [ActorId(1, 0)]), 6)
    assert (f.cause, f.stage, f.host, f.step) == (HANG, 1, 0, 6)
    f = classify(ProgressTimeout("no answer", [ActorId(0, 0), ActorId(1, 0)]), 6)
    assert (f.cause, f.stage) == (HANG, None)
    f = classify(ProgressTimeout("no answer", ["stage 1 host 0"]), 6)      # a label, not an ActorId: unknown
    assert (f.cause, f.stage) == (HANG, None)


def test_leak_check_sees_a_held_block_a_transport_socket_a_port_and_a_live_process(tmp_path):
    """`tests.leaks` (used after every recovery test on Ray) finds each kind of leftover it checks."""
    import os
    import socket
    import subprocess
    import sys
    import time

    import ray  # noqa: F401 - puts Ray's bundled psutil on the import path

    from tests.leaks import RecordPid, alive, left_over, listening

    if not sys.platform.startswith("linux"):
        pytest.skip("/proc")
    before = listening()
    assert left_over("leakcheck", before) == []
    fd = os.memfd_create("meshpipe-block-7", os.MFD_CLOEXEC)
    unix, tcp = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), socket.socket()
    try:
        unix.bind("\0meshpipe-leakcheck")
        unix.listen()
        tcp.bind(("127.0.0.1", 0))
        tcp.listen()
        found = left_over("leakcheck", before)
        assert any("memfd:meshpipe-block-7" in p for p in found), found
        assert any("transport socket @meshpipe-" in p for p in found), found
        assert f"the driver listens on 127.0.0.1:{tcp.getsockname()[1]}" in found, found
    finally:
        os.close(fd)
        unix.close()
        tcp.close()
    assert left_over("leakcheck", before) == []
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        RecordPid(str(tmp_path / "pids")).on_setup(None)          # this process records itself
        assert alive(os.getpid(), float((tmp_path / "pids" / str(os.getpid())).read_text()))
        assert alive(child.pid, time.time()) and not alive(child.pid, time.time() - 3600)   # a reused pid
    finally:
        child.kill()
        child.wait()
    assert not alive(child.pid, time.time())


def test_steps_lost_are_the_finished_steps_run_again():
    """benchmarks/results/recovery.json had `steps_lost` 8 for a kill in step 30 resumed from 20: the
    driver had results up to step 27 (4 steps per call), but 28 and 29 had finished inside the failed
    call. The failure's step comes from the actors still answering (their newest finished step), the
    record counts from it: 30 - 20 = 10 steps run again."""
    from orchestrator.core.recovery import DIED, ERROR, Failure, failed_step
    from orchestrator.driver.recovery import record

    step = failed_step(28, {"stage 0 host 0": 29})        # stage 1 host 0 is dead: no answer
    assert step == 30
    assert record(Failure(DIED, 1, 0, step, "killed"), {}, 20, 0.0, 0.1)["steps_lost"] == 10
    assert failed_step(28, {"stage 0 host 0": 29, "stage 0 host 1": 28}) == 29    # the laggard's step
    assert failed_step(5, {"stage 0 host 0": 4}) == 5      # an error in step 5 (the actor said so)
    assert failed_step(4, {"stage 0 host 0": None}) == 4   # no step finished in this attempt
    assert record(Failure(ERROR, 0, 0, 4, "x"), {}, 4, 0.0, 0.1)["steps_lost"] == 0


def test_stop_message_commands_are_ones_the_cli_accepts():
    """Stopped with nothing committed: the command printed starts again (a new run directory; no
    --overwrite, which is only a deprecation notice now); with a commit: --resume. Parsed by the
    `run` command itself."""
    import doctest
    import shlex

    from orchestrator.core.recovery import DIED, Decision, Failure
    from orchestrator.driver import recovery
    from orchestrator.driver.cli import resume_command, run

    def parsed(message: str, after: str) -> dict:
        line = message.split(after, 1)[1].strip()
        words = shlex.split(line)
        assert words[:2] == ["meshpipe", "run"], line
        return run.make_context("run", words[2:]).params

    root = Path(__file__).resolve().parent.parent
    job, cluster = str(root / "examples/mlp.yaml"), str(root / "cluster_configs/local.yaml")   # (must exist)
    cmd = resume_command(job, cluster, ("run.steps=8",), "auto")
    f, no = Failure(DIED, 1, 0, 1, "killed"), Decision(False, "no checkpoint is committed yet")
    fresh = parsed(recovery.stop_message(f, {}, no, None, 1, cmd), "Start again with:")
    assert not fresh["overwrite"] and fresh["resume"] is None, fresh
    assert (fresh["job"], fresh["cluster"], fresh["overrides"], fresh["address"]) == (job, cluster,
                                                                                     ("run.steps=8",), "auto")
    again = parsed(recovery.stop_message(f, {}, Decision(False, "used up"), 4, 6, cmd), "Continue with:")
    assert again["resume"] == "latest" and not again["overwrite"], again
    assert doctest.testmod(recovery).failed == 0


def test_a_failure_while_a_node_is_gone_is_that_nodes_loss():
    from orchestrator.core.contract import ActorId
    from orchestrator.core.recovery import DIED, ERROR, NODE_LOST, Failure, RestartPolicy, node_loss

    seen = Failure(ERROR, 0, 0, 5, "RuntimeError: Gloo: Connection reset by peer")
    assert node_loss(seen, {}) is seen                          # no node gone: the failure as it was
    f = node_loss(seen, {"ab" * 28: {"labels": [ActorId(0, 1), ActorId(1, 0)], "why": "Ray marks it dead",
                                     "address": "10.1.2.3"}})
    assert (f.cause, f.stage, f.host, f.step, f.node) == (NODE_LOST, 0, 1, 5, "ab" * 28)
    assert f.text.startswith(f"node {'ab' * 6} (10.1.2.3) is gone (Ray marks it dead), with stage 0 host 1, "
                             "stage 1 host 0; a consequence, seen first: error: stage 0 host 0: RuntimeError: Gloo")
    assert f.consequence == "error: stage 0 host 0: RuntimeError: Gloo: Connection reset by peer"
    p = RestartPolicy(2)                   # a node loss is never "the same failure", like a death
    assert p.decide(f, committed=4).restart and p.decide(f, committed=4).restart
    assert "used up" in p.decide(node_loss(Failure(DIED, 1, 0, 5, "x"), {"n": {"labels": [], "why": "w"}}), 4).reason


def test_raylet_probe_tells_a_listening_port_from_a_closed_one():
    import socket

    from orchestrator.driver.recovery import raylet_answers

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert raylet_answers("127.0.0.1", port, 2.0)
    assert not raylet_answers("127.0.0.1", port, 2.0)          # closed: refused at once


@pytest.mark.ray
def test_a_killed_actors_process_is_waited_for_after_ray_frees_its_name(ray_local, no_leaks, tmp_path):
    """Ray frees a killed actor's name before its process ends, and the process runs on (here it
    keeps rewriting a file): `wait_exited` returns only once the process is gone, so nothing it
    writes can land after the next attempt's `prepare` cleaned checkpoint.dir. The state API
    (how other nodes are checked) lists the live worker and then no longer does."""
    import os
    import threading
    import time

    import psutil
    import ray

    from orchestrator.driver.recovery import _alive_remote_workers, wait_exited, wait_released

    @ray.remote(num_cpus=0)
    class Writer:
        def start(self, path: str) -> dict:
            def loop():
                n = 0
                while True:
                    Path(path).write_text(str(n))
                    n += 1
                    time.sleep(0.001)
            threading.Thread(target=loop, daemon=True).start()
            return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(), "stage": 0, "host": 0}

    name = f"writer-{os.getpid()}"
    a = Writer.options(name=name, namespace="meshpipe-tests").remote()
    rec = ray.get(a.start.remote(str(tmp_path / "f")), timeout=60)
    assert (rec["node_id"], rec["pid"]) in _alive_remote_workers(30.0)
    ray.kill(a)
    wait_released([name], "meshpipe-tests", 30.0)
    assert wait_exited([rec], 30.0) == []
    gone = not psutil.pid_exists(rec["pid"]) or psutil.Process(rec["pid"]).status() == psutil.STATUS_ZOMBIE
    assert gone
    before = (tmp_path / "f").stat().st_mtime_ns
    time.sleep(0.2)
    assert (tmp_path / "f").stat().st_mtime_ns == before          # nothing writes any more
    assert wait_exited([], 1.0) == []


def test_progress_deadline_follows_measured_steps():
    from orchestrator.core.recovery import ProgressDeadline

    d = ProgressDeadline(600.0)
    assert d.step_s() == 600.0                     # nothing measured: the configured step_s
    for t in [0.05] * 10:
        d.observe(t)
    assert d.step_s() == 30.0                      # the floor
    for t in [40.0] * 21:
        d.observe(t)
    assert d.step_s() == 120.0                     # 3 x the median
    assert ProgressDeadline(10.0).step_s() == 10.0
    capped = ProgressDeadline(10.0)
    capped.observe(1.0)
    assert capped.step_s() == 10.0                 # never above the configured step_s


def test_heartbeats_name_the_hung_actor_within_one_step_deadline():
    """`stalled` (what HeartbeatWatch asks each second while a step runs): a silent actor, one stuck at
    a computation, a stopped actor the others wait on in RECVs, a lost message; never a slow driver."""
    from orchestrator.core.recovery import stalled

    def beat(doing, busy, waiting=False):
        return {"doing": doing, "waiting": waiting, "busy_s": busy}

    quiet = {"s0": 0.0, "s1": 0.0}
    assert stalled({"s0": beat("0F3", 29.0), "s1": beat("1RECV_F3", 29.5, True)}, quiet, 30.0) is None
    assert stalled({"s0": beat(None, 500.0), "s1": beat(None, 500.0)}, quiet, 30.0) is None   # between steps
    assert stalled({"s0": None, "s1": None}, {"s0": 30.0, "s1": 2.0}, 30.0) is None            # not yet 30 s
    who, why = stalled({"s0": beat("0F3", 1.0), "s1": None}, {"s0": 0.0, "s1": 30.5}, 30.0)
    assert who == ["s1"] and "not answering a heartbeat for 30 s" in why
    who, why = stalled({"s0": beat("0RECV_B2", 50.0, True), "s1": beat("1B2", 40.0)}, quiet, 30.0)
    assert who == ["s1"] and why.startswith("at 1B2 for 40 s")       # not the one waiting on it, though longer
    who, why = stalled({"s0": beat("0RECV_B2", 31.0, True), "s1": beat("1F2", 3.0)}, {"s0": 0.0, "s1": 6.0}, 30.0)
    assert who == ["s1"] and "while the others wait in a RECV" in why   # stopped after s0 began to wait
    who, why = stalled({"s0": beat("0RECV_B2", 31.0, True), "s1": beat("1RECV_F3", 35.0, True)}, quiet, 30.0)
    assert who == ["s0", "s1"] and why.startswith("every busy actor waits in a RECV")


# ----------------------------------------------------------------------------- on Ray
# The default suite runs the deterministic-failure test (one run, two attempts, ~50 s here under
# load); the tests that also need the uninterrupted run to compare with are `chaos` (own CI step).

STEPS = 8


def recovery_job(tmp_path: Path, name: str, ckpt_dir: Path, max_restarts: int = 1) -> dict:
    """8 steps, a checkpoint every 2, saved synchronously: a step's save is reported with that step's
    result, so which steps are committed when a hook holds or fails a later step is fixed (with the
    default 4 steps per call, steps 2 and 4 commit when the first call's results arrive)."""
    job = gpt_job(tmp_path, name, ckpt_dir, steps=STEPS)
    job["checkpoint"]["async"] = False
    job["failure"] = {"max_restarts": max_restarts}
    return job


def _run(job: dict, hooks=(), resume=None, resume_command=None, executor: str = "step_calls",
         pids: Path | None = None, transport: str = "socket") -> dict:
    """run_job on the session's Ray; `pids`: each stage process of each attempt records itself there
    (`tests.leaks.RecordPid`) for `_nothing_left`. `transport: xla` puts every attempt's actors in one
    JAX world (a death takes the world down; recovery makes a new one)."""
    from orchestrator.driver.runner import run_job
    from tests.leaks import RecordPid
    from tests.test_checkpoint import CLUSTER, checked_of

    hooks = list(hooks) + ([RecordPid(str(pids))] if pids is not None else [])
    return run_job(checked_of(job, {**CLUSTER, "executor": executor, "transport": transport}), echo=lambda s: None,
                   keep_params=True,
                   hooks=hooks, resume=resume, resume_command=resume_command)


def _nothing_left(pids: Path, job: dict, listening_before: set) -> None:
    """No process, shared-memory block or socket of the run (every attempt's) is left (`tests.leaks`)."""
    from tests.leaks import assert_nothing_left

    assert_nothing_left(pids, job["run"]["name"], listening_before)


def _summary(job: dict) -> dict:
    from tests.records import summary

    return summary(job["run"]["output_dir"], job["run"]["name"])


def _assert_same_run(got: dict, want: dict) -> None:
    import numpy as np

    assert got["losses"] == want["losses"]                           # exact: floats equal
    assert got["params"].keys() == want["params"].keys()
    for name, arr in want["params"].items():
        np.testing.assert_array_equal(got["params"][name], arr, err_msg=name)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, ray_local):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    full = _run(recovery_job(tmp, "full", tmp / "ck"))
    assert full["restarts"] == 0 and full["recoveries"] == [] and len(full["losses"]) == STEPS
    assert full["losses"][-1] < full["losses"][0]
    return full


def _pid_of(name: str, namespace: str) -> int:
    from ray.util.state import list_actors

    from tests.conftest import _address

    found = [a for a in list_actors(address=_address(), filters=[("name", "=", name), ("state", "=", "ALIVE")])
             if a.ray_namespace == namespace]
    assert len(found) == 1, found
    return int(found[0].pid)


def _signal_when(targets, namespace: str, sig: int):
    """Start a thread that, for each (flag file, actor name) in `targets` in turn, waits for the flag
    (a hook's "reached"), then sends `sig` to that actor's process. Returns (thread, record):
    record holds, for the last signal, its wall time "at", monotonic time "mono" and "pid", or the
    "error" the thread met, for the main thread to report."""
    import os
    import threading
    import time

    from tests.conftest import wait_until

    record: dict = {}

    def send():
        try:
            for flag, name in targets:
                wait_until(flag.exists, 600, f"{flag.name} hold")
                pid = _pid_of(name, namespace)
                record.update(at=time.time(), mono=time.monotonic())
                os.kill(pid, sig)
                record["pid"] = pid
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            record["error"] = e

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread, record


@pytest.mark.ray
@pytest.mark.chaos
@pytest.mark.parametrize("executor,transport", [("step_calls", "socket"), ("action_calls", "socket"),
                                                ("compiled_graph", "socket"), ("step_calls", "xla")])
def test_kill_9_of_a_stage_actor_recovers_bit_equal(tmp_path, no_leaks, uninterrupted, executor, transport):
    """kill -9 of stage 1's actor (found through Ray's state API) while it is in step 5, with steps
    2 and 4 committed: one restart from step 4; losses and parameters equal the uninterrupted run's
    (run with the default executor: every executor runs the same action lists)."""
    import signal

    from orchestrator.core import checkpoint as ck
    from tests.faults import HoldAt

    root = tmp_path / "ck"
    job = recovery_job(tmp_path, "killed", root)
    name = job["run"]["name"] = f"killed-{executor.replace('_', '-')}-{transport}"
    reached = tmp_path / "reached"
    hold = HoldAt(stage=1, host=0, step=5, wait_for=str(ck.step_dir(root, 4) / ck.MARKER), reached=str(reached))
    before = listening()
    t, killed = _signal_when([(reached, f"{name}/stage1/host0")], f"meshpipe-{name}", signal.SIGKILL)
    got = _run(job, hooks=[hold], executor=executor, pids=tmp_path / "pids", transport=transport)
    t.join(60)
    assert "error" not in killed, killed.get("error")
    assert killed["pid"] == int(reached.read_text())                # the held actor is the one killed
    assert got["restarts"] == 1
    (rec,) = got["recoveries"]
    print("recovery:", {**rec, "detection_s": rec["detected_at"] - killed["at"]})     # pytest -rP shows it
    assert (rec["cause"], rec["stage"], rec["host"], rec["resumed_from"]) == ("actor died", 1, 0, 4), rec
    # killed in step 5: step 4 finished (inside the failed call under step_calls) and ran again
    assert (rec["step"], rec["steps_lost"]) == (5, 1), rec
    assert "Some common causes" not in rec["error"] and "actor is dead" in rec["error"], rec
    assert rec["cluster_host"] == 1 and rec["node_id"]
    assert 0 <= rec["detected_at"] - killed["at"] < 10, rec        # noticed within 10 s of the kill
    assert rec["teardown_s"] < 30, rec       # survivors aborted at once, not after shutdown_s (30 s)
    assert rec["recovery_s"] > 0 and rec["start_s"] > 0 and rec["restore_s"] > 0, rec
    _assert_same_run(got, uninterrupted)
    assert _summary(job)["restarts"] == 1 and _summary(job)["status"] == "completed"
    assert [m["step"] for m in ck.committed(root)][-1] == STEPS
    lines = (Path(got["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    assert sum('"restart": 1' in ln for ln in lines) == 1
    _nothing_left(tmp_path / "pids", job, before)


@pytest.mark.ray
@pytest.mark.chaos
@pytest.mark.parametrize("executor,transport", [("step_calls", "socket"), ("compiled_graph", "socket"),
                                                ("step_calls", "xla")])
def test_kill_9_without_restarts_ends_the_run_at_once_naming_the_dead_actor(tmp_path, no_leaks, executor,
                                                                            transport):
    """max_restarts 0: kill -9 of stage 1's actor held in step 5 ends the run within seconds — a
    compiled graph's channel read does not see the death, the heartbeats do — with the error naming
    the dead actor (not stage 0, which waited on it), and leaves nothing behind."""
    import signal
    import time

    from orchestrator.core import checkpoint as ck
    from orchestrator.driver.waiting import StageFailure
    from tests.faults import HoldAt

    root = tmp_path / "ck"
    job = recovery_job(tmp_path, "once", root, max_restarts=0)
    name = job["run"]["name"] = f"once-{executor.replace('_', '-')}-{transport}"
    reached = tmp_path / "reached"
    hold = HoldAt(stage=1, host=0, step=5, wait_for=str(ck.step_dir(root, 4) / ck.MARKER), reached=str(reached),
                  timeout_s=300.0)
    t, killed = _signal_when([(reached, f"{name}/stage1/host0")], f"meshpipe-{name}", signal.SIGKILL)
    with pytest.raises(StageFailure) as ei:
        _run(job, hooks=[hold], executor=executor, transport=transport)
    ended = time.monotonic()
    t.join(60)
    assert "error" not in killed, killed.get("error")
    print(f"{executor}: the run ended {ended - killed['mono']:.2f} s after the kill")   # pytest -rP shows it
    assert ended - killed["mono"] < 20, ended - killed["mono"]     # noticed and torn down: no deadline waited
    e = ei.value
    assert (e.label, e.died) == ("stage 1 host 0", True), str(e)
    assert "stage 1 host 0" in str(e) and "actor is dead" in str(e), str(e)
    s = _summary(job)
    assert s["status"] == "failed" and s["steps_done"] == 4 and "stage 1 host 0" in s["error"]


@pytest.mark.ray
def test_the_same_failure_at_the_same_step_twice_stops(tmp_path, no_leaks):
    """A deterministic failure (the hook fails stage 1 at step 5 every time): one restart from step
    4, the same failure again, and the run stops naming it, with the command that would continue."""
    from orchestrator.driver.recovery import RecoveryStopped
    from tests.faults import FailStep

    job = recovery_job(tmp_path, "determ", tmp_path / "ck", max_restarts=3)
    before = listening()
    with pytest.raises(RecoveryStopped) as ei:
        _run(job, hooks=[FailStep(stage=1, host=0, step=5)], resume_command="meshpipe run j.yaml --resume",
             pids=tmp_path / "pids")
    has_all(str(ei.value), "error: stage 1 host 0", "in step 5", "injected step failure at step 5",
            "deterministic", "last committed checkpoint: step 4", "meshpipe run j.yaml --resume")
    s = _summary(job)
    assert s["status"] == "failed" and s["restarts"] == 1 and s["steps_done"] == 4
    assert [(r["cause"], r["stage"], r["step"], r["resumed_from"], r["steps_lost"]) for r in s["recoveries"]] == [
        ("error", 1, 5, 4, 1)]            # step 4 finished inside the failed call (steps 4-7) and ran again
    _nothing_left(tmp_path / "pids", job, before)           # of either attempt


@pytest.mark.ray
@pytest.mark.chaos
def test_restarts_used_up_stop_with_the_resume_command(tmp_path, no_leaks, uninterrupted):
    """max_restarts 1, two different failures (stage 1 at step 5, then stage 0 at step 6): the second
    stops the run — why, what is lost, the --resume command — and that command's run (here
    run_job(resume="latest")) finishes equal to the uninterrupted one."""
    from orchestrator.driver.recovery import RecoveryStopped
    from tests.faults import FailStepOnce

    job = recovery_job(tmp_path, "usedup", tmp_path / "ck", max_restarts=1)
    hooks = [FailStepOnce(1, 0, 5, str(tmp_path / "a")), FailStepOnce(0, 0, 6, str(tmp_path / "b"))]
    before = listening()
    with pytest.raises(RecoveryStopped) as ei:
        _run(job, hooks=hooks, resume_command="meshpipe run j.yaml --resume", pids=tmp_path / "pids")
    _nothing_left(tmp_path / "pids", job, before)
    has_all(str(ei.value), "error: stage 0 host 0", "in step 6", "max_restarts = 1", "used up",
            "last committed checkpoint: step", "Continue with: meshpipe run j.yaml --resume",
            "restarted before: 1. error: stage 1 host 0 in step 5: ")       # what used the restart up
    s = _summary(job)
    assert s["status"] == "failed" and s["restarts"] == 1
    resumed = _run(job, hooks=hooks, resume="latest", pids=tmp_path / "pids-resumed")   # the faults are spent
    _assert_same_run(resumed, uninterrupted)
    _nothing_left(tmp_path / "pids-resumed", job, before)


# ----------------------------------------------------------------------------- more chaos

@pytest.mark.ray
@pytest.mark.chaos
@pytest.mark.parametrize("transport", ["socket", "xla"])
def test_sigstop_hang_is_detected_by_the_progress_deadline_and_recovered(tmp_path, no_leaks, uninterrupted,
                                                                         transport):
    """SIGSTOP of stage 1's actor in step 5: no result within the progress deadline (max(30 s, 3 x
    4 x the median step), the first call's steps measured), the stopped actor is the one that does
    not answer a heartbeat (stage 0 waits on it and answers, with its RECV deadline: twice the
    driver's, not timeouts.step_s), it is killed first, and the run restarts from step 4 and
    finishes equal to the uninterrupted run."""
    import signal

    from orchestrator.core import checkpoint as ck
    from tests.faults import HoldAt

    root = tmp_path / "ck"
    job = recovery_job(tmp_path, "stopped", root)
    name = job["run"]["name"] = f"stopped-{transport}"
    reached = tmp_path / "reached"
    hold = HoldAt(stage=1, host=0, step=5, wait_for=str(ck.step_dir(root, 4) / ck.MARKER), reached=str(reached),
                  timeout_s=300.0)
    before = listening()
    t, stopped = _signal_when([(reached, f"{name}/stage1/host0")], f"meshpipe-{name}", signal.SIGSTOP)
    got = _run(job, hooks=[hold], pids=tmp_path / "pids", transport=transport)
    t.join(60)
    assert "error" not in stopped, stopped.get("error")
    (rec,) = got["recoveries"]
    print("recovery:", {**rec, "detection_s": rec["detected_at"] - stopped["at"]})    # pytest -rP shows it
    assert (rec["cause"], rec["stage"], rec["host"], rec["resumed_from"]) == ("hang", 1, 0, 4), rec
    assert "not answering a heartbeat: stage 1 host 0" in rec["error"], rec
    assert rec["progress_deadline_s"] == rec["step_deadline_s"] == 30.0, rec     # tiny steps: the floor
    assert "no progress within the step deadline" in rec["error"], rec     # the heartbeats saw it first
    # the waiting actor's RECV deadline follows the driver's (twice it: the driver calls the hang first)
    # (the executor re-sends it only when it moves by more than a tenth: `_follow_deadline`)
    (recv,) = rec["recv_deadline_s"].values()
    assert list(rec["recv_deadline_s"]) == ["stage 0 host 0"], rec
    assert abs(recv - 2 * rec["progress_deadline_s"]) <= 0.1 * recv, rec
    detect = rec["detected_at"] - stopped["at"]
    assert 0 < detect < rec["step_deadline_s"] + 10, rec  # one step's deadline, plus the heartbeat probe
    assert rec["teardown_s"] < 30, rec                      # the stopped actor was killed, not waited for
    _assert_same_run(got, uninterrupted)
    _nothing_left(tmp_path / "pids", job, before)          # the stopped process too


@pytest.mark.ray
@pytest.mark.chaos
@pytest.mark.parametrize("transport", ["socket", "xla"])
def test_a_second_kill_while_recovering_is_survived(tmp_path, no_leaks, uninterrupted, transport):
    """kill -9 of stage 1 in step 5, then kill -9 of stage 0 while the new attempt sets up: two
    restarts (max_restarts 2), both from step 4; the run ends equal to the uninterrupted one."""
    import signal

    from orchestrator.core import checkpoint as ck
    from tests.faults import HoldAt, HoldSetup

    root = tmp_path / "ck"
    job = recovery_job(tmp_path, "twice", root, max_restarts=2)
    name = job["run"]["name"] = f"twice-{transport}"
    first, second = tmp_path / "first", tmp_path / "second"
    hooks = [HoldAt(stage=1, host=0, step=5, wait_for=str(ck.step_dir(root, 4) / ck.MARKER), reached=str(first)),
             HoldSetup(stage=0, host=0, armed=str(first), reached=str(second))]
    before = listening()
    t, done = _signal_when([(first, f"{name}/stage1/host0"), (second, f"{name}/stage0/host0")], f"meshpipe-{name}",
                           signal.SIGKILL)
    got = _run(job, hooks=hooks, pids=tmp_path / "pids", transport=transport)
    t.join(60)
    assert "error" not in done, done.get("error")
    assert got["restarts"] == 2
    assert [(r["cause"], r["stage"], r["resumed_from"]) for r in got["recoveries"]] == [
        ("actor died", 1, 4), ("actor died", 0, 4)], got["recoveries"]
    _assert_same_run(got, uninterrupted)
    _nothing_left(tmp_path / "pids", job, before)          # three attempts' processes
