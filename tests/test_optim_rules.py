"""Optimizer hyperparameters checked by their meaning, at plan time, wherever they are written
(`orchestrator.core.model.optim_rules`): `optimizer.args`, each `optimizer.chain` entry, each
schedule's args and values, and the chain's direction (gradient ascent).

Pure: no Ray; optax builds closures and schedules are evaluated on the CPU. Each refused case
trained garbage to `status: completed` before (issue #35's inputs: a non-finite or negative
learning rate inside `chain`, a gradient-ascent chain, an Adam β out of range), so each asserts
key, value and rule of the refusal; the accepted cases pin that the rules do not refuse what
optax's own defaults or ordinary recipes write.
"""
from __future__ import annotations

import json

import pytest

from orchestrator.core.config import ConfigError, check_job, load_cluster, load_job
from orchestrator.core.model.optim_rules import DENSE_STEPS, problems
from tests.conftest import ROOT

GPT = ROOT / "examples" / "gpt.yaml"
LOCAL = ROOT / "cluster_configs" / "local.yaml"


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(ROOT)  # the example's data path is relative to the repo root


def _yaml(value) -> str:
    """`value` as a YAML flow value (JSON, with YAML's spelling of NaN and infinity)."""
    return json.dumps(value).replace("NaN", ".nan").replace("-Infinity", "-.inf").replace("Infinity", ".inf")


def _chain(*entries, allow_ascent: bool | None = None) -> list[str]:
    opt = {"chain": [{"name": n, "args": a} for n, a in entries]}
    if allow_ascent is not None:
        opt["allow_ascent"] = allow_ascent
    return [f"optimizer={_yaml(opt)}"]


