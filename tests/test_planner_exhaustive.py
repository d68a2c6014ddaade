"""Pure tests of the planner's bounded space (`legal_plans`, what benchmarks/planner_exhaustive.py
measures), remat in the search and the schedules it searches (synthetic profiles, no jax)."""
from __future__ import annotations

import itertools
import statistics
from pathlib import Path

import pytest
import yaml

from orchestrator.core.config import check_job, parse_cluster, parse_job
from orchestrator.core.config import check as check_mod
from orchestrator.core.model.registry import build_spec
from orchestrator.core.planner.adapter import from_spec
from orchestrator.core.planner.cost import MeshChoice, layer_cost
from orchestrator.core.planner.report import job_dict
from orchestrator.core.planner.search import (PlanningError, SearchOptions, default_schedules, legal_plans,
                                              search)
from orchestrator.core.planner.topology import LinkClass, Topology
from tests.planner_fakes import FakeProfiles, fake_model

ROOT = Path(__file__).resolve().parents[1]
GPT = {"vocab": 128, "d_model": 64, "heads": 4, "d_mlp": 256, "blocks": 2}
MEGATRON = {"megatron": ("heads", "mlp", "vocab")}


def topo(hosts=2, dph=2, mem=1e12, inter_gbps=10.0, flops=1e9, hpg=1):
    links = {"host": LinkClass("host", 1e-6, 10e9), "group": LinkClass("group", 1e-5, inter_gbps * 1e9),
             "dcn": LinkClass("dcn", 1e-5, inter_gbps * 1e9)}
    return Topology(hosts, dph, hpg, links, mem, flops, 1e12)


def gpt_model():
    return from_spec(build_spec("gpt", GPT, seq_len=32), "gpt", GPT, 32)


def expected_plans(L, H, dph, ms, gb, max_model, schedules):
    """The bounded space counted from first principles (independent of the search's code):
    plan keys (schedule, m, ((layers), (first host, hosts), (data, model, order)) per stage)."""
    out = set()
    for m in ms:
        micro = gb // m
        for p in range(1, min(H, L) + 1):
            for cuts in itertools.combinations(range(1, L), p - 1):
                bounds = (0, *cuts, L)
                for ks in itertools.product(range(1, H + 1), repeat=p):
                    if sum(ks) > H:
                        continue
                    per_stage = []
                    for k in ks:
                        n = k * dph
                        opts = []
                        for mm in range(1, min(n, max_model) + 1):
                            d = n // mm
                            if n % mm or micro % d:
                                continue
                            orders = [("data", "model")] + ([("model", "data")] if k > 1 and d > 1 and mm > 1 else [])
                            opts += [(d, mm, o) for o in orders]
                        per_stage.append(opts)
                    starts = [sum(ks[:s]) for s in range(p)]
                    for pick in itertools.product(*per_stage):
                        stages = tuple(((bounds[s], bounds[s + 1]), (starts[s], ks[s]), pick[s]) for s in range(p))
                        for sched in (schedules if p > 1 else schedules[:1]):
                            out.add((sched, m, stages))
    return out


def key(c):
    return (c.schedule, c.microbatches,
            tuple((s.layers, s.hosts, (s.choice.data, s.choice.model, s.choice.order)) for s in c.stages))


@pytest.mark.parametrize("gb,ms,schedules", [(16, (2, 4), ("1f1b",)), (8, (4,), ("1f1b", "gpipe"))])
def test_legal_plans_are_exactly_the_bounded_space_and_each_passes_check_job(gb, ms, schedules):
    model = gpt_model()
    L = model.num_layers
    t = topo()
    opts = SearchOptions(microbatches=ms, schedules=schedules, rulesets=MEGATRON, max_model=2, remats=("none",),
                         max_fsdp=1)
    plans = legal_plans(model, t, gb, profile=FakeProfiles(model, [1e6] * L), options=opts)
    want = expected_plans(L, 2, 2, ms, gb, 2, schedules)
    got = [key(c) for c in plans]
    assert len(got) == len(set(got)) == len(want)          # no plan twice, none missing, none extra
    assert set(got) == want
    if gb == 8:     # micro 2 at m = 4: a data axis of 4 cannot split it, so no such plan
        assert all(s.choice.data <= 2 for c in plans for s in c.stages)
    assert [c.step_s for c in plans] == sorted(c.step_s for c in plans)
    raw = yaml.safe_load((ROOT / "examples" / "gpt.yaml").read_text())
    raw["data"]["global_batch"] = gb
    raw["data"]["path"] = str(ROOT / raw["data"]["path"])
    cluster = parse_cluster({"hosts": 2, "devices_per_host": 2, "cpus_per_host": 0.5})
    for c in plans:                       # legal = what `meshpipe run` accepts
        checked = check_job(parse_job(job_dict(raw, c)), cluster)
        assert len(checked.stages) == len(c.stages)


