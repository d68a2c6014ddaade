"""The equinox example (`examples/eqx.yaml`, `examples/eqx_model.py`) trained through meshpipe
against an independent oracle.

The oracle is the equinox `Decoder` itself, vmapped over the batch and trained with plain
`jax.value_and_grad` in this process (`tests.test_byo_models.oracle`: the model's own init from
`jax.random.key(seed)`, the job's text data for (seed, step), gradients of microbatch 0, 1, …
scaled by 1/m and summed in order, the same optax optimizer). The job is the example file as
shipped (2 stages, stage 1 tensor-parallel over heads, mlp and vocab) with 4 steps and SGD with
momentum instead of its Adam (`tests/test_byo_models.py` says why Adam is ill-conditioned for an
elementwise comparison). Tolerance: float32, rtol 1e-5 / atol max(1e-6, 1e-5 × the array's
largest magnitude) on every per-step loss and EVERY parameter array (`assert_params_equal`).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from orchestrator.core.config import check_job, load_job, parse_cluster
from tests.test_byo_models import ATOL, CLUSTER, RTOL, assert_params_equal, flat, oracle, pipeline_name_to_path

pytestmark = [pytest.mark.needs_models]


EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "eqx.yaml"


def example_checked(tmp_path, steps=4):
    job = load_job(str(EXAMPLE), [f"run.output_dir={tmp_path}", f"run.steps={steps}",
                                  "optimizer={name: sgd, args: {learning_rate: 0.1, momentum: 0.9}}"])
    return check_job(job, parse_cluster(CLUSTER))


def decoder_oracle(checked):
    import equinox as eqx
    import jax

    from examples.eqx_model import Decoder, next_token_loss

    a = checked.job.model.args
    model = Decoder(a["vocab"], a["d_model"], a["heads"], a["d_mlp"], a["blocks"], jax.random.key(checked.job.run.seed))
    params0, static = eqx.partition(model, eqx.is_array)

    def loss_of(p, x, y):
        return next_token_loss(jax.vmap(eqx.combine(p, static))(x), y)

    return oracle(checked, loss_of, params0, flat)


def test_example_plans_with_axes_from_its_path_rules():
    checked = example_checked("/tmp")
    assert [layer.name for layer in checked.model.layers] == ["embed", "blocks.0", "blocks.1", "head"]
    block = checked.model.layers[2].params
    assert block["blocks.1/attn/query_proj/weight"].axes == ("heads", "embed")
    assert block["blocks.1/attn/output_proj/weight"].axes == ("embed", "heads")
    assert block["blocks.1/mlp/layers/0/weight"].axes == ("mlp", "embed")
    assert checked.model.layers[3].params["head/weight"].axes == ("vocab", "embed")
    assert checked.stages[1].layout == {"heads": "model", "mlp": "model", "vocab": "model"}


@pytest.mark.ray
@pytest.mark.slow          # ~30 s first-step compile on 2 loaded cores
def test_equinox_example_tensor_parallel_matches_oracle(tmp_path, no_leaks):
    from orchestrator.driver.runner import run_job

    checked = example_checked(tmp_path)
    pipe = run_job(checked, echo=lambda s: None, keep_params=True)
    losses, params = decoder_oracle(checked)
    np.testing.assert_allclose(pipe["losses"], losses, rtol=RTOL, atol=ATOL)
    assert losses[-1] < losses[0]
    assert_params_equal(pipe["params"], params, pipeline_name_to_path)
