"""Checkpoint resume with a multi-host stage on a simulated multi-node cluster (`-m multinode`).

Stage 0 spans 2 hosts × 2 devices ({data: 2, model: 2}, one jax.distributed world): each host
saves its own shards, and its share of the shards replicated over the hosts (orbax replica-parallel
saving, on only across hosts), into the stage's one orbax directory, host 0 finalises; the resumed
run's losses and parameters equal the uninterrupted run's exactly. Own pytest process (as
tests/test_multinode.py: it connects to its own cluster).
"""
from __future__ import annotations

import pytest

from tests.test_checkpoint import _resume_equals_uninterrupted, gpt_job
from tests.test_multinode import CLUSTER, cluster  # noqa: F401 - the module's cluster fixture

pytestmark = pytest.mark.multinode


def multihost_job(tmp_path, name, ckpt_dir, schedule="1f1b"):
    job = gpt_job(tmp_path, name, ckpt_dir, schedule)
    job["pipeline"]["stages"] = [{"layers": [0, 2], "hosts": 2, "mesh": {"data": 2, "model": 2}},
                                 {"layers": [2, 4], "hosts": 1, "mesh": {"model": 2}, "layout": {"batch": None}}]
    return job


def test_multihost_stage_resume_is_bit_exact(cluster, tmp_path):  # noqa: F811 - the fixture
    from orchestrator.core import checkpoint as ck

    full_dir, _ = _resume_equals_uninterrupted(tmp_path, "1f1b", multihost_job, cluster=CLUSTER)
    marker = ck.select(full_dir)
    assert marker["layout"][0]["hosts"] == 2
    assert any(name.startswith("ocdbt.process_1") for name in marker["stages"][0]["files"]), \
        "host 1 wrote its own shards into stage 0's directory"
