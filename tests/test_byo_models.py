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

pytestmark = [pytest.mark.needs_models]

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


def llama_split(checked):
    """The job's nnx Llama, built as its factory builds it: (graph, Param state, state's treedef)."""
    import jax
    from flax import nnx

    from examples.llama_model import Llama

    a = checked.job.model.args
    with nnx.use_eager_sharding(False):
        model = Llama(a["vocab"], a["d_model"], a["heads"], a["kv_heads"], a["d_mlp"], a["blocks"],
                      nnx.Rngs(jax.random.key(checked.job.run.seed)))
    graph, state = nnx.split(model, nnx.Param)
    return graph, state, jax.tree.structure(state)


def llama_oracle(checked, tx=None, norms=None):
    """The nnx Llama itself; under a bfloat16 job the same policy written out by hand: float32
    parameters cast to bfloat16 for the forward, activations in bfloat16 between the pieces (as
    the parts leave them; nnx.Embed returns float32 even from a bfloat16 table, which would run
    every block in float32), logits to float32 for the loss."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from examples.llama_model import next_token_loss

    compute = jnp.dtype(checked.job.precision.compute)
    graph, state, treedef = llama_split(checked)

    def loss_of(pure, x, y):
        st = jax.tree.unflatten(treedef, [v.astype(compute) for v in jax.tree.leaves(pure)])
        model = nnx.merge(graph, st)
        h = model.embed(x).astype(compute)           # Llama.__call__'s body, with the policy's casts
        for block in model.blocks:
            h = block(h).astype(compute)
        logits = model.lm_head(model.norm(h)).astype(compute)
        return next_token_loss(logits.astype(jnp.float32), y)

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
        # atol: at least 1e-6, else 1e-5 of the array's largest entry. After a few adam steps an
        # entry's float32 error follows the size of the terms its gradient sums (the pipeline and
        # the oracle order them differently), not the entry's own size: on an AVX2-only CPU one
        # embedding entry of 0.00886, in an array whose largest is ~0.4, differed by 1.27e-6.
        scale = float(np.max(np.abs(ref[name]))) if np.size(ref[name]) else 0.0
        np.testing.assert_allclose(got[name], ref[name], rtol=RTOL, atol=max(ATOL, RTOL * scale), err_msg=name)


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
# Tolerance: 5x those spreads. Re-measured after the oracle kept its activations in bfloat16
# (jit against op by op): 1.8e-3 and 2.1%, within the same tolerance.
# test_bf16_tolerance_is_five_to_ten_times_the_measured_bf16_spread re-measures the latter (2 cores,
# jax 0.10.2: 1.78e-3 and 2.15%, so the tolerances are 5.6x and 7.0x it) and fails if a tolerance falls
# below 5x the spread this JAX gives or grows past 10x it.
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


def bf16_spread(checked) -> tuple[float, float]:
    """(loss, parameter) spread of the bf16 oracle with itself: whole-model `jit` against op by op
    (`jax.disable_jit`: every op alone, no fusion, other bf16 roundings). Loss: the largest relative
    difference over the steps; parameters: the largest max |difference| / max |array| over arrays."""
    import jax

    jit_losses, jit_params = llama_oracle(checked)
    with jax.disable_jit():
        op_losses, op_params = llama_oracle(checked)
    loss = max(abs(a - b) / abs(b) for a, b in zip(jit_losses, op_losses))
    param = max(float(np.max(np.abs(jit_params[k] - op_params[k])) / np.max(np.abs(op_params[k]))) for k in op_params)
    return loss, param


@pytest.mark.slow          # ~2 min on 2 loaded cores: the op-by-op run is eager
def test_bf16_tolerance_is_five_to_ten_times_the_measured_bf16_spread():
    """The bf16 tolerances rest on a measurement (the comment above BF16_LOSS_RTOL): re-measured here
    on the same job, each tolerance must be at least 5x the spread (the stated multiple) and at most
    10x (a JAX that narrows the spread should narrow the tolerance too)."""
    job = llama_job("/tmp")
    job["precision"] = {"compute": "bfloat16"}
    loss, param = bf16_spread(checked_of(job))
    assert loss > 0 and param > 0, (loss, param)            # the two runs really round differently
    assert 5 * loss <= BF16_LOSS_RTOL <= 10 * loss, loss
    assert 5 * param <= BF16_PARAM_FRACTION <= 10 * param, param


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
            "sys.argv = ['meshpipe', 'plan', 'examples/llama.yaml', '--json', '--allow-code']\n"
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
