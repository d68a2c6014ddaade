"""Training on real token data through the pipeline on a local Ray, against the single-process
reference (same parameters, same batches): float32, rtol 1e-5 / atol 1e-6 on every loss.

The corpus is the licence texts Debian installs (or the stdlib's `email` sources), prepared
by `meshpipe prepare` with a locally trained byte-level BPE. Per-host reads are instrumented
(the worker's `data_bytes_read`): a host of a stage whose batch is split across two hosts
reads exactly half of every step's windows.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from orchestrator.core.config import check_job, parse_cluster, parse_job
from orchestrator.driver.runner import run_job
from tests.data_helpers import gpt_job, prepared

pytestmark = pytest.mark.ray

RTOL, ATOL = 1e-5, 1e-6
CLUSTER = {"address": None, "platform": "cpu", "hosts": 4, "devices_per_host": 2, "cpus_per_host": 0.5}
WINDOW_BYTES = 17 * 2          # (seq_len + 1) uint16 tokens


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return prepared(tmp_path_factory.mktemp("corpus"))


def run_both(job: dict):
    checked = check_job(parse_job(job), parse_cluster(CLUSTER))
    return run_job(checked, echo=lambda s: None), run_job(checked, reference=True, echo=lambda s: None)



def test_tokens_pipeline_matches_reference_learns_and_evaluates(ray_local, tmp_path, shards, no_leaks):
    steps = 8
    lines = []
    job = gpt_job(tmp_path, {"source": "tokens", "path": str(shards), "eval": {"holdout": 0.1, "batches": 2}},
                  steps=steps, eval_every=4)
    checked = check_job(parse_job(job), parse_cluster(CLUSTER))
    pipe = run_job(checked, echo=lines.append)
    ref = run_job(checked, reference=True, echo=lambda s: None)
    np.testing.assert_allclose(pipe["losses"], ref["losses"], rtol=RTOL, atol=ATOL)
    # forward-only eval on the pipeline == the whole model's plain forward on the same params/batches
    assert [s for s, _ in pipe["eval_losses"]] == [s for s, _ in ref["eval_losses"]] == [3, 7]
    np.testing.assert_allclose([v for _, v in pipe["eval_losses"]], [v for _, v in ref["eval_losses"]],
                               rtol=RTOL, atol=ATOL)
    assert pipe["eval_losses"][1][1] < pipe["eval_losses"][0][1]        # held-out loss falls too
    assert sum("eval loss" in line for line in lines) == 2
    recs = [json.loads(line) for line in (Path(pipe["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [[r["step"], r["eval_loss"]] for r in recs if r["eval_loss"] is not None] == pipe["eval_losses"]
    assert np.mean(pipe["losses"][-2:]) < pipe["losses"][0] - 0.3          # it learns the corpus
    hosts = pipe["telemetry"]["hosts_last"]
    for name in ("stage0/host0", "stage1/host0"):   # one host each: every row of every step
        windows = hosts[name]["data_windows_read"]
        assert hosts[name]["data_bytes_read"] == windows * WINDOW_BYTES
        assert windows % 16 == 0 and steps <= windows // 16 <= steps + 3   # + what prefetch read ahead
        assert hosts[name]["data_rows"] == 4        # rows per microbatch this host holds
        assert 0.0 <= hosts[name]["data_wait_s"] < pipe["step_times_s"][-1]
    assert 0.0 <= pipe["telemetry"]["data_wait_share"] < 1.0


@pytest.mark.slow
def test_three_stages_with_a_two_host_stage_read_only_their_rows(ray_local, tmp_path, shards, no_leaks):
    steps = 4
    stages = [{"layers": [0, 1], "hosts": 2, "mesh": {"data": 4}},
              {"layers": [1, 3], "hosts": 1, "mesh": {"model": 2}},
              {"layers": [3, 4], "hosts": 1, "mesh": {"data": 2}}]
    pipe, ref = run_both(gpt_job(tmp_path, {"source": "tokens", "path": str(shards),
                                            "eval": {"holdout": 0.1, "batches": 1}}, stages, steps=steps,
                                 name="gpt-data-2host", eval_every=2))
    np.testing.assert_allclose(pipe["losses"], ref["losses"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose([v for _, v in pipe["eval_losses"]], [v for _, v in ref["eval_losses"]],
                               rtol=RTOL, atol=ATOL)
    hosts = pipe["telemetry"]["hosts_last"]
    for h in (0, 1):            # each host of stage 0: half the rows of every step it loaded
        windows = hosts[f"stage0/host{h}"]["data_windows_read"]
        assert hosts[f"stage0/host{h}"]["data_bytes_read"] == windows * WINDOW_BYTES
        assert windows % 8 == 0 and steps <= windows // 8 <= steps + 3
        assert hosts[f"stage0/host{h}"]["data_rows"] == 2
    assert hosts["stage1/host0"]["data_windows_read"] == 0     # a middle stage reads no data
    lab = hosts["stage2/host0"]["data_windows_read"]       # the labels: one host, all 16 rows a step
    assert lab % 16 == 0 and steps <= lab // 16 <= steps + 3


@pytest.mark.slow
@pytest.mark.parametrize("source", ["hf", "grain"])
def test_hf_and_grain_sources_train_through_ray_as_the_reference(ray_local, tmp_path, shards, no_leaks, source):
    """The optional readers on the actors: a JSONL file tokenized there (hf) and a user's grain
    pipeline imported there by path; pipeline losses = the reference's on the same batches."""
    from tests.data_helpers import write_docs

    if source == "hf":
        jsonl, _, _ = write_docs(tmp_path, shards)
        data = {"source": "hf", "path": str(jsonl), "tokenizer": str(shards / "tokenizer.json")}
    else:
        shard = sorted(shards.glob("*.bin"))[0]
        data = {"source": "grain", "factory": "tests.data_helpers:grain_windows",
                "args": {"path": str(shard), "seq_len": 16}}
    pipe, ref = run_both(gpt_job(tmp_path, data, steps=3, name=f"gpt-{source}"))
    np.testing.assert_allclose(pipe["losses"], ref["losses"], rtol=RTOL, atol=ATOL)
    assert len(pipe["losses"]) == 3 and pipe["telemetry"]["hosts_last"]["stage0/host0"]["data_rows"] == 4