def test_the_dp_pick_is_one_of_the_legal_plans_and_within_5_percent_of_the_best_simulated():
    model = gpt_model()
    opts = SearchOptions(microbatches=(2, 4), schedules=("1f1b",), rulesets=MEGATRON, max_model=2, remats=("none",),
                         max_fsdp=1)
    prof = FakeProfiles(model, [1e6, 4e6, 4e6, 2e6])
    plans = legal_plans(model, topo(), 16, profile=prof, options=opts)
    auto = search(model, topo(), 16, profile=prof, options=opts).best
    assert key(auto) in {key(c) for c in plans}
    assert auto.step_s <= 1.05 * plans[0].step_s


def test_shared_slowdown_is_charged_to_plans_on_several_hosts_and_not_to_a_one_host_plan():
    import dataclasses

    model = gpt_model()
    opts = SearchOptions(microbatches=(4,), schedules=("1f1b",), rulesets=MEGATRON, max_model=2, remats=("none",),
                         max_fsdp=1)
    prof = FakeProfiles(model, [1e6, 4e6, 4e6, 2e6])
    plain = {key(c): c.step_s for c in legal_plans(model, topo(), 16, profile=prof, options=opts)}
    shared = {key(c): c.step_s for c in legal_plans(model, dataclasses.replace(topo(), shared_slowdown=3.0), 16,
                                                    profile=prof, options=opts)}
    assert plain.keys() == shared.keys()
    one_host = [k for k in plain if len(k[2]) == 1 and k[2][0][1][1] == 1]
    several = [k for k in plain if k not in one_host]
    assert one_host and several
    for k in one_host:
        assert shared[k] == pytest.approx(plain[k])
    for k in several:      # compute (and its kernels) 3x, the runtime's per-action and transfer costs not
        assert plain[k] < shared[k] <= 3 * plain[k] + 1e-12
    # the search picks with the same figures: a compute-bound model that wins on 2 hosts unshared moves to 1
    best = search(model, topo(), 16, profile=prof, options=opts).best
    best_shared = search(model, dataclasses.replace(topo(), shared_slowdown=3.0), 16, profile=prof, options=opts).best
    assert key(best_shared) in one_host and shared[key(best_shared)] == pytest.approx(best_shared.step_s)
    assert key(best) not in one_host


# ---- remat ----------------------------------------------------------------------------------

def _choice(remat):
    return MeshChoice(1, 1, ("data", "model"), (), "dp", remat)


def test_full_remat_costs_the_forward_again_and_keeps_only_the_input():
    model = fake_model([1e6, 1e6])
    prof = FakeProfiles(model, [1e6, 1e6], resid_per_example=4096)
    layer = model.layers[1]
    from orchestrator.core.planner.cost import layer_request

    profiles = prof([layer_request(layer, _choice("none"), b) for b in (1, 2)])
    t = topo(hosts=1, dph=1)
    none = layer_cost(layer, _choice("none"), 4, t, 0, profiles, in_bytes=256.0)
    full = layer_cost(layer, _choice("full"), 4, t, 0, profiles, in_bytes=256.0)
    assert full.fwd_s == none.fwd_s
    assert full.bwd_s == pytest.approx(none.bwd_s + none.fwd_s)
    assert full.residual_bytes == 4 * 256.0 < none.residual_bytes == 4 * 4096
    assert full.temp_bytes >= none.residual_bytes         # one layer's residuals, recomputed, live in its B


def _remat_case(mem, remats):
    costs = [1e6] * 4
    model = fake_model(costs)
    prof = FakeProfiles(model, costs, act_bytes=256, resid_per_example=1 << 16)
    # one device, gpipe: all 8 microbatches' residuals in flight, so they dominate memory
    opts = SearchOptions(microbatches=(8,), schedules=("gpipe",), optimizer_slots=0, remats=remats, top=0)
    return search(model, topo(hosts=1, dph=1, mem=mem), 16, profile=prof, options=opts)


