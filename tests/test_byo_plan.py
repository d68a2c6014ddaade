"""`meshpipe plan` for brought-your-own models with tied parameters and mutable state (pure: no Ray).

A tied array is one array of the model held as a copy by each stage that uses it: the plan lists
the group (both names, the stage of each copy, bytes per copy), each stage's per-device memory
lower bound counts the copy it holds, and the model's parameter count counts the array once.
Mutable state (BatchNorm's running statistics) is replicated on its stage's devices: the plan shows
each stage's state bytes and counts them in that stage's per-device bound. Expected figures are
worked out here from the models' shapes, not read from the planner.
"""
from __future__ import annotations

import pytest

from orchestrator.core.plan import make_plan, plan_json, plan_text
from tests.test_byo_models import checked_of, pytree_job
from tests.test_byo_state import bn_job

F32 = 4


def plain_tied_job(mesh=None):
    mesh = mesh or {"data": 2}
    return {**pytree_job("/tmp"), "model": {"factory": "tests.byo_tied_models:plain_tied"},
            "pipeline": {"schedule": "1f1b", "microbatches": 4, "stages": [{"layers": [0, 1], "mesh": mesh},
                                                                           {"layers": [1, 2], "mesh": mesh}]}}


def test_plan_shows_tie_groups_counts_each_copy_on_its_stage_and_the_array_once_globally():
    # plain_tied: in holds w (8, 4); out holds w's copy (8, 4) and v (8, 2); global batch 16, m = 4
    checked = checked_of(plain_tied_job())
    plan = make_plan(checked)
    j = plan_json(plan)
    w, v = 8 * 4, 8 * 2
    assert j["parameters"] == {"held": 2 * w + v, "unique": w + v}
    assert j["ties"] == [{"params": ["00.in/w", "01.out/w"], "layers": [0, 1], "stages": [0, 1], "shape": [8, 4],
                          "dtype": "float32", "bytes": w * F32}]
    s0, s1 = j["stages"]
    assert s0["tied_copies"] == ["00.in/w"] and s1["tied_copies"] == ["01.out/w"]
    mb, devices = 16 // 4, 2
    # replicated parameters (layout batch:data only): every device holds the whole copy
    assert s0["memory_per_device"] == {"params": w * F32, "grads": w * F32, "state": 0,
                                       "activations": mb * 4 * F32 // devices,
                                       "per_device": 2 * w * F32 + mb * 4 * F32 // devices, "devices": devices}
    assert s1["memory_per_device"]["params"] == (w + v) * F32          # the copy counts here too
    assert s0["state_bytes"] == s1["state_bytes"] == 0
    text = plan_text(plan)
    assert f"{w + v} parameters ({2 * w + v} held: tied copies counted per stage)" in text
    assert "00.in/w (stage 0) = 01.out/w (stage 1): float32[8, 4], 128 B per copy" in text
    assert "per device ≥ 288 B: parameters 128 B + gradients 128 B + state 0 B" in text


def test_plan_without_ties_lists_none_and_counts_every_parameter_once():
    checked = checked_of(pytree_job("/tmp"))
    j = plan_json(make_plan(checked))
    assert j["ties"] == [] and j["parameters"]["held"] == j["parameters"]["unique"] == checked.model.param_count()
    assert "tied parameters" not in plan_text(make_plan(checked))


@pytest.mark.needs_models
def test_plan_shows_state_bytes_per_stage_and_counts_them_per_device():
    """The equinox BatchNorm MLP (d 16: each BatchNorm over 2d = 32 channels, "ema" mode: running
    mean and variance float32[32] and a first-time flag bool[]) and the nnx one (mean and var)."""
    for factory, per_bn in [("eqx_bn_mlp", 2 * 32 * F32 + 1), ("nnx_bn_mlp", 2 * 32 * F32)]:
        checked = checked_of(bn_job("/tmp", factory))
        plan = make_plan(checked)
        j = plan_json(plan)
        for s in j["stages"]:          # one BatchNorm block on each stage
            mem = s["memory_per_device"]
            assert s["state_bytes"] == mem["state"] == per_bn, (factory, s["index"], s["state_bytes"])
            assert mem["per_device"] == mem["params"] + mem["grads"] + mem["state"] + mem["activations"]
        assert f"+ state {per_bn} B +" in plan_text(plan)
        # state is not a parameter: neither counted as one nor in the parameter bytes
        assert j["parameters"]["unique"] == checked.model.param_count()
