"""Training on real token data through the pipeline on a local Ray, against the single-process
reference (same parameters, same batches): float32, rtol 1e-5 / atol 1e-6 on every loss.

The corpus is the licence texts Debian installs (or the stdlib's `email` sources), prepared
by `meshpipe prepare` with a locally trained byte-level BPE. Per-host reads are instrumented
(the worker's `data_bytes_read`): a host of a stage whose batch is split across two hosts
reads exactly half of every step's windows.
"""
from __future__ import annotations

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


def test_tokens_pipeline_matches_reference_and_learns(ray_local, tmp_path, shards, no_leaks):
    steps = 8
    pipe, ref = run_both(gpt_job(tmp_path, {"source": "tokens", "path": str(shards)}, steps=steps))
    np.testing.assert_allclose(pipe["losses"], ref["losses"], rtol=RTOL, atol=ATOL)
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
def test_two_host_stage_reads_only_its_rows(ray_local, tmp_path, shards, no_leaks):
    steps = 4
    stages = [{"layers": [0, 2], "hosts": 2, "mesh": {"data": 4}},
              {"layers": [2, 4], "hosts": 1, "mesh": {"model": 2}}]
    pipe, ref = run_both(gpt_job(tmp_path, {"source": "tokens", "path": str(shards)}, stages, steps=steps,
                                 name="gpt-data-2host"))
    np.testing.assert_allclose(pipe["losses"], ref["losses"], rtol=RTOL, atol=ATOL)
    hosts = pipe["telemetry"]["hosts_last"]
    for h in (0, 1):            # each host of stage 0: half the rows of every step it loaded
        windows = hosts[f"stage0/host{h}"]["data_windows_read"]
        assert hosts[f"stage0/host{h}"]["data_bytes_read"] == windows * WINDOW_BYTES
        assert windows % 8 == 0 and steps <= windows // 8 <= steps + 3
        assert hosts[f"stage0/host{h}"]["data_rows"] == 2
    lab = hosts["stage1/host0"]["data_windows_read"]       # the labels: one host, all 16 rows a step
    assert lab % 16 == 0 and steps <= lab // 16 <= steps + 3