def test_a_tight_memory_limit_makes_the_search_pick_remat_and_no_plan_exceeds_it():
    roomy = _remat_case(1e12, ("none", "full"))
    assert all(s.choice.remat == "none" for s in roomy.best.stages)       # remat only costs time
    need = min(c.memory_bytes for c in _remat_case(1e12, ("none",)).candidates)
    with pytest.raises(PlanningError, match="does not fit"):
        _remat_case(need * 0.5, ("none",))
    tight = _remat_case(need * 0.5, ("none", "full"))
    assert any(s.choice.remat == "full" for s in tight.best.stages)
    assert tight.best.memory_bytes <= need * 0.5
    assert tight.best.step_s > roomy.best.step_s
    for frac in (1.0, 0.8, 0.6, 0.5, 0.4, 0.3):               # the winner never violates memory
        try:
            r = _remat_case(need * frac, ("none", "full"))
        except PlanningError:
            continue
        assert all(c.memory_bytes <= need * frac for c in r.candidates)
        for c in r.candidates:
            assert all(s.memory_bytes <= need * frac for s in c.stages)
    written = job_dict({"pipeline": {"microbatches": 1, "stages": []}}, tight.best)
    assert any(st.get("remat") == "full" for st in written["pipeline"]["stages"])


def test_remats_must_be_none_or_full():
    with pytest.raises(PlanningError, match=r"remats = \['dots'\]"):
        _remat_case(1e12, ("dots",))


# ---- schedules ------------------------------------------------------------------------------

def _pipelined(schedules, ms=(8,)):
    costs = [1e6] * 4
    model = fake_model(costs, param_scale=8)
    t = topo(hosts=2, dph=1, inter_gbps=1e-3)          # data parallel across hosts is ruinous: pipeline
    opts = SearchOptions(microbatches=ms, schedules=schedules, top=0)
    return search(model, t, 32, profile=FakeProfiles(model, costs), options=opts)


def test_zb_h1_is_searched_where_jax_runs_it_and_wins_a_balanced_pipeline(monkeypatch):
    monkeypatch.setattr(check_mod, "_jax_version", lambda: (0, 10))   # CI's oldest step has 0.8
    assert default_schedules() == ("1f1b", "gpipe", "zb-h1", "interleaved-1f1b")
    r = _pipelined(("1f1b", "gpipe", "zb-h1"))
    assert r.best.schedule == "zb-h1" and len(r.best.stages) == 2
    ones = [c for c in r.candidates if c.schedule == "1f1b" and key(c)[2] == key(r.best)[2]]
    assert ones and r.best.step_s < ones[0].step_s                     # the smaller bubble
    assert all(c.memory_bytes <= r.topology.memory_bytes for c in r.candidates)


def test_zb_h1_is_refused_at_plan_time_on_older_jax(monkeypatch):
    monkeypatch.setattr(check_mod, "_jax_version", lambda: (0, 8))
    assert "zb-h1" not in default_schedules()
    assert all(c.schedule != "zb-h1" for c in _pipelined(None).candidates)
    with pytest.raises(PlanningError, match=r"zb-h1 needs JAX >= 0\.10 .*this is JAX 0\.8"):
        _pipelined(("1f1b", "zb-h1"))


def test_unknown_schedules_are_refused_with_the_rule():
    with pytest.raises(PlanningError, match="'2f2b' is not a schedule the planner searches"):
        _pipelined(("2f2b",))


# ---- the exhaustive benchmark's arithmetic (benchmarks/planner_exhaustive.py) ------------------

