"""Elastic recovery, the pure half (`failure.elastic`, `orchestrator.core.elastic`): the config keys,
the re-plan (rule and planner), the grow-back decision, the capacity count, the record. No Ray.

The jobs are the README's GPT (examples/gpt.yaml: 2 stages on 2 of the local cluster's 4 hosts)
and a 4-host variant of it (stage 0 {data: 4} on 2 hosts, stage 1 {data: 2, model: 2} on 2 hosts),
on cluster_configs/local.yaml (4 hosts × 2 devices). Every plan a re-plan emits is checked again
here with `check_job` after a YAML-style round trip (`parse_job(job.to_dict())`), so a plan that
only the re-plan's own check accepted would fail.
"""
from __future__ import annotations

import doctest
import importlib
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from orchestrator.core.config import ConfigError, check_job, load_cluster, load_job, load_raw, parse_cluster, parse_job
from orchestrator.core.config.limits import stage_memory
from orchestrator.core.elastic import (METRICS, Prediction, ReplanRecord, Timings, check_elastic, describe_plan,
                                       grow_decision, host_capacity, plan_by_rule, plan_for, plan_hosts, plan_line,
                                       predict_step, speedup, uncalibrated)
from orchestrator.core.elastic.rule import microbatch_order, rescale_mesh
from tests.test_bad_input import error_of, has_all

REPO = Path(__file__).resolve().parents[1]
GPT = REPO / "examples" / "gpt.yaml"
LOCAL = REPO / "cluster_configs" / "local.yaml"
ELASTIC = ["checkpoint={dir: /tmp/meshpipe-elastic-test, every_steps: 2}", "failure={max_restarts: 3, elastic: {}}"]
FOUR_HOSTS = [{"layers": [0, 2], "mesh": {"data": 4}, "hosts": 2},
              {"layers": [2, 4], "mesh": {"data": 2, "model": 2}, "hosts": 2}]


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)     # the example's data path is relative to the repo root


@pytest.fixture(scope="module")
def local():
    return load_cluster(LOCAL)


def elastic_job(elastic: str = "{}", stages=None, layout=None, **pipeline):
    """The README's GPT with `failure.elastic: <elastic>`, other stages / pipeline keys, and (with
    `layout`) another job layout (the README's names `model`, which a mesh of `data` alone lacks)."""
    job = load_job(GPT, overrides=[ELASTIC[0], f"failure={{max_restarts: 3, elastic: {elastic}}}"])
    if stages is None and not pipeline and layout is None:
        return job
    raw = job.to_dict()
    raw["pipeline"] = {**raw["pipeline"], **({"stages": stages} if stages else {}), **pipeline}
    if layout is not None:
        raw["layout"] = layout
    return parse_job(raw)


@pytest.fixture(scope="module")
def readme(local):
    return check_job(elastic_job(), local)


@pytest.fixture(scope="module")
def four(local):
    return check_job(elastic_job(stages=FOUR_HOSTS), local)


def rechecked(plan, original):
    """`plan` checked again from its plain form; the training-defining sections are the job's."""
    job = parse_job(plan.job.to_dict())
    again = check_job(job, original.cluster)
    o = original.job
    assert (job.data, job.optimizer, job.precision, job.model, job.run, job.checkpoint, job.failure) == \
           (o.data, o.optimizer, o.precision, o.model, o.run, o.checkpoint, o.failure)
    assert again.data == original.data                       # the same DataPlan: the same batches, in order
    assert o.data.global_batch % job.pipeline.microbatches == 0
    assert again.microbatch_size * job.pipeline.microbatches == o.data.global_batch
    layers = sorted(c for s in again.stages for c in s.chunks)
    assert [a for a, _ in layers] == [0] + [b for _, b in layers[:-1]] and layers[-1][1] == 4   # tile [0, 4)
    assert [s.hosts for s in again.stages] == [s.hosts for s in plan.stages]
    return again


# ----------------------------------------------------------------------------- config

