"""Multi-host submeshes on a simulated multi-node Ray cluster (`-m multinode`, own CI step).

A `ray.cluster_utils.Cluster` (head + 3 worker nodes, one machine) hosts a
2-stage GPT whose stage 0 spans 2 hosts × 2 devices (mesh {data: 2, model: 2},
`data` across the two jax processes, joined by jax.distributed + gloo) and whose
stage 1 is 1 host × 2 devices with another layout. Numerics are compared with
the single-process reference at the slice's tolerance (rtol 1e-5, atol 1e-6).

This module connects the test process to its own cluster, so it must run in a
pytest process of its own (the `multinode` marker is excluded by default).
"""
from __future__ import annotations

import numpy as np
import pytest

from orchestrator.core.config import check_job, parse_cluster, parse_job
from orchestrator.driver.runner import run_job
from orchestrator.driver.waiting import StageFailure
from tests.clusters import LoopbackWatch, simulated_cluster
from tests.conftest import _address, free_port, wait_until
from tests.faults import FailSetup

pytestmark = pytest.mark.multinode

RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster("meshpipe-multinode-tests", nodes=[{"num_cpus": 2}] * 3, head={
            "num_cpus": 1, "include_dashboard": True, "dashboard_host": "127.0.0.1",
            "dashboard_port": free_port()}) as c:
        yield c


CLUSTER = {"address": "auto", "platform": "cpu", "hosts": 4, "devices_per_host": 2, "cpus_per_host": 0.5,
           "placement_strategy": "STRICT_SPREAD",
           "timeouts": {"init_s": 180, "step_s": 300, "shutdown_s": 30, "jax_distributed_init_s": 60}}


def job(tmp_path, name="gpt-multihost", steps=4):
    return {
        "run": {"name": name, "steps": steps, "seed": 3, "output_dir": str(tmp_path)},
        "model": {"name": "gpt", "args": {"vocab": 64, "d_model": 32, "heads": 4, "d_mlp": 64, "blocks": 2}},
        "data": {"source": "synthetic", "global_batch": 16, "seq_len": 16},
        "optimizer": {"name": "adam", "args": {"learning_rate": 0.003}},
        "pipeline": {"schedule": "1f1b", "microbatches": 4, "stages": [
            {"layers": [0, 2], "hosts": 2, "mesh": {"data": 2, "model": 2}},
            {"layers": [2, 4], "hosts": 1, "mesh": {"model": 2}, "layout": {"batch": None}},
        ]},
        "layout": {"batch": "data", "heads": "model", "mlp": "model", "vocab": "model"},
    }


def _actors_gone(run: str):
    from ray.util.state import list_actors

    alive = list_actors(address=_address(), filters=[("state", "=", "ALIVE")])
    return not [a for a in alive if (a.name or "").startswith(run)]


def _pgs_gone():
    from ray.util import placement_group_table

    return all(pg["state"] == "REMOVED" for pg in placement_group_table().values())


def test_two_host_stage_matches_reference_and_spans_nodes(cluster, tmp_path):
    from ray.util.state import list_actors

    checked = check_job(parse_job(job(tmp_path)), parse_cluster(CLUSTER))
    with LoopbackWatch() as watch:      # the actors, their TCP listeners, the jax.distributed coordinator
        pipe = run_job(checked, echo=lambda s: None)
    ref = run_job(checked, reference=True, echo=lambda s: None)
    assert watch.samples >= 3, (watch.samples, watch.error)
    assert not watch.bad, f"listening beyond loopback during the run: {sorted(watch.bad)}"
    np.testing.assert_allclose(pipe["losses"], ref["losses"], rtol=RTOL, atol=ATOL)
    names = sorted(ref["param_norms"])
    np.testing.assert_allclose([pipe["param_norms"][n] for n in names],
                               [ref["param_norms"][n] for n in names], rtol=RTOL, atol=ATOL)

    workers = {(w["stage"], w["host"]): w for w in pipe["workers"]}
    assert sorted(workers) == [(0, 0), (0, 1), (1, 0)]
    # stage 0's two hosts are one jax world of 4 devices, 2 of them local to each process
    assert [workers[(0, h)]["devices"] for h in (0, 1)] == [4, 4]
    assert [workers[(0, h)]["local_devices"] for h in (0, 1)] == [2, 2]
    # each actor ran on its bundle's node (Ray state API), and stage 0 spans two nodes
    by_name = {a.name: a for a in list_actors(address=_address(), filters=[("name", "!=", "")], detail=True)}
    for (stage, host), w in workers.items():
        actor = by_name[f"gpt-multihost/stage{stage}/host{host}"]
        assert actor.node_id == w["bundle_node_id"] == w["node_id"]
    assert workers[(0, 0)]["node_id"] != workers[(0, 1)]["node_id"]
    wait_until(lambda: _actors_gone("gpt-multihost"), 30, "the run's actors to exit")
    wait_until(_pgs_gone, 30, "the placement group to be removed")


def test_peer_that_fails_to_start_fails_fast_and_cleans_up(cluster, tmp_path):
    checked = check_job(parse_job(job(tmp_path, name="gpt-badpeer", steps=1)), parse_cluster(CLUSTER))
    with pytest.raises(StageFailure) as err:
        run_job(checked, echo=lambda s: None, hooks=[FailSetup(stage=0, host=1)])
    text = str(err.value)
    assert "stage 0 host 1" in text and "injected setup failure" in text
    wait_until(lambda: _actors_gone("gpt-badpeer"), 30, "the failed run's actors to exit")
    wait_until(_pgs_gone, 30, "the placement group to be removed")