def test_exhaustive_benchmark_summary_ratio_rank_error_and_noise_verdict():
    from benchmarks.planner_exhaustive import render, summarize

    plans = [("a", 0.010, 1.0), ("b", 0.011, 1.0), ("c", 0.020, 1.0), ("d", 0.030, 1.0)]
    runs = {0: [{"median_s": x} for x in (0.0120, 0.0118, 0.0121)],      # predicted best
            1: [{"median_s": x} for x in (0.0110, 0.0112, 0.0111)],      # measured best
            2: [{"median_s": 0.025}], 3: []}                              # 3 failed to run
    s = summarize(plans, runs, auto_i=0)
    assert s["best_measured"]["plan"] == 1 and s["auto"]["measured_rank"] == 2
    assert s["ratio_auto_over_best"] == pytest.approx(0.0120 / 0.0111)
    assert s["plans_measured"] == 3 and [r["plan"] for r in s["rows"]] == [0, 1, 2]
    errs = sorted(abs(x) for x in ((0.010 - 0.012) / 0.012, (0.011 - 0.0111) / 0.0111, (0.020 - 0.025) / 0.025))
    assert s["median_abs_error"] == pytest.approx(errs[1])
    assert s["repeated_spread"]["max"] == pytest.approx((0.0121 - 0.0118) / 0.012)
    assert s["verdict"].startswith("NOT MET")                    # 1.08 > 1.05 with a 2.5 % spread
    noisy = summarize(plans, {**runs, 1: [{"median_s": 0.0111}, {"median_s": 0.0150}]}, auto_i=0)
    assert noisy["verdict"].startswith("NOT DECIDED")            # spread > 5 %: no claim either way
    met = summarize(plans, {**runs, 0: [{"median_s": 0.0112}, {"median_s": 0.0113}]}, auto_i=0)
    assert met["verdict"].startswith("MET") and met["ratio_auto_over_best"] <= 1.05
    with pytest.raises(RuntimeError, match="auto pick"):
        summarize(plans, runs, auto_i=3)
    out = {"case": {"model_args": {}, "seq_len": 32, "global_batch": 16, "hosts": 2, "devices_per_host": 2,
                    "space": {"microbatches": [4], "schedules": ["1f1b"], "stages": [1, 2], "max_model": 2,
                              "rulesets": {}, "remats": ["none"], "plans": 4},
                    "protocol": {"steps": 12, "warmup_dropped": 4, "rounds": 3, "order": "x"}},
           "machine": {"when": "now", "cpu": "cpu", "nproc": 2, "affinity": 2}, "load_avg": {"start": (1, 2, 3)},
           "calibrated": {"device": {}, "links": {}}, "failed": {3: "boom"},
           "wall_s": {"calibrate": 1, "plan": 1, "rounds": [1, 2, 3]}, **s}
    md = render(out)
    assert "NOT MET" in md and "| 0 **auto** |" in md and "1 plan(s) failed to run" in md
    assert "3 rounds" in md and "rounds 1 s, 2 s, 3 s" in md and "hypervisor steal not read" in md


def test_recalibrated_rounds_score_each_run_against_its_own_rounds_prediction():
    from benchmarks.planner_exhaustive import render, summarize

    plans = [("a", 0.010, 1.0), ("b", 0.020, 1.0)]
    # the first calibration predicts 10 and 20 ms; the machine slows, and later rounds predict more
    runs = {0: [{"median_s": 0.011, "predicted_s": 0.010}, {"median_s": 0.016, "predicted_s": 0.015},
                {"median_s": 0.020, "predicted_s": 0.022}],
            1: [{"median_s": 0.022, "predicted_s": 0.020}, {"median_s": 0.030, "predicted_s": 0.030},
                {"median_s": 0.040, "predicted_s": 0.044}]}
    s = summarize(plans, runs, auto_i=0)
    # against the first calibration: (10 - 16) / 16 and (20 - 30) / 30
    assert s["median_abs_error"] == pytest.approx(statistics.median([6 / 16, 10 / 30]))
    # each run against its own round's figures: medians of (-1/11, -1/16, +2/20) and (-2/22, 0, +4/40)
    a = statistics.median([-1 / 11, -1 / 16, 2 / 20])
    b = statistics.median([-2 / 22, 0.0, 4 / 40])
    assert [r["error_each_round"] for r in s["rows"]] == [pytest.approx(a), pytest.approx(b)]
    assert s["median_abs_error_each_round"] == pytest.approx(statistics.median([abs(a), abs(b)]))
    # a run without its prediction: no each-round figure at all, rather than one from some runs
    partial = summarize(plans, {**runs, 1: runs[1][:2] + [{"median_s": 0.04}]}, auto_i=0)
    assert partial["median_abs_error_each_round"] is None
    out = {"case": {"model_args": {}, "seq_len": 32, "global_batch": 16, "hosts": 2, "devices_per_host": 2,
                    "space": {"microbatches": [4], "schedules": ["1f1b"], "stages": [1, 2], "max_model": 2,
                              "rulesets": {}, "remats": ["none"], "plans": 2},
                    "protocol": {"steps": 12, "warmup_dropped": 4, "rounds": 3, "order": "x", "recalibrate": True}},
           "machine": {"when": "now", "cpu": "cpu", "nproc": 2, "affinity": 2}, "load_avg": {"start": (1, 2, 3)},
           "calibrated": {"device": {}, "links": {}}, "failed": {},
           "calibrations": [{"when": "before round 1", "flops_per_device": 1e11, "bandwidth_per_device": 2e10,
                             "action_overhead_s": 3e-4, "transfer_overhead_s": None}],
           "wall_s": {"calibrate": 1, "plan": 1, "rounds": [1, 2, 3]}, **s}
    md = render(out)
    assert f"(`--recalibrate`): median |error| {s['median_abs_error_each_round'] * 100:.1f} %" in md
    assert "before round 1: 100 GFLOP/s, 20 GB/s per device, overheads 300 / ? µs" in md