def _refusal(sets: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        check_job(load_job(GPT, sets), load_cluster(LOCAL))
    return str(e.value)


WARMUP = {"schedule": "warmup_cosine_decay_schedule",
          "args": {"init_value": 0.0, "peak_value": 3e-3, "warmup_steps": 10, "decay_steps": 100}}

REFUSED = [
    # the inputs: values inside `chain` were not checked at all
    (_chain(("adam", {"learning_rate": float("nan")})),
     ["optimizer.chain[0].args.learning_rate = nan", "finite"]),
    (_chain(("clip_by_global_norm", {"max_norm": 1.0}), ("adam", {"learning_rate": -1e-3})),
     ["optimizer.chain[1].args.learning_rate = -0.001", "> 0"]),
    (_chain(("adamw", {"learning_rate": float("inf"), "weight_decay": 0.1})),
     ["optimizer.chain[0].args.learning_rate = inf", "finite"]),
    (_chain(("scale_by_adam", {}), ("scale", {"step_size": 1e-3})),
     ["optimizer.chain = ['scale_by_adam', 'scale']", "gradient ascent", "optimizer.allow_ascent"]),
    (["optimizer.args.b1=1.5"], ["optimizer.args.b1 = 1.5", "[0, 1)", "decay rate"]),
    (["optimizer.args.b2=-0.1"], ["optimizer.args.b2 = -0.1", "[0, 1)"]),
    # the same rules in every other place
    (_chain(("scale_by_adam", {"b1": 1.0}), ("scale", {"step_size": -1e-3})),
     ["optimizer.chain[0].args.b1 = 1.0", "[0, 1)"]),
    (_chain(("adam", {"learning_rate": 1e-3}), ("sgd", {"learning_rate": 0.1})),
     ["optimizer.chain = ['adam', 'sgd']", "2 functions each turn the update downhill", "gradient ascent"]),
    (_chain(("scale_by_adam", {}), ("scale", {"step_size": 0})),
     ["optimizer.chain[1].args.step_size = 0", "non-zero"]),
    (_chain(("scale_by_adam", {}), ("scale_by_learning_rate", {"learning_rate": 1e-3, "flip_sign": False})),
     ["optimizer.chain = ['scale_by_adam', 'scale_by_learning_rate']", "gradient ascent"]),
    (["optimizer.args.eps=0"], ["optimizer.args.eps = 0", "> 0"]),
    (["optimizer.args.eps=-1e-8"], ["optimizer.args.eps = -1e-08", "> 0"]),
    (["optimizer.args.eps_root=-1e-8"], ["optimizer.args.eps_root = -1e-08", ">= 0"]),
    (_chain(("rmsprop", {"learning_rate": 1e-2, "decay": 1.0})), ["optimizer.chain[0].args.decay = 1.0", "[0, 1)"]),
    (_chain(("sgd", {"learning_rate": 0.1, "momentum": 1.2})), ["optimizer.chain[0].args.momentum = 1.2", "[0, 1)"]),
    (_chain(("adamw", {"learning_rate": 1e-3, "weight_decay": -0.01})),
     ["optimizer.chain[0].args.weight_decay = -0.01", ">= 0"]),
    (_chain(("adam", {"learning_rate": 1e-3, "b1": "0.9"})), ["optimizer.chain[0].args.b1 = '0.9'", "must be a number"]),
    (["optimizer.args.learning_rate=1e308"], ["optimizer.args.learning_rate", "at most 100"]),
    # schedules: their args by the same table, their values at the run's steps
    ([f"optimizer.args.learning_rate={_yaml({**WARMUP, 'args': {**WARMUP['args'], 'peak_value': float('nan')}})}"],
     ["optimizer.args.learning_rate.args.peak_value = nan", "finite"]),
    (["optimizer.args.learning_rate=" + json.dumps({"schedule": "linear_schedule", "args": {
        "init_value": 1e-3, "end_value": -1e-3, "transition_steps": 40}})],
     ["optimizer.args.learning_rate = {'schedule': 'linear_schedule'", "is -5e-05 at step 21", ">= 0 at every step"]),
    (["optimizer.args.learning_rate=" + json.dumps({"schedule": "constant_schedule", "args": {"value": 0}})],
     ["optimizer.args.learning_rate", "0 at every step", "nothing would be learned"]),
    (["optimizer.args.learning_rate=" + json.dumps({"schedule": "cosine_onecycle_schedule", "args": {
        "transition_steps": 100, "peak_value": 300}})],
     ["optimizer.args.learning_rate", "reaches 300 at step 30", "at most 100"]),
    (_chain(("clip_by_global_norm", {"max_norm": 1.0}),
            ("adamw", {"learning_rate": {**WARMUP, "args": {**WARMUP["args"], "warmup_steps": -5}}})),
     ["optimizer.chain[1].args.learning_rate.args.warmup_steps = -5", ">= 0"]),
    (["optimizer.args.learning_rate=" + json.dumps({"schedule": "cosine_decay", "args": {}})],
     ["optimizer.args.learning_rate.schedule = 'cosine_decay'", "not an optax schedule"]),
]


@pytest.mark.parametrize("sets,needles", REFUSED, ids=[f"refused{i}" for i in range(len(REFUSED))])
def test_each_hyperparameter_is_refused_by_its_meaning_with_key_value_and_rule(sets, needles):
    msg = _refusal(sets)
    missing = [n for n in needles if n not in msg]
    assert not missing, f"{missing} not in:\n{msg}"


ACCEPTED = [
    [],                                                                   # the example's adam
    ["optimizer.args.learning_rate=99"],                                  # legal: only training shows it
    [f"optimizer.args.learning_rate={json.dumps(WARMUP)}"],               # a warmup starting at 0
    _chain(("scale_by_adam", {}), ("scale", {"step_size": -1e-3})),        # descent written by hand
    _chain(("clip_by_global_norm", {"max_norm": 1.0}), ("add_decayed_weights", {"weight_decay": 0.01}),
           ("sgd", {"learning_rate": 0.1, "momentum": 0.9})),
    _chain(("scale_by_adam", {}), ("scale_by_learning_rate", {"learning_rate": WARMUP})),
    _chain(("lars", {"learning_rate": 0.1})),                             # optax's own default eps = 0
    ["optimizer.args.eps=0", "optimizer.args.eps_root=1e-8"],             # eps_root keeps it finite
    _chain(("scale_by_adam", {}), ("scale", {"step_size": 1e-3}), allow_ascent=True),   # asked for
]


@pytest.mark.parametrize("sets", ACCEPTED, ids=[f"accepted{i}" for i in range(len(ACCEPTED))])
def test_ordinary_recipes_and_optax_defaults_pass(sets):
    check_job(load_job(GPT, sets), load_cluster(LOCAL))


def test_every_optax_optimizer_with_a_learning_rate_descends():
    """The direction rule counts a function taking `learning_rate` as one that turns the update
    downhill; this holds for every such optax function buildable from a learning rate alone
    (measured: the first update of a fixed gradient points against it), so the rule is not a guess."""
    import inspect

    import jax.numpy as jnp
    import optax

    checked = 0
    params, grads = {"w": jnp.ones(3)}, {"w": jnp.array([1.0, 2.0, 3.0])}
    for name in dir(optax):
        fn = getattr(optax, name)
        if name.startswith("_") or not callable(fn) or isinstance(fn, type) or name == "scale_by_learning_rate":
            continue
        try:
            if "learning_rate" not in inspect.signature(fn).parameters:
                continue
            tx = fn(learning_rate=0.1)
            update, _ = tx.update(grads, tx.init(params), params)
        except Exception:  # noqa: BLE001 - needs more than a learning rate (lbfgs: the loss value)
            continue
        dot = float(jnp.vdot(update["w"], grads["w"]))
        assert dot <= 0, (name, dot)
        assert not problems({"name": name, "args": {"learning_rate": 0.1}}, 10), name
        checked += 1
    assert checked >= 25


def test_a_long_run_samples_the_schedule_and_keeps_its_boundaries():
    """Beyond DENSE_STEPS a schedule is evaluated at evenly spaced steps plus either side of each
    integer argument: the step where a schedule turns negative is named exactly, not the next sample."""
    steps = 50 * DENSE_STEPS
    dip = {"schedule": "linear_schedule", "args": {"init_value": 0.1, "end_value": -0.1, "transition_steps": 1,
                                                    "transition_begin": 3_333_333}}
    found = problems({"name": "sgd", "args": {"learning_rate": dip}}, steps)
    assert found and "at step 3333334" in found[0][2], found
