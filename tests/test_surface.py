"""What a user sees (issue #23): the plan of interleaved schedules, stage errors with their
cause, the progress bar's width, stopping with Ctrl-C/SIGTERM, runs never overwritten
silently, a model factory beside the job file, and the everyday commands."""
from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from orchestrator.core.config import check_job, load_cluster, load_job, parse_cluster, parse_job
from orchestrator.core.plan import make_plan, plan_json, plan_text
from tests.conftest import ROOT

GPT, LOCAL = str(ROOT / "examples/gpt.yaml"), str(ROOT / "cluster_configs/local.yaml")
INTERLEAVED = ["pipeline.schedule=interleaved-1f1b", "pipeline.virtual_stages=2",
               "pipeline.stages.0.layers=[[0, 1], [2, 3]]", "pipeline.stages.1.layers=[[1, 2], [3, 4]]"]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}


def cli(*args, cwd=ROOT, timeout=180, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.driver.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=env or ENV)


# -- plan: interleaved ------------------------------------------------------------------------
def test_plan_of_an_interleaved_schedule_lists_every_chunk_and_every_edge():
    checked = check_job(load_job(GPT, INTERLEAVED), load_cluster(LOCAL))
    plan = make_plan(checked)
    js = plan_json(plan)
    m = checked.model
    s0, s1 = js["stages"]
    assert [c["layers"] for c in s0["chunks"]] == [[0, 1], [2, 3]]
    assert [c["layers"] for c in s1["chunks"]] == [[1, 2], [3, 4]]
    assert [c["virtual_stage"] for c in s0["chunks"] + s1["chunks"]] == [0, 2, 1, 3]
    assert s0["params"] == m.param_count(0, 1) + m.param_count(2, 3)       # every chunk counted
    assert s1["chunks"][1]["layer_names"] == [m.layers[3].name]
    # virtual stages 0→1→2→3: edges 0→1, 1→0 (last stage back to the first: chunk boundary), 0→1
    edges = js["edges"]
    assert [(e["edge"], e["virtual"], e["boundary"], e["wraps"]) for e in edges] == [
        ([0, 1], [0, 1], 1, False), ([1, 0], [1, 2], 2, True), ([0, 1], [2, 3], 3, False)]
    assert all(e["dtype"] == "float32" for e in edges)
    assert all(e["forward"]["cross_host_bytes"] == e["forward"]["lower_bound_bytes"] > 0 for e in edges)
    # costs ∝ the mean chunk of each stage, so stage 1's small head chunk lowers its cost
    per_stage = [(m.param_count(0, 1) + m.param_count(2, 3)) / 2, (m.param_count(1, 2) + m.param_count(3, 4)) / 2]
    assert [c["F"] for c in js["simulated"]["costs"]] == pytest.approx([x / max(per_stage) for x in per_stage])
    text = plan_text(plan)
    assert "chunk 1 (virtual stage 3) layers [3, 4)" in text
    assert "1→0 (virtual 1→2, layer 2, chunk boundary: last stage back to the first) float32" in text
    assert text.count("float32 (") == 3


def test_plan_of_a_plain_schedule_is_unchanged_in_shape():
    js = plan_json(make_plan(check_job(load_job(GPT), load_cluster(LOCAL))))
    assert [e["edge"] for e in js["edges"]] == [[0, 1]] and not js["edges"][0]["wraps"]
    assert [len(s["chunks"]) for s in js["stages"]] == [1, 1]


def test_plan_png_prints_the_path_it_wrote(tmp_path):
    out = cli("plan", "examples/mlp.yaml", "--png", str(tmp_path / "t.png"), "--json")
    assert out.returncode == 0, out.stderr
    assert f"wrote {tmp_path / 't.png'}" in out.stderr and (tmp_path / "t.png").stat().st_size > 0
    json.loads(out.stdout)           # stdout stays JSON


# -- everyday commands (no Ray) ---------------------------------------------------------------
def test_version():
    out = cli("--version")
    assert out.returncode == 0 and re.fullmatch(r"meshpipe \S+\n", out.stdout), out.stdout + out.stderr


