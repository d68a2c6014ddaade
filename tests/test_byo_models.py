"""Bring your own model: flax.nnx and plain-JAX models, unchanged, pipelined, against an independent oracle.

The oracle is NOT meshpipe's stage code: it is the user's whole model (the nnx
`Llama` module itself; the plain functions composed into one) trained with
`jax.value_and_grad` in this process, with the same init (the model's own init
from `jax.random.key(seed)`), the same data (seed, step), the same microbatch
accumulation order (gradients of microbatch 0, 1, … scaled by 1/m, summed in
order) and the same optax optimizer.

Tolerance: float32, rtol 1e-5 / atol 1e-6 on every per-step loss and on EVERY
parameter array after the run (elementwise, not norms). The pipelined stages run
the same math under GSPMD partitioning (tensor-parallel reductions in another
order), so the results agree to float32 rounding, not bit for bit.

The optimizer here is SGD with momentum, not Adam: Adam divides each gradient element
by its own running RMS, so an element whose gradient is ~1e-9 (an embedding row barely
used) turns a float32 rounding difference into an O(learning rate) parameter
difference. Measured with adam(3e-3) on the nnx Llama after 4 steps: 4 of 512
elements of one kernel differed by up to 2.8e-6 absolute (5e-4 relative) while
every loss agreed to 1e-5. SGD+momentum keeps the elementwise comparison well
conditioned (a parameter error is lr × the gradient's rounding error).
"""
from __future__ import annotations

import numpy as np
import pytest

from orchestrator.core.config import ConfigError, check_job, parse_cluster, parse_job
from orchestrator.core.model.pipeline import key_path

RTOL, ATOL = 1e-5, 1e-6
# init_s: stage setup compiles each part's programs; on the shared 2-core machine 120 s ran out
CLUSTER = {"address": None, "platform": "cpu", "hosts": 4, "devices_per_host": 2, "cpus_per_host": 0.5,
           "timeouts": {"init_s": 600}}
LLAMA = {"vocab": 64, "d_model": 32, "heads": 4, "kv_heads": 2, "d_mlp": 64, "blocks": 2}


def llama_job(tmp_path, schedule="1f1b", steps=4):
    return {
        "run": {"name": f"llama-{schedule}", "steps": steps, "seed": 3, "output_dir": str(tmp_path)},
        "model": {"factory": "examples.llama_model:pipeline", "args": dict(LLAMA)},
        "data": {"source": "synthetic", "global_batch": 16, "seq_len": 16},
        "optimizer": {"name": "sgd", "args": {"learning_rate": 0.2, "momentum": 0.9}},
        "pipeline": {"schedule": schedule, "microbatches": 4, "stages": [
            {"layers": [0, 2], "mesh": {"data": 2}},
            {"layers": [2, 4], "mesh": {"model": 2}},
        ]},
        "layout": {"batch": "data", "heads": "model", "kv_heads": "model", "mlp": "model", "vocab": "model"},
    }


def pytree_job(tmp_path):
    return {
        "run": {"name": "pytree", "steps": 4, "seed": 5, "output_dir": str(tmp_path)},
        "model": {"factory": "tests.byo_models:pytree_mlp", "args": {"d": 16, "blocks": 2}},
        "data": {"source": "synthetic", "global_batch": 16},
        "optimizer": {"name": "sgd", "args": {"learning_rate": 0.1}},
        "pipeline": {"schedule": "1f1b", "microbatches": 4, "stages": [
            {"layers": [0, 2], "mesh": {"data": 2}},
            {"layers": [2, 4], "mesh": {"model": 2}},
        ]},
        "layout": {"batch": "data"},
    }


def framework_job(tmp_path, factory):
    """linen / equinox MLPs: stage 1 tensor-parallel over the MLP hidden dim."""
    job = pytree_job(tmp_path)
    job["run"]["name"] = factory
    job["model"] = {"factory": f"tests.byo_models:{factory}", "args": {"d": 16, "blocks": 2}}
    job["optimizer"] = {"name": "sgd", "args": {"learning_rate": 0.1, "momentum": 0.9}}
    job["layout"] = {"batch": "data", "mlp": "model"}
    return job


def checked_of(job, cluster=CLUSTER):
    return check_job(parse_job(job), parse_cluster(cluster))