def test_elastic_keys_defaults_and_round_trip():
    assert load_job(GPT).failure.elastic is None                # absent: today's behaviour (stop with --resume)
    el = elastic_job().failure.elastic
    assert (el.min_hosts, el.replan, el.grow, el.min_gain, el.gain_threshold) == (None, "rule", "next_commit", None, 0.1)
    job = elastic_job("{min_hosts: 2, replan: auto, grow: gain, min_gain: 0.25}")
    el = job.failure.elastic
    assert (el.min_hosts, el.replan, el.grow, el.gain_threshold) == (2, "auto", "gain", 0.25)
    assert parse_job(job.to_dict()) == job
    assert elastic_job("{grow: gain, min_gain: 1}").failure.elastic.min_gain == 1.0     # an integer is a number


@pytest.mark.parametrize("elastic, key, value, rule", [
    ("{min_hosts: 0}", "failure.elastic.min_hosts", "0", ">= 1"),
    ("{min_hosts: true}", "failure.elastic.min_hosts", "True", "integer"),
    ("{min_hosts: '2'}", "failure.elastic.min_hosts", "'2'", "integer"),
    ("{replan: planner}", "failure.elastic.replan", "'planner'", "'rule', 'auto'"),
    ("{grow: always}", "failure.elastic.grow", "'always'", "'never', 'next_commit', 'gain'"),
    ("{grow: gain, min_gain: 0}", "failure.elastic.min_gain", "0.0", "> 0"),
    ("{grow: gain, min_gain: 11}", "failure.elastic.min_gain", "11", "less than or equal to 10"),
    ("{grow: gain, min_gain: .nan}", "failure.elastic.min_gain", "nan", "finite"),
    ("{min_gain: 0.2}", "failure.elastic.min_gain", "0.2", "only used with grow: gain"),
    ("{grow: never, min_gain: 0.2}", "failure.elastic.min_gain", "0.2", "only used with grow: gain"),
    ("{minhosts: 2}", "failure.elastic.minhosts", "2", "unknown key"),
    ("fast", "failure.elastic", "'fast'", "mapping"),
])
def test_elastic_bad_values_name_key_value_and_rule(elastic, key, value, rule):
    msg = error_of(load_job, GPT, overrides=[ELASTIC[0], f"failure={{max_restarts: 1, elastic: {elastic}}}"])
    has_all(msg, key, value, rule)


def test_elastic_needs_restarts_and_restarts_need_checkpoints():
    has_all(error_of(load_job, GPT, overrides=[ELASTIC[0], "failure={elastic: {min_hosts: 1}}"]),
            "failure.elastic = {'min_hosts': 1}", "failure.max_restarts > 0")
    has_all(error_of(load_job, GPT, overrides=["failure={max_restarts: 1, elastic: {}}"]),
            "failure.max_restarts = 1", "checkpoint:")


def test_check_elastic_cross_checks(readme, local):
    from orchestrator.core.config import check_plan

    assert check_elastic(check_job(load_job(GPT), local)) == []          # no section: nothing to check
    assert check_elastic(readme) == []                                   # min_hosts null: the smallest legal plan
    ok = check_job(elastic_job("{min_hosts: 1}"), local)
    assert check_elastic(ok) == [] and check_elastic(check_job(elastic_job("{min_hosts: 2}"), local)) == []
    has_all(" ".join(check_elastic(check_plan(elastic_job("{min_hosts: 3}"), local))),
            "failure.elastic.min_hosts = 3", "more than the 2 hosts the job's plan uses")
    # the whole model on one host's 2 devices needs more than device.memory_gb: 2 hosts are the smallest plan
    one = plan_by_rule(ok, 1)[0].stages[0]
    need = stage_memory(ok.model, one.chunks, one.mesh, one.layout, 1)["per_device"]   # m = 16: the least it needs
    tight = parse_cluster({**load_raw(LOCAL), "device": {"memory_gb": need * 0.99 / 1e9}})
    has_all(" ".join(check_elastic(check_plan(elastic_job("{min_hosts: 1}"), tight))),
            "failure.elastic.min_hosts = 1", "no legal plan of this job fits on 1 host(s)", "min_hosts >= 2")


def test_check_job_refuses_a_bad_elastic_section_before_anything_starts(local):
    """`check_job` (what `meshpipe run` and `check` call) reports `check_elastic`'s problems as a
    ConfigError, as every other cross-check (the plan's own checks pass: `check_plan`)."""
    from orchestrator.core.config import check_plan

    job = elastic_job("{min_hosts: 3}")
    assert check_plan(job, local).job == job
    with pytest.raises(ConfigError) as ei:
        check_job(job, local)
    assert list(ei.value.problems) == check_elastic(check_plan(job, local))
    has_all(str(ei.value), "failure.elastic.min_hosts = 3", "more than the 2 hosts the job's plan uses")


