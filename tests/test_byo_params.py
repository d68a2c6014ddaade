"""Pipeline parts at parameters the model holds itself, not only at submodules (issue #38).

A Llama whose `embed` and `unembed` are top-level `nnx.Param`s (no nnx.Embed / nnx.Linear
around them) was refused by `nnx_model` ("split point 'unembed' is a Param, not an
nnx.Module") and needed a hand-written wrapper module. The nnx, linen and equinox adapters
now take a parameter's attribute path in a part's paths; the part's call gets it as the
model's own forward uses it (tests/byo_param_models.py holds the models, written as a user
writes them).

Numerics: the pipelined run against the user's whole model trained by plain
`jax.value_and_grad` in this process (tests.test_byo_models.oracle: same init, data,
microbatch order and optax optimizer), float32, rtol 1e-5 / atol 1e-6 on every per-step
loss and on EVERY parameter array (elementwise; atol scaled to the array's largest entry as
in test_byo_models.assert_params_equal).
"""
from __future__ import annotations

import numpy as np
import pytest

from orchestrator.core.model.pipeline import ModelError, describe
from tests.test_byo_models import ATOL, RTOL, assert_params_equal, checked_of, flat, oracle

pytestmark = [pytest.mark.needs_models]      # flax / equinox models throughout (CI's oldest step leaves them out)

LLAMA = {"vocab": 64, "d_model": 32, "heads": 4, "kv_heads": 2, "d_mlp": 64, "blocks": 2}


def _spec(model):
    return describe(model, name="m", factory="f", args={})


def param_llama_job(tmp_path):
    return {
        "run": {"name": "param-llama", "steps": 4, "seed": 3, "output_dir": str(tmp_path)},
        "model": {"factory": "tests.byo_param_models:nnx_llama_pipeline", "args": dict(LLAMA)},
        "data": {"source": "synthetic", "global_batch": 16, "seq_len": 16},
        "optimizer": {"name": "sgd", "args": {"learning_rate": 0.2, "momentum": 0.9}},
        "pipeline": {"schedule": "1f1b", "microbatches": 4, "stages": [
            {"layers": [0, 2], "mesh": {"data": 2}},
            {"layers": [2, 4], "mesh": {"model": 2}},      # the unembed Param split over `model` by vocab
        ]},
        "layout": {"batch": "data", "heads": "model", "kv_heads": "model", "mlp": "model", "vocab": "model"},
    }


def mlp_job(tmp_path, factory):
    return {
        "run": {"name": factory.replace("_", "-"), "steps": 4, "seed": 5, "output_dir": str(tmp_path)},
        "model": {"factory": f"tests.byo_param_models:{factory}", "args": {"d": 16, "blocks": 2}},
        "data": {"source": "synthetic", "global_batch": 16},
        "optimizer": {"name": "sgd", "args": {"learning_rate": 0.1, "momentum": 0.9}},
        "pipeline": {"schedule": "1f1b", "microbatches": 4, "stages": [
            {"layers": [0, 2], "mesh": {"data": 2}},
            {"layers": [2, 4], "mesh": {"model": 2}},
        ]},
        "layout": {"batch": "data", "mlp": "model"},
    }


# ----------------------------------------------------------------------------- pure: the front ends

def test_nnx_parts_at_top_level_params_carry_their_partitioning():
    from tests.byo_param_models import nnx_llama_pipeline

    spec = _spec(nnx_llama_pipeline(**LLAMA))
    assert [layer.name for layer in spec.layers] == ["embed", "blocks.0", "blocks.1", "head"]
    assert {k: (p.shape, p.axes) for k, p in spec.layers[0].params.items()} == {
        "embed": ((64, 32), ("vocab", "embed"))}
    assert {k: (p.shape, p.axes) for k, p in spec.layers[3].params.items()} == {
        "norm/scale": ((32,), ("embed",)), "unembed": ((32, 64), ("embed", "vocab"))}
    assert spec.layers[3].outputs[0].shape == (16, 64)
    # and the job's layout shards it: vocab over stage 1's `model` axis
    checked = checked_of(param_llama_job("/tmp"))
    assert checked.stages[1].layout.get("vocab") == "model"


