"""Training health as a policy (`failure.on_nonfinite`, `failure.divergence`): pure rules, then real runs.

The runs use real Ray (the session's local cluster) and inject their faults through the model
itself (`tests.health_models`: a first part whose backward turns NaN on one step's data, a loss
that is NaN from the start), never through a hook in product code.

Numerics (skip, rollback): against an independent single-process oracle — the whole model with
`jax.value_and_grad`, microbatches accumulated in order, optax SGD with momentum — that drops the
bad step's update (skip) or trains on the batches a rollback leaves (rollback). Tolerance as in
`tests.test_byo_models`: float32, rtol 1e-5 / atol max(1e-6, 1e-5 × the array's largest entry) on
every parameter array, rtol 1e-5 on every loss.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest

from orchestrator.core.config import ConfigError, check_job, parse_cluster, parse_job
from orchestrator.core.health import (GRAD, LOSS, PARAMS, ROLLBACK, SKIP, STOP, HealthMonitor, HealthRule,
                                      first_nonfinite, skip_data)
from tests.conftest import ROOT
from tests.test_byo_models import CLUSTER, RTOL, ATOL, assert_params_equal, flat

NAN = float("nan")
BAD_STEP = 3


# ----------------------------------------------------------------------------- pure: rules and config

def test_first_nonfinite_follows_the_steps_own_order():
    assert first_nonfinite(NAN, [NAN, NAN], [1, 1]) == (LOSS, 1)            # the loss comes first
    assert first_nonfinite(1.0, [NAN, math.inf, 1.0], [5, 0, 0]) == (GRAD, 1)  # the backward runs 2 → 0
    assert first_nonfinite(1.0, [1.0, 1.0], [0, 2]) == (PARAMS, 1)
    assert first_nonfinite(1.0, [1.0, 1.0], [0, 0]) is None


def test_monitor_skips_then_stops_after_max_skips_in_a_row():
    m = HealthMonitor(HealthRule(on_nonfinite=SKIP, max_skips=2))
    acts = [m.observe(s, 1.0, [NAN, 1.0], [None, None]).action for s in range(3)]
    assert acts == [SKIP, SKIP, STOP]
    m = HealthMonitor(HealthRule(on_nonfinite=SKIP, max_skips=2))
    acts = [getattr(m.observe(s, 1.0, [NAN if s != 2 else 1.0, 1.0], [0, 0]), "action", None) for s in range(5)]
    assert acts == [SKIP, SKIP, None, SKIP, SKIP]          # a healthy step resets the count
    # parameters already updated cannot be skipped
    assert HealthMonitor(HealthRule(on_nonfinite=SKIP)).observe(0, 1.0, [1.0], [3]).action == STOP


def test_divergence_uses_the_median_of_healthy_steps_only():
    m = HealthMonitor(HealthRule(divergence_factor=10.0, divergence_window=3, divergence_action=ROLLBACK))
    for s, loss in enumerate([5.0, 4.0, 3.0, 2.0]):
        assert m.observe(s, loss, [1.0], [0]) is None
    e = m.observe(4, 40.0, [1.0], [0])                      # median of (4, 3, 2) is 3: 40 > 30
    assert (e.kind, e.action, e.values["median"]) == ("divergence", ROLLBACK, 3.0)
    assert m.observe(5, 29.0, [1.0], [0]) is None           # the diverged loss never joined the median
    assert [s for s, _ in m.history] == [2, 3, 5]
    m.rollback(3)                                           # back to commit 3: steps 3.. forgotten
    assert [s for s, _ in m.history] == [2]
    assert HealthMonitor(HealthRule(divergence_factor=None)).observe(1, 1e9, [1.0], [0]) is None


def test_skip_data_moves_the_position_past_the_bad_step():
    assert skip_data(2, 3) == 2
    with pytest.raises(ValueError, match="before the commit"):
        skip_data(4, 3)


def test_a_rollback_is_a_typed_cause_never_the_same_failure_again():
    """A rollback skips the bad step's data, so the step that follows is another: two rollbacks at
    the same step both restart (`max_restarts` bounds them), where two errors there would not."""
    from orchestrator.core.recovery import ERROR, ROLLBACK, Failure, RestartPolicy

    policy = RestartPolicy(2)
    bad = Failure(ROLLBACK, 0, 0, BAD_STEP, "step 3: gradient norm non-finite on stage 0")
    assert [policy.decide(bad, committed=2).restart for _ in range(3)] == [True, True, False]
    errors = RestartPolicy(2)
    err = Failure(ERROR, 0, 0, BAD_STEP, "boom")
    assert [errors.decide(err, committed=2).restart for _ in range(2)] == [True, False]


def _job(tmp_path, **failure):
    return {"run": {"name": "h", "steps": 6, "seed": 5, "output_dir": str(tmp_path)},
            "model": {"name": "mlp", "args": {"d_in": 8, "d_hidden": 16, "d_out": 4, "blocks": 2}},
            "data": {"source": "synthetic", "global_batch": 16},
            "optimizer": {"name": "sgd", "args": {"learning_rate": 0.1, "momentum": 0.9}},
            "pipeline": {"microbatches": 4, "stages": [{"layers": [0, 2], "mesh": {"data": 1}},
                                                       {"layers": [2, 4], "mesh": {"data": 1}}]},
            **({"failure": failure} if failure else {})}


@pytest.mark.parametrize("failure,needles", [
    ({"on_nonfinite": "rollback"}, ["failure.on_nonfinite = 'rollback'", "failure.max_restarts > 0"]),
    ({"divergence": {"action": "rollback"}}, ["failure.divergence.action = 'rollback'", "max_restarts"]),
    ({"on_nonfinite": "retry"}, ["failure.on_nonfinite", "retry"]),
    ({"divergence": {"factor": 1.0}}, ["failure.divergence.factor = 1.0", "must be > 1"]),
    ({"divergence": {"factor": math.inf}}, ["failure.divergence.factor"]),
    ({"max_skips": 0}, ["failure.max_skips"]),
])
def test_health_keys_are_checked_at_plan_time(tmp_path, failure, needles):
    with pytest.raises(ConfigError) as e:
        parse_job(_job(tmp_path, **failure))
    for needle in needles:
        assert needle in str(e.value), str(e.value)


def test_health_defaults_and_off():
    job = parse_job(_job("/tmp"))
    assert job.failure.on_nonfinite == "stop" and job.failure.divergence.factor == 100.0
    assert parse_job(_job("/tmp", divergence=None)).failure.divergence is None


# ----------------------------------------------------------------------------- real runs (Ray)

def poison_job(tmp_path, name, poison, steps=6, **failure):
    return {
        "run": {"name": name, "steps": steps, "seed": 5, "output_dir": str(tmp_path)},
        "model": {"factory": "tests.health_models:poisoned_mlp", "args": {"poison": poison, "d": 16, "blocks": 2}},
        "data": {"source": "synthetic", "global_batch": 16},
        "optimizer": {"name": "sgd", "args": {"learning_rate": 0.1, "momentum": 0.9}},
        "pipeline": {"schedule": "1f1b", "microbatches": 4, "stages": [
            {"layers": [0, 2], "mesh": {"data": 2}},
            {"layers": [2, 4], "mesh": {"data": 2}},
        ]},
        "layout": {"batch": "data"},
        "failure": failure,
    }


def checked_of(job):
    return check_job(parse_job(job), parse_cluster(CLUSTER))


def poison_value(tmp_path) -> float:
    """The first input feature of microbatch 0's first row at step BAD_STEP (seed 5): that step's
    gradient on stage 0 goes NaN, no other step's does (checked over every batch the tests read)."""
    from stages.data import global_batch, open_reader

    checked = checked_of(poison_job(tmp_path, "probe", 0.0))
    reader = open_reader(checked.data)
    firsts = [global_batch(reader, checked.data, b)[0][:, 0] for b in range(20)]
    v = float(firsts[BAD_STEP][0])
    assert sum(int(np.any(np.abs(f - v) < 1e-6)) for f in firsts) == 1
    return v