def test_check_elastic_refuses_tpu():
    from orchestrator.core.config import check_plan

    cluster = parse_cluster({"platform": "tpu", "tpu": {"type": "v5litepod-16", "topology": "4x4"}, "hosts": 4,
                             "devices_per_host": 4, "cpus_per_host": 0.5, "placement_strategy": "SPREAD"})
    job = elastic_job(stages=[{"layers": [0, 4], "mesh": {"data": 16}, "hosts": 4}], layout={"batch": "data"},
                      microbatches=1)
    has_all(" ".join(check_elastic(check_plan(job, cluster))), "failure.elastic", "not supported on TPU")
    with pytest.raises(ConfigError, match="not supported on TPU"):
        check_job(job, cluster)


# ----------------------------------------------------------------------------- the rule

def test_readme_gpt_losing_one_two_three_hosts(readme):
    """The README's GPT uses 2 of the 4 hosts: with 2 or more left its own plan fits (keep); with 1
    the rule merges the two stages onto one host; with 0 the run stops."""
    for capacity in (4, 3, 2):
        r = plan_for(readme, capacity)
        assert (r.action, r.method, r.checked) == ("keep", "original", readme)
    r = plan_for(readme, 1)
    assert (r.action, r.method, r.hosts, r.fallback) == ("replan", "rule", 1, None)
    again = rechecked(r.checked, readme)
    assert [(s.chunks, s.mesh) for s in again.stages] == [(((0, 4),), {"model": 2})]   # stage 1's mesh: most FLOPs
    assert r.checked.job.pipeline.microbatches == 4                       # the job's own m still fits
    stop = plan_for(readme, 0)
    assert stop.action == "stop" and stop.checked is None and "holds 0 host(s)" in stop.reason


def test_four_host_gpt_shrinks_replicas_first_then_stages(four):
    """Losing 1, 2, 3 hosts: the data axes shrink with the hosts (rule A) while a stage has hosts to
    give; then the stages merge (rule B). Every plan legal, same global batch, same data."""
    plans = {c: plan_for(four, c) for c in (3, 2, 1)}
    assert all(r.action == "replan" and r.method == "rule" and r.hosts == c for c, r in plans.items())
    got = {c: [(s.chunks, s.mesh, s.hosts) for s in rechecked(r.checked, four).stages] for c, r in plans.items()}
    assert got[3] == [(((0, 2),), {"data": 2}, (0,)), (((2, 4),), {"data": 2, "model": 2}, (1, 2))]
    assert got[2] == [(((0, 2),), {"data": 2}, (0,)), (((2, 4),), {"data": 1, "model": 2}, (1,))]
    assert got[1] == [(((0, 4),), {"data": 1, "model": 2}, (0,))]
    assert "rule A" in plans[3].reason and "rule A" in plans[2].reason and "rule B" in plans[1].reason


def test_plans_depend_on_the_host_count_only(four):
    """Deterministic, and path-independent: a second loss while re-planning (4 → 3 → 2) gives the plan
    of losing both at once; all hosts back gives the job's own plan."""
    twice = [plan_for(four, 2) for _ in range(2)]
    assert twice[0].checked.job == twice[1].checked.job and twice[0].checked.stages == twice[1].checked.stages
    assert plan_for(four, 3).checked.job != twice[0].checked.job
    assert plan_for(four, 4).checked is four and plan_for(four, 7).action == "keep"


def test_min_hosts_honoured(four, local):
    job = elastic_job("{min_hosts: 2}", stages=FOUR_HOSTS)
    original = check_job(job, local)
    assert plan_for(original, 2).hosts == 2
    stop = plan_for(original, 1)
    assert stop.action == "stop"
    has_all(stop.reason, "holds 1 host(s) of the 4", "failure.elastic.min_hosts = 2")
    assert plan_by_rule(original, 3, min_hosts=3)[0].stages == plan_for(four, 3).checked.stages


