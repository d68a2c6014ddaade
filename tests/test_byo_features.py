"""Bring your own model, continued: named split points, candidate mesh axes, float16 with dynamic
loss scaling, and RNG state inside flax.nnx / flax.linen models — each against an independent
single-process oracle (the user's model under plain `jax.value_and_grad`; helpers and the float32
tolerance, rtol 1e-5 / atol 1e-6, from `tests.test_byo_models`, whose docstring states the rules).
"""
from __future__ import annotations

import numpy as np
import pytest

from orchestrator.core.config import ConfigError, parse_job
from tests.test_byo_models import (ATOL, CLUSTER, RTOL, assert_params_equal, checked_of, edge_bytes, flat,
                                   framework_job, llama_job, llama_oracle, oracle, pipeline_name_to_path,
                                   pytree_job)


pytestmark = [pytest.mark.needs_models]


# ----------------------------------------------------------------------------- named split points

def split_job(job, names, extra_stages=()):
    """The job cut by named split points instead of layer ranges (meshes kept)."""
    for st in job["pipeline"]["stages"]:
        st.pop("layers")
    job["pipeline"]["stages"] += list(extra_stages)
    job["pipeline"]["split_at"] = list(names)
    return job


def test_named_split_points_resolve_to_layer_ranges_for_every_framework():
    from orchestrator.core.model.split import split_names

    llama = checked_of(split_job(llama_job("/tmp"), ["norm"]))     # the head part ("norm", "lm_head") starts at norm
    assert [s.layers for s in llama.stages] == [(0, 3), (3, 4)]
    assert llama.job.pipeline.split_at is None and llama.job.pipeline.stages[1].layers == (3, 4)
    assert parse_job(llama.job.to_dict()) == llama.job               # the resolved job round-trips
    assert split_names(llama.model) == {"blocks.0": 1, "blocks.1": 2, "head": 3, "norm": 3}
    three = split_job(llama_job("/tmp"), ["blocks.1", "head"], [{"mesh": {"data": 2}}])
    assert [s.layers for s in checked_of(three).stages] == [(0, 2), (2, 3), (3, 4)]
    linen = checked_of(split_job(framework_job("/tmp", "linen_mlp"), ["body_1"]))      # a linen params key
    assert [s.layers for s in linen.stages] == [(0, 2), (2, 4)]
    eqx = checked_of(split_job(framework_job("/tmp", "eqx_mlp"), ["out"]))
    assert [s.layers for s in eqx.stages] == [(0, 3), (3, 4)]
    gpt = {**pytree_job("/tmp"), "model": {"name": "mlp", "args": {"blocks": 2}}, "layout": {"batch": "data"}}
    assert [s.layers for s in checked_of(split_job(gpt, ["block1"])).stages] == [(0, 2), (2, 4)]   # a built-in
    virtual = split_job(llama_job("/tmp"), ["blocks.0", "blocks.1", "head"])
    virtual["pipeline"].update(virtual_stages=2, schedule="interleaved-1f1b")
    assert [s.chunks for s in checked_of(virtual).stages] == [((0, 1), (2, 3)), ((1, 2), (3, 4))]


@pytest.mark.parametrize("names,needles", [
    (["layers.1"], ["pipeline.split_at[0] = 'layers.1'", "no part of model", "valid split points: blocks.0, "
                    "blocks.1, head, norm", "0:embed 1:blocks.0 2:blocks.1 3:head"]),
    (["blocks.l"], ["pipeline.split_at[0] = 'blocks.l'", "did you mean 'blocks.1'?"]),
    (["lm_head"], ["pipeline.split_at[0] = 'lm_head'", "inside part 3:head", "valid split points: blocks.0"]),
    (["blocks.0.attn"], ["'blocks.0.attn'", "inside part 1:blocks.0"]),
    (["embed"], ["pipeline.split_at[0] = 'embed'", "the first stage always starts at part 0"]),
])
def test_unknown_split_point_is_refused_with_the_valid_names(names, needles):
    with pytest.raises(ConfigError) as e:
        checked_of(split_job(llama_job("/tmp"), names))
    msg = str(e.value)
    assert all(n in msg for n in needles), (needles, msg)


