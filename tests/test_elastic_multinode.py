"""Elastic recovery on a simulated cluster (`-m multinode`, own CI step): a lost node and no spare.

A `ray.cluster_utils.Cluster` on loopback: a head with no CPUs and three worker nodes of one CPU
each. The tiny GPT of tests/test_recovery_multinode.py runs stage 0 on 2 hosts × 2 devices
({data: 2, model: 2}) and stage 1 on one host, STRICT_SPREAD: every node holds a host and none is
spare. `failure.elastic` is set and `failure.placement_timeout_s` is 10 s. The node of stage 0
host 1 is removed while that host holds in step 5 with step 4 committed; the restart cannot
place 3 hosts, so the run re-plans:

  - shrink: onto the 2 nodes left (the rule: stage 0 gives up its second data-parallel host,
    `[0,2) data=1,model=2 | [2,4) model=2`), restores step 4 and finishes all 8 steps —
    bit-equal to a `--resume` of that smaller plan from the uninterrupted run's step-4 commit
    (the same computation), and within the stated tolerance of the uninterrupted run itself;
  - grow: a node added back once the smaller plan has trained step 4 → at the next commit (6)
    the run goes back onto the job's own plan;
  - min_hosts 3: the run stops with the reason and the resume command;
  - a second loss while re-planning: a node removed the moment the 2-host plan is chosen → its
    placement fails too and the run re-plans onto the one host left.

After each: no actor, placement group or stage process of the run is left. Before each, the
cluster is topped up to three worker nodes. Own pytest process (it connects to its own cluster).
"""
from __future__ import annotations

import shutil
import threading
import time

import numpy as np
import pytest

from tests.clusters import LOOPBACK, simulated_cluster
from tests.conftest import free_port, wait_until
from tests.test_checkpoint import gpt_job
from tests.test_recovery import STEPS
from tests.test_recovery_multinode import CLUSTER, _actor, _nothing_left

pytestmark = pytest.mark.multinode

WORKERS = 3
SMALL = "2 stages 1f1b m=2 on 2 hosts: [0,2) data=1,model=2 | [2,4) model=2"
OWN = "2 stages 1f1b m=2 on 3 hosts: [0,2) data=2,model=2 x2h | [2,4) model=2"
# the stated tolerance of an elastic run against an uninterrupted run of the job's own plan
# (docs/guides/elastic.md; measured in tests/test_elastic_numerics.py)
LOSS_RTOL, ARRAY_REL_L2 = 1e-5, 1e-4


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster("meshpipe-elastic-multinode-tests", nodes=[{"num_cpus": 1}] * WORKERS, head={
            "num_cpus": 0, "include_dashboard": True, "dashboard_host": "127.0.0.1",
            "dashboard_port": free_port()}) as c:
        yield c


def top_up(cluster) -> None:
    """Three live worker nodes (an earlier test removed some). A removed node stays `Alive` in
    Ray's table until its health check fails, so a node counts when its raylet answers."""
    import ray

    from orchestrator.driver.ray_internals import single_machine_mode
    from orchestrator.driver.recovery import raylet_answers

    def alive() -> int:
        return sum(1 for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) >= 1
                   and raylet_answers(n["NodeManagerAddress"], n["NodeManagerPort"], 1.0))

    while alive() < WORKERS:
        with single_machine_mode():
            cluster.add_node(num_cpus=1, node_ip_address=LOOPBACK)
        cluster.wait_for_nodes(timeout=120)
    wait_until(lambda: alive() == WORKERS, 60, "three worker nodes")


@pytest.fixture
def full(cluster):
    top_up(cluster)
    return cluster


def elastic_job(tmp_path, name: str, ckpt_dir, **elastic) -> dict:
    job = gpt_job(tmp_path, name, ckpt_dir, steps=STEPS)
    job["pipeline"]["stages"] = [{"layers": [0, 2], "hosts": 2, "mesh": {"data": 2, "model": 2}},
                                 {"layers": [2, 4], "hosts": 1, "mesh": {"model": 2}, "layout": {"batch": None}}]
    job["checkpoint"].update({"async": False, "keep": 10})   # step 4 kept: the oracle resumes from it
    job["failure"] = {"max_restarts": 2, "placement_timeout_s": 10, "elastic": elastic}
    return job


def _run(job: dict, hooks=(), echo=lambda s: None, resume=None, resume_command=None, **cluster) -> dict:
    from orchestrator.core.config import check_job, parse_cluster, parse_job
    from orchestrator.driver.runner import run_job

    checked = check_job(parse_job(job), parse_cluster({**CLUSTER, **cluster}))
    return run_job(checked, echo=echo, keep_params=True, hooks=hooks, resume=resume, resume_command=resume_command)