# ----------------------------------------------------------------------------- the oracle

def oracle(checked, loss_of, params0, to_flat, tx=None, norms=None, keyed=False):
    """Plain single-process training: value_and_grad of the whole model, microbatches in order.
    `tx`: the optax transformation (default: the job's single optimizer); `norms`: a list that
    receives each step's global gradient norm; `keyed`: loss_of also takes the microbatch's RNG key."""
    import jax
    import jax.numpy as jnp
    import optax

    from stages.data import global_batch, open_reader

    job = checked.job
    m = job.pipeline.microbatches
    tx = tx or getattr(optax, job.optimizer.name)(**job.optimizer.args)
    reader = open_reader(checked.data)        # the job's data: the same batch for (seed, step) everywhere
    grad = jax.jit(jax.value_and_grad(loss_of))
    params, state = params0, tx.init(params0)
    losses = []
    for step in range(job.run.steps):
        x, y = global_batch(reader, checked.data, step)
        n = x.shape[0] // m
        acc, mb_losses = jax.tree.map(jnp.zeros_like, params), []
        for i in range(m):
            xy = (jnp.asarray(x[i * n:(i + 1) * n]), jnp.asarray(y[i * n:(i + 1) * n]))
            if keyed:       # the documented rule: fold_in(fold_in(key(seed), step), microbatch)
                xy += (jax.random.fold_in(jax.random.fold_in(jax.random.key(job.run.seed), step), i),)
            loss, g = grad(params, *xy)
            acc = jax.tree.map(lambda a, b: a + b / m, acc, g)
            mb_losses.append(float(loss))
        if norms is not None:
            norms.append(float(optax.tree.norm(acc)))
        updates, state = tx.update(acc, state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(np.mean(mb_losses)))
    return losses, to_flat(params)


