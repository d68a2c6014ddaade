"""A checkpoint written before `StageState` (meshpipe at 80f3881) resumes, bit-exact, with this code.

`tests/fixtures/ckpt_v1/` holds step 2 of a 4-step run of the checkpoint tests' tiny GPT (2 stages,
{data: 2} | {model: 2}, 1F1B) under bfloat16 compute with dynamic loss scaling — parameters,
Adam state, the loss-scale state (scale, finite steps in a row) and the data position — as that
code wrote it, and `expected.npz`: what its uninterrupted run gave (losses, scales, skipped steps,
final parameters). `tests/fixtures/make_v1_checkpoint.py` wrote them (run at that commit).
Resuming the copy at step 2 must give those numbers exactly (same programs: equality).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "ckpt_v1"


@pytest.mark.ray
@pytest.mark.needs_checkpoint
def test_a_checkpoint_of_the_old_format_resumes_bit_exact(tmp_path, no_leaks):
    from orchestrator.core import checkpoint as ck
    from orchestrator.core.config import check_job, parse_cluster, parse_job
    from orchestrator.driver.runner import run_job
    from tests.fixtures.make_v1_checkpoint import CLUSTER, job

    root = tmp_path / "ck"
    root.mkdir()
    shutil.copytree(FIXTURE / "step_00000002", root / "step_00000002")
    checked = check_job(parse_job(job(tmp_path / "runs", root, "v1-resumed")), parse_cluster(CLUSTER))
    out = run_job(checked, echo=lambda s: None, keep_params=True, resume="latest")
    expected = np.load(FIXTURE / "expected.npz", allow_pickle=False)
    assert out["checkpoint"]["resumed_from"] == 2
    assert out["losses"] == expected["losses"].tolist()                 # steps 0-1 from the marker, 2-3 run here
    assert out["loss_scale"]["scales"] == expected["scales"].tolist()[2:]     # the restored (scale, good) grows at 3
    assert out["loss_scale"]["skipped_steps"] == [s for s in expected["skipped"].tolist() if s >= 2]
    params = {k[len("param:"):]: expected[k] for k in expected.files if k.startswith("param:")}
    assert sorted(out["params"]) == sorted(params)
    for name, arr in params.items():
        np.testing.assert_array_equal(out["params"][name], arr, err_msg=name)
    assert ck.select(root)["step"] == 4        # and it committed its own step 4 in the current format
