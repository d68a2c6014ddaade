"""Platform backends, pure: registry, TPU geometry (vs Ray's tables), config rules, dry-run placement.

No Ray cluster is started and no jax backend is initialised here; the
`multinode` twin (tests/test_backends_cluster.py) places the same plans on a
simulated cluster with fake GPU/TPU resources.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.core.backends import Backend, JaxInit, Node, PlacementError, get_backend, platforms
from orchestrator.core.backends.jaxinit import ENV_KEY
from stages.jaxinit import initialize
from orchestrator.core.backends.tpu_topology import VALID_TOPOLOGIES, WORKER_DIMS, aligned_block, geometry
from orchestrator.core.config import ConfigError, check_job, load_cluster, parse_cluster, parse_job
from orchestrator.core.hosts import plan_hosts

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "cluster_configs"
TPU = {"address": "auto", "platform": "tpu", "hosts": 4, "devices_per_host": 4, "cpus_per_host": 2,
       "placement_strategy": "SPREAD", "tpu": {"type": "v5litepod-16", "topology": "4x4"}}
GPU = {"address": "auto", "platform": "gpu", "hosts": 2, "devices_per_host": 8, "cpus_per_host": 4,
       "gpu": {"gpus_per_node": 8}}


def gpt_job(stage_hosts, devices_per_host, blocks=2):
    """A GPT job with one stage per entry of `stage_hosts`, each mesh {model: hosts × devices}."""
    n = len(stage_hosts)
    layers = blocks + 2
    cuts = [round(i * layers / n) for i in range(n + 1)]
    return parse_job({
        "run": {"name": "backends", "steps": 1},
        "model": {"name": "gpt", "args": {"vocab": 128, "d_model": 64, "heads": 16, "d_mlp": 256,
                                          "blocks": blocks}},
        "data": {"global_batch": 8, "seq_len": 8},
        "optimizer": {"name": "sgd", "args": {"learning_rate": 0.1}},
        "pipeline": {"microbatches": 2, "stages": [
            {"layers": [cuts[i], cuts[i + 1]], "hosts": h, "mesh": {"model": h * devices_per_host}}
            for i, h in enumerate(stage_hosts)]},
        "layout": {"heads": "model", "mlp": "model", "vocab": "model"},
    })


def checked(cluster: dict, stage_hosts, blocks=2):
    cl = parse_cluster(cluster)
    return check_job(gpt_job(stage_hosts, cl.devices_per_host, blocks), cl)


def tpu_nodes(slice_name="tpu-a", pod="v5litepod-16", hosts=4, chips=4, busy=False, drop_worker=None):
    out = []
    for w in range(hosts):
        if w == drop_worker:
            continue
        res = {"CPU": 8.0, "TPU": float(chips), slice_name: 1.0}
        if w == 0:
            res[f"TPU-{pod}-head"] = 1.0
        avail = dict(res, **({f"TPU-{pod}-head": 0.0} if busy and w == 0 else {}))
        out.append(Node(f"{slice_name}-node{w}", f"10.0.0.{w}", res,
                        {"ray.io/tpu-slice-name": slice_name, "ray.io/tpu-worker-id": str(w),
                         "ray.io/tpu-pod-type": pod}, avail))
    return out


# ----------------------------------------------------------------------------- registry

def test_backends_register_themselves():
    assert platforms() == ["cpu", "gpu", "tpu"]

    class FakeBackend(Backend):
        platform = "fake-test"

    try:
        assert "fake-test" in platforms()
        assert isinstance(get_backend(type("C", (), {"platform": "fake-test"})()), FakeBackend)
    finally:
        Backend._registry.pop("fake-test")
    with pytest.raises(ValueError, match="no backend for platform 'nope'"):
        get_backend(type("C", (), {"platform": "nope"})())


@pytest.mark.parametrize("module", ["orchestrator.core.backends", "orchestrator.core.backends.base",
                                    "orchestrator.core.backends.jaxinit", "orchestrator.core.backends.tpu_topology"])
def test_docstring_examples(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0


# ----------------------------------------------------------------------------- TPU geometry

@pytest.mark.parametrize("tpu_type,topology,hosts,chips_per_host,head", [
    ("v5litepod-16", "4x4", 4, 4, "TPU-v5litepod-16-head"),
    ("v5e-16", "4x4", 4, 4, "TPU-v5litepod-16-head"),        # alias: GCP calls v5e 'v5litepod'
    ("v5litepod-8", "2x4", 1, 8, "TPU-v5litepod-8-head"),
    ("v6e-16", "4x4", 4, 4, "TPU-v6e-16-head"),
    ("v6e-256", "16x16", 64, 4, "TPU-v6e-256-head"),
    ("v4-16", "2x2x2", 2, 4, "TPU-v4-16-head"),              # v4: 2 cores per chip
    ("v5p-8", "2x2x1", 1, 4, "TPU-v5p-8-head"),
])
def test_slice_geometry(tpu_type, topology, hosts, chips_per_host, head):
    g = geometry(tpu_type, topology)
    assert (g.hosts, g.chips_per_host, g.head_resource) == (hosts, chips_per_host, head)


@pytest.mark.ray_260
def test_topology_tables_match_rays():
    from ray._private.accelerators import tpu as rtpu

    assert VALID_TOPOLOGIES == rtpu.VALID_TPU_TOPOLOGY
    assert WORKER_DIMS == {**rtpu._VALID_TOPOLOGY_WORKER_DIMS_2D, **rtpu._VALID_TOPOLOGY_WORKER_DIMS_3D}
    for version, topos in VALID_TOPOLOGIES.items():
        for topo in topos:
            g = geometry(f"{version}-{rtpu.get_num_chips_from_topology(topo) * rtpu.get_tpu_cores_per_chip(version)}",
                         topo)
            assert g.chips_per_host == rtpu.get_chips_per_host(topo, version), (version, topo)
            pod = rtpu.infer_tpu_pod_type_from_topology(topo, f"TPU-{version.upper()}")
            assert g.head_resource == f"TPU-{pod}-head"


def test_aligned_subslices():
    g = geometry("v5litepod-16", "4x4")                       # 2 × 2 workers
    assert aligned_block(g, 0, 2) == ("2x4", (1, 2)) and aligned_block(g, 2, 2) == ("2x4", (1, 2))
    assert aligned_block(g, 1, 2) is None                     # workers 1, 2: different rows
    g = geometry("v5litepod-32", "4x8")                       # 2 × 4 workers
    assert [w for w in range(8) if aligned_block(g, w, 2)] == [0, 2, 4, 6]
    assert aligned_block(g, 0, 4) is None                     # 4 consecutive = a 1×4 row: no such topology


# ----------------------------------------------------------------------------- config rules

@pytest.mark.parametrize("change,expect", [
    ({"tpu": {"type": "v5litepod-16", "topology": "4x8"}}, ["tpu.topology = '4x8'", "has 16 chips", "has 32"]),
    ({"tpu": {"type": "v5litepod-16", "topology": "2x2x4"}}, ["tpu.topology", "not a v5litepod slice topology"]),
    ({"tpu": {"type": "v9-16", "topology": "4x4"}}, ["tpu.type = 'v9-16'", "unknown TPU version"]),
    ({"tpu": {"type": "tpu", "topology": "4x4"}}, ["tpu.type = 'tpu'", "'<version>-<cores>'"]),
    ({"hosts": 3}, ["hosts = 3", "tpu.slices × hosts per slice = 1 × 4 = 4"]),
    ({"devices_per_host": 3}, ["devices_per_host = 3", "a whole VM (4 devices) or 1, 2 or 4 of its chips"]),
    ({"devices_per_host": 8}, ["devices_per_host = 8"]),
    ({"devices_per_host": 2, "hosts": 8, "placement_strategy": "STRICT_SPREAD"},
     ["placement_strategy = 'STRICT_SPREAD'", "2 hosts share each TPU VM"]),
    ({"placement_strategy": "STRICT_PACK"}, ["placement_strategy = 'STRICT_PACK'", "4 TPU VMs"]),
    ({"tpu": None}, ["tpu = None", "required for platform: tpu"]),
    ({"gpu": {"gpus_per_node": 8}}, ["gpu = {", "only for platform: gpu"]),
])
def test_tpu_cluster_rules(change, expect):
    with pytest.raises(ConfigError) as e:
        parse_cluster({**TPU, **change})
    for text in expect:
        assert text in str(e.value)


@pytest.mark.parametrize("change,expect", [
    ({"devices_per_host": 16}, ["devices_per_host = 16", "more GPUs per host than a node has",
                                "gpu.gpus_per_node = 8"]),
    ({"placement_strategy": "STRICT_PACK"}, ["placement_strategy = 'STRICT_PACK'", "16 GPUs on one node"]),
    ({"gpu": {"memory_fraction": 1.5}}, ["gpu.memory_fraction = 1.5", "must be in (0, 1]"]),
    ({"gpu": {"accelerator_type": "A 100"}}, ["gpu.accelerator_type = 'A 100'"]),
    ({"platform": "cpu"}, ["gpu = {", "only for platform: gpu"]),
])
def test_gpu_cluster_rules(change, expect):
    with pytest.raises(ConfigError) as e:
        parse_cluster({**GPU, **change})
    for text in expect:
        assert text in str(e.value)


@pytest.mark.parametrize("stage_hosts", [[4], [1, 1, 1, 1], [2, 2], [2, 1, 1], [1, 1, 2], [1], [2]])
def test_legal_tpu_submeshes(stage_hosts):
    checked(TPU, stage_hosts, blocks=4)


@pytest.mark.parametrize("cluster,stage_hosts,expect", [
    (TPU, [1, 3], ["pipeline.stages[1].hosts = 3", "cluster hosts 1..3", "not an ICI-aligned subslice",
                   "2 hosts starting at worker 0 or 2 of a slice (subslice 2x4)"]),
    (TPU, [1, 2, 1], ["pipeline.stages[1].hosts = 2", "workers 1..2"]),
    (TPU, [3], ["pipeline.stages[0].hosts = 3", "a multiple of 4 hosts starting at a slice boundary"]),
    ({**TPU, "hosts": 8, "tpu": {**TPU["tpu"], "slices": 2}}, [2, 4],
     ["pipeline.stages[1].hosts = 4", "crosses a slice boundary"]),
    ({**TPU, "hosts": 8, "devices_per_host": 2}, [2], ["pipeline.stages[0].hosts = 2", "part of a TPU VM",
                                                        "exactly 1 host per stage"]),
])
def test_illegal_tpu_submeshes_name_key_value_rule(cluster, stage_hosts, expect):
    with pytest.raises(ConfigError) as e:
        checked(cluster, stage_hosts, blocks=4)
    for text in expect:
        assert text in str(e.value)


# ----------------------------------------------------------------------------- dry-run placement

def test_cpu_placement_is_simulated_devices():
    hosts = plan_hosts(checked({"hosts": 4, "devices_per_host": 2, "cpus_per_host": 0.5}, [2, 1]))
    assert [(h.stage, h.host, h.bundle) for h in hosts] == [(0, 0, 0), (0, 1, 1), (1, 0, 2)]
    h = hosts[0]
    assert h.bundle_resources == {"CPU": 0.5} and h.label_selector == {}
    assert h.actor == {"num_cpus": 0.5, "resources": {}}
    assert h.env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2" and h.env["JAX_PLATFORMS"] == "cpu"
    assert [h.jax_init for h in hosts] == [JaxInit("explicit", 2, 0), JaxInit("explicit", 2, 1), JaxInit()]
    assert JaxInit.from_env(h.env[ENV_KEY]) == h.jax_init


def test_gpu_placement():
    hosts = plan_hosts(checked({**GPU, "gpu": {"gpus_per_node": 8, "memory_fraction": 0.9,
                                               "accelerator_type": "H100"}}, [2]))
    for i, h in enumerate(hosts):
        assert h.bundle_resources == {"CPU": 4.0, "GPU": 8.0, "accelerator_type:H100": 0.001}
        assert h.actor == {"num_cpus": 4.0, "num_gpus": 8.0, "resources": {"accelerator_type:H100": 0.001}}
        assert h.env["JAX_PLATFORMS"] == "cuda" and h.env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.9"
        assert h.env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
        assert "CUDA_VISIBLE_DEVICES" not in h.env and "XLA_FLAGS" not in h.env   # Ray sets CUDA_VISIBLE_DEVICES
        assert h.jax_init == JaxInit("explicit", 2, i, tuple(range(8)))
    assert JaxInit("explicit", 2, 1, tuple(range(8))).kwargs("10.0.0.1:1234", 30) == {
        "coordinator_address": "10.0.0.1:1234", "coordinator_bind_address": "10.0.0.1:1234",
        "num_processes": 2, "process_id": 1, "local_device_ids": list(range(8)), "initialization_timeout": 30}


def test_tpu_whole_slice_placement():
    hosts = plan_hosts(checked(TPU, [4]))
    assert [h.label_selector for h in hosts] == [
        {"ray.io/tpu-slice-name": "<slice 0>", "ray.io/tpu-worker-id": str(w)} for w in range(4)]
    assert hosts[0].bundle_resources == {"CPU": 2.0, "TPU": 4.0, "TPU-v5litepod-16-head": 1.0}
    assert all(h.bundle_resources == {"CPU": 2.0, "TPU": 4.0} for h in hosts[1:])      # head only on worker 0
    assert all(h.actor == {"num_cpus": 2.0, "resources": {"TPU": 4.0}} for h in hosts)
    assert [h.jax_init for h in hosts] == [JaxInit("auto", 4, w) for w in range(4)]  # auto-detect the slice
    assert JaxInit("auto", 4, 2).kwargs(None, 30) == {"initialization_timeout": 30}
    for h in hosts:
        assert h.env["JAX_PLATFORMS"] == "tpu"
        assert not any(k.startswith(("MEGASCALE", "TPU_PROCESS", "TPU_CHIPS")) for k in h.env)


def test_tpu_one_host_stages_get_single_process_bounds():
    hosts = plan_hosts(checked(TPU, [1, 1, 1, 1]))
    for w, h in enumerate(hosts):
        assert h.label_selector["ray.io/tpu-worker-id"] == str(w) and h.jax_init == JaxInit()
        assert (h.env["TPU_PROCESS_BOUNDS"], h.env["TPU_CHIPS_PER_PROCESS_BOUNDS"]) == ("1,1,1", "2,2,1")
        assert h.env["TPU_PROCESS_ADDRESSES"] == "localhost:8471" and h.env["TPU_PROCESS_PORT"] == "8471"


def test_tpu_partial_hosts_split_vms():
    hosts = plan_hosts(checked({**TPU, "hosts": 8, "devices_per_host": 2}, [1] * 8, blocks=6))
    assert [h.label_selector["ray.io/tpu-worker-id"] for h in hosts] == ["0", "0", "1", "1", "2", "2", "3", "3"]
    assert ["TPU-v5litepod-16-head" in h.bundle_resources for h in hosts] == [True] + [False] * 7
    assert all(h.actor["resources"] == {"TPU": 2.0} for h in hosts)
    assert [h.env["TPU_PROCESS_PORT"] for h in hosts[:2]] == ["8471", "8472"]     # two processes per VM
    assert [h.env["TPU_MESH_CONTROLLER_PORT"] for h in hosts[:2]] == ["8476", "8477"]
    assert all(h.env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,2,1" for h in hosts)


def test_tpu_subslice_placement_uses_explicit_init_and_addresses():
    ck = checked(TPU, [2, 2])
    hosts = plan_hosts(ck, addresses={0: "10.0.0.0", 1: "10.0.0.1", 2: "10.0.0.2", 3: "10.0.0.3"})
    assert [h.jax_init for h in hosts] == [JaxInit("explicit", 2, 0), JaxInit("explicit", 2, 1)] * 2
    assert hosts[2].env["TPU_PROCESS_ADDRESSES"] == "10.0.0.2:8471,10.0.0.3:8471"
    assert hosts[3].env["TPU_WORKER_ID"] == "1" and hosts[3].env["TPU_PROCESS_BOUNDS"] == "2,1,1"


def test_tpu_stage_across_two_slices_sets_megascale():
    cl = {**TPU, "hosts": 4, "devices_per_host": 4, "tpu": {"type": "v4-16", "topology": "2x2x2", "slices": 2}}
    hosts = plan_hosts(checked(cl, [4]), addresses={0: "10.1.0.0", 1: "10.1.0.1", 2: "10.2.0.0", 3: "10.2.0.1"})
    assert [h.env["MEGASCALE_SLICE_ID"] for h in hosts] == ["0", "0", "1", "1"]
    assert {h.env["MEGASCALE_COORDINATOR_ADDRESS"] for h in hosts} == {"10.1.0.0"}
    assert {h.env["MEGASCALE_NUM_SLICES"] for h in hosts} == {"2"}
    assert [h.label_selector["ray.io/tpu-slice-name"] for h in hosts] == ["<slice 0>"] * 2 + ["<slice 1>"] * 2
    assert [h.jax_init.mode for h in hosts] == ["auto"] * 4


def test_single_vm_slice_needs_no_distributed_init():
    cl = {**TPU, "hosts": 1, "devices_per_host": 8, "tpu": {"type": "v6e-8", "topology": "2x4"}}
    (h,) = plan_hosts(checked(cl, [1]))
    assert h.jax_init == JaxInit() and h.bundle_resources["TPU"] == 8.0 and "TPU_PROCESS_BOUNDS" not in h.env


# ----------------------------------------------------------------------------- live cluster rules (fake nodes)

def test_tpu_binds_idle_intact_slices_first():
    b = get_backend(parse_cluster(TPU))
    nodes = tpu_nodes("tpu-a", busy=True) + tpu_nodes("tpu-b") + tpu_nodes("tpu-c", drop_worker=2)
    sites = b.sites(4, nodes)
    assert {s.slice_name for s in sites} == {"tpu-b"} and [s.worker for s in sites] == [0, 1, 2, 3]


@pytest.mark.parametrize("nodes,expect", [
    ([], ["cluster.tpu.type = 'v5litepod-16'", "no node with a TPU resource"]),
    (tpu_nodes(drop_worker=3), ["needs 1 intact v5litepod-16 slice(s)", "has 0", "incomplete: tpu-a (workers [0, 1, 2]"]),
    (tpu_nodes(pod="v6e-16"), ["has 0", "TPU pod types present: v6e-16"]),
    ([Node("n0", "10.0.0.9", {"TPU": 4.0}, {})], ["lack the ray.io/tpu-slice-name / ray.io/tpu-worker-id labels"]),
])
def test_tpu_live_errors(nodes, expect):
    with pytest.raises(PlacementError) as e:
        get_backend(parse_cluster(TPU)).check_live(4, nodes)
    for text in expect:
        assert text in str(e.value)


def test_gpu_live_error_names_key_value_rule():
    b = get_backend(parse_cluster({**GPU, "gpu": None}))
    b.check_live(2, [Node("a", "1", {"GPU": 8.0}), Node("b", "2", {"GPU": 8.0})])
    with pytest.raises(PlacementError, match=r"cluster.devices_per_host = 8: more GPUs per host than any live "
                                              r"node has \(GPUs per node: a: 4, b: 4\)"):
        b.check_live(2, [Node("a", "1", {"GPU": 4.0}), Node("b", "2", {"GPU": 4.0})])


# ----------------------------------------------------------------------------- jax init (worker side, no jax)

def test_jax_init_values_and_worker_checks(monkeypatch):
    with pytest.raises(ValueError, match="mode"):
        JaxInit("magic")
    with pytest.raises(ValueError, match="outside"):
        JaxInit("explicit", 2, 2)
    with pytest.raises(ValueError, match="coordinator"):
        JaxInit("explicit", 2, 0).kwargs(None, 10)
    monkeypatch.setenv(ENV_KEY, JaxInit().to_env())
    assert initialize(1, 0, None, 10) == JaxInit()           # mode none: jax.distributed untouched
    monkeypatch.setenv(ENV_KEY, JaxInit("explicit", 2, 1).to_env())
    with pytest.raises(RuntimeError, match="planned process 1 of 2, but this is host 0 of a 2-host stage"):
        initialize(2, 0, "127.0.0.1:1", 10, who="s0h0")


# ----------------------------------------------------------------------------- the driver never grabs devices

def test_planning_has_no_side_effects_on_the_caller():
    """check_job and make_plan import no jax up front, initialise no backend, and leave the
    caller's JAX_PLATFORMS and jax.config alone (a notebook keeps its accelerator)."""
    code = """
import os, sys, json
import orchestrator.core.backends, orchestrator.driver.placement, orchestrator.core.plan, orchestrator.core.config
before = "jax" in sys.modules
from orchestrator.core.config import check_job, load_cluster, load_job
from orchestrator.core.plan import make_plan
from orchestrator.core.hosts import describe
ck = check_job(load_job("examples/gpt.yaml", overrides=["pipeline.stages=[{layers: [0, 2], hosts: 2, mesh: {data: 2, model: 4}}, {layers: [2, 4], hosts: 2, mesh: {data: 2, model: 4}}]"]),
               load_cluster("cluster_configs/tpu-v5e-16.yaml"))
make_plan(ck); describe(ck)
import jax
from jax._src import xla_bridge
print(json.dumps([before, os.environ.get("JAX_PLATFORMS"), jax.config.jax_platforms, len(xla_bridge._backends)]))
"""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [False, None, None, 0]