def test_a_stage_without_a_batch_axis_is_not_shrunk_but_replanned(local):
    """Stage 1 is tensor-parallel over 2 hosts ({model: 4}): no data axis to shrink, so 3 → 2 hosts
    re-cuts the stages (rule B); the head's stage keeps a mesh of its own size where one fits."""
    stages = [{"layers": [0, 2], "mesh": {"data": 2}, "hosts": 1}, {"layers": [2, 4], "mesh": {"model": 4}, "hosts": 2}]
    original = check_job(elastic_job(stages=stages), local)
    r = plan_for(original, 2)
    assert r.action == "replan" and "rule B" in r.reason and r.hosts == 2
    again = rechecked(r.checked, original)
    assert len(again.stages) == 2 and all(len(s.hosts) == 1 and s.num_devices == 2 for s in again.stages)


def test_more_microbatches_when_the_device_memory_needs_them(readme, local):
    """On one host the whole model's activations per microbatch grow; with device.memory_gb between
    what m = 4 and m = 8 need, the rule takes m = 8 (smaller microbatches, same global batch)."""
    one = plan_for(readme, 1).checked.stages[0]
    need = {m: stage_memory(readme.model, one.chunks, one.mesh, one.layout, 16 // m)["per_device"] for m in (4, 8)}
    assert need[8] < need[4]
    cluster = parse_cluster({**load_raw(LOCAL), "device": {"memory_gb": (need[4] + need[8]) / 2 / 1e9}})
    original = check_job(elastic_job(), cluster)
    r = plan_for(original, 1)
    assert r.action == "replan" and r.checked.job.pipeline.microbatches == 8
    assert [(s.chunks, s.mesh) for s in r.checked.stages] == [(one.chunks, one.mesh)]
    rechecked(r.checked, original)


def test_microbatch_order_and_mesh_rescaling():
    job = elastic_job()
    assert microbatch_order(job, stateful=False) == [4, 8, 16, 2, 1]
    assert microbatch_order(elastic_job(microbatches=2), stateful=False) == [2, 4, 8, 16, 1]
    assert microbatch_order(job, stateful=True) == [4]          # per-microbatch statistics: m is kept
    assert rescale_mesh({"data": 4}, ["data"], 4) == {"data": 4}
    assert rescale_mesh({"data": 2, "fsdp": 2, "model": 2}, ["data", "fsdp"], 4) == {"data": 1, "fsdp": 2, "model": 2}
    assert rescale_mesh({"data": 2, "fsdp": 2}, ["data", "fsdp"], 3) is None
    assert rescale_mesh({"data": 2, "model": 2}, ["data"], 3) is None
    assert list(rescale_mesh({"model": 2, "data": 4}, ["data"], 4)) == ["model", "data"]    # axis order kept


_MESHES = ("data", "data+model", "model")


@st.composite
def four_host_jobs(draw):
    """Originals on the 4-host local cluster: 1-4 stages, 1-2 hosts each, meshes from a small menu."""
    p = draw(st.integers(1, 4))
    hosts = draw(st.lists(st.integers(1, 2), min_size=p, max_size=p))
    assume(sum(hosts) <= 4)
    stages = []
    for h in hosts:
        kind = draw(st.sampled_from(_MESHES))
        mesh = {"data": 2 * h} if kind == "data" else {"model": 2 * h} if kind == "model" else {"data": h, "model": 2}
        stages.append({"mesh": mesh, "hosts": h})
    m = draw(st.sampled_from([4, 8]))
    return stages, m, draw(st.integers(0, 4)), draw(st.sampled_from([None, 1, 2]))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(four_host_jobs())
def test_every_emitted_plan_is_legal_property(local, case):
    stages, m, capacity, min_hosts = case
    try:
        original = check_job(elastic_job("{}" if min_hosts is None else f"{{min_hosts: {min_hosts}}}",
                                         stages=stages, microbatches=m), local)
    except ConfigError:
        assume(False)
    own = plan_hosts(original)
    r = plan_for(original, capacity)
    if capacity >= own:
        assert r.action == "keep" and r.checked is original
        return
    if capacity < (min_hosts or 1):
        assert r.action == "stop" and "holds" in r.reason
        return
    if r.action == "stop":
        assert "no legal plan" in r.reason
        return
    assert r.action == "replan" and (min_hosts or 1) <= r.hosts <= capacity
    rechecked(r.checked, original)


# ----------------------------------------------------------------------------- the planner

def calibrated(local_raw: dict | None = None):
    raw = local_raw or load_raw(LOCAL)
    return parse_cluster({**raw, "device": {"tflops": 0.05, "memory_bandwidth_gbps": 10, "memory_gb": 2}})


def fake_profile(job):
    from orchestrator.core.planner.adapter import from_job
    from tests.planner_fakes import FakeProfiles

    model = from_job(job)
    return FakeProfiles(model, [1e6 * (i + 1) for i in range(model.num_layers)])


def test_auto_replans_with_the_planner_on_a_calibrated_cluster():
    job = elastic_job("{replan: auto}")
    original = check_job(job, calibrated())
    profile = fake_profile(job)
    r = plan_for(original, 1, profile=profile)
    assert (r.action, r.method, r.fallback, r.hosts) == ("replan", "auto", None, 1)
    assert profile.calls >= 1 and r.planner_step_s > 0 and r.predicted.estimator == "flops"
    rechecked(r.checked, original)
    assert r.checked.job.failure.elastic.replan == "auto"


def test_auto_falls_back_to_the_rule_with_the_reason(local):
    job = elastic_job("{replan: auto}")
    bare = plan_for(check_job(job, local), 1, profile=fake_profile(job))
    assert (bare.action, bare.method) == ("replan", "rule")
    has_all(bare.fallback, "no device.tflops, device.memory_bandwidth_gbps", "meshpipe calibrate")
    assert uncalibrated(local) == bare.fallback
    unprofiled = plan_for(check_job(job, calibrated()), 1)
    assert unprofiled.method == "rule" and "no layer profiler" in unprofiled.fallback

    def failing(requests):
        from orchestrator.core.planner import ProfileError

        raise ProfileError("the profiling subprocess died")

    broken = plan_for(check_job(job, calibrated()), 1, profile=failing)
    assert broken.method == "rule" and "the profiling subprocess died" in broken.fallback
    assert [s.stages for s in (bare.checked, broken.checked)][0] == broken.checked.stages    # the same rule plan


# ----------------------------------------------------------------------------- growing back

def test_grow_back_for_each_policy(local):
    def decide(elastic: str, current_capacity: int, capacity: int, **kw):
        original = check_job(elastic_job(elastic, stages=FOUR_HOSTS), local)
        current = plan_for(original, current_capacity).checked
        return original, current, grow_decision(original, current, capacity, **kw)

    _, _, g = decide("{grow: never}", 2, 4)
    assert not g.grow and "never" in g.reason
    original, current, g = decide("{}", 2, 4)                          # next_commit (the default)
    assert g.grow and g.replan.action == "keep" and g.replan.checked is original and "4 hosts instead of 2" in g.reason
    _, _, g = decide("{}", 2, 3)                                       # one host back: the 3-host plan
    assert g.grow and g.replan.hosts == 3 and g.replan.checked.stages == plan_for(original, 3).checked.stages
    _, _, g = decide("{}", 2, 2)
    assert not g.grow and "holds 2 host(s); the plan in use has 2" in g.reason
    assert not grow_decision(original, original, 4).grow                # the job's own plan is in use
    _, current, g = decide("{grow: gain, min_gain: 0.05}", 1, 4)
    assert g.grow and "steps per second" in g.reason
    gain = speedup(predict_step(current), g.replan.predicted)
    assert gain >= 0.05
    _, _, g = decide(f"{{grow: gain, min_gain: {min(10.0, round(gain + 0.5, 2))}}}", 1, 4)
    assert not g.grow and "gains too little" in g.reason
    slow = Prediction(g.replan.predicted.step_s * 0.5, 0.0)            # a plan in use predicted faster than the grow
    _, _, g = decide("{grow: gain}", 1, 4, predicted_now=slow)
    assert not g.grow


def test_grow_needs_a_larger_legal_plan(local):
    """More hosts than the plan in use, but no legal plan uses them: no grow, and the reason. One stage
    {data: 6} on 3 hosts with a global batch of 6: on 2 hosts `batch` would be cut 4 ways, which no
    microbatch of 6, 3, 2 or 1 rows allows, so 2 hosts run the 1-host plan."""
    raw = elastic_job(stages=[{"layers": [0, 4], "mesh": {"data": 6}, "hosts": 3}], layout={"batch": "data"},
                      microbatches=1).to_dict()
    raw["data"]["global_batch"] = 6
    original = check_job(parse_job(raw), local)
    current = plan_for(original, 1).checked
    assert plan_hosts(current) == 1 and [s.mesh for s in current.stages] == [{"data": 2}]
    assert plan_for(original, 2).hosts == 1
    g = grow_decision(original, current, 2)
    assert not g.grow and "no legal plan on more than the 1 host(s) in use fits the 2 there are" in g.reason
    assert grow_decision(original, current, 3).replan.checked is original


# ----------------------------------------------------------------------------- capacity, prediction, record

def test_host_capacity_per_strategy():
    nodes = [{"CPU": 1.0}, {"CPU": 2.0, "GPU": 1.0}, {"memory": 1e9}]
    assert host_capacity({"CPU": 1.0}, "PACK", nodes, 8) == 3
    assert host_capacity({"CPU": 1.0}, "SPREAD", nodes, 2) == 2           # never above the job's own hosts
    assert host_capacity({"CPU": 1.0}, "STRICT_SPREAD", nodes, 8) == 2
    assert host_capacity({"CPU": 1.0}, "STRICT_PACK", nodes, 8) == 2
    assert host_capacity({"CPU": 0.5, "GPU": 1.0}, "PACK", nodes, 8) == 1
    assert host_capacity({"CPU": 0.3}, "PACK", [{"CPU": 0.9}], 8) == 3     # 0.9 / 0.3 rounds to 3, not 2
    assert host_capacity({"CPU": 1.0}, "PACK", [], 4) == 0


def test_predicted_step_grows_as_hosts_go(four):
    steps = {c: plan_for(four, c).predicted.step_s for c in (4, 3, 2, 1)}
    assert steps[4] < steps[2] < steps[1] and steps[3] <= steps[2]
    assert speedup(Prediction(2.0, 0.1), Prediction(1.0, 0.1)) == pytest.approx(1.0)
    assert speedup(None, Prediction(1.0, 0.0)) is None


def test_record_log_line_progress_line_and_metrics(four):
    r = plan_for(four, 2)
    rec = ReplanRecord.of("shrink", 8, "node lost: node 3 (stage 1 host 1)", four, r, predict_step(four),
                          Timings(detection_s=1.2, teardown_s=0.3, planning_s=0.6, restore_s=0.7, compile_s=4.1,
                                  total_s=21.5))
    data = json.loads(json.dumps(rec.to_json()))
    assert data["hosts"] == {"before": 4, "after": 2} and data["step"] == 8 and data["method"] == "rule"
    assert data["plan"]["before"] == describe_plan(four) == \
        "2 stages 1f1b m=4 on 4 hosts: [0,2) data=4 x2h | [2,4) data=2,model=2 x2h"
    assert data["plan"]["after"] == "2 stages 1f1b m=4 on 2 hosts: [0,2) data=2 | [2,4) data=1,model=2"
    assert data["predicted_step_s"]["before"] < data["predicted_step_s"]["after"]
    assert data["times_s"] == {"detection": 1.2, "teardown": 0.3, "wait": None, "planning": 0.6, "placement": None,
                               "restore": 0.7, "compile": 4.1, "total": 21.5}
    line = rec.message()
    has_all(line, "elastic shrink at step 8 (node lost", "→ 2 stages", "[rule]", "predicted step",
            "training again 21.5 s after the loss (detection 1.2, teardown 0.3, planning 0.6, restore 0.7, "
            "compile 4.1 s)")
    grow = ReplanRecord.of("grow", 12, "2 hosts back", r.checked, plan_for(four, 4), timings=Timings(total_s=9.0))
    assert grow.to_json()["method"] == "original" and grow.to_json()["hosts"] == {"before": 2, "after": 4}
    assert grow.message().endswith("[original]; training again 9.0 s after the commit")
    assert plan_line(r.checked, plan_hosts(four)) == "plan: 2 stages on 2 of 4 hosts, m=4"
    assert plan_line(four, 4) == "plan: 2 stages on 4 hosts, m=4"
    with pytest.raises(ValueError, match="needs the new plan"):
        ReplanRecord.of("shrink", 8, "x", four, plan_for(four, 0))
    assert [m.scraped for m in METRICS] == ["ray_meshpipe_hosts", "ray_meshpipe_replans"]


@pytest.mark.parametrize("module", ["auto", "predict", "record", "replan", "rule"])
def test_docstring_examples(module):
    mod = importlib.import_module(f"orchestrator.core.elastic.{module}")
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
