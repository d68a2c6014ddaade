"""benchmarks/gpu_transfer_check.py runs where there is no Ray, and every part works on CPU.

The script is prepared for a GPU session; here it runs with a `ray` package on the path that
refuses to import (so a stray `import ray` in the script or anything it imports fails the
part that made it), on small tensors (`--smoke`). What must hold on CPU: every copy path
moves the bytes (finite rates), the socket transport between two processes delivers equal
values over shared memory and over TCP, one jax.distributed world moves an array from one
process's device to the other's with equal values, and the stage program compiles for a
2 × 8 mesh (16 simulated CPU devices standing in for the mocked GPU topology).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(tmp_path, parts: str, timeout: float) -> dict:
    stub = tmp_path / "no_ray" / "ray"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('the GPU check must not import ray')\n")
    out = tmp_path / "check.json"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(tmp_path / "no_ray")}
    run = subprocess.run([sys.executable, "benchmarks/gpu_transfer_check.py", "--smoke", "--reps", "1",
                          "--timeout-s", "400", "--budget-s", "1200", "--parts", parts, "--out", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    got = json.loads(out.read_text())
    assert got["ray_imported"] is False and got["smoke"] is True and got["sizes_mib"] == [1, 2]
    assert got["versions"]["jax"]
    return got["parts"]


def test_copies_and_the_socket_transport_between_two_processes(tmp_path):
    parts = _run(tmp_path, "copies,socket", 900)
    copies = parts["copies"]
    assert "error" not in copies, copies
    assert copies["device"]["backend"] == "cpu"
    for mib in ("1", "2"):
        r = copies["sizes"][mib]
        assert r["bytes"] == int(mib) * 2**20
        for path in ("d2h_meshpipe", "d2h_copy_to_host_async", "h2d_meshpipe", "h2d_replicated_per_device",
                     "h2d_once_then_broadcast"):
            assert r[path]["gb_per_s"] > 0, (mib, path, r[path])
        assert r["d2h_copy_to_host_async"]["issue_median_s"] >= 0
        assert ("d2h_pinned" in r) == copies["pinned_host"]
    sender, receiver = parts["socket"]["ranks"]
    for variant, kind in (("shared_memory", "shm"), ("tcp", "stream")):
        s, r = sender["variants"][variant], receiver["variants"][variant]
        assert "error" not in s and "error" not in r, (s, r)
        assert all(r[mib]["values_equal"] for mib in ("1", "2"))
        assert s["sends"][kind] >= 2 * 2          # two sizes, warm-up + one timed rep each
        assert all(s[mib]["median_s"] >= s[mib]["send_blocked_median_s"] > 0 for mib in ("1", "2"))


@pytest.mark.slow
def test_one_world_device_put_and_the_mock_topology_stage(tmp_path):
    parts = _run(tmp_path, "world,mock", 1200)
    for variant in ("default", "force_dcn"):      # on CPU both are XLA's socket transfer library
        r0, r1 = parts["world"][variant]["ranks"]
        assert "error" not in r0 and "error" not in r1, (variant, r0, r1)
        assert r1["force_dcn"] is (variant == "force_dcn")
        for mib in ("1", "2"):
            assert r1["sizes"][mib]["values_equal"] is True and r1["sizes"][mib]["gb_per_s"] > 0
    mock = parts["mock"]
    assert mock["flag_exists"] is True and mock["mode"].startswith("cpu stand-in")
    assert "error" not in mock, mock
    assert mock["devices"] == 16 and mock["mesh"] == {"data": 2, "model": 8}
    assert mock["memory_per_device"]["F"]["output"] > 0 and mock["memory_per_device"]["B"]["argument"] > 0