def test_cli_keeps_the_driver_on_the_cpu():
    """The one place the driver's jax is put on the CPU: the CLI entry point."""
    code = """
import os, sys
from click.testing import CliRunner
from orchestrator.driver.cli import main
r = CliRunner().invoke(main, ["plan", "examples/gpt.yaml"])
print(r.exit_code, os.environ.get("JAX_PLATFORMS"))
"""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["0", "cpu"], r.stderr


# ----------------------------------------------------------------------------- the YAML files

def test_cluster_configs_load_and_plan():
    for path in sorted(CONFIGS.glob("*.yaml")):
        cl = load_cluster(path)
        assert cl.platform in platforms()
    gpu = load_cluster(CONFIGS / "gpu-2x8.yaml")
    assert (gpu.platform, gpu.hosts, gpu.devices_per_host, gpu.gpu.gpus_per_node) == ("gpu", 2, 8, 8)
    tpu = load_cluster(CONFIGS / "tpu-v5e-16.yaml")
    assert (tpu.platform, tpu.hosts, tpu.devices_per_host, tpu.tpu.type, tpu.tpu.topology) == (
        "tpu", 4, 4, "v5litepod-16", "4x4")


def _entrypoint_args(manifest: Path) -> list[str]:
    import shlex

    args = shlex.split(yaml.safe_load(manifest.read_text())["spec"]["entrypoint"])
    assert args[:4] == ["python", "-m", "orchestrator.driver.cli", "run"]
    return args[4:]


