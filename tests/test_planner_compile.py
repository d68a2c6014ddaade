"""The auto-planner against real compiled programs: the profiling subprocess, its cache, `plan --auto`.

Compiles layer programs ahead of time on simulated CPU devices (a few seconds each
on this machine), so the module is marked `slow` (still part of CI).
"""
from __future__ import annotations

import json
import os

import pytest
import yaml

from orchestrator.core.config import check_job, load_cluster, load_job
from orchestrator.core.model.registry import build_spec
from orchestrator.core.plan import make_plan
from orchestrator.core.planner.adapter import from_spec
from orchestrator.core.planner.profile import Profiler, ProfileRequest, linear
from tests import records
from tests.conftest import ROOT
from tests.test_cli import meshpipe

pytestmark = pytest.mark.slow

MEGATRON = (("heads", "model"), ("mlp", "model"), ("vocab", "model"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("planner-cache")


def test_profiles_come_from_compiled_programs_and_are_cached(cache):
    spec = build_spec("gpt", {"blocks": 2}, seq_len=32)
    model = from_spec(spec, "gpt", {"blocks": 2}, 32)
    block = model.layers[1]
    assert block.signature == model.layers[2].signature != model.layers[0].signature
    reqs = [ProfileRequest(block.signature, 1, 2, MEGATRON, b) for b in (1, 2, 4)]
    before = os.environ.get("XLA_FLAGS")
    prof = Profiler("stages.aot_profile", cache)
    twin = ProfileRequest(block.signature, 2, 2, MEGATRON, 1)          # block 2: the same program as block 1
    assert twin == reqs[0]
    got = prof.profile(model.source, reqs + [twin])
    assert os.environ.get("XLA_FLAGS") == before                    # the caller's process is untouched
    assert prof.stats.compiled == 3 and got[twin] is got[reqs[0]]
    p1, p2, p4 = (got[r] for r in reqs)
    # a GPT block's forward: 2·b·s·(4·d² + 2·d·h)/M matmul flops at least, per device (M = 2)
    d, h, s = 64, 256, 32
    assert p1.flops["fwd"] >= 2 * s * (4 * d * d + 2 * d * h) / 2
    assert p1.flops["bwd"] > 1.5 * p1.flops["fwd"]
    kinds = {(ph, k) for ph, k, _, _ in p1.collectives}
    assert ("fwd", "all-reduce") in kinds and ("bwd", "all-reduce") in kinds   # Megatron: one per row-parallel matmul
    assert all(g == ((0, 1),) for _, _, _, g in p1.collectives)
    # each phase's compiled kernels (the per-kernel term): a block has tens; batches 2 and 4 the same
    assert all(p2.kernels[ph] >= 10 and p2.kernels[ph] == p4.kernels[ph] for ph in ("fwd", "bwd", "i", "w"))
    est = linear(p1, p2, 4)
    assert est.kernels == p4.kernels
    for ph in ("fwd", "bwd"):
        assert est.flops[ph] == pytest.approx(p4.flops[ph], rel=0.02)
    assert est.residual_bytes == pytest.approx(p4.residual_bytes, rel=0.02)
    assert sum(c[2] for c in est.collectives) == pytest.approx(sum(c[2] for c in p4.collectives), rel=0.02)
    again = Profiler("stages.aot_profile", cache)
    hit = again.profile(model.source, reqs)
    assert again.stats.compiled == 0 and again.stats.cache_hits == 3
    assert hit[reqs[0]].flops == p1.flops and hit[reqs[0]].cached
    for f in cache.iterdir():                                         # JSON on disk, nothing else
        json.loads(f.read_text())


def test_plan_auto_writes_a_job_that_loads_checks_and_plans(cache, tmp_path):
    out = tmp_path / "mlp.auto.yaml"
    r = meshpipe("plan", "examples/mlp.yaml", "--auto", "--explain", "--max-model", "2", "--microbatches", "2,4",
                 "--out", str(out), "--cache-dir", str(cache), "--no-calibrate", timeout=900)
    assert r.returncode == 0, r.stderr
    assert "RAY_IMPORTED=False" in r.stderr
    assert "step ms" in r.stdout and "winner:" in r.stdout and "loses by" in r.stdout
    job = load_job(out)
    checked = check_job(job, load_cluster(ROOT / "cluster_configs" / "local.yaml"))
    make_plan(checked)
    raw = yaml.safe_load(out.read_text())
    assert raw["model"] == yaml.safe_load((ROOT / "examples" / "mlp.yaml").read_text())["model"]
    assert raw["pipeline"]["microbatches"] in (2, 4)
    r2 = meshpipe("plan", str(out))
    assert r2.returncode == 0, r2.stderr
    # warm cache: the same search compiles nothing
    r3 = meshpipe("plan", "examples/mlp.yaml", "--auto", "--json", "--max-model", "2", "--microbatches", "2,4",
                  "--out", str(tmp_path / "again.yaml"), "--cache-dir", str(cache), "--no-calibrate", timeout=300)
    assert r3.returncode == 0, r3.stderr
    rep = json.loads(r3.stdout)
    assert rep["profiles"]["compiled"] == 0 and rep["profiles"]["cache_hits"] > 0
    assert rep["candidates"][0]["step_s"] > 0


def test_plan_auto_model_that_cannot_fit_exits_2_naming_the_memory(cache, tmp_path):
    cluster = tmp_path / "tiny.yaml"
    cluster.write_text("hosts: 1\ndevices_per_host: 1\ncpus_per_host: 0.5\ndevice: {memory_gb: 0.000001}\n")
    r = meshpipe("plan", "examples/mlp.yaml", "--auto", "--cluster", str(cluster), "--microbatches", "2",
                 "--out", str(tmp_path / "x.yaml"), "--cache-dir", str(cache), "--no-calibrate", timeout=600)
    assert r.returncode == 2
    assert "does not fit" in r.stderr and "the smallest needs" in r.stderr and "GB per device" in r.stderr
    assert not (tmp_path / "x.yaml").exists()


@pytest.mark.ray
def test_plan_auto_measure_runs_the_top_candidate_on_ray(cache, tmp_path):
    r = meshpipe("plan", "examples/mlp.yaml", "--auto", "--json", "--measure", "1", "--max-model", "2",
                 "--microbatches", "2,4", "--out", str(tmp_path / "m.yaml"), "--cache-dir", str(cache),
                 "--set", f"run.output_dir={tmp_path / 'runs'}", "--no-calibrate", timeout=900)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    (row,) = rep["measured"]
    assert row["predicted_s"] == rep["candidates"][0]["step_s"] and row["measured_s"] > 0
    assert row["steps_timed"] == 4
    summary = records.summary(tmp_path / "runs", "mlp-tiny-auto-measure0")
    assert len(summary["step_times_s"]) == 8


def test_loss_layer_profile_has_its_fused_program_temp(tmp_path):
    # pipeline.fuse_loss_chunk runs the loss layer's F and B as one program: the worker compiles it
    # too; on XLA:CPU (measured, gpt blocks=2, seq 32) its temp was within 0.4 % of residuals + temp
    spec = build_spec("gpt", {"blocks": 2}, seq_len=32)
    model = from_spec(spec, "gpt", {"blocks": 2}, 32)
    head, block = model.layers[-1], model.layers[1]
    reqs = [ProfileRequest(head.signature, head.index, 1, (), 2), ProfileRequest(block.signature, 1, 1, (), 2)]
    got = Profiler("stages.aot_profile", tmp_path).profile(model.source, reqs)
    fused = got[reqs[0]].fused_temp_bytes
    assert fused is not None and fused > 0 and got[reqs[1]].fused_temp_bytes is None
    hit = Profiler("stages.aot_profile", tmp_path).profile(model.source, reqs)
    assert hit[reqs[0]].cached and hit[reqs[0]].fused_temp_bytes == fused


def test_worker_shortcuts_leave_profiles_unchanged(monkeypatch):
    # the worker builds the model once per run, shares a layer's program between batch sizes and
    # compiles with ANALYSIS_ONLY (LLVM -O0): every figure must equal a fresh build compiled by default
    from stages import aot_profile

    spec = build_spec("gpt", {"blocks": 2}, seq_len=32)
    model = from_spec(spec, "gpt", {"blocks": 2}, 32)
    reqs = [{"key": str(i), "layer": layer, "model_size": 1, "rules": [], "batch": b}
            for i, (layer, b) in enumerate([(3, 1), (3, 2), (1, 1), (1, 2)])]
    memo: dict = {}
    quick = [aot_profile.profile_one(model.source, r, memo) for r in reqs]
    monkeypatch.setattr(aot_profile, "ANALYSIS_ONLY", None)
    slow = [aot_profile.profile_one(model.source, r) for r in reqs]
    for a, b in zip(quick, slow):
        a.pop("compile_s"), b.pop("compile_s")
        assert a == b
    assert "fused_temp_bytes" in quick[0] and quick[1]["flops"]["fwd"] > quick[0]["flops"]["fwd"]


def test_profiled_i_plus_w_is_within_1_2x_of_b_and_held_matches_the_stage_program(tmp_path):
    # the zero-bubble I and W the worker compiles are the stage program's cut of its backward:
    # per layer of the GPT (embedding, block, head; one device and Megatron on two) I + W costs
    # within 1.2x of B through the cost model, and what I keeps for W equals what
    # benchmarks/stage_bytes.py counts from the stage program's shapes (one device)
    from benchmarks.stage_bytes import kept_bytes, stage_operands
    from orchestrator.core.model.registry import build_model
    from orchestrator.core.planner.cost import MeshChoice, layer_cost, layer_request
    from orchestrator.core.planner.topology import from_cluster
    from stages.program import StageProgram, make_optimizer

    spec = build_spec("gpt", {"blocks": 2}, seq_len=32)
    model = from_spec(spec, "gpt", {"blocks": 2}, 32)
    topo = from_cluster(load_cluster(ROOT / "cluster_configs" / "local.yaml"))
    layers = [model.layers[0], model.layers[1], model.layers[-1]]
    choices = [MeshChoice(1, 1, ("data", "model"), (), "dp"), MeshChoice(1, 2, ("data", "model"), MEGATRON, "megatron")]
    reqs = [layer_request(layer, c, b) for layer in layers for c in choices for b in (1, 2)]
    got = Profiler("stages.aot_profile", tmp_path).profile(model.source, reqs)
    for layer in layers:
        for c in choices:
            cost = layer_cost(layer, c, 2, topo, 0, got)
            assert got[layer_request(layer, c, 2)].split
            assert cost.bwd_s / 1.2 <= cost.i_s + cost.w_s <= 1.2 * cost.bwd_s, (layer.name, c.label(), cost)
    built = build_model(spec.factory, spec.args)
    for layer in layers:
        prog = StageProgram(spec, built, layer.index, layer.index + 1, microbatches=1,
                            optimizer=make_optimizer("sgd", {"learning_rate": 0.1}))
        want = kept_bytes(prog, *stage_operands(prog, 2, 32, model.layers[0].out_shape[-1]))
        prof = got[layer_request(layer, choices[0], 2)]
        assert prof.held_bytes == want["I"], layer.name
        assert prof.held_bytes <= prof.residual_bytes or layer.index == 0
