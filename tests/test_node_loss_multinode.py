"""Node loss reported as the cause on a simulated multi-node cluster (#35, item 7; `-m multinode`,
own CI step; the cluster and job of tests/test_recovery_multinode.py).

Without restarts (`failure.max_restarts: 0`) the node of stage 0 host 1 is removed while that host
is in step 5 with step 4 committed: the run stops with "node lost" naming the node and stage 0
host 1 — in the error and in summary.json's typed `failure` — not with the surviving actors'
Gloo errors, which the record keeps as the loss's consequence. And `compiled_graph` with
restarts on this cluster is refused before any actor starts, naming key, value and rule.
"""
from __future__ import annotations

import time

import pytest

from tests.clusters import simulated_cluster
from tests.conftest import free_port, wait_until
from tests.test_recovery_multinode import CLUSTER, _lose_node, _nothing_left, node_job

pytestmark = pytest.mark.multinode


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster("meshpipe-node-loss-tests", nodes=[{"num_cpus": 1}] * 4, head={
            "num_cpus": 0, "include_dashboard": True, "dashboard_host": "127.0.0.1",
            "dashboard_port": free_port()}) as c:
        yield c


def _checked(job: dict, executor: str = "step_calls"):
    from orchestrator.core.config import check_job, parse_cluster, parse_job

    return check_job(parse_job(job), parse_cluster({**CLUSTER, "executor": executor}))


def test_compiled_graph_with_restarts_is_refused_before_any_actor_starts(cluster, tmp_path):
    from ray.util.state import list_actors

    from orchestrator.core.config.errors import ConfigError
    from orchestrator.driver.runner import run_job
    from tests.conftest import _address
    from tests.test_bad_input import has_all

    job = node_job(tmp_path, "cg-refused", tmp_path / "ck")        # failure.max_restarts: 1
    with pytest.raises(ConfigError) as ei:
        run_job(_checked(job, "compiled_graph"), echo=lambda s: None)
    has_all(str(ei.value), "cluster.executor = 'compiled_graph'", "failure.max_restarts = 1",
            "a cluster of 5 nodes", "refused", "step_calls")
    started = [a for a in list_actors(address=_address(), filters=[("state", "=", "ALIVE")])
               if (a.name or "").startswith("cg-refused/")]
    assert started == []


def test_without_restarts_a_lost_node_is_the_reported_cause(cluster, tmp_path):
    from orchestrator.core import checkpoint as ck
    from orchestrator.driver.recovery import RecoveryStopped
    from orchestrator.driver.runner import run_job
    from tests.faults import HoldAt
    from tests.records import summary
    from tests.test_bad_input import has_all

    root, reached = tmp_path / "ck", tmp_path / "reached"
    job = node_job(tmp_path, "node-gone", root)
    job["failure"] = {"max_restarts": 0}
    hold = HoldAt(stage=0, host=1, step=5, wait_for=str(ck.step_dir(root, 4) / ck.MARKER), reached=str(reached))
    lost = _lose_node(cluster, "node-gone", reached)
    t0 = time.monotonic()
    with pytest.raises(RecoveryStopped) as ei:
        run_job(_checked(job), echo=lambda s: None, hooks=[hold], resume_command="meshpipe run j.yaml --resume")
    wait_until(lambda: "removed_s" in lost or "error" in lost, 120, "the node thread")
    assert "error" not in lost, lost.get("error")
    msg = str(ei.value)
    assert msg.startswith("node lost: stage 0 host 1"), msg
    has_all(msg, lost["node_id"][:12], "is gone", "not restarting: failure.max_restarts is 0",
            "last committed checkpoint: step 4", "Continue with: meshpipe run j.yaml --resume")
    s = summary(job["run"]["output_dir"], "node-gone")
    f = s["failure"]
    assert s["status"] == "failed" and s["error"].split(": ", 1)[1].startswith("node lost: stage 0 host 1"), s["error"]
    assert (f["cause"], f["stage"], f["host"], f["node"]) == ("node lost", 0, 1, lost["node_id"]), f
    print("consequence:", f["consequence"], "stopped after", round(time.monotonic() - t0), "s")
    _nothing_left("node-gone", lost["pid"])
