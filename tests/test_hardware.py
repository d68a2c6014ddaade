"""The GPT example on real accelerators (markers `gpu` / `tpu`); skipped cleanly when absent.

Detection never opens a device from the test process: GPUs are counted with
`nvidia-smi -L`, TPU chips by their device files (/dev/accel*, /dev/vfio/<n>)
and the slice type from the TPU VM's metadata through Ray's TPU helpers (HTTP
only, no libtpu). The test process keeps jax on the CPU (conftest sets
JAX_PLATFORMS=cpu) for the single-process reference; only the stage actors,
with the backend's environment, touch the accelerators.

Single machine (the default): an embedded Ray on this GPU box / TPU VM.
  GPU: n GPUs → 2 stages × 1 host × (2 GPUs if n >= 4 else 1) — the example's
       meshes; 1 GPU → 1 stage.
  TPU: one VM's chips split into 2 hosts (partial hosts: TPU_VISIBLE_CHIPS,
       TPU_CHIPS_PER_PROCESS_BOUNDS) → 2 stages.
A multi-host TPU slice (run from its head, in a pytest process of its own):
  MESHPIPE_TPU_CLUSTER=cluster_configs/tpu-v5e-16.yaml pytest -m tpu tests/test_hardware.py
  (connects to the running Ray cluster, address: auto; 4 stages, one per VM).

Numerics: stage actors run with JAX_DEFAULT_MATMUL_PRECISION=highest (no TF32 on
GPU, no bf16 passes on TPU), so losses match the CPU reference to rtol 1e-4,
atol 1e-5 — looser than the CPU-only suites' 1e-5/1e-6 because the accelerator's
reductions sum in a different order.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from orchestrator.core.config import check_job, load_job, load_raw, parse_cluster
from orchestrator.driver.runner import run_job

ROOT = Path(__file__).resolve().parent.parent
RTOL, ATOL = 1e-4, 1e-5
PRECISE = {"JAX_DEFAULT_MATMUL_PRECISION": "highest"}


def gpu_count() -> int:
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def tpu_chips() -> int:
    accel = [p for p in glob.glob("/dev/accel*") if not os.path.isdir(p)]
    vfio = [p for p in glob.glob("/dev/vfio/*") if os.path.basename(p).isdigit()]
    return len(accel) or len(vfio)


def _job(tmp_path, stages, steps=3, **overrides):
    sets = [f"run.steps={steps}", f"run.output_dir={tmp_path}", "pipeline.microbatches=4",
            f"pipeline.stages={stages}", *[f"{k}={v}" for k, v in overrides.items()]]
    return load_job(ROOT / "examples" / "gpt.yaml", overrides=sets)


def _train_and_compare(checked):
    pipe = run_job(checked, echo=lambda s: None)
    ref = run_job(checked, reference=True, echo=lambda s: None)
    np.testing.assert_allclose(pipe["losses"], ref["losses"], rtol=RTOL, atol=ATOL)
    names = sorted(ref["param_norms"])
    np.testing.assert_allclose([pipe["param_norms"][n] for n in names], [ref["param_norms"][n] for n in names],
                               rtol=RTOL, atol=ATOL)
    assert pipe["losses"][-1] < pipe["losses"][0]
    return pipe


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() == 0, reason="no NVIDIA GPU here (nvidia-smi absent or lists none)")
def test_gpt_on_gpus(request, tmp_path):
    request.getfixturevalue("ray_local")          # after the skip: the embedded Ray sees the GPUs
    n = gpu_count()
    dph = 2 if n >= 4 else 1
    hosts = min(n // dph, 2)
    cluster = parse_cluster({"address": None, "platform": "gpu", "hosts": hosts, "devices_per_host": dph,
                             "cpus_per_host": 0.5, "env_vars": PRECISE,
                             "gpu": {"gpus_per_node": n, "memory_fraction": 0.3}})
    if hosts == 2:
        meshes = ("{data: 2}", "{model: 2}") if dph == 2 else ("{data: 1}", "{model: 1}")
        stages = (f"[{{layers: [0, 2], mesh: {meshes[0]}}}, {{layers: [2, 4], mesh: {meshes[1]}}}]")
    else:
        stages = "[{layers: [0, 4], mesh: {data: 1, model: 1}}]"
    pipe = _train_and_compare(check_job(_job(tmp_path, stages), cluster))
    assert all(w["local_devices"] == dph for w in pipe["workers"])


def _tpu_cluster_from_env():
    path = os.environ.get("MESHPIPE_TPU_CLUSTER")
    return parse_cluster({**load_raw(ROOT / path), "address": "auto"}) if path else None


@pytest.mark.tpu
@pytest.mark.skipif(tpu_chips() == 0 and not os.environ.get("MESHPIPE_TPU_CLUSTER"),
                    reason="no TPU chips here (/dev/accel*, /dev/vfio) and no MESHPIPE_TPU_CLUSTER")
def test_gpt_on_tpu(request, tmp_path):
    cluster = _tpu_cluster_from_env()
    if cluster is None:                        # this TPU VM alone: split its chips into 2 hosts
        from ray._private.accelerators.tpu import TPUAcceleratorManager as M

        pod, topo = M.get_current_node_tpu_pod_type(), M.get_current_node_tpu_topology()
        if not pod or not topo:
            pytest.skip("TPU chips present but the TPU type/topology is unknown (no metadata, no TPU_ACCELERATOR_TYPE)")
        from orchestrator.core.backends.tpu_topology import geometry

        g = geometry(pod, topo)
        if g.hosts > 1:
            pytest.skip(f"{pod} is a multi-host slice: run from its head with MESHPIPE_TPU_CLUSTER=<cluster yaml>")
        request.getfixturevalue("ray_local")
        half = max(1, g.chips_per_host // 2)
        hosts = g.chips_per_host // half
        cluster = parse_cluster({"address": None, "platform": "tpu", "hosts": hosts,
                                 "devices_per_host": half * g.devices_per_chip, "cpus_per_host": 0.5,
                                 "env_vars": PRECISE, "tpu": {"type": pod, "topology": topo}})
    else:
        cluster = parse_cluster({**cluster.model_dump(mode="json"), "env_vars": PRECISE})
    d = cluster.devices_per_host
    n_stages = min(cluster.hosts, 4)
    cuts = [round(i * 4 / n_stages) for i in range(n_stages + 1)]
    stages = "[" + ", ".join(f"{{layers: [{cuts[i]}, {cuts[i + 1]}], mesh: {{data: 1, model: {d}}}}}"
                             for i in range(n_stages)) + "]"
    pipe = _train_and_compare(check_job(_job(tmp_path, stages), cluster))
    assert all(w["local_devices"] == d for w in pipe["workers"])
