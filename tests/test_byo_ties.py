"""Bring your own model: tied weights across stages (a Llama whose unembedding is its embedding).

The oracle is the nnx Llama itself with ONE embedding array used twice (`embed(tokens)` and
`embed.attend(h)`), trained by plain `jax.value_and_grad` in one process with the same data,
microbatch order and optax chain (global-norm clipping that bites, weight decay, SGD with
momentum). Pipelined on 2 stages (the embedding on stage 0, data-parallel; its copy in the head
on stage 1, tensor-parallel over vocab) every parameter array — both copies of the embedding
against the one oracle array — must match at float32 tolerance, rtol 1e-5 / atol 1e-6
(`tests.test_byo_models`), and the two copies must be bit-identical after every run.
"""
from __future__ import annotations

import numpy as np
import pytest

from orchestrator.core.config import ConfigError
from tests.test_byo_models import (ATOL, CHAIN, MAX_NORM, RTOL, checked_of, flat, llama_job, llama_split, oracle,
                                   oracle_chain, pipeline_name_to_path, pytree_job)

pytestmark = [pytest.mark.needs_models]


EMBED = ("00.embed/embed/embedding", "03.head/embed/embedding")


def tied_job(tmp_path, steps=4):
    job = llama_job(tmp_path, steps=steps)
    job["model"]["factory"] = "tests.byo_tied_models:tied_llama"
    job["optimizer"] = {"chain": CHAIN}
    return job


def tied_oracle(checked, norms=None):
    """The Llama with its head replaced by `embed.attend(norm(h))`: one embedding array."""
    import jax
    from flax import nnx

    from examples.llama_model import next_token_loss

    graph, state, treedef = llama_split(checked)

    def loss_of(pure, x, y):
        m = nnx.merge(graph, jax.tree.unflatten(treedef, jax.tree.leaves(pure)))
        h = m.embed(x)
        for block in m.blocks:
            h = block(h)
        return next_token_loss(m.embed.attend(m.norm(h)), y)

    return oracle(checked, loss_of, nnx.to_pure_dict(state), flat, oracle_chain(), norms)


def test_ties_found_from_a_shared_submodule_and_bad_ties_refused():
    spec = checked_of(tied_job("/tmp")).model
    assert spec.ties == (((0, "embed/embedding"), (3, "embed/embedding")),)
    assert "embed/embedding" in spec.layers[3].params and "lm_head/kernel" not in spec.layers[3].params
    plain = {**pytree_job("/tmp"), "model": {"factory": "tests.byo_tied_models:plain_tied"},
             "pipeline": {"schedule": "1f1b", "microbatches": 4, "stages": [{"layers": [0, 1], "mesh": {"data": 2}},
                                                                            {"layers": [1, 2], "mesh": {"data": 2}}]}}
    assert checked_of(plain).model.ties == (((0, "w"), (1, "w")),)
    for bad, needles in [
        ("unknown", ["model.factory", "ties[0]", "'out/q' is not a parameter", "in/w, out/v, out/w"]),
        ("shape", ["ties[0]", "float32[8, 4] and float32[8, 2] differ"]),
        ("self", ["ties[0]", "ties a parameter to itself"]),
        ("twice", ["ties[1]", "'in/w' is already tied (ties[0])"]),
    ]:
        job = {**plain, "model": {"factory": "tests.byo_tied_models:plain_tied", "args": {"bad": bad}}}
        with pytest.raises(ConfigError) as e:
            checked_of(job)
        assert all(n in str(e.value) for n in needles), (bad, str(e.value))


def test_tie_stages_and_local_sum_keep_copies_identical():
    """Pure JAX, one process: both sides on one program (the `--reference` case) get g0 + g1."""
    import jax
    import jax.numpy as jnp

    from stages.ties import for_norm, locate, sum_tied, tie_stages

    class Prog:
        start, stop = 0, 2

    ties = (((0, "w"), (1, "w")),)
    grads = [[{"w": jnp.array([1.0, 2.0])}, {"w": jnp.array([0.5, -4.0]), "b": jnp.ones(2)}]]
    assert locate([Prog()], ties) == [[(0, 0, 0, "w"), (1, 0, 1, "w")]]
    sum_tied(grads, [Prog()], ties)
    np.testing.assert_array_equal(grads[0][0]["w"], [1.5, -2.0])
    np.testing.assert_array_equal(grads[0][1]["w"], [1.5, -2.0])
    zeroed = for_norm(grads, [Prog()], ties)
    np.testing.assert_array_equal(zeroed[0][1]["w"], [0.0, 0.0])             # the later copy counts 0
    np.testing.assert_array_equal(grads[0][1]["w"], [1.5, -2.0])             # a copy: grads unchanged
    assert jax.tree.leaves(zeroed[0][1])[0].shape == (2,)
    assert tie_stages(ties, [[(0, 1)], [(1, 2)]]) == ((0, 1),)

    class Far:
        start, stop = 1, 2
    with pytest.raises(RuntimeError, match="another stage and there is no exchange"):
        sum_tied([[{"w": jnp.ones(2)}]], [Far()], ties)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("executor", ["step_calls", "compiled_graph"])
def test_tied_embedding_across_two_stages_matches_oracle_and_copies_stay_identical(tmp_path, no_leaks, executor):
    """Under either executor: the tie's gradient exchange goes through the actors' `deliver`
    mailbox (their io group), beside a Compiled Graph's execution loop as beside a step call."""
    from orchestrator.driver.runner import run_job
    from tests.test_byo_models import CLUSTER

    checked = checked_of(tied_job(tmp_path), {**CLUSTER, "executor": executor})
    assert checked.cluster.executor == executor
    assert checked.stages[1].layout.get("vocab") == "model"        # stage 1 holds its copy vocab-sharded
    pipe = run_job(checked, echo=lambda s: None, keep_params=True)
    norms: list = []
    losses, params = tied_oracle(checked, norms)
    assert min(norms) > 2 * MAX_NORM, norms                        # the clip bites on every step
    np.testing.assert_allclose(pipe["losses"], losses, rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(pipe["params"][EMBED[0]], pipe["params"][EMBED[1]])   # copies: same bits
    covered = set()
    for name, arr in pipe["params"].items():
        path = pipeline_name_to_path(name)
        covered.add(path)
        np.testing.assert_allclose(arr, params[path], rtol=RTOL, atol=ATOL, err_msg=name)
    assert covered == set(params) - {"lm_head/kernel"}, sorted(set(params) ^ covered)   # lm_head: used by no part
    from flax import nnx

    init = flat(nnx.to_pure_dict(llama_split(checked)[1]))["embed/embedding"]    # the factory's initial array
    assert not np.allclose(params["embed/embedding"], init)                       # it trained


@pytest.mark.slow
def test_reference_run_sums_tied_gradients_like_the_oracle():
    """`--reference` (one process, both copies in one program) equals the one-array oracle too."""
    from orchestrator.driver.reference import train_reference

    checked = checked_of(tied_job("/tmp", steps=3))
    job = checked.job
    ref = train_reference(checked.model, checked.data, steps=job.run.steps, seed=job.run.seed,
                          microbatches=job.pipeline.microbatches, optimizer=job.optimizer.spec())
    losses, params = tied_oracle(checked)
    np.testing.assert_allclose(ref["losses"], losses, rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(ref["params"][EMBED[0]], ref["params"][EMBED[1]])
    for name, arr in ref["params"].items():
        np.testing.assert_allclose(arr, params[pipeline_name_to_path(name)], rtol=RTOL, atol=ATOL, err_msg=name)
