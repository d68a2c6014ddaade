"""Bring your own model: mutable (non-parameter) model state — BatchNorm's running statistics as
flax.nnx `nnx.BatchStat` variables, flax.linen's `batch_stats` collection and equinox's
`eqx.nn.State` (`eqx.nn.BatchNorm`; its oracle: the equinox model vmapped over the batch with its
state, the same threading and tolerance as nnx).

The oracle is the user's whole model in one process: `jax.value_and_grad(..., has_aux=True)` of
the nnx module itself (or the linen module's `apply(..., mutable=["batch_stats"])`), the state
threaded through the microbatches of every step in order (microbatch 0, 1, …), gradients of the
mean loss summed in that order, the same optax optimizer. Pipelined training on 2 stages (state
on both; stage 1 tensor-parallel) must match it on every per-step loss, EVERY parameter array and
EVERY state array: float32, rtol 1e-5 / atol 1e-6 (`tests.test_byo_models`' tolerance and
reasons) for the nnx model. The linen model's own float32 rounding is wider than that: its
oracle under `jit` and op by op (`use_jit=False`) already differ by 1.56× that tolerance (measured:
1.13e-5 of an array's largest value; the nnx model's 0.38×), so its arrays are compared, as the
fp16 tests are, at 5× that measured spread: |pipeline − oracle| ≤ 5.7e-5 × max|oracle array|
(`LINEN_SPREAD`), losses still at rtol 1e-5. A resumed run must reproduce the uninterrupted run's
parameters and state bit for bit.
"""
from __future__ import annotations

import numpy as np
import pytest

from orchestrator.core.config import ConfigError
from tests.test_byo_models import (ATOL, RTOL, assert_params_equal, checked_of, flat, framework_job,
                                   pipeline_name_to_path)

pytestmark = [pytest.mark.needs_models]

LINEN_SPREAD = 1.13e-5      # linen oracle, jit vs op by op: max |difference| / max |array| over all arrays


def assert_within_spread(pipe: dict, ref: dict, rename, spread=LINEN_SPREAD):
    got = {rename(k): v for k, v in pipe.items()}
    assert sorted(got) == sorted(ref), (sorted(got), sorted(ref))
    for name in sorted(ref):
        bound = 5 * spread * float(np.max(np.abs(ref[name])))
        np.testing.assert_allclose(got[name], ref[name], rtol=0, atol=bound, err_msg=name)


def bn_job(tmp_path, factory, schedule="1f1b"):
    job = framework_job(tmp_path, factory)
    job["model"]["factory"] = f"tests.byo_state_models:{factory}"
    job["pipeline"]["schedule"] = schedule
    return job


def stateful_oracle(checked, loss_of, params0, state0, use_jit=True):
    """Plain single-process training with state: loss_of(params, state, x, y) -> (loss, new state);
    microbatches in order, the state of microbatch i feeding microbatch i + 1. Returns (losses,
    params, state)."""
    import jax
    import jax.numpy as jnp
    import optax

    from stages.data import global_batch, open_reader

    job = checked.job
    m = job.pipeline.microbatches
    tx = getattr(optax, job.optimizer.name)(**job.optimizer.args)
    reader = open_reader(checked.data)
    grad = jax.value_and_grad(loss_of, has_aux=True)
    grad = jax.jit(grad) if use_jit else grad
    params, opt, state = params0, tx.init(params0), state0
    losses = []
    for step in range(job.run.steps):
        x, y = global_batch(reader, checked.data, step)
        n = x.shape[0] // m
        acc, mb = jax.tree.map(jnp.zeros_like, params), []
        for i in range(m):
            (loss, state), g = grad(params, state, jnp.asarray(x[i * n:(i + 1) * n]), jnp.asarray(y[i * n:(i + 1) * n]))
            acc = jax.tree.map(lambda a, b: a + b / m, acc, g)
            mb.append(float(loss))
        updates, opt = tx.update(acc, opt, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(np.mean(mb)))
    return losses, params, state


def nnx_parts():
    """The nnx BatchNorm MLP itself: (graph, param treedef, stats treedef, params0, stats0)."""
    import jax
    from flax import nnx

    from tests.byo_state_models import nnx_bn_make

    def build(seed):
        with nnx.use_eager_sharding(False):
            model = nnx_bn_make(16, 2)(nnx.Rngs(jax.random.key(seed)))
        graph, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)
        return graph, params, stats

    return build