def _lose_node(c, run: str, reached, stage: int = 0, host: int = 1) -> dict:
    """A thread: once `reached` exists, remove the node of `run`'s (stage, host) (SIGKILL, no graceful exit)."""
    done: dict = {}

    def go():
        try:
            wait_until(reached.exists, 600, f"{reached.name} to be created")
            node_id = _actor(f"{run}/stage{stage}/host{host}").node_id
            (node,) = [n for n in c.worker_nodes if n.node_id == node_id]
            done.update(node_id=node_id, pid=int(reached.read_text()), at=time.time())
            c.remove_node(node, allow_graceful=False)
            done["removed_s"] = time.time() - done["at"]
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            done["error"] = e

    threading.Thread(target=go, daemon=True).start()
    return done


def _hold(tmp_path):
    from orchestrator.core import checkpoint as ck
    from tests.faults import HoldAt

    reached = tmp_path / "reached"
    return HoldAt(stage=0, host=1, step=5, wait_for=str(ck.step_dir(tmp_path / "ck", 4) / ck.MARKER),
                  reached=str(reached)), reached


def _close(got: dict, want: dict) -> None:
    """Within the stated tolerance of `want` (losses relative 1e-5, each array relative L2 1e-4)."""
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=LOSS_RTOL)
    assert got["params"].keys() == want["params"].keys()
    for name, arr in want["params"].items():
        rel = np.linalg.norm(got["params"][name] - arr) / max(np.linalg.norm(arr), 1e-30)
        assert rel <= ARRAY_REL_L2, (name, rel)


def _nodes(got: dict) -> set:
    return {w["node_id"] for w in got["workers"]}


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory):
    top_up(cluster)        # (set up before `full`: pytest makes module fixtures first)
    tmp = tmp_path_factory.mktemp("uninterrupted")
    got = _run(elastic_job(tmp, "el-full", tmp / "ck"))
    assert got["restarts"] == 0 and got["replans"] == [] and got["plan_in_use"] == OWN
    assert len(got["losses"]) == STEPS and got["losses"][-1] < got["losses"][0]
    return got, tmp / "ck"


def _resumed_small(tmp_path, root, original_job: dict) -> dict:
    """The oracle: the rule's 2-host plan, `--resume`d from the uninterrupted run's step-4 commit."""
    from orchestrator.core import checkpoint as ck
    from orchestrator.core.config import check_job, parse_cluster, parse_job
    from orchestrator.core.elastic import plan_for

    copy = tmp_path / "ck-oracle"
    shutil.copytree(root, copy)
    for m in ck.committed(copy):
        if m["step"] > 4:
            shutil.rmtree(ck.step_dir(copy, m["step"]))
    small = plan_for(check_job(parse_job(original_job), parse_cluster(CLUSTER)), 2).checked.job.to_dict()
    small["run"]["name"] = "el-oracle"
    small["checkpoint"]["dir"] = str(copy)
    small["failure"] = {"max_restarts": 0}
    return _run(small, resume="latest")


def test_a_lost_node_without_a_spare_shrinks_and_finishes_as_the_smaller_plan_resumed(full, tmp_path, uninterrupted):
    want, root = uninterrupted
    job = elastic_job(tmp_path, "el-shrink", tmp_path / "ck")
    hold, reached = _hold(tmp_path)
    lost = _lose_node(full, "el-shrink", reached)
    lines: list[str] = []
    got = _run(job, hooks=[hold], echo=lines.append)
    assert "error" not in lost, lost.get("error")
    assert got["restarts"] == 1 and got["recoveries"][0]["cause"] == "node lost"
    (rep,) = got["replans"]
    rec = got["recoveries"][0]
    print("re-plan:", rep, "detection_s:", rec["detected_at"] - lost["at"], "start_s:", rec.get("start_s"),
          "first_step_s:", rec.get("first_step_s"), "load:", __import__("os").getloadavg())
    assert (rep["kind"], rep["step"], rep["capacity"], rep["method"]) == ("shrink", 4, 2, "rule"), rep
    assert rep["hosts"] == {"before": 3, "after": 2} and rep["plan"] == {"before": OWN, "after": SMALL}, rep
    assert rep["why"].startswith("node lost: stage 0 host 1") and lost["node_id"][:12] in rep["why"], rep
    t = rep["times_s"]
    assert all(t[k] is not None and t[k] >= 0 for k in ("teardown", "wait", "planning", "placement", "restore",
                                                         "compile", "total")), t
    assert t["wait"] >= 9 and t["total"] > t["wait"], t        # the placement's wait is part of it
    p = rep["predicted_step_s"]
    assert p["after"] > p["before"] > 0, p                      # fewer devices: slower, predicted
    assert got["plan_in_use"] == SMALL and len(_nodes(got)) == 2 and lost["node_id"] not in _nodes(got)
    assert any(line.startswith("elastic shrink at step 4 (node lost") and "training again" in line for line in lines)
    steps = [line for line in lines if line.startswith("step ")]
    assert steps[-1].endswith("[plan: 2 stages on 2 of 3 hosts, m=2]"), steps[-1]
    assert len(got["losses"]) == STEPS and got["losses"][:4] == want["losses"][:4]     # the data order
    from tests.test_recovery import _assert_same_run

    _assert_same_run(got, _resumed_small(tmp_path, root, job))        # the same computation: bit-equal
    _close(got, want)
    _nothing_left("el-shrink", lost["pid"])


