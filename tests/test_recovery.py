"""Automatic recovery (`failure: {max_restarts}`): config (pure), the restart rules (pure), and on Ray
a real kill -9 of a stage actor, a deterministic failure and exhausted restarts.

The Ray tests train the tiny GPT of tests/test_checkpoint.py (2 stages, {data: 2} | {model: 2},
a checkpoint every 2 steps). A recovered run must give the uninterrupted run's per-step losses
and final parameters exactly (same schedule and layout: equality, no tolerance) — the restart
restores the committed checkpoint through the `--resume` path, data and RNG state with it.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.core.config import parse_job
from tests.test_bad_input import error_of, has_all
from tests.test_checkpoint import gpt_job


# ----------------------------------------------------------------------------- config (pure)

def test_failure_section_keys_and_rules(tmp_path):
    raw = gpt_job(tmp_path, "f", tmp_path / "ck")
    assert parse_job(raw).failure.max_restarts == 0            # default: any failure ends the run
    raw["failure"] = {"max_restarts": 2}
    job = parse_job(raw)
    assert job.failure.max_restarts == 2 and parse_job(job.to_dict()) == job
    for value, rule in [(-1, "must be >= 0"), ("2", "must be an integer"), (True, "must be an integer"),
                        (10**6, "must be <= 1000")]:
        raw["failure"] = {"max_restarts": value}
        has_all(error_of(parse_job, raw), "failure.max_restarts", repr(value), rule)
    raw["failure"] = {"max_retries": 1}
    has_all(error_of(parse_job, raw), "failure.max_retries", "unknown key", "max_restarts")
    no_ckpt = gpt_job(tmp_path, "f", tmp_path / "ck")
    del no_ckpt["checkpoint"]
    no_ckpt["failure"] = {"max_restarts": 1}
    has_all(error_of(parse_job, no_ckpt), "failure.max_restarts = 1", "checkpoint:")
    no_ckpt["failure"] = {"max_restarts": 0}
    assert parse_job(no_ckpt).checkpoint is None