def test_split_points_out_of_order_miscounted_or_mixed_with_layers_are_refused():
    job = split_job(llama_job("/tmp"), ["head", "blocks.1"], [{"mesh": {"data": 2}}])
    with pytest.raises(ConfigError, match=r"split_at\[1\] = 'blocks.1': starts part 2 .* not after the previous "
                                          r"split point 'head'"):
        checked_of(job)
    with pytest.raises(ConfigError, match=r"pipeline.split_at = \['blocks.1', 'head'\]: 2 stages need 1 split"):
        parse_job(split_job(llama_job("/tmp"), ["blocks.1", "head"]))
    both = split_job(llama_job("/tmp"), ["blocks.1"])
    both["pipeline"]["stages"][1]["layers"] = [2, 4]
    with pytest.raises(ConfigError, match=r"pipeline.stages\[1\].layers = \[2, 4\]: give either pipeline.split_at"):
        parse_job(both)
    with pytest.raises(ConfigError, match=r"pipeline.split_at = 'head': must be a list"):
        parse_job({**both, "pipeline": {**both["pipeline"], "split_at": "head"}})


@pytest.mark.ray
@pytest.mark.slow
def test_nnx_llama_cut_by_named_split_points_matches_oracle(tmp_path, no_leaks):
    """`split_at: [blocks.2, norm]` on a 4-block Llama: stages [embed, blocks.0-1] (data 2),
    [blocks.2-3] (model 2), [head] (data 2) — a cut no layer-range test uses — equal the oracle."""
    from orchestrator.driver.runner import run_job

    job = llama_job(tmp_path)
    job["model"]["args"]["blocks"] = 4
    checked = checked_of(split_job(job, ["blocks.2", "norm"], [{"mesh": {"data": 2}}]))
    assert [s.layers for s in checked.stages] == [(0, 3), (3, 5), (5, 6)]
    pipe = run_job(checked, echo=lambda s: None, keep_params=True)
    losses, params = llama_oracle(checked)
    np.testing.assert_allclose(pipe["losses"], losses, rtol=RTOL, atol=ATOL)
    assert losses[-1] < losses[0]
    assert_params_equal(pipe["params"], params, pipeline_name_to_path)


# ----------------------------------------------------------------------------- candidate mesh axes

CANDIDATES = {"batch": "data", "heads": {"first": ["model", "data"]}, "kv_heads": "model|data",
              "mlp": {"first": ["model", None]}, "vocab": {"first": [["data", "model"], "model"]}}


def test_candidate_mesh_axes_first_that_fits_each_stage_wins():
    """heads 6 x head_dim 8 = 48, kv_heads 2 x 8 = 16, d_mlp 64, vocab 64: on a (data 2, model 3) stage
    heads take model (48 % 3 == 0), kv_heads fall through to data (16 % 3 != 0), mlp to null
    (replicated), vocab replicated (64 % 6 != 0, 64 % 3 != 0); on a stage without a model axis
    every candidate naming model is dropped and heads take data."""
    from orchestrator.core.model.layout import FirstOf, choose, format_layout, parse_layout

    job = llama_job("/tmp")
    job["model"]["args"].update(d_model=48, heads=6, kv_heads=2)
    job["pipeline"]["stages"] = [{"layers": [0, 2], "mesh": {"data": 2, "rep": 3}},
                                 {"layers": [2, 4], "mesh": {"data": 2, "model": 3}}]
    job["layout"] = CANDIDATES
    checked = checked_of(job, {**CLUSTER, "devices_per_host": 6, "hosts": 2})
    assert checked.stages[0].layout == {"batch": "data", "heads": "data", "kv_heads": "data"}
    assert checked.stages[1].layout == {"batch": "data", "heads": "model", "kv_heads": "data"}
    assert parse_job(checked.job.to_dict()) == checked.job                    # {first: [...]} round-trips
    assert checked.job.layout["kv_heads"] == FirstOf(("model", "data"))       # text candidates in a mapping
    assert format_layout(parse_layout("heads:model|data;e:data,model|")) == "heads:model|data;e:data,model|"
    assert choose({"h": FirstOf(("data", "model"))}, {"data": 2, "model": 2}, {"h": [6, 5]}) == {}
    # a stage override replaces the candidates with a plain rule
    job["pipeline"]["stages"][1]["layout"] = {"kv_heads": "model"}
    with pytest.raises(ConfigError, match=r"pipeline.stages\[1\].layout.kv_heads = 'model': not divisible.*16"):
        checked_of(job, {**CLUSTER, "devices_per_host": 6, "hosts": 2})