def nnx_oracle(checked, use_jit=True):
    import jax
    from flax import nnx

    from tests.byo_models import mse

    graph, params, stats = nnx_parts()(checked.job.run.seed)
    ptree, stree = jax.tree.structure(params), jax.tree.structure(stats)

    def merged(p, s):
        return nnx.merge(graph, jax.tree.unflatten(ptree, jax.tree.leaves(p)), jax.tree.unflatten(stree, jax.tree.leaves(s)))

    def loss_of(p, s, x, y):
        model = merged(p, s)
        model.train()
        loss = mse(model(x), y)
        return loss, nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))

    def eval_loss(p, s, x, y):
        model = merged(p, s)
        model.eval()
        return mse(model(x), y)

    losses, p, s = stateful_oracle(checked, loss_of, nnx.to_pure_dict(params), nnx.to_pure_dict(stats), use_jit)
    return losses, p, s, eval_loss


def linen_oracle(checked, use_jit=True):
    import jax
    import flax.linen as nn

    from tests.byo_models import D_IN, mse
    from tests.byo_state_models import linen_bn_module

    module = linen_bn_module(16, 2)
    v0 = nn.unbox(module.init(jax.random.key(checked.job.run.seed), np.zeros((2, D_IN), np.float32)))

    def loss_of(p, s, x, y):
        out, upd = module.apply({"params": p, "batch_stats": s}, x, train=True, mutable=["batch_stats"])
        return mse(out, y), upd["batch_stats"]

    losses, p, s = stateful_oracle(checked, loss_of, v0["params"], v0["batch_stats"], use_jit)
    return losses, p, s, None


def eqx_state_dict(model, state) -> dict:
    """An eqx.nn.State as {index path: value} ('blocks/0/bn/ema_state_index': (mean, var))."""
    from orchestrator.core.model.adapters import _eqx_indices

    return {path: state.get(idx) for path, idx in _eqx_indices(model)}


def eqx_whole(seed):
    """The equinox BatchNorm MLP itself: (params0, state0, static, run) with
    run(params, state, x, train) -> (y, new state), the whole model vmapped over the batch."""
    import equinox as eqx
    import jax

    from tests.byo_state_models import eqx_bn_make

    model, state0 = eqx_bn_make(16, 2)(jax.random.key(seed))
    params0, static = eqx.partition(model, eqx.is_array)

    def run(p, s, x, train=True):
        mod = eqx.combine(p, static)
        mod = mod if train else eqx.nn.inference_mode(mod, True)
        return jax.vmap(mod, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, s)

    return params0, state0, model, run


def eqx_oracle(checked, use_jit=True):
    from tests.byo_models import mse

    params0, state0, model, run = eqx_whole(checked.job.run.seed)

    def loss_of(p, s, x, y):
        out, s = run(p, s, x)
        return mse(out, y), s

    losses, p, s = stateful_oracle(checked, loss_of, params0, state0, use_jit)
    return losses, p, eqx_state_dict(model, s), None


def exact_ints(arrays: dict) -> dict:
    """Bool state leaves (equinox's first-time flag) as int8, so the float comparison is exact on them."""
    return {k: v.astype(np.int8) if v.dtype == bool else v for k, v in arrays.items()}


def expected(params, state) -> dict:
    return {**flat(params), **{f"state:{k}": v for k, v in flat(state).items()}}


def nnx_name(name: str) -> str:
    """Pipeline names (params and `state:` leaves) -> the nnx oracle's paths."""
    if name.startswith("state:"):
        return "state:" + pipeline_name_to_path(name[len("state:"):])
    return pipeline_name_to_path(name)


def linen_name(name: str) -> str:
    """'state:01.block0/body_0/BatchNorm_0/mean' -> 'state:body_0/BatchNorm_0/mean'."""
    prefix = "state:" if name.startswith("state:") else ""
    return prefix + name[len(prefix):].split("/", 1)[1]


# ----------------------------------------------------------------------------- pure / plan time