def test_nnx_a_param_named_by_two_parts_is_tied():
    from orchestrator.core.model.adapters import nnx_model

    from examples.llama_model import next_token_loss
    from tests.byo_param_models import nnx_llama_make

    parts = [("embed", "embed", lambda table, t: table[...][t]), "blocks.0",
             ("head", ("norm", "embed"), lambda norm, table, x: norm(x) @ table[...].T)]
    model = nnx_model(nnx_llama_make(blocks=1), parts, loss=next_token_loss, input=((16,), "int32"),
                      label=((16,), "int32"), vocab=64)
    assert model.ties == (("embed/embed", "head/embed"),)
    assert _spec(model).ties == (((0, "embed"), (2, "embed")),)


def test_nnx_param_without_a_call_and_non_param_variables_are_refused_naming_the_path():
    from flax import nnx

    from orchestrator.core.model.adapters import nnx_model

    from examples.llama_model import next_token_loss
    from tests.byo_param_models import nnx_llama_make

    kw = dict(loss=next_token_loss, input=((16,), "int32"), label=((16,), "int32"), vocab=64)
    with pytest.raises(ModelError, match=r"split point 'unembed' is a parameter \(Param\), not a submodule.*"
                                         r"\(name, paths, call\)"):
        nnx_model(nnx_llama_make(blocks=1), [("embed", "embed", lambda e, t: e[...][t]), "blocks.0", "unembed"],
                  **kw)

    class Counter(nnx.Variable):
        pass

    class WithCounter(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, rngs=rngs)
            self.count = Counter(np.zeros((), np.int32))

    with pytest.raises(ModelError, match=r"split point 'count' is a Counter variable"):
        nnx_model(WithCounter, ["lin", ("c", "count", lambda c, x: x)], loss=lambda y, t: (y - t).sum(),
                  input=((4,), "float32"), label=((4,), "float32"))


def test_linen_top_level_param_is_a_part_and_an_unowned_use_is_refused():
    from orchestrator.core.model.adapters import linen_model

    from tests.byo_models import mse
    from tests.byo_param_models import D_IN, D_OUT, linen_module, linen_pipeline

    spec = _spec(linen_pipeline())
    assert [layer.name for layer in spec.layers] == ["in", "block0", "block1", "out"]
    assert {k: p.axes for k, p in spec.layers[3].params.items()} == {"w_out": ("mlp", None)}
    assert "w_out" not in spec.layers[0].params            # the placeholder other parts get is not a parameter
    # a part computing with a top-level parameter it does not own would compute with a placeholder: refused
    parts = [("in", ("inp",), lambda m, x: m.inp(x) @ m.w_out), ("out", ("w_out", "body_0", "body_1"),
                                                                 lambda m, x: x)]
    with pytest.raises(ModelError, match=r"part 'in' uses the top-level parameter\(s\) \['w_out'\] without "
                                         r"owning them"):
        _spec(linen_model(linen_module(), parts, loss=mse, input=((D_IN,), "float32"), label=((D_OUT,), "float32")))


def test_equinox_array_fields_are_parts_and_need_a_call():
    from orchestrator.core.model.adapters import eqx_model

    from tests.byo_models import mse
    from tests.byo_param_models import D_IN, D_OUT, eqx_make, eqx_pipeline

    spec = _spec(eqx_pipeline())
    assert {k: p.axes for k, p in spec.layers[0].params.items()} == {"w_in": (None, "embed")}
    assert {k: p.axes for k, p in spec.layers[3].params.items()} == {"w_out": ("embed", None)}
    with pytest.raises(ModelError, match=r"split point 'w_out' is a parameter \(array\), not a submodule"):
        eqx_model(eqx_make(), [("in", "w_in", lambda w, x: x @ w), "blocks.0", "blocks.1", "w_out"], loss=mse,
                  input=((D_IN,), "float32"), label=((D_OUT,), "float32"))


