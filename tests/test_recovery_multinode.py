"""Automatic recovery from a lost node on a simulated multi-node cluster (`-m multinode`, own CI step).

A `ray.cluster_utils.Cluster`: a head with no CPUs (the driver only) and four worker nodes of
one CPU each. The tiny GPT of tests/test_recovery.py runs with stage 0 on 2 hosts × 2 devices
({data: 2, model: 2}, one jax.distributed world) and stage 1 on one host; the placement is
STRICT_SPREAD, so each host is on its own node and one node is spare. The node of stage 0
host 1 is removed (`Cluster.remove_node`, its processes SIGKILLed) while that host is in step 5
with step 4 committed. The run must re-place onto the three nodes left (the spare among them),
restore step 4 and finish with the uninterrupted run's per-step losses and parameters exactly.
When no node is left to spare (the second test: two nodes for three hosts), the run stops after
`failure.placement_timeout_s` with the resume command.

Own pytest process (as tests/test_multinode.py: it connects to its own cluster).
"""
from __future__ import annotations

import threading
import time

import pytest

from tests.clusters import simulated_cluster
from tests.conftest import _address, free_port, wait_until
from tests.test_checkpoint import gpt_job
from tests.test_recovery import STEPS, _assert_same_run

pytestmark = pytest.mark.multinode

CLUSTER = {"address": "auto", "platform": "cpu", "hosts": 3, "devices_per_host": 2, "cpus_per_host": 0.5,
           "placement_strategy": "STRICT_SPREAD",
           "timeouts": {"init_s": 180, "step_s": 300, "shutdown_s": 30, "jax_distributed_init_s": 60}}


@pytest.fixture(scope="module")
def cluster():
    # 3 hosts, one spare per transport the node-loss test runs under, the last loss left with none
    with simulated_cluster("meshpipe-recovery-multinode-tests", nodes=[{"num_cpus": 1}] * 5, head={
            "num_cpus": 0, "include_dashboard": True, "dashboard_host": "127.0.0.1",
            "dashboard_port": free_port()}) as c:
        yield c


def node_job(tmp_path, name: str, ckpt_dir, placement_timeout_s: float | None = None) -> dict:
    job = gpt_job(tmp_path, name, ckpt_dir, steps=STEPS)
    job["pipeline"]["stages"] = [{"layers": [0, 2], "hosts": 2, "mesh": {"data": 2, "model": 2}},
                                 {"layers": [2, 4], "hosts": 1, "mesh": {"model": 2}, "layout": {"batch": None}}]
    job["checkpoint"]["async"] = False       # which steps are committed when step 5 is held is fixed
    job["failure"] = {"max_restarts": 1}
    if placement_timeout_s is not None:
        job["failure"]["placement_timeout_s"] = placement_timeout_s
    return job


def _run(job: dict, hooks=(), resume_command=None, transport: str = "socket") -> dict:
    from orchestrator.core.config import check_job, parse_cluster, parse_job
    from orchestrator.driver.runner import run_job

    checked = check_job(parse_job(job), parse_cluster({**CLUSTER, "transport": transport}))
    return run_job(checked, echo=lambda s: None, keep_params=True, hooks=hooks, resume_command=resume_command)


def _actor(name: str):
    from ray.util.state import list_actors

    found = list_actors(address=_address(), filters=[("name", "=", name), ("state", "=", "ALIVE")])
    assert len(found) == 1, found
    return found[0]


def _nothing_left(run: str, pid: int) -> None:
    import psutil
    from ray.util import placement_group_table
    from ray.util.state import list_actors

    def actors_gone():
        alive = list_actors(address=_address(), filters=[("state", "=", "ALIVE")])
        return not [a for a in alive if (a.name or "").startswith(f"{run}/")]

    wait_until(actors_gone, 60, f"the actors of {run} to exit")
    wait_until(lambda: all(pg["state"] == "REMOVED" for pg in placement_group_table().values()), 30,
               "the placement groups to be removed")
    wait_until(lambda: not psutil.pid_exists(pid), 30, f"the lost node's stage process {pid} to be gone")


def _lose_node(c, run: str, reached) -> dict:
    """A thread: once stage 0 host 1 holds in step 5, remove its node (SIGKILL, no graceful exit)."""
    done: dict = {}

    def go():
        try:
            wait_until(reached.exists, 600, "stage 0 host 1 held in step 5")
            node_id = _actor(f"{run}/stage0/host1").node_id
            (node,) = [n for n in c.worker_nodes if n.node_id == node_id]
            done.update(node_id=node_id, pid=int(reached.read_text()), at=time.time())
            c.remove_node(node, allow_graceful=False)
            done["removed_s"] = time.time() - done["at"]
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            done["error"] = e

    threading.Thread(target=go, daemon=True).start()
    return done


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    full = _run(node_job(tmp, "node-full", tmp / "ck"))
    assert full["restarts"] == 0 and len(full["losses"]) == STEPS and full["losses"][-1] < full["losses"][0]
    return full