@pytest.mark.parametrize("rule,needles", [
    ({"frist": ["model"]}, ["layout.heads = {'frist': ['model']}", "{first: [candidate, ...]}"]),
    ({"first": []}, ["layout.heads = {'first': []}", "{first: [candidate, ...]}"]),
    ({"first": ["modle", "data"]}, ["layout.heads", "mesh axis 'modle' is in no stage's mesh", "did you mean 'model'"]),
    ("model|da-ta", ["layout.heads", "'da-ta' must be an identifier"]),
])
def test_bad_candidate_rules_are_refused_with_the_key(rule, needles):
    job = llama_job("/tmp")
    job["layout"]["heads"] = rule
    with pytest.raises(ConfigError) as e:
        checked_of(job)
    assert all(n in str(e.value) for n in needles), (needles, str(e.value))


@pytest.mark.ray
@pytest.mark.slow
def test_nnx_llama_with_candidate_layout_matches_oracle(tmp_path, no_leaks):
    """Candidates resolved per stage reach the stage programs: stage 0 (data 2) shards heads and
    kv_heads over data (a layout no plain-rule test uses), stage 1 (model 2) over model."""
    from orchestrator.driver.runner import run_job

    job = llama_job(tmp_path)
    job["layout"] = CANDIDATES
    checked = checked_of(job)
    assert checked.stages[0].layout == {"batch": "data", "heads": "data", "kv_heads": "data"}
    assert checked.stages[1].layout == {"heads": "model", "kv_heads": "model", "mlp": "model", "vocab": "model"}
    pipe = run_job(checked, echo=lambda s: None, keep_params=True)
    losses, params = llama_oracle(checked)
    np.testing.assert_allclose(pipe["losses"], losses, rtol=RTOL, atol=ATOL)
    assert_params_equal(pipe["params"], params, pipeline_name_to_path)


# ----------------------------------------------------------------------------- float16 with dynamic loss scaling

# float16 tolerance, from a measured single-process fp16-vs-fp16 comparison (fp16_job, 8 steps):
# scaled_oracle under jax.jit against the same loop op by op (jax.disable_jit: every op on its own,
# no fusion) took the same skip decisions and scales, and differed by up to 7.5e-5 relative in the
# losses and by up to 6.4e-4 of an array's largest magnitude in the parameters. Tolerance: 5x those.
FP16_LOSS_RTOL, FP16_PARAM_FRACTION = 4e-4, 3.2e-3
# 2**16 overflows float16 on step 0 (skipped: 2**15); growth every finite step brings the scale
# to 2**21 by step 7, which overflows again (skipped). Measured in scaled_oracle, jit and eager alike.
FP16_SCALE = {"initial": 65536, "growth_interval": 1, "factor": 2, "min_scale": 1}
FP16_SCALES = [2.0 ** k for k in (16, 15, 16, 17, 18, 19, 20, 21)]
FP16_SKIPPED = [0, 7]


def fp16_job(tmp_path):
    job = llama_job(tmp_path, steps=8)
    job["precision"] = {"compute": "float16", "loss_scale": dict(FP16_SCALE)}
    return job


