"""GPU and TPU placement on a simulated cluster with fake accelerators (`-m multinode`, own process).

One `ray.cluster_utils.Cluster` for the module: a CPU head, 2 "GPU nodes"
declaring num_gpus=8 (+ accelerator_type:H100), and 4 "TPU VMs" of one
v5litepod-16 slice declaring TPU: 4, the slice-name resource, worker 0's
`TPU-v5litepod-16-head`, and Ray's TPU labels (ray.io/tpu-slice-name,
ray.io/tpu-worker-id, ray.io/tpu-pod-type). For the repository's GPU and TPU
cluster configs, placement reserves the job's placement group and trivial
`Probe` actors are created with exactly the options `placement.actor_options`
returns; each reports its node, the environment it got (Ray's
CUDA_VISIBLE_DEVICES / TPU_VISIBLE_CHIPS included) and the accelerator ids Ray
assigned. No accelerator code runs. Illegal requests are refused against the
live resources with the key, value and rule, and leave no placement group.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from orchestrator.core.backends import JaxInit, PlacementError
from orchestrator.core.backends.jaxinit import ENV_KEY
from orchestrator.core.config import check_job, load_raw, parse_cluster
from orchestrator.driver import placement
from tests.clusters import simulated_cluster
from tests.test_backends import gpt_job

pytestmark = pytest.mark.multinode

ROOT = Path(__file__).resolve().parent.parent
SLICE, POD = "tpu-a", "v5litepod-16"
ENV_KEYS = ("CUDA_VISIBLE_DEVICES", "TPU_VISIBLE_CHIPS", "JAX_PLATFORMS", ENV_KEY, "TPU_PROCESS_BOUNDS",
            "TPU_CHIPS_PER_PROCESS_BOUNDS", "TPU_PROCESS_ADDRESSES", "TPU_PROCESS_PORT", "XLA_FLAGS",
            "XLA_PYTHON_CLIENT_PREALLOCATE")


class Probe:
    """Test-only actor body: where am I, what environment and accelerators did I get."""

    def where(self) -> dict:
        import ray

        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "env": {k: os.environ.get(k) for k in ENV_KEYS},
                "accelerators": {k: v for k, v in ctx.get_accelerator_ids().items() if v}}


@pytest.fixture(scope="module")
def nodes():
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])   # workers cannot import tests/
    gpu_nodes = [{"num_cpus": 2, "num_gpus": 8, "resources": {"accelerator_type:H100": 1}}] * 2
    tpu_vms = [{"num_cpus": 2, "resources": {"TPU": 4, SLICE: 1, **({f"TPU-{POD}-head": 1} if w == 0 else {})},
                "labels": {"ray.io/tpu-slice-name": SLICE, "ray.io/tpu-worker-id": str(w),
                           "ray.io/tpu-pod-type": POD, "ray.io/tpu-topology": "4x4"}} for w in range(4)]
    with simulated_cluster("meshpipe-backend-tests", head={"num_cpus": 1, "include_dashboard": False},
                           nodes=gpu_nodes + tpu_vms, logging_level="WARNING"):
        yield {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}


def cluster_cfg(name: str, **change):
    """A repository cluster config with small CPU reservations (the fake nodes have 2 CPUs each)."""
    raw = load_raw(ROOT / "cluster_configs" / f"{name}.yaml")
    return parse_cluster({**raw, "cpus_per_host": 0.25, **change})


def place(checked, run: str):
    """Reserve, start one Probe per stage host with placement's options; return (plan, probes, bundle nodes)."""
    import ray
    from ray.util import placement_group_table
    from ray.util.placement_group import remove_placement_group

    pg = placement.reserve(checked, f"{run}/pg", timeout=60)
    actors = []
    try:
        remote = ray.remote(Probe)
        for stage in checked.stages:
            for host in range(len(stage.hosts)):
                actors.append(remote.options(**placement.actor_options(checked, stage, host, pg, run)).remote())
        probes = ray.get([a.where.remote() for a in actors], timeout=120)
        bundle_nodes = placement_group_table(pg)["bundles_to_node_id"]
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)
        remove_placement_group(pg)
    return placement.plan_hosts(checked), probes, bundle_nodes


def _no_live_groups():
    from ray.util import placement_group_table

    return all(pg["state"] == "REMOVED" for pg in placement_group_table().values())


def test_gpu_hosts_get_whole_nodes_and_ray_picks_the_gpus(nodes):
    ck = check_job(gpt_job([2], 8), cluster_cfg("gpu-2x8", gpu={"gpus_per_node": 8, "accelerator_type": "H100"}))
    plan, probes, where = place(ck, "gpu-2x8")
    assert [p["node_id"] for p in probes] == [where[0], where[1]] and where[0] != where[1]
    for h, p in zip(plan, probes):
        node = nodes[p["node_id"]]
        assert node["Resources"]["GPU"] == 8 and "TPU" not in node["Resources"]
        assert p["env"]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"          # set by Ray for num_gpus=8
        assert p["accelerators"] == {"GPU": [str(i) for i in range(8)]}
        assert p["env"]["JAX_PLATFORMS"] == "cuda" and p["env"]["XLA_FLAGS"] is None
        assert JaxInit.from_env(p["env"][ENV_KEY]) == h.jax_init == JaxInit("explicit", 2, h.host, tuple(range(8)))