@pytest.mark.parametrize("transport", ["socket", "xla"])
def test_a_lost_node_is_named_and_the_run_recovers_bit_equal_on_the_spare(cluster, tmp_path, uninterrupted,
                                                                          transport):
    """Under `transport: xla` the lost host is a process of the job's one JAX world: the world goes
    with it and the restart makes a new one on the nodes left."""
    from orchestrator.core import checkpoint as ck
    from tests.faults import HoldAt

    root, reached = tmp_path / "ck", tmp_path / "reached"
    name = f"node-lost-{transport}"
    job = node_job(tmp_path, name, root)
    hold = HoldAt(stage=0, host=1, step=5, wait_for=str(ck.step_dir(root, 4) / ck.MARKER), reached=str(reached))
    lost = _lose_node(cluster, name, reached)
    got = _run(job, hooks=[hold], transport=transport)
    wait_until(lambda: "removed_s" in lost or "error" in lost, 120, "the node thread")
    assert "error" not in lost, lost.get("error")
    assert got["restarts"] == 1
    (rec,) = got["recoveries"]
    print("recovery:", {**rec, "detection_s": rec["detected_at"] - lost["at"], "removal_s": lost["removed_s"]})
    assert (rec["cause"], rec["stage"], rec["host"], rec["step"], rec["resumed_from"]) == ("node lost", 0, 1, 5, 4), rec
    assert rec["steps_lost"] == 1, rec          # step 4 finished inside the failed call (steps 4-7)
    assert rec["node_id"] == lost["node_id"] and lost["node_id"][:12] in rec["error"], rec
    assert "is gone" in rec["error"] and "stage 0 host 1" in rec["error"], rec
    assert 0 <= rec["detected_at"] - lost["at"] < 10, rec          # the bound for a node loss
    assert rec["placement_s"] > 0 and rec["recovery_s"] > 0 and rec["restore_s"] > 0, rec
    # The survivor (stage 0 host 0, in a RECV on its lost peer's stage) is told to abort and waits for
    # nothing after it: teardown measured 0.1-0.5 s (load ~10 on 2 cores) where jax.distributed's
    # shutdown barrier held it 30.1 s (timeouts.shutdown_s). Bound: the most a survivor is given
    # (ABORT_GRACE_S, 5 s) plus as much again for the kills and the names' release, a third of the old wait.
    from orchestrator.driver.executor import ABORT_GRACE_S

    assert rec["teardown_stuck"] == [] and rec["teardown_graceful_s"] < ABORT_GRACE_S, rec
    assert rec["teardown_s"] < 2 * ABORT_GRACE_S, rec
    _assert_same_run(got, uninterrupted)
    nodes = {(w["stage"], w["host"]): w["node_id"] for w in got["workers"]}      # the new attempt's placement:
    assert lost["node_id"] not in nodes.values() and len(set(nodes.values())) == 3, nodes   # so on the spare
    _nothing_left(name, lost["pid"])


def test_no_node_to_replace_a_lost_one_stops_within_the_placement_timeout(cluster, tmp_path):
    """No node to spare (after the first test's two runs, three nodes for three hosts; one lost): the restart
    waits `failure.placement_timeout_s` (20 s) and the run stops saying so, with the command that
    continues it. (The failed call was steps 4-7: the failure's step is 5, the first one the actors
    still answering had not finished.)"""
    from orchestrator.core import checkpoint as ck
    from orchestrator.driver.recovery import RecoveryStopped
    from tests.faults import HoldAt
    from tests.test_bad_input import has_all

    root, reached = tmp_path / "ck", tmp_path / "reached"
    job = node_job(tmp_path, "node-nospare", root, placement_timeout_s=20)
    hold = HoldAt(stage=0, host=1, step=5, wait_for=str(ck.step_dir(root, 4) / ck.MARKER), reached=str(reached))
    lost = _lose_node(cluster, "node-nospare", reached)
    t0 = time.monotonic()
    with pytest.raises(RecoveryStopped) as ei:
        _run(job, hooks=[hold], resume_command="meshpipe run j.yaml --resume")
    assert "error" not in lost, lost.get("error")
    has_all(str(ei.value), "node lost: stage 0 host 1", lost["node_id"][:12], "in step 5",
            "could not be reserved again within 20 s", "failure.placement_timeout_s", "STRICT_SPREAD",
            "last committed checkpoint: step 4", "Continue with: meshpipe run j.yaml --resume")
    assert time.monotonic() - t0 < 600
    _nothing_left("node-nospare", lost["pid"])