def test_adapter_docstring_examples_run():
    import doctest

    import orchestrator.core.model.adapters as adapters

    result = doctest.testmod(adapters, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


# ----------------------------------------------------------------------------- Ray: pipelined == oracle

def param_llama_oracle(checked):
    """The ParamLlama itself, whole, from the same key: value_and_grad of its own __call__."""
    import jax
    from flax import nnx

    from examples.llama_model import next_token_loss
    from tests.byo_param_models import nnx_llama_make

    a = checked.job.model.args
    with nnx.use_eager_sharding(False):
        model = nnx_llama_make(**{k: a[k] for k in LLAMA})(nnx.Rngs(jax.random.key(checked.job.run.seed)))
    graph, state = nnx.split(model, nnx.Param)
    treedef = jax.tree.structure(state)

    def loss_of(pure, x, y):
        return next_token_loss(nnx.merge(graph, jax.tree.unflatten(treedef, jax.tree.leaves(pure)))(x), y)

    return oracle(checked, loss_of, nnx.to_pure_dict(state), flat)


def part_to_model_path(name: str) -> str:
    """'01.blocks.0/blocks.0/attn/q/kernel' -> 'blocks/0/attn/q/kernel'; '03.head/unembed' -> 'unembed'."""
    return name.partition("/")[2].replace(".", "/")


@pytest.mark.ray
@pytest.mark.slow      # ~1 min: the slow CI step (the parts' split at top-level params stays tested fast)
def test_nnx_llama_with_top_level_params_pipelined_matches_its_own_training(tmp_path, no_leaks):
    from orchestrator.driver.runner import run_job

    checked = checked_of(param_llama_job(tmp_path))
    pipe = run_job(checked, echo=lambda s: None, keep_params=True)
    losses, params = param_llama_oracle(checked)
    np.testing.assert_allclose(pipe["losses"], losses, rtol=RTOL, atol=ATOL)
    assert losses[-1] < losses[0]
    assert {"embed", "unembed"} <= set(params)
    assert_params_equal(pipe["params"], params, part_to_model_path)


def linen_oracle(checked):
    import jax
    import flax.linen as nn

    from tests.byo_models import mse
    from tests.byo_param_models import D_IN, linen_module

    module = linen_module(16, 2)
    params0 = nn.unbox(module.init(jax.random.key(checked.job.run.seed), np.zeros((2, D_IN), np.float32)))["params"]
    return oracle(checked, lambda p, x, y: mse(module.apply({"params": p}, x), y), params0, flat)


def eqx_oracle(checked):
    import jax
    import equinox as eqx

    from tests.byo_models import mse
    from tests.byo_param_models import eqx_make

    params0, static = eqx.partition(eqx_make(16, 2)(jax.random.key(checked.job.run.seed)), eqx.is_array)
    return oracle(checked, lambda p, x, y: mse(jax.vmap(eqx.combine(p, static))(x), y), params0, flat)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("factory,ref", [("linen_pipeline", linen_oracle), ("eqx_pipeline", eqx_oracle)])
def test_linen_and_equinox_top_level_params_pipelined_match_their_own_training(tmp_path, no_leaks, factory, ref):
    from orchestrator.driver.runner import run_job

    checked = checked_of(mlp_job(tmp_path, factory))
    pipe = run_job(checked, echo=lambda s: None, keep_params=True)
    losses, params = ref(checked)
    np.testing.assert_allclose(pipe["losses"], losses, rtol=RTOL, atol=ATOL)
    assert losses[-1] < losses[0]
    rename = (lambda n: n.split("/", 1)[1]) if factory == "linen_pipeline" else part_to_model_path
    assert_params_equal(pipe["params"], params, rename)