def flat(tree) -> dict:
    import jax

    return {key_path(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def llama_oracle(checked, tx=None, norms=None):
    """The nnx Llama itself; under a bfloat16 job the same policy written out by hand: float32
    parameters cast to bfloat16 for the forward, logits to float32 for the loss."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from examples.llama_model import Llama, next_token_loss

    a = checked.job.model.args
    compute = jnp.dtype(checked.job.precision.compute)
    with nnx.use_eager_sharding(False):
        model = Llama(a["vocab"], a["d_model"], a["heads"], a["kv_heads"], a["d_mlp"], a["blocks"],
                      nnx.Rngs(jax.random.key(checked.job.run.seed)))
    graph, state = nnx.split(model, nnx.Param)
    treedef = jax.tree.structure(state)

    def loss_of(pure, x, y):
        st = jax.tree.unflatten(treedef, [v.astype(compute) for v in jax.tree.leaves(pure)])
        return next_token_loss(nnx.merge(graph, st)(x).astype(jnp.float32), y)

    return oracle(checked, loss_of, nnx.to_pure_dict(state), flat, tx, norms)


def pipeline_name_to_path(name: str) -> str:
    """'01.blocks.0/blocks.0/attn/q/kernel' -> 'blocks/0/attn/q/kernel' (the nnx adapter's naming)."""
    _, _, rest = name.partition("/")
    head, _, leaf = rest.partition("/")
    return f"{head.replace('.', '/')}/{leaf}"


def assert_params_equal(pipe: dict, ref: dict, rename=lambda n: n):
    got = {rename(k): v for k, v in pipe.items()}
    assert sorted(got) == sorted(ref), (sorted(got), sorted(ref))
    for name in sorted(ref):
        np.testing.assert_allclose(got[name], ref[name], rtol=RTOL, atol=ATOL, err_msg=name)


# ----------------------------------------------------------------------------- pure: the front end

def test_linen_and_equinox_axes_from_metadata_and_path_rules():
    linen = checked_of(framework_job("/tmp", "linen_mlp")).model
    assert linen.layers[1].params["body_0/w"].axes == ("embed", "mlp")      # nn.with_logical_partitioning
    assert linen.layers[0].params["inp/bias"].axes == (None,)
    eqx = checked_of(framework_job("/tmp", "eqx_mlp")).model
    assert [layer.name for layer in eqx.layers] == ["inp", "blocks.0", "blocks.1", "out"]
    assert eqx.layers[1].params["blocks.0/layers/0/weight"].axes == ("mlp", "embed")   # path rule
    assert eqx.layers[3].outputs[0].axes == ("batch", None)


def test_nnx_axes_come_from_the_models_partitioning_metadata():
    model = checked_of(llama_job("/tmp")).model
    assert [layer.name for layer in model.layers] == ["embed", "blocks.0", "blocks.1", "head"]
    block = model.layers[1].params
    assert block["blocks.0/attn/q/kernel"].axes == ("embed", "heads")
    assert block["blocks.0/attn/k/kernel"].axes == ("embed", "kv_heads")
    assert block["blocks.0/attn/k/kernel"].shape == (32, 16)          # 2 kv heads × head_dim 8
    assert block["blocks.0/down/kernel"].axes == ("mlp", "embed")
    assert model.layers[0].params["embed/embedding"].axes == ("vocab", "embed")
    assert model.layers[3].params["lm_head/kernel"].axes == ("embed", "vocab")
    assert model.layers[1].outputs[0].axes == ("batch", "seq", "embed")
    assert model.layers[3].outputs[0].shape == (16, 64)


def test_pytree_activation_described_leaf_by_leaf_with_real_dtypes():
    checked = checked_of(pytree_job("/tmp"))
    outs = checked.model.layers[1].outputs
    assert [(o.path, o.dtype, o.shape, o.axes) for o in outs] == [
        ("count", "int32", (1,), ("batch", None)),
        ("h", "float32", (16,), ("batch", "embed"))]
    from orchestrator.core.edges import edges_json

    edge = edges_json(checked)[0]
    by = {leaf["path"]: leaf for leaf in edge["leaves"]}
    assert by["count"]["dtype"] == "int32" and "backward" not in by["count"]       # no gradient for ints
    assert by["h"]["forward"]["lower_bound_bytes"] == 4 * 16 * 4                    # mb 4 × 16 × float32
    assert edge["forward"]["lower_bound_bytes"] == 4 * 16 * 4 + 4 * 1 * 4


@pytest.mark.parametrize("model,needles", [
    ({"factory": "tests.byo_models:raises"},
     ["model.factory", "tests.byo_models:raises", "factory failed", "RuntimeError", "boom"]),
    ({"factory": "tests.byo_models:not_a_model"}, ["model.factory", "returned dict, not a PipelineModel"]),
    ({"factory": "tests.byo_models:bad_feed"},
     ["model.factory", "part 1 (b) cannot take the output of part 0 (a)", "float32[2, 16]"]),
    ({"factory": "tests.byo_models:nope"}, ["model.factory", "cannot import", "nope"]),
    ({"factory": "tests.byo_models:pytree_mlp", "args": {"bogus": 1}}, ["model.factory", "bogus"]),
])
def test_bad_models_refused_at_plan_time(model, needles):
    job = {**pytree_job("/tmp"), "model": model}
    with pytest.raises(ConfigError) as e:
        checked_of(job)
    msg = str(e.value)
    missing = [n for n in needles if n not in msg]
    assert not missing, f"{missing} not in:\n{msg}"


def test_model_name_and_factory_are_exclusive():
    with pytest.raises(ConfigError, match="exactly one of"):
        parse_job({**pytree_job("/tmp"), "model": {"name": "gpt", "factory": "tests.byo_models:pytree_mlp"}})


def test_split_point_that_does_not_exist_is_named():
    from orchestrator.core.model.adapters import nnx_model
    from orchestrator.core.model.pipeline import ModelError

    from examples.llama_model import Llama, next_token_loss

    with pytest.raises(ModelError, match=r"split point 'blocks.7' does not exist.*no index '7'"):
        nnx_model(lambda rngs: Llama(64, 32, 4, 2, 64, 2, rngs), ["embed", "blocks.7"], loss=next_token_loss,
                  input=((16,), "int32"), label=((16,), "int32"))
    with pytest.raises(ModelError, match=r"split point 'blokcs.0' does not exist.*has no attribute 'blokcs'"):
        nnx_model(lambda rngs: Llama(64, 32, 4, 2, 64, 2, rngs), ["blokcs.0"], loss=next_token_loss,
                  input=((16,), "int32"), label=((16,), "int32"))


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


def test_logical_axis_not_divisible_names_the_rule_and_the_nnx_parameter():
    job = llama_job("/tmp")
    job["model"]["args"]["vocab"] = 63
    with pytest.raises(ConfigError) as e:
        checked_of(job)
    msg = str(e.value)
    for needle in ("layout.vocab", "'model'", "not divisible", "03.head/lm_head/kernel", "63"):
        assert needle in msg, msg


# ----------------------------------------------------------------------------- Ray: pipelined == oracle

def three_stages(job):
    """4 blocks: embed+blocks.0 (data 2) | blocks.1-2 (model 2) | blocks.3+head (data 2)."""
    job["model"]["args"]["blocks"] = 4
    job["pipeline"]["stages"] = [{"layers": [0, 2], "mesh": {"data": 2}}, {"layers": [2, 4], "mesh": {"model": 2}},
                                 {"layers": [4, 6], "mesh": {"data": 2}}]
    return job


@pytest.mark.ray
@pytest.mark.parametrize("schedule,stages", [
    ("1f1b", 2),
    pytest.param("zb-h1", 2, marks=pytest.mark.slow),
    pytest.param("1f1b", 3, marks=pytest.mark.slow),
])
def test_nnx_llama_tensor_parallel_stage_matches_oracle(tmp_path, no_leaks, schedule, stages):
    from orchestrator.driver.runner import run_job

    job = llama_job(tmp_path, schedule)
    checked = checked_of(three_stages(job) if stages == 3 else job)
    assert checked.stages[1].layout.get("heads") == "model"            # stage 1 is tensor-parallel
    pipe = run_job(checked, echo=lambda s: None, keep_params=True)
    losses, params = llama_oracle(checked)
    np.testing.assert_allclose(pipe["losses"], losses, rtol=RTOL, atol=ATOL)
    assert losses[-1] < losses[0]
    assert_params_equal(pipe["params"], params, pipeline_name_to_path)


@pytest.mark.ray
def test_plain_jax_pytree_activations_with_an_int_leaf_match_oracle(tmp_path, no_leaks):
    import jax

    from orchestrator.driver.runner import run_job
    from tests.byo_models import mse, pytree_forward, pytree_init

    checked = checked_of(pytree_job(tmp_path))
    pipe = run_job(checked, echo=lambda s: None, keep_params=True)
    params0 = pytree_init(jax.random.key(checked.job.run.seed), 16, 2)
    losses, params = oracle(checked, lambda p, x, y: mse(pytree_forward(p, x, 2), y), params0, flat)
    np.testing.assert_allclose(pipe["losses"], losses, rtol=RTOL, atol=ATOL)
    # pipeline names '01.block0/w' -> oracle path 'block0/w'
    assert_params_equal(pipe["params"], params, lambda n: n.split(".", 1)[1])


def linen_oracle(checked):
    import jax
    import flax.linen as nn

    from tests.byo_models import D_IN, linen_module, mse

    module = linen_module(16, 2)
    params0 = nn.unbox(module.init(jax.random.key(checked.job.run.seed), np.zeros((2, D_IN), np.float32)))["params"]
    return oracle(checked, lambda p, x, y: mse(module.apply({"params": p}, x), y), params0, flat)


def eqx_oracle(checked):
    import jax
    import equinox as eqx

    from tests.byo_models import eqx_make, mse

    model = eqx_make(16, 2)(jax.random.key(checked.job.run.seed))
    params0, static = eqx.partition(model, eqx.is_array)

    def loss_of(p, x, y):
        return mse(jax.vmap(eqx.combine(p, static))(x), y)

    return oracle(checked, loss_of, params0, flat)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("factory,ref", [("linen_mlp", linen_oracle), ("eqx_mlp", eqx_oracle)])
def test_linen_and_equinox_models_two_stages_tensor_parallel_match_oracle(tmp_path, no_leaks, factory, ref):
    from orchestrator.driver.runner import run_job

    checked = checked_of(framework_job(tmp_path, factory))
    # stage 1's MLP hidden dim really is split over the model axis
    assert checked.stages[1].layout.get("mlp") == "model"
    pipe = run_job(checked, echo=lambda s: None, keep_params=True)
    losses, params = ref(checked)
    np.testing.assert_allclose(pipe["losses"], losses, rtol=RTOL, atol=ATOL)
    assert losses[-1] < losses[0]
    rename = (lambda n: n.split("/", 1)[1]) if factory == "linen_mlp" else pipeline_name_to_path
    assert_params_equal(pipe["params"], params, rename)


# ----------------------------------------------------------------------------- bf16 and remat

# bfloat16 tolerance, from a measured single-process bf16-vs-bf16 comparison (this job, 4 steps):
# the oracle's whole-model jit against the same math with optimisation barriers between blocks
# (another XLA fusion, so other bf16 roundings) differed by 2.1e-3 relative in the losses and by
# up to 3.0% of an array's largest magnitude in the parameters (bf16 vs f32: 1.3e-3 and 1.8%).
# Tolerance: 5x those spreads.
BF16_LOSS_RTOL, BF16_PARAM_FRACTION = 1e-2, 0.15


def edge_bytes(checked) -> tuple[int, int]:
    """Plan: bytes one microbatch moves across edge 0→1, forward and backward."""
    from orchestrator.core.edges import edges_json

    e = edges_json(checked)[0]
    return e["forward"]["cross_host_bytes"], e["backward"]["cross_host_bytes"]


def test_bf16_plan_moves_half_the_bytes_of_f32():
    f32 = checked_of(llama_job("/tmp"))
    job = llama_job("/tmp")
    job["precision"] = {"compute": "bfloat16"}
    bf16 = checked_of(job)
    assert bf16.model.layers[1].outputs[0].dtype == "bfloat16"
    assert all(p.dtype == "float32" for p in bf16.model.layers[1].params.values())   # params stay f32
    fb, bb = edge_bytes(bf16)
    ff, bf = edge_bytes(f32)
    assert (fb * 2, bb * 2) == (ff, bf) and ff == 4 * 16 * 32 * 4       # mb 4 × seq 16 × d 32 × f32


@pytest.mark.ray
@pytest.mark.slow
def test_nnx_llama_bf16_matches_bf16_oracle_and_moves_half_the_bytes(tmp_path, no_leaks):
    from orchestrator.driver.runner import run_job

    job = llama_job(tmp_path)
    job["precision"] = {"compute": "bfloat16"}
    checked = checked_of(job)
    pipe = run_job(checked, echo=lambda s: None, keep_params=True)
    losses, params = llama_oracle(checked)
    np.testing.assert_allclose(pipe["losses"], losses, rtol=BF16_LOSS_RTOL)
    got = {pipeline_name_to_path(k): v for k, v in pipe["params"].items()}
    assert sorted(got) == sorted(params)
    for name, ref in params.items():
        assert got[name].dtype == np.float32, name                       # parameters stay float32
        assert np.max(np.abs(got[name] - ref)) <= BF16_PARAM_FRACTION * np.max(np.abs(ref)), name
    # counted by the transport: every forward / backward crossing in bfloat16
    sends = checked.job.run.steps * checked.job.pipeline.microbatches
    hosts = pipe["telemetry"]["hosts_last"]
    fwd, bwd = edge_bytes(checked)
    assert hosts["stage0/host0"]["sent_bytes_to"]["1"] == sends * fwd
    assert hosts["stage1/host0"]["sent_bytes_to"]["0"] == sends * bwd
    f32_fwd, f32_bwd = edge_bytes(checked_of(llama_job(tmp_path)))
    assert (2 * fwd, 2 * bwd) == (f32_fwd, f32_bwd)


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


def test_unknown_remat_policy_is_refused_with_the_valid_names():
    job = llama_job("/tmp")
    job["pipeline"]["stages"][1]["remat"] = "dots_savable"
    with pytest.raises(ConfigError) as e:
        checked_of(job)
    msg = str(e.value)
    for needle in ("pipeline.stages[1].remat", "'dots_savable'", "unknown remat policy", "dots_saveable", "full"):
        assert needle in msg, msg


def residual_bytes(checked, stage: int, remat: str) -> int:
    """Shapes only: bytes of the residuals one microbatch keeps on `stage` (no mesh: one device)."""
    import jax

    from orchestrator.core.model.registry import build_model
    from stages.program import StageProgram, make_optimizer

    spec = checked.model
    start, stop = checked.stages[stage].layers
    prog = StageProgram(spec, build_model(spec.factory, spec.args), start, stop, microbatches=1,
                        optimizer=make_optimizer("sgd", {"learning_rate": 0.1}), remat=remat)
    params = jax.eval_shape(prog.init_params, 0)
    mb = checked.microbatch_size
    xs = [jax.ShapeDtypeStruct(leaf.batched(mb), leaf.dtype) for leaf in prog.in_leaves]
    labels = jax.ShapeDtypeStruct(spec.label.batched(mb), spec.label.dtype) if prog.last else None
    _, res = jax.eval_shape(prog.fwd, params, xs, labels)
    return sum(r.size * r.dtype.itemsize for r in jax.tree.leaves(res))


@pytest.mark.ray
@pytest.mark.slow
def test_nnx_llama_with_remat_matches_oracle_and_keeps_less(tmp_path, no_leaks):
    """Stage 0 under dots_saveable, stage 1 under full remat: the same training (float32
    tolerance), and the residuals the actors measure are what the remat programs keep."""
    from orchestrator.driver.runner import run_job

    job = llama_job(tmp_path)
    job["layout"] = {"batch": "data"}
    for st, remat in zip(job["pipeline"]["stages"], ("dots_saveable", "full")):
        st["mesh"], st["remat"] = {"data": 1}, remat
    checked = checked_of(job, {**CLUSTER, "devices_per_host": 1})
    assert [s.remat for s in checked.stages] == ["dots_saveable", "full"]
    pipe = run_job(checked, echo=lambda s: None, keep_params=True)
    losses, params = llama_oracle(checked)
    np.testing.assert_allclose(pipe["losses"], losses, rtol=RTOL, atol=ATOL)
    assert_params_equal(pipe["params"], params, pipeline_name_to_path)
    hosts = pipe["telemetry"]["hosts_last"]
    for s, remat in enumerate(("dots_saveable", "full")):
        kept = residual_bytes(checked, s, remat)
        assert kept < residual_bytes(checked, s, "none") / 2, (s, remat)
        got = hosts[f"stage{s}/host0"]
        assert got["stash_peak_bytes"] == got["stash_peak_items"] * kept, (s, got, kept)


# ----------------------------------------------------------------------------- optax chains, global-norm clipping

MAX_NORM = 0.05
CHAIN = [
    {"name": "clip_by_global_norm", "args": {"max_norm": MAX_NORM}},
    {"name": "add_decayed_weights", "args": {"weight_decay": 0.05, "mask": {"exclude": ["*norm*"]}}},
    {"name": "sgd", "args": {"momentum": 0.9, "learning_rate": {
        "schedule": "warmup_cosine_decay_schedule",
        "args": {"init_value": 0.0, "peak_value": 0.5, "warmup_steps": 2, "decay_steps": 6}}}},
]


def oracle_chain():
    """The same chain written directly in optax over the nnx model's own parameter tree."""
    import jax
    import optax

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(lambda p, _: "norm" not in key_path(p), params)

    return optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.add_decayed_weights(0.05, mask=decay_mask),
                       optax.sgd(optax.warmup_cosine_decay_schedule(0.0, 0.5, 2, 6), momentum=0.9))


def test_optax_chain_from_yaml_builds_masks_over_part_names_and_refuses_bad_entries():
    import jax

    from orchestrator.core.model.registry import build_model
    from stages.program import StageProgram

    job = llama_job("/tmp")
    job["optimizer"] = {"chain": CHAIN}
    checked = checked_of(job)
    prog = StageProgram(checked.model, build_model(checked.model.factory, checked.model.args), 1, 4,
                        microbatches=4, optimizer=checked.job.optimizer.spec())
    assert prog.clip == MAX_NORM                             # taken out of the chain: done across stages
    params = jax.eval_shape(prog.init_params, 0)
    names = jax.tree.leaves(prog.param_names(params))
    assert "blocks.0/blocks.0/attn_norm/scale" in names and "head/lm_head/kernel" in names
    for chain, needles in [
        ([{"name": "adamx", "args": {}}], ["optimizer.chain[0].name", "'adamx'", "not an optax function"]),
        ([{"name": "sgd", "args": {"learning_rate": 0.1}}, {"name": "clip_by_global_norm", "args": {"max_norm": 1}}],
         ["optimizer.chain[1].name", "must come first"]),
        ([{"name": "sgd", "args": {"learning_rate": {"schedule": "cosine_decay", "args": {}}}}],
         ["optimizer.chain[0].args.learning_rate.schedule", "not an optax schedule"]),
        ([{"name": "adamw", "args": {"learning_rate": 0.1, "bogus": 1}}], ["optimizer.chain[0].args", "rejects"]),
    ]:
        job["optimizer"] = {"chain": chain}
        with pytest.raises(ConfigError) as e:
            checked_of(job)
        assert all(n in str(e.value) for n in needles), (needles, str(e.value))


@pytest.mark.ray
def test_global_norm_clipping_across_stages_matches_single_process_optax(tmp_path, no_leaks):
    """clip_by_global_norm with a threshold that bites on every step: each stage's squared norm is
    exchanged before any stage updates, so the pipelined run equals optax over the whole model."""
    from orchestrator.driver.runner import run_job

    job = llama_job(tmp_path)
    job["optimizer"] = {"chain": CHAIN}
    checked = checked_of(job)
    pipe = run_job(checked, echo=lambda s: None, keep_params=True)
    norms: list = []
    losses, params = llama_oracle(checked, oracle_chain(), norms)
    assert min(norms) > 2 * MAX_NORM, norms                  # the clip bites on every step
    np.testing.assert_allclose(pipe["losses"], losses, rtol=RTOL, atol=ATOL)
    assert_params_equal(pipe["params"], params, pipeline_name_to_path)


@pytest.mark.ray
@pytest.mark.slow
def test_dropout_keys_per_seed_step_microbatch_part_match_oracle(tmp_path, no_leaks):
    """Dropout in the blocks draws from fold_in(fold_in(fold_in(key(seed), step), microbatch), part):
    the pipelined masks (batch split over 2 devices on stage 0) are the single-process ones."""
    import jax

    from orchestrator.driver.runner import run_job
    from tests.byo_models import dropout_block, dropout_init, mse

    job = pytree_job(tmp_path)
    job["model"] = {"factory": "tests.byo_models:dropout_mlp", "args": {"d": 16, "blocks": 2}}
    job["pipeline"]["stages"] = [{"layers": [0, 2], "mesh": {"data": 2}}, {"layers": [2, 4], "mesh": {"data": 2}}]
    checked = checked_of(job)
    pipe = run_job(checked, echo=lambda s: None, keep_params=True)

    def loss_of(p, x, y, key, train=True):
        h = x @ p["in"]["w"]
        for i in range(2):
            h = dropout_block(p[f"block{i}"], h, rng=jax.random.fold_in(key, 1 + i), train=train)
        return mse(h @ p["out"]["w"], y)

    params0 = dropout_init(jax.random.key(checked.job.run.seed), 16, 2)
    losses, params = oracle(checked, loss_of, params0, flat, keyed=True)
    np.testing.assert_allclose(pipe["losses"], losses, rtol=RTOL, atol=ATOL)
    assert_params_equal(pipe["params"], params, lambda n: n.split(".", 1)[1])
    # the dropout is real: in eval mode (no masks) the same model gives another loss
    evals, _ = oracle(checked, lambda p, x, y, key: loss_of(p, x, y, key, train=False), params0, flat, keyed=True)
    assert abs(evals[0] - losses[0]) > 1e-3, (evals[0], losses[0])


def test_plan_of_the_llama_example_needs_no_ray_or_devices():
    """`meshpipe plan examples/llama.yaml` in a fresh interpreter: shapes by jax.eval_shape only."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    code = ("import sys, json\n"
            "from orchestrator.driver.cli import main\n"
            "sys.argv = ['meshpipe', 'plan', 'examples/llama.yaml', '--json']\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print('RAY_IMPORTED=%s' % ('ray' in sys.modules), file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr
    assert "RAY_IMPORTED=False" in out.stderr
    plan = json.loads(out.stdout)
    assert plan["stages"][0]["layer_names"] == ["embed", "blocks.0"]
    assert plan["stages"][1]["layer_names"] == ["blocks.1", "head"]
    leaf = plan["edges"][0]["leaves"][0]
    assert leaf["dtype"] == "float32" and leaf["shape"] == [4, 32, 64]
