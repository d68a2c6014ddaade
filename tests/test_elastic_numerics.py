"""What stays exact after a re-plan and what only close (`failure.elastic`, docs/guides/elastic.md).

A re-plan keeps the data (each step's global batch, in order) and the update rule; it changes the
microbatch count m and the data-parallel degree d, so only the order of floating-point sums. One
process, no Ray (`tests.elastic_numerics`, in a subprocess with 4 simulated CPU devices): the
README's GPT for 5 steps with m = 4, 8, 2 and d = 1, 2 against (m = 4, d = 1). The bounds are the
ones proposed for the elastic run against an uninterrupted run on the job's own plan:

  losses              relative difference ≤ 1e-5
  every param array   ‖Δ‖₂ / ‖p‖₂ ≤ 1e-4
  every param entry   |Δ| ≤ learning rate / 2 — Adam's step is lr · m̂ / (√v̂ + ε): an entry whose
                      gradient is zero up to round-off (|g| ≲ ε = 1e-8) moves by round-off ÷ ε, up to
                      lr a step, in any run; another summation order moves it differently.

(With SGD at lr 0.1 the same cases differ by one float32 ulp at most, docs/guides/elastic.md.)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_microbatches_and_data_parallel_degree_change_only_the_summation_order():
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip())
    proc = subprocess.run([sys.executable, "-m", "tests.elastic_numerics", "--steps", "5", "--optimizer", "adam"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    lr = out["learning_rate"]
    assert out["repeat"]["bit_equal"], out["repeat"]           # the same case twice: the same bits
    assert {(c["m"], c["d"]) for c in out["cases"]} == {(8, 1), (2, 1), (4, 2), (8, 2)}
    for c in out["cases"]:
        assert c["max_rel_loss_diff"] <= 1e-5, c
        assert c["max_rel_l2_per_array"] <= 1e-4, c
        assert c["max_abs_param_diff"] <= lr / 2, c