def scaled_oracle(checked, use_jit=True):
    """The nnx Llama under float16 compute with dynamic loss scaling, written out by hand with plain
    jax.value_and_grad: each microbatch's loss times scale/m is differentiated, the sum divided by the
    scale; a step with any non-finite gradient is skipped and halves the scale (not below min_scale),
    `growth_interval` finite steps in a row double it. Returns losses, scales, skipped steps, params."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from examples.llama_model import Llama, next_token_loss
    from stages.data import global_batch, open_reader

    job, a = checked.job, checked.job.model.args
    m, rule = job.pipeline.microbatches, job.precision.loss_scale
    with nnx.use_eager_sharding(False):
        model = Llama(a["vocab"], a["d_model"], a["heads"], a["kv_heads"], a["d_mlp"], a["blocks"],
                      nnx.Rngs(jax.random.key(job.run.seed)))
    graph, state = nnx.split(model, nnx.Param)
    treedef = jax.tree.structure(state)

    def loss_of(pure, x, y, seed):
        st = jax.tree.unflatten(treedef, [v.astype(jnp.float16) for v in jax.tree.leaves(pure)])
        model = nnx.merge(graph, st)
        # Llama.__call__'s body with the policy's float16 activations between the pieces (nnx.Embed
        # returns float32 even from a float16 table, which would run every block in float32)
        h = model.embed(x).astype(jnp.float16)
        for block in model.blocks:
            h = block(h).astype(jnp.float16)
        logits = model.lm_head(model.norm(h)).astype(jnp.float16)
        loss = next_token_loss(logits.astype(jnp.float32), y)
        return loss * seed, loss

    grad = jax.value_and_grad(loss_of, has_aux=True)
    grad = jax.jit(grad) if use_jit else grad
    tx = getattr(optax, job.optimizer.name)(**job.optimizer.args)
    params = nnx.to_pure_dict(state)
    opt_state, reader = tx.init(params), open_reader(checked.data)
    scale, good = rule.initial, 0
    losses, scales, skipped = [], [], []
    for step in range(job.run.steps):
        x, y = global_batch(reader, checked.data, step)
        n = x.shape[0] // m
        acc, mb_losses = jax.tree.map(jnp.zeros_like, params), []
        for i in range(m):
            (_, loss), g = grad(params, jnp.asarray(x[i * n:(i + 1) * n]), jnp.asarray(y[i * n:(i + 1) * n]),
                                jnp.float32(scale) / jnp.float32(m))
            acc = jax.tree.map(jnp.add, acc, g)
            mb_losses.append(float(loss))
        acc = jax.tree.map(lambda v: v / jnp.float32(scale), acc)
        finite = all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree.leaves(acc))
        scales.append(scale)
        losses.append(float(np.mean(mb_losses)))
        if finite:
            updates, opt_state = tx.update(acc, opt_state, params)
            params = optax.apply_updates(params, updates)
            good += 1
            if good >= rule.growth_interval:
                scale, good = scale * rule.factor, 0
        else:
            skipped.append(step)
            scale, good = max(rule.min_scale, scale / rule.factor), 0
    return losses, scales, skipped, flat(params)


def test_loss_scale_rule_and_bad_settings():
    from orchestrator.core.model.policy import DynamicLossScale

    rule = DynamicLossScale(initial=4.0, growth_interval=2, factor=2.0, min_scale=2.0)
    state, seen = rule.start(), []
    for finite in (False, False, True, True, True, False):
        state = rule.next(state, finite)
        seen.append(state)
    assert seen == [(2.0, 0), (2.0, 0), (2.0, 1), (4.0, 0), (4.0, 1), (2.0, 0)]      # min_scale floors it
    job = fp16_job("/tmp")
    assert checked_of(job).job.precision.scaling() == DynamicLossScale(65536.0, 1, 2.0, 1.0)
    job["precision"] = {"compute": "float16"}
    assert checked_of(job).job.precision.scaling() == DynamicLossScale()          # float16: on by default
    job["precision"] = {"compute": "bfloat16"}
    assert checked_of(job).job.precision.scaling() is None
    for bad, needles in [({"factor": 1}, ["precision.loss_scale.factor = 1.0", "must be > 1"]),
                         ({"min_scale": 8, "initial": 4}, ["precision.loss_scale.min_scale = 8.0", "<= initial"]),
                         ({"growth_interval": 0}, ["precision.loss_scale.growth_interval"]),
                         ({"initial": float("inf")}, ["precision.loss_scale.initial"]),
                         ({"bogus": 1}, ["precision.loss_scale.bogus"])]:
        job["precision"] = {"compute": "float16", "loss_scale": bad}
        with pytest.raises(ConfigError) as e:
            parse_job(job)
        assert all(n in str(e.value) for n in needles), (needles, str(e.value))


def test_fp16_plan_moves_half_the_bytes_of_f32():
    fb, bb = edge_bytes(checked_of(fp16_job("/tmp")))
    ff, bf = edge_bytes(checked_of(llama_job("/tmp")))
    assert (2 * fb, 2 * bb) == (ff, bf)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_nnx_llama_fp16_dynamic_loss_scaling_matches_oracle_and_skips_on_every_stage(tmp_path, no_leaks, schedule):
    """float16 compute, 2 stages (stage 1 tensor-parallel): the scale backs off on an overflow, grows
    after each finite step and backs off again — the same scales and skipped steps as scaled_oracle,
    reported identically by every actor (the decision is global), losses and every parameter within
    the measured fp16 tolerance."""
    from orchestrator.driver.runner import run_job

    job = fp16_job(tmp_path)
    job["pipeline"]["schedule"] = schedule
    checked = checked_of(job)
    pipe = run_job(checked, echo=lambda s: None, keep_params=True)
    losses, scales, skipped, params = scaled_oracle(checked)
    assert (scales, skipped) == (FP16_SCALES, FP16_SKIPPED)          # the trajectory this test is about
    assert pipe["loss_scale"] == {"scales": scales, "skipped_steps": skipped}
    np.testing.assert_allclose(pipe["losses"], losses, rtol=FP16_LOSS_RTOL)
    got = {pipeline_name_to_path(k): v for k, v in pipe["params"].items()}
    assert sorted(got) == sorted(params)
    for name, ref in params.items():
        assert got[name].dtype == np.float32, name
        assert np.max(np.abs(got[name] - ref)) <= FP16_PARAM_FRACTION * np.max(np.abs(ref)), name
    # every actor reported the same (scale, skipped) for the last step (the runner fails a run otherwise)
    hosts = pipe["telemetry"]["hosts_last"]
    assert {(h["loss_scale"], h["skipped"]) for h in hosts.values()} == {(scales[-1], True)}, hosts


@pytest.mark.slow
def test_reference_run_applies_the_same_loss_scaling_rule():
    """`meshpipe run --reference` (meshpipe's unpipelined trainer) under fp16: the oracle's scales and
    skipped steps, losses within the fp16 tolerance."""
    from orchestrator.driver.reference import train_reference

    checked = checked_of(fp16_job("/tmp"))
    recs: list = []
    ref = train_reference(checked.model, checked.data, steps=checked.job.run.steps, seed=checked.job.run.seed,
                          microbatches=checked.job.pipeline.microbatches, optimizer=checked.job.optimizer.spec(),
                          on_step=recs.append, loss_scale=checked.job.precision.scaling())
    losses, scales, skipped, _ = scaled_oracle(checked)
    assert [r["loss_scale"] for r in recs] == scales == FP16_SCALES
    assert [r["step"] for r in recs if r["skipped"]] == skipped == FP16_SKIPPED
    np.testing.assert_allclose(ref["losses"], losses, rtol=FP16_LOSS_RTOL)


@pytest.mark.ray
@pytest.mark.slow
def test_fp16_resume_restores_the_loss_scale_state_bit_exact(tmp_path, no_leaks):
    """4 fp16 steps with checkpoints at 2 and 4 vs step 2's checkpoint resumed: the loss-scale state
    (scale 2**15, one finite step towards growth_interval 2) comes back with the arrays, so the resumed
    steps use the same scales and give the same losses and parameters, bit for bit."""
    import shutil

    from orchestrator.core import checkpoint as ck
    from orchestrator.driver.runner import run_job

    def job(name, ckpt_dir):
        j = fp16_job(tmp_path)
        j["run"].update(name=name, steps=4)
        j["precision"]["loss_scale"]["growth_interval"] = 2
        j["checkpoint"] = {"dir": str(ckpt_dir), "every_steps": 2, "keep": 3}
        return j

    full_dir, part_dir = tmp_path / "ck-full", tmp_path / "ck-part"
    full = run_job(checked_of(job("full", full_dir)), echo=lambda s: None, keep_params=True)
    assert full["loss_scale"] == {"scales": [2.0 ** 16, 2.0 ** 15, 2.0 ** 15, 2.0 ** 16], "skipped_steps": [0]}
    part_dir.mkdir()
    shutil.copytree(ck.step_dir(full_dir, 2), ck.step_dir(part_dir, 2))
    resumed = run_job(checked_of(job("resumed", part_dir)), echo=lambda s: None, keep_params=True, resume=2)
    assert resumed["loss_scale"]["scales"] == full["loss_scale"]["scales"][2:]     # not the initial 2**16
    assert resumed["losses"] == full["losses"]
    for name, arr in full["params"].items():
        np.testing.assert_array_equal(resumed["params"][name], arr, err_msg=name)


# ----------------------------------------------------------------------------- RNG state inside nnx / linen models

def nnx_dropout_oracle(checked, train=True):
    """The nnx dropout MLP itself under plain value_and_grad; before each microbatch every block's RNG
    streams are reseeded by the documented rule: stream j (sorted names) of part 1 + i gets
    fold_in(fold_in(microbatch key, 1 + i), j)."""
    import jax
    from flax import nnx

    from tests.byo_models import mse, nnx_dropout_make

    with nnx.use_eager_sharding(False):
        model = nnx_dropout_make(16, 2)(nnx.Rngs(jax.random.key(checked.job.run.seed)))
    graph, state, rest = nnx.split(model, nnx.Param, ...)
    streams = [sorted({v.tag for v in jax.tree.leaves(nnx.state(b, nnx.RngState),
                                                      is_leaf=lambda v: isinstance(v, nnx.Variable))})
               for b in model.blocks]
    assert all(streams), streams                      # the blocks really hold RNG state

    def loss_of(pure, x, y, key):
        # fresh Variables for the RNG state in this trace (nnx refuses to mutate ones from outside it)
        m = nnx.merge(graph, jax.tree.unflatten(jax.tree.structure(state), jax.tree.leaves(pure)),
                      jax.tree.map(lambda v: v, rest))
        for i, (block, names) in enumerate(zip(m.blocks, streams)):
            nnx.reseed(block, **{n: jax.random.fold_in(jax.random.fold_in(key, 1 + i), j) for j, n in enumerate(names)})
        m.train() if train else m.eval()
        return mse(m(x), y)

    return oracle(checked, loss_of, nnx.to_pure_dict(state), flat, keyed=True)


def linen_dropout_oracle(checked, train=True):
    """The linen LinenDropMLP under plain value_and_grad, its submodules called in __call__'s order,
    block i with the documented key: rngs {"dropout": fold_in(fold_in(microbatch key, 1 + i), 0)}."""
    import jax
    import flax.linen as nn

    from tests.byo_models import D_IN, linen_dropout_module, mse

    module = linen_dropout_module(16, 2)
    params0 = nn.unbox(module.init(jax.random.key(checked.job.run.seed), np.zeros((2, D_IN), np.float32)))["params"]

    def loss_of(p, x, y, key):
        v = {"params": p}
        h = module.apply(v, x, method=lambda m, x: m.inp(x))
        for i in range(2):
            h = module.apply(v, h, method=lambda m, x, i=i: m.body[i](x, train=train),
                             rngs={"dropout": jax.random.fold_in(jax.random.fold_in(key, 1 + i), 0)})
        return mse(module.apply(v, h, method=lambda m, x: m.out(x)), y)

    return oracle(checked, loss_of, params0, flat, keyed=True)


@pytest.mark.ray
@pytest.mark.slow
def test_linen_dropout_rngs_per_microbatch_match_oracle(tmp_path, no_leaks):
    from orchestrator.driver.runner import run_job

    checked = checked_of(framework_job(tmp_path, "linen_dropout_mlp"))
    pipe = run_job(checked, echo=lambda s: None, keep_params=True)
    losses, params = linen_dropout_oracle(checked)
    np.testing.assert_allclose(pipe["losses"], losses, rtol=RTOL, atol=ATOL)
    assert_params_equal(pipe["params"], params, lambda n: n.split("/", 1)[1])
    evals, _ = linen_dropout_oracle(checked, train=False)
    assert abs(evals[0] - losses[0]) > 1e-3, (evals[0], losses[0])


@pytest.mark.ray
@pytest.mark.slow
def test_nnx_dropout_rng_state_reseeded_per_microbatch_matches_oracle(tmp_path, no_leaks):
    """nnx.Dropout holding its own RNG stream, 2 stages (stage 1 tensor-parallel over mlp): each
    part's streams are reseeded from (seed, step, microbatch, part) on every call, so the masks are
    the single-process ones; the eval-mode loss differs (the dropout is real)."""
    from orchestrator.driver.runner import run_job

    job = framework_job(tmp_path, "nnx_dropout_mlp")
    checked = checked_of(job)
    assert checked.stages[1].layout.get("mlp") == "model"
    pipe = run_job(checked, echo=lambda s: None, keep_params=True)
    losses, params = nnx_dropout_oracle(checked)
    np.testing.assert_allclose(pipe["losses"], losses, rtol=RTOL, atol=ATOL)
    assert_params_equal(pipe["params"], params, pipeline_name_to_path)
    evals, _ = nnx_dropout_oracle(checked, train=False)
    assert abs(evals[0] - losses[0]) > 1e-3, (evals[0], losses[0])