def poison_oracle(checked, poison: float, batches: list[int | None]):
    """Plain training of the whole poisoned model: step i trains on batch `batches[i]`, and a None
    drops that step (its update) entirely."""
    import jax
    import jax.numpy as jnp
    import optax

    from stages.data import global_batch, open_reader
    from tests.byo_models import mse, pytree_init
    from tests.health_models import poisoned_forward

    job = checked.job
    m = job.pipeline.microbatches
    tx = optax.sgd(**job.optimizer.args)
    reader = open_reader(checked.data)
    grad = jax.jit(jax.value_and_grad(lambda p, x, y: mse(poisoned_forward(p, x, poison), y)))
    params = pytree_init(jax.random.key(job.run.seed), 16, 2)
    state, losses = tx.init(params), []
    for b in batches:
        if b is None:
            continue
        x, y = global_batch(reader, checked.data, b)
        n = x.shape[0] // m
        acc, mb = jax.tree.map(jnp.zeros_like, params), []
        for i in range(m):
            loss, g = grad(params, jnp.asarray(x[i * n:(i + 1) * n]), jnp.asarray(y[i * n:(i + 1) * n]))
            acc = jax.tree.map(lambda a, b_: a + b_ / m, acc, g)
            mb.append(float(loss))
        assert all(np.all(np.isfinite(np.asarray(a))) for a in jax.tree.leaves(acc)), f"batch {b} is poisoned"
        updates, state = tx.update(acc, state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(np.mean(mb)))
    return losses, flat(params)