def test_gpu_hosts_sharing_a_node_get_disjoint_gpus(nodes):
    ck = check_job(gpt_job([2, 2], 4), cluster_cfg("gpu-2x8", hosts=4, devices_per_host=4))
    _, probes, _ = place(ck, "gpu-4x4")
    by_node: dict[str, set] = {}
    for p in probes:
        by_node.setdefault(p["node_id"], set()).add(p["env"]["CUDA_VISIBLE_DEVICES"])
    assert sorted(map(sorted, by_node.values())) == [["0,1,2,3", "4,5,6,7"]] * 2


def _worker(nodes, node_id) -> int:
    labels = nodes[node_id]["Labels"]
    assert labels["ray.io/tpu-slice-name"] == SLICE
    return int(labels["ray.io/tpu-worker-id"])


def test_tpu_whole_slice_pins_host_i_to_worker_i_and_takes_the_head(nodes):
    ck = check_job(gpt_job([4], 4), cluster_cfg("tpu-v5e-16"))
    live = placement.plan_hosts(ck, nodes=placement.live_nodes())
    assert {h.label_selector["ray.io/tpu-slice-name"] for h in live} == {SLICE}   # bound to the live slice
    plan, probes, where = place(ck, "tpu-slice")
    assert [_worker(nodes, p["node_id"]) for p in probes] == [0, 1, 2, 3]
    assert f"TPU-{POD}-head" in nodes[where[0]]["Resources"]
    for h, p in zip(plan, probes):
        assert p["env"]["TPU_VISIBLE_CHIPS"] == "0,1,2,3" and p["accelerators"] == {"TPU": ["0", "1", "2", "3"]}
        assert p["env"]["JAX_PLATFORMS"] == "tpu"
        assert JaxInit.from_env(p["env"][ENV_KEY]) == JaxInit("auto", 4, h.host)    # jax auto-detects the slice


def test_tpu_subslice_and_single_hosts_on_their_workers(nodes):
    ck = check_job(gpt_job([2, 1, 1], 4, blocks=4), cluster_cfg("tpu-v5e-16"))
    _plan, probes, _ = place(ck, "tpu-split")
    assert [_worker(nodes, p["node_id"]) for p in probes] == [0, 1, 2, 3]
    ips = [nodes[p["node_id"]]["NodeManagerAddress"] for p in probes]
    assert probes[0]["env"]["TPU_PROCESS_ADDRESSES"] == f"{ips[0]}:8471,{ips[1]}:8471"
    assert [JaxInit.from_env(p["env"][ENV_KEY]).mode for p in probes] == ["explicit", "explicit", "none", "none"]
    assert [p["env"]["TPU_PROCESS_BOUNDS"] for p in probes] == ["2,1,1", "2,1,1", "1,1,1", "1,1,1"]


def test_tpu_partial_hosts_split_each_vm(nodes):
    ck = check_job(gpt_job([1] * 8, 2, blocks=6), cluster_cfg("tpu-v5e-16", hosts=8, devices_per_host=2))
    _, probes, _ = place(ck, "tpu-partial")
    assert [_worker(nodes, p["node_id"]) for p in probes] == [0, 0, 1, 1, 2, 2, 3, 3]
    for a, b in zip(probes[::2], probes[1::2]):                 # the two processes of one VM
        assert {a["env"]["TPU_VISIBLE_CHIPS"], b["env"]["TPU_VISIBLE_CHIPS"]} == {"0,1", "2,3"}
        assert (a["env"]["TPU_PROCESS_PORT"], b["env"]["TPU_PROCESS_PORT"]) == ("8471", "8472")
        assert a["env"]["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,2,1"


@pytest.mark.parametrize("name,change,expect", [
    ("gpu-2x8", {"devices_per_host": 16, "hosts": 1, "gpu": None},
     ["cluster.devices_per_host = 16", "more GPUs per host than any live node has", ": 8"]),
    ("gpu-2x8", {"gpu": {"accelerator_type": "A100"}},
     ["cluster.devices_per_host = 8", "GPUs of type A100 per node: none"]),
    ("tpu-v5e-16", {"tpu": {"type": "v6e-16", "topology": "4x4"}},
     ["cluster.tpu.type = 'v6e-16'", "needs 1 intact v6e-16 slice(s)", "TPU pod types present: v5litepod-16"]),
])
def test_impossible_requests_are_refused_against_live_resources(nodes, name, change, expect):
    cl = cluster_cfg(name, **change)
    ck = check_job(gpt_job([cl.hosts], cl.devices_per_host), cl)
    with pytest.raises(PlacementError) as e:
        placement.reserve(ck, f"bad-{name}/pg", timeout=10)
    for text in expect:
        assert text in str(e.value)
    assert _no_live_groups()