# ---- the head-to-head decision (benchmarks/paired.py) -----------------------------------------

def test_the_median_interval_has_the_binomial_coverage_it_claims():
    import math

    from benchmarks.paired import median_interval

    xs = [1.3, 0.9, 1.1, 1.0, 1.2, 0.8, 1.05, 0.95, 1.15, 0.85]        # n = 10
    r = median_interval(xs, 0.9)
    # P(Binomial(10, 1/2) <= 1) = 11/1024; k = 2 covers 1 - 22/1024 ≥ 0.9, k = 3 covers 1 - 112/1024 < 0.9
    assert r["k"] == 2 and r["coverage"] == pytest.approx(1 - 2 * 11 / 1024)
    assert (r["lo"], r["hi"]) == (sorted(xs)[1], sorted(xs)[8])
    assert math.isclose(median_interval(xs, 0.8)["coverage"], 1 - 2 * 56 / 1024)    # k = 3 suffices at 0.8
    assert median_interval(xs[:4], 0.9) is None                       # 4 pairs reach only 0.875
    with pytest.raises(ValueError, match="confidence = 1.5"):
        median_interval(xs, 1.5)
    import doctest

    from benchmarks import paired
    result = doctest.testmod(paired)
    assert result.attempted >= 5 and result.failed == 0


def test_block_order_puts_every_plan_in_every_position_equally_often():
    from benchmarks.paired import block_order

    blocks = [block_order(i, (0, 3, 7)) for i in range(6)]
    assert len(set(blocks)) == 6
    for pos in range(3):
        assert sorted(b[pos] for b in blocks) == [0, 0, 3, 3, 7, 7]


def test_paired_verdict_decides_through_a_drift_that_the_rounds_cannot():
    from benchmarks.paired import verdict

    # the machine slows 2x over eight blocks; auto is 2 % slower than #1 and 20 % slower than #2 within each block
    speed = [1 + i / 7 for i in range(8)]
    auto = [0.0102 * s for s in speed]
    one, two = [0.0100 * s for s in speed], [0.0085 * s for s in speed]
    spread = (max(auto) - min(auto)) / sorted(auto)[4]
    assert spread > 0.5                                                # unpaired: far too noisy for a 5 % claim
    v = verdict({"#1": [a / b for a, b in zip(auto, one)]}, 1.05)
    assert v["overall"] == "MET" and v["per"]["#1"]["status"] == "within"
    v = verdict({"#1": [a / b for a, b in zip(auto, one)], "#2": [a / b for a, b in zip(auto, two)]}, 1.05)
    assert v["overall"] == "NOT MET" and v["per"]["#2"]["status"] == "beyond" and "#2 median 1.200" in v["line"]
    # ratios straddling the target: no claim
    v = verdict({"#1": [1.0, 1.1, 0.98, 1.12, 1.02, 1.09, 1.0, 1.1]}, 1.05)
    assert v["overall"] == "NOT DECIDED" and "undecided" in v["line"]
    assert verdict({"#1": [1.0, 1.01, 1.0]}, 1.05)["overall"] == "NOT DECIDED"       # too few pairs
    with pytest.raises(ValueError, match="challenger #1"):
        verdict({"#1": [1.0, float("nan")]}, 1.05)
    with pytest.raises(ValueError, match="nothing to decide"):
        verdict({}, 1.05)