def read_summary(tmp_path, name) -> dict:
    from tests.records import summary

    return summary(tmp_path, name)


@pytest.mark.ray
def test_nonfinite_gradient_stops_by_default_naming_step_stage_and_kind(tmp_path, no_leaks):
    from orchestrator.core.health import HealthStop
    from orchestrator.driver.runner import run_job

    checked = checked_of(poison_job(tmp_path, "stop", poison_value(tmp_path)))
    with pytest.raises(HealthStop) as e:
        run_job(checked, echo=lambda s: None)
    msg = str(e.value)
    assert f"step {BAD_STEP}: gradient norm non-finite on stage 0" in msg, msg
    rec = read_summary(tmp_path, "stop")
    assert rec["status"] == "failed" and "gradient norm non-finite" in rec["error"]
    (event,) = rec["health"]["events"]
    assert (event["step"], event["kind"], event["stage"], event["action"]) == (BAD_STEP, "gradient norm", 0, "stop")
    assert math.isnan(event["values"]["grad_norm"][0]) and math.isfinite(event["values"]["grad_norm"][1])


@pytest.mark.ray
def test_nan_loss_from_step_0_stops_naming_the_loss_and_step_0(tmp_path, no_leaks):
    from orchestrator.core.health import HealthStop
    from orchestrator.driver.runner import run_job

    job = poison_job(tmp_path, "nanloss", 0.0)
    job["model"] = {"factory": "tests.health_models:nan_loss_mlp", "args": {"d": 16, "blocks": 2}}
    with pytest.raises(HealthStop, match="step 0: loss non-finite on stage 1"):
        run_job(checked_of(job), echo=lambda s: None)
    rec = read_summary(tmp_path, "nanloss")
    assert rec["status"] == "failed" and rec["steps_done"] == 1
    assert [(e["step"], e["kind"], e["action"]) for e in rec["health"]["events"]] == [(0, "loss", "stop")]


@pytest.mark.ray
def test_skip_drops_the_update_on_every_stage_and_matches_the_oracle(tmp_path, no_leaks):
    from orchestrator.driver.runner import run_job

    v = poison_value(tmp_path)
    lines: list[str] = []
    checked = checked_of(poison_job(tmp_path, "skip", v, on_nonfinite="skip"))
    pipe = run_job(checked, echo=lines.append, keep_params=True)
    assert pipe["status"] == "completed"
    health = read_summary(tmp_path, "skip")["health"]
    assert health["skipped_steps"] == [BAD_STEP]
    assert [(e["step"], e["kind"], e["stage"], e["action"]) for e in health["events"]] == [
        (BAD_STEP, "gradient norm", 0, "skip")]
    assert any(f"step {BAD_STEP}: gradient norm non-finite on stage 0: skip" in s for s in lines), lines
    steps = checked.job.run.steps
    losses, params = poison_oracle(checked, v, [None if s == BAD_STEP else s for s in range(steps)])
    # the skipped step's loss is finite (the fault is in the backward): the oracle's list lacks it
    kept = [x for s, x in enumerate(pipe["losses"]) if s != BAD_STEP]
    np.testing.assert_allclose(kept, losses, rtol=RTOL, atol=ATOL)
    assert_params_equal(pipe["params"], params, lambda n: n.split(".", 1)[1])


