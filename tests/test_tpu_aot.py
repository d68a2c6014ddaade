"""benchmarks/tpu_aot.py: stage programs compiled for a TPU v5e-16 slice with the libtpu wheel, no TPU.

With libtpu installed (`pip install "libtpu==0.0.42.*"`, jax 0.10.2's `jax[tpu]` pin; it loads on
x86-64 Linux without a TPU) the `libtpu` tests compile the README GPT's two stages as submeshes
of one 16-chip world and check XLA's per-chip figures and the sub-slice arithmetic against
libtpu's own chip coordinates and Ray's helpers. Without libtpu they skip, and the script's
record of why (what failed, what it would take) is checked instead.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(not HAVE_LIBTPU, reason="the libtpu wheel is not installed "
                                                          "(pip install 'libtpu==0.0.42.*')")


def _run(tmp_path, *extra_path: Path, timeout: float = 300) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "tpu_aot.json"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(str(p) for p in extra_path)}
    run = subprocess.run([sys.executable, "benchmarks/tpu_aot.py", "--configs", "readme", "--out", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return run, json.loads(out.read_text())


@pytest.mark.libtpu
@needs_libtpu
def test_readme_gpt_stages_compile_for_a_v5e_16_and_fit(tmp_path):
    run, got = _run(tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert got["libtpu"]["loaded"] and got["libtpu"]["devices"] == 16 and got["libtpu"]["processes"] == 4
    assert got["versions"]["libtpu"] and got["versions"]["jax"]
    for s in got["subslices"]:          # libtpu's chips of hosts 2s, 2s+1: one 4x2 block, what meshpipe names
        assert s["contiguous_block"] and sorted(s["block_shape"]) == [2, 4]
        assert s["meshpipe_aligned_block"] == ["2x4", [1, 2]]
        assert s["ray_physical_worker_ids"] == s["hosts"]
    stages = got["configs"]["readme"]["stages"]
    assert [st["layers"] for st in stages] == [[0, 2], [2, 4]]
    for st in stages:
        assert "errors" not in st, st
        assert st["chips"] == 8 and st["device_kind"].startswith("TPU v5")
        pc = st["per_chip"]
        assert pc["fits"] and pc["peak"] == pc["params_opt_grads"] + pc["stash"] + pc["temp"] + pc["code"]
        assert pc["params_opt_grads"] > 0 and pc["stash"] > 0
        assert st["inflight"] == 2 - st["stage"]          # 1F1B on 2 stages
        opt = st["optimizer_state_at_init"]             # adam: two parameter-shaped slots, sharded as they are
        assert 0 < opt["steady_bytes_per_chip"] < pc["params_opt_grads"]


def test_without_libtpu_the_failure_is_recorded(tmp_path):
    stub = tmp_path / "no_libtpu" / "libtpu"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('no libtpu here')\n")
    run, got = _run(tmp_path, tmp_path / "no_libtpu", timeout=120)
    assert run.returncode == 1 and "libtpu did not load" in run.stdout
    assert got["libtpu"]["loaded"] is False
    assert got["libtpu"]["error"] and "libtpu" in got["libtpu"]["what_it_would_take"]
    assert got["configs"] == {}