def test_the_head_to_head_line_is_rendered_beside_the_rounds_verdict():
    from benchmarks.paired import verdict
    from benchmarks.planner_exhaustive import render, summarize

    plans = [("a", 0.010, 1.0), ("b", 0.011, 1.0)]
    s = summarize(plans, {0: [{"median_s": 0.012}, {"median_s": 0.020}], 1: [{"median_s": 0.011}]}, auto_i=0)
    h2h = {"auto": 0, "challengers": [1], "blocks": [{}] * 8, "failed": ["block 9: boom"],
           **verdict({"#1": [1.0, 1.01, 0.99, 1.02, 1.0, 0.98, 1.01, 1.0]}, 1.05)}
    out = {"case": {"model_args": {}, "seq_len": 32, "global_batch": 16, "hosts": 2, "devices_per_host": 2,
                    "space": {"microbatches": [4], "schedules": ["1f1b"], "stages": [1, 2], "max_model": 2,
                              "rulesets": {}, "remats": ["none"], "plans": 2},
                    "protocol": {"steps": 12, "warmup_dropped": 4, "rounds": 2, "order": "x"}},
           "machine": {"when": "now", "cpu": "cpu", "nproc": 2, "affinity": 2}, "load_avg": {"start": (1, 2, 3)},
           "calibrated": {"device": {}, "links": {}}, "failed": {}, "head_to_head": h2h,
           "wall_s": {"calibrate": 1, "plan": 1, "rounds": [1, 2], "head_to_head": 42}, **s}
    md = render(out)
    assert "**head to head: MET (target ≤ 1.05): ÷ #1 median 1.000 over 8 pairs" in md
    assert "rounds alone: **NOT DECIDED" in md and "1 block(s) failed" in md and "head to head 42 s" in md


def _source(h2h):
    rows = [{"plan": i, "describe": d, "measured_rank": r} for i, (d, r) in enumerate([("a", 1), ("b", 3), ("c", 2)])]
    return {"rows": rows, "auto": {"plan": 0}, "head_to_head": h2h}


def test_the_long_head_to_head_takes_up_what_the_source_run_left_undecided():
    from benchmarks.paired import verdict
    from benchmarks.planner_h2h import chosen, find, render

    v = verdict({"#2": [0.7, 0.8, 0.75, 0.7, 0.72, 0.8, 0.71, 0.74], "#1": [0.9, 1.2, 1.0, 1.1, 0.95, 1.3, 0.9, 1.0]},
                1.05)
    assert v["per"]["#2"]["status"] == "within" and v["per"]["#1"]["status"] == "undecided"
    assert chosen(_source({"challengers": [2, 1], **v}), 2) == ("a", ["b"])     # #2 is decided: not run again
    assert chosen(_source(None), 1) == ("a", ["c"])                              # no head to head: best measured other
    assert chosen(_source(None), 2) == ("a", ["c", "b"])
    done = verdict({"#2": [0.7] * 8}, 1.05)
    with pytest.raises(ValueError, match="without deciding it"):
        chosen(_source({"challengers": [2], **done}), 1)
    with pytest.raises(ValueError, match="--challengers = 0"):
        chosen(_source(None), 0)

    class P:      # a plan as `describe` reads it
        def __init__(self, label):
            self.stages, self.microbatches, self.schedule = [], 4, label

    plans = [P("x"), P("y")]
    from benchmarks.planner_exhaustive import describe
    assert find(plans, [describe(plans[1]), describe(plans[0])]) == [1, 0]
    with pytest.raises(ValueError, match="not among today's 2 legal plans"):
        find(plans, ["nope"])

    ratios = {"#1": [1.0, 1.01, 0.99, 1.02, 1.0, 0.98, 1.01, 1.0]}
    out = {"source": {"path": "s.json", "when": "then"}, "label": "", "pin_cpus": False, "wall_s": 9.0,
           "machine": {"when": "now", "cpu": "cpu", "nproc": 2, "steal_share": 0.001},
           "load_avg": {"start": (1, 2, 3), "end": (1, 1, 1)}, "protocol": {"steps": 30, "warmup_dropped": 6, "pairs": 9},
           "describe": {"0": "a", "1": "b"}, "auto": 0, "challengers": [1], "failed": ["block 9: boom"],
           "blocks": [{"conditions": [[{"affinity": [0, 1]}]]}] * 8, **verdict(ratios, 1.05)}
    md = render(out)
    assert "**MET (target ≤ 1.05): ÷ #1 median 1.000 over 8 pairs" in md
    assert "#0 (auto) a; #1 b" in md and "9 blocks asked, 8 ran" in md and "cores read back on the stage actors [0, 1]" in md
    assert "| #1 | 8 | 1.000 | 0.990–1.010 |" in md and "failed: ['block 9: boom']" in md