def test_batchnorm_state_is_described_per_part_and_other_kinds_are_refused():
    model = checked_of(bn_job("/tmp", "nnx_bn_mlp")).model
    assert [layer.name for layer in model.layers] == ["inp", "blocks.0", "blocks.1", "out"]
    assert "blocks.0/bn/scale" in model.layers[1].params and "blocks.0/bn/mean" not in model.layers[1].params
    from orchestrator.core.model.registry import build_model

    built = build_model(model.factory, model.args)
    assert [p.state_init is not None for p in built.parts] == [False, True, True, False]
    linen = build_model("tests.byo_state_models:linen_bn_mlp", {"d": 16, "blocks": 2})
    assert [p.state_init is not None for p in linen.parts] == [False, True, True, False]
    eqx_spec = checked_of(bn_job("/tmp", "eqx_bn_mlp")).model
    assert "blocks.0/bn/weight" in eqx_spec.layers[1].params                  # trained
    assert not any("index" in p for layer in eqx_spec.layers for p in layer.params)   # state is not
    eqx = build_model("tests.byo_state_models:eqx_bn_mlp", {"d": 16, "blocks": 2})
    assert [p.state_init is not None for p in eqx.parts] == [False, True, True, False]
    bare = checked_of({**bn_job("/tmp", "eqx_bn_mlp"), "model": {"factory": "tests.byo_state_models:eqx_bn_mlp",
                                                                "args": {"d": 16, "blocks": 2, "bare": True}}}).model
    assert [(layer.params, layer.state) for layer in bare.layers] == [
        (layer.params, layer.state) for layer in eqx_spec.layers]        # make_with_state applied by the adapter
    assert sorted(eqx_spec.layers[1].state) == ["blocks.0/bn/ema_first_time_index",
                                                "blocks.0/bn/ema_state_index/0", "blocks.0/bn/ema_state_index/1"]

    for factory, needles in [
        ("nnx_counter", ["model.factory", "split point 'head'", "Counter", "only nnx.Param"]),
        ("linen_orphan_stats", ["model.factory", "batch_stats entry 'bn' belongs to no part"]),
        ("eqx_stateful", ["model.factory", "eqx.nn.make_with_state without its state",
                          "'blocks/0/bn/ema_first_time_index'", "return (model, state)"]),
    ]:
        with pytest.raises(ConfigError) as e:
            checked_of(bn_job("/tmp", factory))
        assert all(n in str(e.value) for n in needles), (factory, str(e.value))


