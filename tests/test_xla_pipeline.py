"""`transport: xla` end to end on Ray: one JAX world per job, edges as XLA's own transfers.

Every schedule trains bit for bit like `transport: socket` (the same stage programs on the same
inputs: only the data plane differs) and, within tests/test_pipeline_numerics.py's tolerance,
like the independent single-process reference. The edges differ on their two sides: {data: 2}
-> {model: 2} (whole-array and tile transfers), a 2-host stage -> a 1-host stage, 4 devices -> 2,
bf16 activations, and interleaved's wrap-around edge.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from orchestrator.core.config import check_job, parse_cluster, parse_job
from orchestrator.driver.runner import run_job
from tests.test_pipeline_numerics import CLUSTER, assert_same_training, gpt_job

pytestmark = pytest.mark.ray


def _run(job: dict, transport: str, cluster: dict | None = None, reference: bool = False) -> dict:
    checked = check_job(parse_job(job), parse_cluster({**(cluster or CLUSTER), "transport": transport}))
    return run_job(checked, echo=lambda s: None, keep_params=not reference, reference=reference)


def assert_bit_equal(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]                       # exact: floats equal
    assert a["params"].keys() == b["params"].keys()
    for name, arr in b["params"].items():
        np.testing.assert_array_equal(a["params"][name], arr, err_msg=name)


def _workers(out: dict) -> set:
    return {w["transport"] for w in out["workers"]}


@pytest.mark.parametrize("schedule", ["1f1b", *(pytest.param(s, marks=pytest.mark.slow)
                                                for s in ("gpipe", "eager-1f1b", "zb-h1"))])
def test_every_schedule_equals_socket_bit_for_bit_and_the_reference(tmp_path, no_leaks, schedule):
    job = gpt_job(tmp_path, schedule, steps=3)
    xla = _run(job, "xla")
    assert _workers(xla) == {"XlaTransport"}
    job["run"]["name"] += "-socket"
    sock = _run(job, "socket")
    assert _workers(sock) == {"SocketTransport"}
    assert_bit_equal(xla, sock)
    assert_same_training(xla, _run(job, "socket", reference=True))


@pytest.mark.slow
def test_interleaved_wrap_around_edge_and_bf16(tmp_path, no_leaks):
    """interleaved-1f1b (v=2): stage 1's first chunk sends back to stage 0's second chunk; bf16
    activations (precision: compute bf16) cross as bf16."""
    job = gpt_job(tmp_path, "interleaved-1f1b", steps=3, virtual_stages=2)
    job["pipeline"]["stages"] = [{"layers": [[0, 1], [2, 3]], "mesh": {"data": 2}},
                                 {"layers": [[1, 2], [3, 4]], "mesh": {"model": 2}}]
    job["precision"] = {"compute": "bfloat16"}
    xla = _run(job, "xla")
    job["run"]["name"] += "-socket"
    assert_bit_equal(xla, _run(job, "socket"))


@pytest.mark.slow      # 2 min on 2 cores: the slow CI step; the 1F1B bit-equality case stays in the default suite
def test_two_host_stage_to_one_host_and_four_devices_to_two_no_listener_on_all_interfaces(tmp_path, no_leaks):
    """Stage 0 spans 2 hosts ({data: 2, model: 2}: 4 devices, its collectives over the same world),
    stage 1 is one host of 2 devices ({model: 2}: 4 devices -> 2, a 2-host stage -> a 1-host stage),
    stage 2 another ({data: 2}: a layout change between one-host stages). Every socket the run's
    actors listen on (read back from inside each actor in step 1: JAX's coordinator, XLA's transfer
    sockets, gloo's) is bound to the node address, none to 0.0.0.0 / ::."""
    import json

    from tests.leaks import RecordListeners
    from tests.test_xla_transport import wildcard

    cluster = {**CLUSTER, "hosts": 4, "devices_per_host": 2}
    job = gpt_job(tmp_path, "1f1b", steps=3)
    job["pipeline"]["stages"] = [{"layers": [0, 1], "mesh": {"data": 2, "model": 2}, "hosts": 2},
                                 {"layers": [1, 3], "mesh": {"model": 2}},
                                 {"layers": [3, 4], "mesh": {"data": 2}}]
    job["pipeline"]["microbatches"] = 2
    seen = tmp_path / "listeners"
    checked = check_job(parse_job(job), parse_cluster({**cluster, "transport": "xla"}))
    xla = run_job(checked, echo=lambda s: None, keep_params=True, hooks=[RecordListeners(str(seen))])
    found = [json.loads(f.read_text()) for f in seen.glob("*.json")]
    assert len(found) == 4, found                       # every actor of the world reported
    for rec in found:
        assert not wildcard(rec["listening"]), rec
        assert sum(a.startswith("127.0.0.1:") for a in rec["listening"]) >= 5, rec   # XLA's 1 + 4, at least
    job["run"]["name"] += "-socket"
    assert_bit_equal(xla, _run(job, "socket", cluster))


class _Beating:
    """An actor that answers heartbeats in its "io" group, as a stage actor does."""

    def heartbeat(self) -> dict:
        import os

        return {"pid": os.getpid()}


def _until_dead(actor, deadline_s: float = 60.0) -> None:
    """Wait (bounded) until Ray reports `actor` dead: `ray.kill` returns before the kill lands, and a
    heartbeat sent at once may still be answered (seen once in a full default-suite run)."""
    import ray
    from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            ray.get(actor.heartbeat.remote(), timeout=5)
        except (ActorUnavailableError, GetTimeoutError):
            pass
        except RayActorError:
            return
        time.sleep(0.1)
    raise AssertionError(f"the killed actor still answered after {deadline_s} s")


def test_a_death_is_reported_as_the_world_coordinators_when_it_died_too(ray_local):
    """Under xla, when cluster host 0's actor (the world's coordinator) dies, JAX aborts the others
    within a second and any of their deaths may reach the driver first: `first_cause` names the
    coordinator's actor then; while it lives, the death seen stays the cause."""
    from types import SimpleNamespace

    import ray

    from orchestrator.driver.executor import PipelineExecutor
    from orchestrator.driver.waiting import StageFailure

    remote = ray.remote(concurrency_groups={"io": 1})(_Beating)
    root, other = remote.remote(), remote.remote()
    try:
        ray.get([root.heartbeat.remote(), other.heartbeat.remote()], timeout=60)
        ex = SimpleNamespace(plane="xla", actors=[[root], [other]], labels=[["stage 0 host 0"], ["stage 1 host 0"]],
                             checked=SimpleNamespace(stages=[SimpleNamespace(hosts=(0,)), SimpleNamespace(hosts=(1,))]))
        seen = StageFailure("steps 4-7 failed on stage 1 host 0: the actor is dead", label="stage 1 host 0", died=True)
        assert PipelineExecutor.first_cause(ex, seen) is seen             # the coordinator lives: no change
        ray.kill(root, no_restart=True)
        _until_dead(root)          # as in a real world: the coordinator died first, the others after it
        cause = PipelineExecutor.first_cause(ex, seen)
        assert (cause.label, cause.died) == ("stage 0 host 0", True), str(cause)
        assert "stage 1 host 0 died with it" in str(cause)
        ex.plane = "socket"                                                # separate worlds: no such rule
        assert PipelineExecutor.first_cause(ex, seen) is seen
    finally:
        for a in (root, other):
            ray.kill(a, no_restart=True)


@pytest.mark.slow
@pytest.mark.parametrize("saved,resumed", [("socket", "xla"), ("xla", "socket")])
def test_a_checkpoint_resumes_under_the_other_transport_bit_for_bit(tmp_path, no_leaks, saved, resumed):
    """4 steps under `saved` (commits 2 and 4); a copy of step 2 resumed under `resumed` gives the
    uninterrupted run's losses, final parameters and step-4 arrays exactly: a checkpoint does not
    depend on the transport that wrote it (under xla a one-host stage saves in a one-process view)."""
    import shutil

    from orchestrator.core import checkpoint as ck
    from tests import test_checkpoint as tc

    full_dir, part_dir = tmp_path / "ck-full", tmp_path / "ck-part"
    full = tc._run(tc.gpt_job(tmp_path, "full", full_dir), cluster={**tc.CLUSTER, "transport": saved})
    assert _workers(full) == {"XlaTransport" if saved == "xla" else "SocketTransport"}
    assert [m["step"] for m in ck.committed(full_dir)] == [2, 4]
    part_dir.mkdir()
    shutil.copytree(ck.step_dir(full_dir, 2), ck.step_dir(part_dir, 2))
    back = tc._run(tc.gpt_job(tmp_path, "resumed", part_dir), resume=2, cluster={**tc.CLUSTER, "transport": resumed})
    assert _workers(back) == {"XlaTransport" if resumed == "xla" else "SocketTransport"}
    assert back["checkpoint"]["resumed_from"] == 2 and len(back["step_times_s"]) == 2
    assert_bit_equal(back, full)
    assert ck.select(part_dir)["step"] == 4 and ck.select(part_dir)["arrays"] == ck.select(full_dir)["arrays"]