def test_cluster_keys_are_overridable_with_set():
    out = cli("plan", "examples/mlp.yaml", "--json", "--set", "cluster.hosts=3", "--set", "run.steps=2")
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["placement"]) == 3
    bad = cli("plan", "examples/mlp.yaml", "--set", "cluster.hosts=2")   # 3 stages need 3 hosts
    assert bad.returncode == 2 and "hosts" in bad.stderr


# -- bring your own model --------------------------------------------------------------------
FACTORY = '''
from orchestrator.core.model import mlp
from orchestrator.core.model.spec import LayerSpec, ModelSpec
import dataclasses


def spec(args, seq_len=None):
    """The built-in MLP, but its jax side comes from this module (the actors must import it)."""
    return dataclasses.replace(mlp.spec(args, seq_len=seq_len), name="mine", impl="mymodel:impl")


def impl(s):
    from stages.models.mlp_impl import impl as builtin
    return builtin(s)


def empty(args, seq_len=None):
    layers = tuple(LayerSpec(f"id{i}", "identity", {}, ("batch", "embed"), (8,)) for i in range(2))
    return ModelSpec("empty", layers, "mymodel:impl", (8,), "float32", ("batch", "embed"), (8,), "float32")
'''


def _own_model_job(tmp_path, factory="mymodel:spec", steps=1, name="mine") -> Path:
    d = tmp_path / "job"
    d.mkdir(exist_ok=True)
    (d / "mymodel.py").write_text(FACTORY)
    job = yaml.safe_load((ROOT / "examples/mlp.yaml").read_text())
    job["model"]["name"] = factory
    job["run"].update(steps=steps, name=name, output_dir=str(tmp_path / "runs"))
    (d / "job.yaml").write_text(yaml.safe_dump(job))
    return d / "job.yaml"


def test_a_model_with_no_parameters_is_refused_at_plan_time(tmp_path):
    job = _own_model_job(tmp_path, "mymodel:empty")
    out = cli("plan", str(job))                     # also: mymodel imports without PYTHONPATH
    assert out.returncode == 2, out.stdout + out.stderr
    assert "model.name = 'mymodel:empty'" in out.stderr and "no parameters" in out.stderr


def test_a_factory_beside_the_job_file_plans_without_pythonpath(tmp_path):
    out = cli("plan", str(_own_model_job(tmp_path)), "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["model"] == "mine"


# -- progress bar in a terminal of 80 columns --------------------------------------------------
def _in_pty(args: list[str], columns: int, timeout: float, env: dict | None = None) -> tuple[int, str]:
    """Run the CLI on a pseudo-terminal `columns` wide; (exit code, everything it printed)."""
    import fcntl
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.driver.cli", *args], cwd=ROOT,
                            stdin=slave, stdout=slave, stderr=slave, env=env or ENV, close_fds=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        r, _, _ = select.select([master], [], [], 0.5)
        if r:
            try:
                data = os.read(master, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    if proc.poll() is None:
        proc.kill()
    rc = proc.wait(timeout=30)
    os.close(master)
    return rc, b"".join(chunks).decode("utf-8", "replace")


def _screen_lines(text: str) -> list[str]:
    """What the terminal shows per redraw: split on newlines and carriage returns."""
    return [seg for line in text.split("\n") for seg in line.split("\r")]


@pytest.mark.ray
def test_progress_bar_fits_an_80_column_terminal(tmp_path):
    rc, text = _in_pty(["run", "examples/mlp.yaml", "--set", "run.steps=3", "--set",
                        f"run.output_dir={tmp_path}"], 80, 300)
    assert rc == 0, text[-3000:]
    bars = [ln for ln in _screen_lines(text) if "3/3" in ln or "1/3" in ln]
    assert bars, text[-3000:]
    assert all(len(ln) <= 79 for ln in bars), [len(ln) for ln in bars]
    assert "loss" in bars[-1]
