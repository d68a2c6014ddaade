"""`describe` and the cost-balanced cut trace a one-init model's whole init ONCE, not once per part
(`orchestrator.core.model.pipeline.abstract_inits`): every adapter's parts build the whole model and
keep their piece, so tracing per part is quadratic in the layer count (~12 s for a 64-block GPT)."""
from __future__ import annotations

import jax
import pytest

from orchestrator.core.model.balance import layer_costs
from orchestrator.core.model.pipeline import ModelError, abstract_inits, describe
from tests.byo_models import D_IN, D_OUT, block, first, last, mse, pytree_init
from tests.byo_state_models import eqx_bn_make, linen_bn_module, nnx_bn_make

BLOCKS = 6


def _counted(fn, count):
    def wrapped(*a, **k):
        count.append(1)
        return fn(*a, **k)
    return wrapped


def _plain(count):
    from orchestrator.core.model.adapters import plain

    parts = [("in", first)] + [(f"block{i}", block) for i in range(BLOCKS)] + [("out", last)]
    return plain(_counted(lambda key: pytree_init(key, blocks=BLOCKS), count), parts, loss=mse,
                 input=((D_IN,), "float32"), label=((D_OUT,), "float32"))


def _nnx(count):
    from tests.byo_models import nnx_blocks_adapter

    return nnx_blocks_adapter(_counted(nnx_bn_make(blocks=BLOCKS), count), BLOCKS)


def _eqx(count):
    from orchestrator.core.model.adapters import eqx_model
    from tests.byo_models import OUT_AXES
    from tests.byo_state_models import EQX_BN_AXES, eqx_block_call

    parts = ["inp", *[(f"blocks.{i}", f"blocks.{i}", eqx_block_call) for i in range(BLOCKS)], "out"]
    return eqx_model(_counted(eqx_bn_make(blocks=BLOCKS), count), parts, loss=mse, input=((D_IN,), "float32"),
                     label=((D_OUT,), "float32"), axes=EQX_BN_AXES, out_axes=OUT_AXES)


def _linen(count):
    from tests import byo_state_models as m

    module = linen_bn_module(blocks=BLOCKS)
    real_init = type(module).init

    class Counting(type(module)):
        def init(self, *a, **k):
            count.append(1)
            return real_init(self, *a, **k)

    orig, m.linen_bn_module = m.linen_bn_module, lambda d=16, blocks=2: Counting(d=d, blocks=blocks)
    try:
        return m.linen_bn_mlp(blocks=BLOCKS)
    finally:
        m.linen_bn_module = orig


@pytest.mark.parametrize("build", [_plain] + [pytest.param(b, marks=pytest.mark.needs_models) for b in (_nnx, _eqx, _linen)],
                         ids=["plain", "nnx", "eqx", "linen"])
def test_describe_traces_the_whole_init_once_for_all_parts(build):
    count = []
    model = build(count)
    assert len(model.parts) == BLOCKS + 2
    before = len(count)                     # the adapter's own shape look at construction
    spec = describe(model, name="m", factory="f", args={})
    assert len(count) - before == 1, f"the whole init was traced {len(count) - before} times for {len(model.parts)} parts"
    assert spec.num_layers == BLOCKS + 2
    before = len(count)
    costs, kind = layer_costs(model, spec)
    assert kind == "flops" and len(costs) == BLOCKS + 2
    assert len(count) - before == 1
    # the same shapes as each part's own init, traced alone
    for part, (params, state) in zip(model.parts, abstract_inits(model.parts)):
        alone = jax.eval_shape(lambda part=part: part.init(jax.random.key(0)))
        assert jax.tree.structure(alone) == jax.tree.structure(params)
        assert [(a.shape, a.dtype) for a in jax.tree.leaves(alone)] == [(b.shape, b.dtype) for b in jax.tree.leaves(params)]
        if part.state_init is not None:
            st = jax.eval_shape(lambda part=part: part.state_init(jax.random.key(0)))
            assert [(a.shape, a.dtype) for a in jax.tree.leaves(st)] == [(b.shape, b.dtype) for b in jax.tree.leaves(state)]
        else:
            assert state is None


def test_a_part_the_whole_init_lacks_is_still_named():
    from orchestrator.core.model.adapters import plain

    parts = [("in", first), ("block0", block), ("ghost", block), ("out", last)]
    model = plain(lambda key: pytree_init(key, blocks=2), parts, loss=mse, input=((D_IN,), "float32"),
                  label=((D_OUT,), "float32"))
    with pytest.raises(ModelError, match=r"part 2 \(ghost\): init failed: .*no parameters for part 'ghost'"):
        describe(model, name="m", factory="f", args={})