@pytest.mark.parametrize("manifest", ["gpu-2x8-rayjob.yaml", "tpu-v5e-16-rayjob.yaml"])
def test_rayjob_entrypoints_plan_cleanly(manifest):
    from click.testing import CliRunner

    from orchestrator.driver.cli import main

    r = CliRunner().invoke(main, ["plan", "--json", *_entrypoint_args(CONFIGS / "kuberay" / manifest)],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["stages"]


@pytest.mark.parametrize("name", ["gpu-2x8", "tpu-v5e-16"])
def test_ray_up_files_pass_rays_schema_and_match(name):
    from ray._private.accelerators.tpu import TPUAcceleratorManager
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load((CONFIGS / "ray-up" / f"{name}.yaml").read_text())
    validate_config(prepare_config(raw))      # what `ray up` checks before it talks to the cloud
    cl = load_cluster(CONFIGS / f"{name}.yaml")
    workers = [t for k, t in raw["available_node_types"].items() if k != raw["head_node_type"]]
    assert len(workers) == 1
    (w,) = workers
    if cl.platform == "gpu":
        assert w["resources"]["GPU"] == cl.gpu.gpus_per_node and w["min_workers"] * w["resources"]["GPU"] >= (
            cl.hosts * cl.devices_per_host)
    else:
        acc = w["node_config"]["acceleratorType"]
        assert TPUAcceleratorManager.is_valid_tpu_accelerator_type(acc) and acc == cl.tpu.type
        assert w["min_workers"] == cl.tpu.slices and w["resources"]["TPU"] == geometry(acc, cl.tpu.topology).chips_per_host
    assert "--dashboard-host=127.0.0.1" in " ".join(raw["head_start_ray_commands"])


@pytest.mark.ray_260
@pytest.mark.parametrize("name", ["gpu-2x8", "tpu-v5e-16"])
def test_kuberay_manifests_match_cluster_configs(name):
    cl = load_cluster(CONFIGS / f"{name}.yaml")
    rc = yaml.safe_load((CONFIGS / "kuberay" / f"{name}-raycluster.yaml").read_text())
    job = yaml.safe_load((CONFIGS / "kuberay" / f"{name}-rayjob.yaml").read_text())
    assert (rc["apiVersion"], rc["kind"], job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayCluster", "ray.io/v1", "RayJob")
    assert job["spec"]["rayClusterSpec"] == rc["spec"]           # the job's cluster is the RayCluster's
    import ray

    assert rc["spec"]["rayVersion"] == ray.__version__
    (group,) = rc["spec"]["workerGroupSpecs"]
    (container,) = group["template"]["spec"]["containers"]
    limits = container["resources"]["limits"]
    assert ray.__version__ in container["image"]
    if cl.platform == "gpu":
        assert int(limits["nvidia.com/gpu"]) == cl.gpu.gpus_per_node
        assert group["replicas"] * int(limits["nvidia.com/gpu"]) >= cl.hosts * cl.devices_per_host
    else:
        g = geometry(cl.tpu.type, cl.tpu.topology)
        sel = group["template"]["spec"]["nodeSelector"]
        assert sel["cloud.google.com/gke-tpu-topology"] == cl.tpu.topology
        assert sel["cloud.google.com/gke-tpu-accelerator"] == {"v5litepod": "tpu-v5-lite-podslice",
                                                               "v6e": "tpu-v6e-slice"}[g.version]
        assert (group["numOfHosts"], int(limits["google.com/tpu"]), group["replicas"]) == (
            g.hosts, g.chips_per_host, cl.tpu.slices)