@pytest.mark.parametrize("recompute", [False, True])
def test_stage_programs_thread_state_like_the_whole_model_and_eval_uses_it(recompute):
    """Single process, no Ray: the model cut into two StagePrograms (state on both), each
    microbatch's forward returns the new state, the backward gives the whole model's gradients,
    and eval mode uses the running statistics unchanged — all equal to the nnx module itself
    (rtol 1e-5 / atol 1e-6). `recompute`: the fallback that reruns the forward in the backward
    (its residuals carry the state the forward saw)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from orchestrator.core.model.registry import build_model
    from stages.program import StageProgram

    checked = checked_of(bn_job("/tmp", "nnx_bn_mlp"))
    spec, seed, m = checked.model, checked.job.run.seed, 2
    model = build_model(spec.factory, spec.args)
    progs = [StageProgram(spec, model, a, b, microbatches=m, optimizer=optax.sgd(0.1), recompute=recompute)
             for a, b in ((0, 2), (2, 4))]
    assert [p.stateful for p in progs] == [True, True]
    params = [p.init_params(seed) for p in progs]
    mstate = [p.init_mstate(seed) for p in progs]
    assert mstate[0][0] is None and mstate[1][1] is None

    graph, p0, s0 = nnx_parts()(seed)
    ptree, stree = jax.tree.structure(p0), jax.tree.structure(s0)
    from tests.byo_models import mse

    def whole(p, s, x, y, train=True):
        mod = nnx.merge(graph, jax.tree.unflatten(ptree, jax.tree.leaves(p)), jax.tree.unflatten(stree, jax.tree.leaves(s)))
        mod.train() if train else mod.eval()
        return mse(mod(x), y), nnx.to_pure_dict(nnx.state(mod, nnx.BatchStat))

    ref_p, ref_s = nnx.to_pure_dict(p0), nnx.to_pure_dict(s0)
    rng = np.random.default_rng(0)
    for i in range(3):          # three microbatches, state threaded
        x = jnp.asarray(rng.normal(size=(8, 8)), jnp.float32)
        y = jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)
        ids = np.array([seed, 0, i], np.int32)
        h, res0, mstate[0] = progs[0].fwd(params[0], [x], None, ids, mstate[0])
        loss, res1, mstate[1] = progs[1].fwd(params[1], h, y, ids, mstate[1])
        dh, g1 = progs[1].bwd(params[1], res1, None)
        _, g0 = progs[0].bwd(params[0], res0, dh)
        (ref_loss, ref_s), ref_g = jax.value_and_grad(whole, has_aux=True)(ref_p, ref_s, x, y)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=RTOL, atol=ATOL)
        got_s = {"blocks/0/bn/" + k: v for k, v in flat(mstate[0][1]["blocks.0"]["bn"]).items()}
        got_s.update({"blocks/1/bn/" + k: v for k, v in flat(mstate[1][0]["blocks.1"]["bn"]).items()})
        assert_params_equal(got_s, flat(ref_s))
        got_g = {}
        for grads in (g0, g1):
            for tree in grads:           # {"blocks.0": {"up": {"kernel": ...}}} -> "blocks/0/up/kernel"
                for path, v in flat(tree).items():
                    head, rest = path.split("/", 1)
                    got_g[f"{head.replace('.', '/')}/{rest}"] = v
        want = {k: np.asarray(v) / m for k, v in flat(ref_g).items()}     # the programs seed 1/m
        assert_params_equal(got_g, want)
        assert not np.allclose(flat(ref_s)["blocks/0/bn/mean"], 0)       # the statistics really moved
    h = progs[0].fwd_eval(params[0], [x], None, mstate[0])
    ev = progs[1].fwd_eval(params[1], h, y, mstate[1])
    ref_ev, same = whole(ref_p, ref_s, x, y, train=False)
    np.testing.assert_allclose(float(ev), float(ref_ev), rtol=RTOL, atol=ATOL)
    assert_params_equal(flat(same), flat(ref_s))                         # eval mode leaves the state alone
    assert abs(float(ev) - float(loss)) > 1e-4                           # and differs from the train-mode loss


# ----------------------------------------------------------------------------- through Ray

@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("factory,schedule", [("nnx_bn_mlp", "1f1b"), ("linen_bn_mlp", "zb-h1"),
                                              ("eqx_bn_mlp", "1f1b")])
def test_batchnorm_two_stages_match_oracle_every_param_and_state_array(tmp_path, no_leaks, factory, schedule):
    from orchestrator.core import checkpoint as ck
    from orchestrator.driver.runner import run_job

    job = bn_job(tmp_path, factory, schedule)
    if factory.startswith("eqx"):       # equinox state is checkpointed by name, as the flax state is
        job["checkpoint"] = {"dir": str(tmp_path / "ck"), "every_steps": job["run"]["steps"], "keep": 1}
    checked = checked_of(job)
    assert checked.stages[1].layout.get("mlp") == "model"
    pipe = run_job(checked, echo=lambda s: None, keep_params=True)
    oracle_of = {"nnx": nnx_oracle, "linen": linen_oracle, "eqx": eqx_oracle}[factory.split("_")[0]]
    losses, params, state, _ = oracle_of(checked)
    np.testing.assert_allclose(pipe["losses"], losses, rtol=RTOL, atol=ATOL)
    want = expected(params, state)
    if factory.startswith("eqx"):       # (mean, var) and the first-time flag of two BatchNorms
        assert sum(k.startswith("state:") for k in want) == 6
        marker = ck.read_marker(ck.step_dir(tmp_path / "ck", job["run"]["steps"]) / ck.MARKER)
        assert sorted(n for n in marker["arrays"] if n.startswith("state:")) == sorted(
            n for n in pipe["params"] if n.startswith("state:"))
        assert "state:01.blocks.0/blocks.0/bn/ema_state_index/0" in marker["arrays"]
        assert_params_equal(exact_ints(pipe["params"]), exact_ints(want), nnx_name)
        return
    assert sum(k.startswith("state:") for k in want) == 4           # mean and var of two BatchNorms
    if factory.startswith("nnx"):
        assert_params_equal(pipe["params"], want, nnx_name)
    else:       # the linen model's own measured float32 spread (module docstring)
        assert_within_spread(pipe["params"], want, linen_name)


@pytest.mark.ray
@pytest.mark.slow
def test_batchnorm_state_resumes_bit_exact(tmp_path, no_leaks):
    """4 steps with checkpoints at 2 and 4 vs step 2's checkpoint resumed: the running statistics
    are saved and restored with the parameters, so losses, parameters and state are bit-equal."""
    import shutil

    from orchestrator.core import checkpoint as ck
    from orchestrator.driver.runner import run_job

    def job(name, ckpt_dir):
        j = bn_job(tmp_path, "nnx_bn_mlp")
        j["run"].update(name=name, steps=4)
        j["checkpoint"] = {"dir": str(ckpt_dir), "every_steps": 2, "keep": 3}
        return j

    full_dir, part_dir = tmp_path / "ck-full", tmp_path / "ck-part"
    full = run_job(checked_of(job("full", full_dir)), echo=lambda s: None, keep_params=True)
    marker = ck.read_marker(ck.step_dir(full_dir, 2) / ck.MARKER)
    assert sum(n.startswith("state:") for n in marker["arrays"]) == 4
    part_dir.mkdir()
    shutil.copytree(ck.step_dir(full_dir, 2), ck.step_dir(part_dir, 2))
    resumed = run_job(checked_of(job("resumed", part_dir)), echo=lambda s: None, keep_params=True, resume=2)
    assert resumed["losses"] == full["losses"]
    assert sorted(resumed["params"]) == sorted(full["params"])
    for name, arr in full["params"].items():
        np.testing.assert_array_equal(resumed["params"][name], arr, err_msg=name)


def test_a_stateful_part_must_return_its_state_as_it_took_it():
    """describe(): a part whose returned state differs in structure or dtype is refused at plan time."""
    import jax.numpy as jnp

    from orchestrator.core.model.pipeline import ModelError, Part, PipelineModel, describe
    from orchestrator.core.model.adapters import as_spec

    def apply(p, x, *, rng=None, train=True, state=None):
        return x * p["w"], {"count": (state["count"] + 1).astype(jnp.float32)}     # int32 in, float32 out

    part = Part("p", lambda key: {"w": jnp.ones(4)}, apply, state_init=lambda key: {"count": jnp.zeros((), jnp.int32)})
    model = PipelineModel((part,), lambda y, t: jnp.mean((y - t) ** 2), as_spec(((4,), "float32")),
                          as_spec(((4,), "float32")))
    with pytest.raises(ModelError, match=r"part 0 \(p\): the state it returns .* is not the state it takes"):
        describe(model, name="m", factory="f", args={})


@pytest.mark.slow
def test_linen_spread_behind_its_tolerance_is_what_this_jax_measures():
    """The linen tolerance rests on a measurement: its oracle under jit vs op by op. If a JAX release
    narrows the spread, the tolerance should narrow too; this fails when it is far off either way."""
    checked = checked_of(bn_job("/tmp", "linen_bn_mlp"))
    a, b = linen_oracle(checked, True), linen_oracle(checked, False)
    wa, wb = expected(a[1], a[2]), expected(b[1], b[2])
    spread = max(float(np.max(np.abs(wa[k] - wb[k])) / np.max(np.abs(wb[k]))) for k in wb)
    assert LINEN_SPREAD / 10 < spread <= 2 * LINEN_SPREAD, spread


# ----------------------------------------------------------------------------- equinox, one process

@pytest.mark.slow          # 14-23 s on 2 loaded cores (two compiles)
@pytest.mark.parametrize("bare", [False, True])
def test_equinox_state_reference_run_matches_the_model_itself(bare):
    """`--reference` (one process, meshpipe's whole-model program) threads the equinox BatchNorm
    state through the microbatches in order: losses, every parameter and every state array equal
    the equinox model under plain `jax.value_and_grad(has_aux=True)`, rtol 1e-5 / atol 1e-6.
    `bare`: the factory returns the model alone and the blocks are parts with their own call."""
    from orchestrator.driver.reference import train_reference

    job = bn_job("/tmp", "eqx_bn_mlp")
    job["model"]["args"]["bare"] = bare
    checked = checked_of(job)
    job = checked.job
    ref = train_reference(checked.model, checked.data, steps=job.run.steps, seed=job.run.seed,
                          microbatches=job.pipeline.microbatches, optimizer=job.optimizer.spec())
    losses, params, state, _ = eqx_oracle(checked)
    np.testing.assert_allclose(ref["losses"], losses, rtol=RTOL, atol=ATOL)
    want = expected(params, state)
    assert sum(k.startswith("state:") for k in want) == 6
    assert_params_equal(exact_ints(ref["params"]), exact_ints(want), nnx_name)
    assert not np.allclose(want["state:blocks/1/bn/ema_state_index/1"], 0)       # the statistics moved


@pytest.mark.slow          # 10-33 s on 2 loaded cores
def test_equinox_stage_programs_thread_state_and_eval_uses_it_unchanged():
    """Two StagePrograms (state on both), three microbatch forwards: each stage's state equals
    the equinox model's own after the same forwards; eval (`eqx.nn.inference_mode`) gives the
    model's own eval loss and leaves the state as it was (rtol 1e-5 / atol 1e-6). Eval runs on a new
    batch: in equinox's "ema" mode a training call normalises with the statistics it stores, so on
    the batch it last saw eval and train give the same loss."""
    import jax.numpy as jnp
    import optax

    from orchestrator.core.model.registry import build_model
    from stages.program import StageProgram
    from tests.byo_models import mse

    checked = checked_of(bn_job("/tmp", "eqx_bn_mlp"))
    spec, seed = checked.model, checked.job.run.seed
    model = build_model(spec.factory, spec.args)
    progs = [StageProgram(spec, model, a, b, microbatches=2, optimizer=optax.sgd(0.1)) for a, b in ((0, 2), (2, 4))]
    params = [p.init_params(seed) for p in progs]
    mstate = [p.init_mstate(seed) for p in progs]
    p0, ref_s, whole, run = eqx_whole(seed)
    rng = np.random.default_rng(0)
    for i in range(3):
        x = jnp.asarray(rng.normal(size=(8, 8)), jnp.float32)
        y = jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)
        ids = np.array([seed, 0, i], np.int32)
        h, _, mstate[0] = progs[0].fwd(params[0], [x], None, ids, mstate[0])
        loss, _, mstate[1] = progs[1].fwd(params[1], h, y, ids, mstate[1])
        out, ref_s = run(p0, ref_s, x)
        np.testing.assert_allclose(float(loss), float(mse(out, y)), rtol=RTOL, atol=ATOL)
    got = {"state:" + k: v for k, v in flat(mstate[0][1]).items()}
    got.update({"state:" + k: v for k, v in flat(mstate[1][0]).items()})
    want = {f"state:{k}": v for k, v in flat(eqx_state_dict(whole, ref_s)).items()}
    assert_params_equal(exact_ints(got), exact_ints(want), lambda n: "state:" + _blocks(n[len("state:"):]))
    x = jnp.asarray(rng.normal(size=(8, 8)), jnp.float32)
    h = progs[0].fwd_eval(params[0], [x], None, mstate[0])
    ev = progs[1].fwd_eval(params[1], h, y, mstate[1])
    out, same = run(p0, ref_s, x, train=False)
    np.testing.assert_allclose(float(ev), float(mse(out, y)), rtol=RTOL, atol=ATOL)
    loss = mse(run(p0, ref_s, x)[0], y)
    assert_params_equal(exact_ints({f"state:{k}": v for k, v in flat(eqx_state_dict(whole, same)).items()}),
                        exact_ints(want))                                    # eval leaves the state alone
    assert abs(float(ev) - float(loss)) > 1e-4                               # and is not the train-mode loss


def _blocks(path: str) -> str:
    """'blocks.0/bn/ema_state_index/0' (a part's state path) -> 'blocks/0/bn/ema_state_index/0'."""
    head, _, rest = path.partition("/")
    return f"{head.replace('.', '/')}/{rest}"