def _one_rollback_then_the_oracle(tmp_path, name, checked, v, pipe) -> None:
    """One rollback event at BAD_STEP, and the run equal to the oracle that trained steps 0, 1 on
    batches 0, 1 and, from commit 2, skipped the batches through the bad one (2, 3)."""
    events = read_summary(tmp_path, name)["health"]["events"]
    assert [(e["step"], e["kind"], e["action"]) for e in events] == [(BAD_STEP, "gradient norm", "rollback")]
    batches = [0, 1] + [s + BAD_STEP + 1 - 2 for s in range(2, checked.job.run.steps)]
    losses, params = poison_oracle(checked, v, batches)
    np.testing.assert_allclose(pipe["losses"], losses, rtol=RTOL, atol=ATOL)
    assert_params_equal(pipe["params"], params, lambda n: n.split(".", 1)[1])


@pytest.mark.ray
def test_rollback_restores_the_commit_skips_the_bad_data_and_completes(tmp_path, no_leaks):
    from orchestrator.driver.runner import run_job

    v = poison_value(tmp_path)
    job = poison_job(tmp_path, "rollback", v, on_nonfinite="rollback", max_restarts=2)
    job["checkpoint"] = {"dir": str(tmp_path / "ckpt"), "every_steps": 2}
    checked = checked_of(job)
    pipe = run_job(checked, echo=lambda s: None, keep_params=True)
    assert pipe["status"] == "completed" and pipe["restarts"] == 1
    (rec,) = pipe["recoveries"]
    assert rec["resumed_from"] == 2 and "gradient norm non-finite" in rec["error"]
    _one_rollback_then_the_oracle(tmp_path, "rollback", checked, v, pipe)


@pytest.mark.ray
def test_a_crash_after_a_rollback_restarts_from_the_same_commit_and_still_skips_the_bad_data(tmp_path, no_leaks):
    """The rollback to commit 2 skips batches 2 and 3; then stage 1 fails at step 2 of the next
    attempt (an error, not a health event) and the run restarts from commit 2 again. That restart
    must skip the same batches: the commit's checkpoint predates the skip. (CI once saw the bad
    batch trained again, a second rollback, and the restarts used up.)"""
    from orchestrator.driver.runner import run_job

    from tests.faults import FailStepAtVisit

    v = poison_value(tmp_path)
    job = poison_job(tmp_path, "rollback2", v, on_nonfinite="rollback", max_restarts=3)
    job["checkpoint"] = {"dir": str(tmp_path / "ckpt"), "every_steps": 2}
    checked = checked_of(job)
    counter = tmp_path / "visits"
    counter.mkdir()
    crash = FailStepAtVisit(stage=1, host=0, step=2, visit=2, counter=str(counter))
    pipe = run_job(checked, echo=lambda s: None, keep_params=True, hooks=[crash])
    assert pipe["status"] == "completed" and pipe["restarts"] == 2, pipe.get("recoveries")
    first, second = pipe["recoveries"]
    assert (first["resumed_from"], second["resumed_from"]) == (2, 2)
    assert "gradient norm non-finite" in first["error"] and "visit 2" in second["error"], second["error"]
    _one_rollback_then_the_oracle(tmp_path, "rollback2", checked, v, pipe)


@pytest.mark.ray
def test_learning_rate_99_diverges_and_the_cli_exits_non_zero_naming_it(tmp_path):
    """The issue's own input: examples/gpt.yaml at learning rate 99 (loss 5.19 → 127,982 at step 1)."""
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator.driver.cli", "run", "examples/gpt.yaml", "--set",
         "optimizer.args.learning_rate=99", "--set", "run.steps=4", "--set", f"run.output_dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 1, out.stdout + out.stderr
    assert "step 1: divergence: loss" in out.stderr and "failure.divergence" in out.stderr, out.stderr
    rec = read_summary(tmp_path, "gpt-tiny")
    assert rec["status"] == "failed"
    assert [(e["step"], e["kind"], e["action"]) for e in rec["health"]["events"]] == [(1, "divergence", "stop")]