def test_a_node_added_back_grows_onto_the_jobs_own_plan_at_the_next_commit(full, tmp_path, uninterrupted):
    """One step at a time (`steps_per_call: 1`): once the smaller plan has trained step 4, a node
    joins (from the driver's own progress line, so before the commit of step 6 is seen) → at that
    commit the run goes back onto the job's own plan and trains steps 6 and 7 there."""
    want, _ = uninterrupted
    job = elastic_job(tmp_path, "el-grow", tmp_path / "ck")
    hold, reached = _hold(tmp_path)
    lost = _lose_node(full, "el-grow", reached)
    added: dict = {}

    def echo(line: str) -> None:      # the driver's thread (Ray starts a node from the main thread only)
        from orchestrator.driver.ray_internals import single_machine_mode

        if line.startswith("step    4 ") and line.endswith("[plan: 2 stages on 2 of 3 hosts, m=2]") and not added:
            with single_machine_mode():
                full.add_node(num_cpus=1, node_ip_address=LOOPBACK)
            full.wait_for_nodes(timeout=120)
            added["at"] = time.time()

    got = _run(job, hooks=[hold], echo=echo, steps_per_call=1)
    assert "error" not in lost and added, (lost, added)
    shrink, grow = got["replans"]
    print("grow:", grow)
    assert (shrink["kind"], shrink["plan"]["after"]) == ("shrink", SMALL), shrink
    assert (grow["kind"], grow["step"], grow["method"]) == ("grow", 6, "original"), grow
    assert grow["hosts"] == {"before": 2, "after": 3} and grow["plan"] == {"before": SMALL, "after": OWN}, grow
    assert grow["times_s"]["detection"] is None and grow["times_s"]["wait"] is None, grow
    assert grow["times_s"]["total"] > 0 and grow["times_s"]["restore"] > 0, grow
    assert got["restarts"] == 1 and got["plan_in_use"] == OWN and len(_nodes(got)) == 3   # a grow is no restart
    assert len(got["losses"]) == STEPS and got["losses"][:4] == want["losses"][:4]
    _close(got, want)
    _nothing_left("el-grow", lost["pid"])


def test_fewer_hosts_than_min_hosts_stop_with_the_reason_and_the_resume_command(full, tmp_path):
    from orchestrator.driver.recovery import RecoveryStopped
    from tests.test_bad_input import has_all

    job = elastic_job(tmp_path, "el-min", tmp_path / "ck", min_hosts=3)
    hold, reached = _hold(tmp_path)
    lost = _lose_node(full, "el-min", reached)
    with pytest.raises(RecoveryStopped) as ei:
        _run(job, hooks=[hold], resume_command="meshpipe run j.yaml --resume")
    assert "error" not in lost, lost.get("error")
    has_all(str(ei.value), "node lost: stage 0 host 1", "could not be reserved again within 10 s",
            "failure.elastic: the live cluster holds 2 host(s) of the 3", "failure.elastic.min_hosts = 3",
            "last committed checkpoint: step 4", "Continue with: meshpipe run j.yaml --resume")
    _nothing_left("el-min", lost["pid"])


def test_a_second_loss_while_replanning_replans_again_onto_what_is_left(full, tmp_path, uninterrupted):
    """The 2-host plan is chosen, and its second node is removed before it is placed (from the
    driver's own log line, so before the placement begins): that placement fails too, and the run
    re-plans onto the one host left — the whole model as one stage."""
    want, _ = uninterrupted
    job = elastic_job(tmp_path, "el-twice", tmp_path / "ck")
    hold, reached = _hold(tmp_path)
    lost = _lose_node(full, "el-twice", reached)
    second: dict = {}

    def echo(line: str) -> None:
        if line.startswith("elastic shrink:") and not second:
            import ray

            gone = lost.get("node_id")
            (node,) = [n for n in full.worker_nodes if n.node_id != gone and n.node_id in
                       {x["NodeID"] for x in ray.nodes() if x["Alive"]}][:1]
            second["node_id"] = node.node_id
            full.remove_node(node, allow_graceful=False)

    got = _run(job, hooks=[hold], echo=echo)
    assert "error" not in lost, lost.get("error")
    assert second, "the second node was not removed"
    replans = got["replans"]
    print("re-plans:", replans)
    assert [r["hosts"]["after"] for r in replans] == [2, 1], replans
    assert replans[-1]["plan"]["after"] == "1 stage 1f1b m=2 on 1 host: [0,4) model=2", replans
    assert got["plan_in_use"] == replans[-1]["plan"]["after"] and len(_nodes(got)) == 1
    assert second["node_id"] not in _nodes(got) and lost["node_id"] not in _nodes(got)
    assert len(got["losses"]) == STEPS and got["losses"][:4] == want["losses"][:4]
    _close(got, want)
    _nothing_left("el-twice", lost["pid"])
