"""The benchmark's derived quantities (benchmarks/formulas.py) and the checks that refuse to publish
impossible ones (benchmarks/derive.py, benchmarks/pipeline.py check_pinning), pure: worked
examples by hand, nothing timed."""
from __future__ import annotations

import pytest

from benchmarks import formulas


def test_efficiency_is_ideal_over_step():
    assert formulas.efficiency(ideal_s=0.045, step_s=0.05) == pytest.approx(0.9)
    assert formulas.efficiency(0.05, 0.05) == 1.0


def test_overhead_is_excess_per_action_in_ms():
    # 1f1b, m = 8: 2m + 1 = 17 compute actions per stage; 3.4 ms over the ideal -> 0.2 ms each
    assert formulas.overhead_ms(step_s=0.0234, ideal_s=0.0200, actions=17) == pytest.approx(0.2)
    assert formulas.overhead_ms(0.02, 0.021, 10) == pytest.approx(-0.1)   # faster than ideal: negative, not hidden


@pytest.mark.parametrize("m, p, expected", [(8, 2, 8 / 9), (1, 1, 1.0), (4, 4, 4 / 7), (32, 2, 32 / 33)])
def test_bound_is_m_over_m_plus_p_minus_1(m, p, expected):
    assert formulas.bound(m, p) == pytest.approx(expected)


def test_vs_plain():
    assert formulas.vs_plain(plain_s=0.08, step_s=0.1) == pytest.approx(0.8)


@pytest.mark.parametrize("plain1, m, p, expected", [
    (1.583, 8, 2, 1.583 * 9 / 16),     # the issue's quiet-machine figure: 1583 ms on 1 core -> 890 ms
    (1.0, 1, 2, 1.0),                  # one microbatch: no overlap, the whole program's time
    (1.0, 4, 4, 7 / 16),
    (2.0, 1000, 1, 2.0),               # one stage: the program itself
])
def test_honest_bound_is_a_perfect_pipeline_of_the_one_core_program(plain1, m, p, expected):
    assert formulas.honest_bound_s(plain1, m, p) == pytest.approx(expected)
    # of honest bound: 1.0 exactly when the pipeline runs at that perfect step
    assert formulas.of_honest_bound(plain1, m, p, expected) == pytest.approx(1.0)
    assert formulas.of_honest_bound(plain1, m, p, 2 * expected) == pytest.approx(0.5)


def test_the_issue_figures_come_out_of_the_honest_bound():
    """plain₁ 1583 ms, 1F1B 1067 ms pinned / 1251 ms unpinned at m = 8: 0.83 and 0.71 of the bound."""
    assert round(formulas.of_honest_bound(1.583, 8, 2, 1.067), 2) == 0.83
    assert round(formulas.of_honest_bound(1.583, 8, 2, 1.251), 2) == 0.71


def test_checked_efficiency_refuses_above_one_and_names_the_run():
    assert formulas.checked_efficiency(0.09, 0.1, "x") == pytest.approx(0.9)
    assert formulas.checked_efficiency(0.1, 0.1, "x") == 1.0
    with pytest.raises(formulas.ImplausibleMeasurement, match=r"large 1f1b m=8: efficiency 1\.1440 > 1"):
        formulas.checked_efficiency(1.144, 1.0, "large 1f1b m=8")


def test_checked_overhead_refuses_negative():
    assert formulas.checked_overhead_ms(0.0234, 0.0200, 17, "x") == pytest.approx(0.2)
    assert formulas.checked_overhead_ms(0.02, 0.02, 17, "x") == 0.0
    with pytest.raises(formulas.ImplausibleMeasurement, match=r"tiny: overhead -4\.2000 ms"):
        formulas.checked_overhead_ms(0.0958, 0.1, 1, "tiny")
    assert issubclass(formulas.ImplausibleMeasurement, ValueError)


@pytest.mark.parametrize("costs, expected", [
    ({"F": 1.0, "B": 2.0, "OPT": 5.0}, 3.0),
    ({"F": 1.0, "I": 1.5, "W": 0.75}, 3.25),          # zero-bubble: B split into I + W
    ({"F": 1.0, "B": 2.0, "I": 9.0, "W": 9.0}, 3.0),  # B present: I/W are not added
    ({}, 0.0),
])
def test_fb_sums_one_microbatch_of_compute(costs, expected):
    assert formulas.fb(costs) == pytest.approx(expected)


@pytest.mark.parametrize("call, name", [
    (lambda: formulas.efficiency(1.0, 0.0), "step_s"),
    (lambda: formulas.overhead_ms(1.0, 0.5, 0), "actions"),
    (lambda: formulas.bound(0, 2), "m"),
    (lambda: formulas.bound(8, 0), "p"),
    (lambda: formulas.vs_plain(1.0, -1.0), "step_s"),
    (lambda: formulas.honest_bound_s(0.0, 8, 2), "plain1_s"),
    (lambda: formulas.honest_bound_s(1.0, 0, 2), "m"),
    (lambda: formulas.of_honest_bound(1.0, 8, 2, 0.0), "step_s"),
])
def test_a_zero_denominator_is_an_error_naming_it(call, name):
    with pytest.raises(ValueError, match=f"{name} must be > 0"):
        call()


def test_module_docstring_example_holds():
    import doctest

    result = doctest.testmod(formulas)
    assert result.attempted == 6 and result.failed == 0


def test_the_conditions_note_reads_the_observed_load():
    """A result says "busier than the benchmark alone" only when the load it read back was."""
    import doctest

    from benchmarks import common

    result = doctest.testmod(common)
    assert result.attempted >= 2 and result.failed == 0
    assert "no more than the benchmark" in common.load_note((0.1, 0, 0), (3.0, 0, 0), cores=2)
    assert "busier" in common.load_note((3.1, 0, 0), (0.2, 0, 0), cores=2)


# ----------------------------------------------------------------------------- derive: refuse, don't publish

def _record(step_s: float, ideal_s: float, schedule: str = "1f1b") -> dict:
    """A pipelined run's raw record as benchmarks/pipeline.py writes it (the fields derive reads)."""
    costs = [{"F": 0.01, "B": 0.02, "OPT": 0.001}, {"F": 0.012, "B": 0.022, "OPT": 0.001}]
    return {"size": "large", "schedule": schedule, "m": 8, "status": "ok", "step_s": step_s, "ideal_s": ideal_s,
            "ideal_no_opt_s": ideal_s - 0.001, "compute_actions_per_stage": 17, "critical_path_actions": 19,
            "standalone": {"stages": costs}, "costs": [{k: 1.1 * v for k, v in c.items()} for c in costs],
            "totals": [{"SEND_F": 0.001, "RECV_B": 0.002}, {"RECV_F": 0.003, "SEND_B": 0.001}],
            "losses": [5.0, 4.9], "observed": [{"stage": 0, "host": 0, "affinity": [0]},
                                               {"stage": 1, "host": 0, "affinity": [1]}]}


def _plain(cores: int, step_s: float) -> dict:
    return {"status": "ok", "size": "large", "m": 8, "cores": cores, "step_s": step_s, "fused_mb_s": 0.05,
            "update_s": 0.01, "losses": [5.0, 4.9], "step_spread": 0.1}


def test_derive_publishes_a_plausible_run_with_the_honest_bound(monkeypatch):
    from benchmarks import derive, run

    monkeypatch.setattr(derive.os, "cpu_count", lambda: 2)
    raw = {"pipeline": {"records": [_record(step_s=1.0, ideal_s=0.9)]},
           "jax": {"records": [_plain(2, 1.2), _plain(1, 0.5)]}}
    d = run.derive(raw)["pipeline"][0]
    assert d["efficiency"] == pytest.approx(0.9)
    # the stages' standalone F + B: 0.064 s per microbatch, 0.512 s for 8; the plain program is faster
    assert d["honest_base"] == "plain1" and d["honest_bound_s"] == pytest.approx(0.5 * 9 / 16)
    assert d["of_honest_bound"] == pytest.approx(0.5 * 9 / 16)
    assert d["vs_plain_all"] == pytest.approx(1.2) and d["plain_all_cores"] == 2
    assert d["breakdown_s"]["orchestration"] >= 0
    assert d["in_run_vs_standalone"][0]["F"] == pytest.approx(1.1)


def test_the_honest_bound_is_left_out_for_schedules_that_shrink_the_bubble(monkeypatch):
    """ZB-H1 (and interleaved) beat the (m+p-1)/(m p) bound by design: no `of honest bound` for them."""
    from benchmarks import derive, run

    monkeypatch.setattr(derive.os, "cpu_count", lambda: 2)
    recs = [_record(step_s=0.8, ideal_s=0.75, schedule=s) for s in ("zb-h1", "gpipe")]
    for c in recs[0]["standalone"]["stages"] + recs[0]["costs"]:      # zb-h1's split backward
        c["I"], c["W"] = c["B"] / 2, c["B"] / 2
    out = run.derive({"pipeline": {"records": recs}, "jax": {"records": [_plain(2, 1.2), _plain(1, 1.6)]}})
    # base₁: the stages' F + B × 8 = 0.512 s, less than plain₁ = 1.6 s
    assert [d.get("of_honest_bound") for d in out["pipeline"]] == [None, pytest.approx(0.512 * 9 / 16 / 0.8)]
    assert out["pipeline"][1]["honest_base"] == "stages"
    assert all(d["vs_plain_all"] == pytest.approx(1.5) for d in out["pipeline"])


def test_the_split_penalty_is_measured_against_the_faster_unsplit_program(monkeypatch):
    """The unsplit baseline is the faster of the scanned 1-core step's share per microbatch and one
    microbatch's program alone — or the stage programs themselves when they run faster still (smaller
    working sets; measured at `large`): then the split penalty is 0, not negative, and the row says so."""
    from benchmarks import derive, run

    monkeypatch.setattr(derive.os, "cpu_count", lambda: 2)
    plain1 = {**_plain(1, 0.25), "fused_mb_s": 0.05}       # (0.25 - 0.01) / 8 = 0.03 s per microbatch
    d = run.derive({"pipeline": {"records": [_record(step_s=1.0, ideal_s=0.9)]},
                    "jax": {"records": [_plain(2, 0.2), plain1]}})["pipeline"][0]
    assert d["fused_mb_1core_s"] == pytest.approx(0.03)
    assert d["split_fb_sum_s"] == pytest.approx(0.064)       # (10 + 20) + (12 + 22) ms
    assert d["breakdown_s"]["split"] == pytest.approx(8 * (0.064 - 0.03) / 2)
    assert d["breakdown_s"]["useful"] == pytest.approx(8 * 0.03 / 2)
    assert (d["unsplit_base"], d["split_gain"]) == ("plain1", 0.0)
    plain1["step_s"] = 8 * 0.07 + 0.01                      # both unsplit programs now take 70 ms per
    plain1["fused_mb_s"] = 0.07                             # microbatch: slower than the stages' 64 ms
    raw = {"pipeline": {"records": [_record(step_s=1.0, ideal_s=0.9)]}, "jax": {"records": [_plain(2, 0.2), plain1]}}
    d = run.derive(raw)["pipeline"][0]
    assert d["breakdown_s"]["split"] == 0.0
    assert d["breakdown_s"]["useful"] == pytest.approx(8 * 0.064 / 2)
    assert d["unsplit_base"] == "stages" and d["split_gain"] == pytest.approx(0.006 / 0.07)
    assert "| 0.00 (s) |" in "\n".join(run._render_breakdown(raw, run.derive(raw)))


def test_interleaved_stages_count_every_chunk_in_their_compute():
    """Standalone costs are per-chunk means: a stage of v chunks computes v times that per microbatch."""
    from benchmarks import run

    rec = _record(step_s=1.0, ideal_s=0.9, schedule="interleaved-1f1b")
    rec["standalone"]["chunks"] = [{}] * 4                  # 2 stages x 2 chunks
    d = run.derive({"pipeline": {"records": [rec]}})["pipeline"][0]
    assert d["split_fb_sum_s"] == pytest.approx(2 * 0.064)


@pytest.mark.parametrize("section", ["pipeline", "overhead"])
def test_derive_refuses_an_efficiency_above_one(section):
    from benchmarks import run

    with pytest.raises(formulas.ImplausibleMeasurement, match="meshpipe large 1f1b m=8: efficiency"):
        run.derive({section: {"records": [_record(step_s=1.0, ideal_s=1.05)]}})


def test_derive_refuses_torch_the_same_way():
    from benchmarks import run

    rec = {"size": "large", "schedule": "1f1b", "m": 8, "status": "ok", "step_s": 0.1,   # far below its ideal
           "costs": [{"F": 0.01, "B": 0.02, "OPT": 0.0}] * 2, "standalone": [{"F": 0.01, "B": 0.02, "OPT": 0.0}] * 2}
    with pytest.raises(formulas.ImplausibleMeasurement, match="torch large 1f1b m=8"):
        run.derive({"torch": {"pipe": [rec]}})
    rec["step_s"] = 0.4             # ideal 1F1B p=2 m=8 with F=10, B=20 ms: 8*30 + 30 = 270 ms
    d = run.derive({"torch": {"pipe": [rec]}})["torch"][0]
    assert d["ideal_s"] == pytest.approx(0.27) and d["efficiency"] == pytest.approx(0.27 / 0.4)


def test_pinning_is_checked_from_what_the_actors_read_back():
    from benchmarks.pipeline import check_pinning

    check_pinning([{"stage": 0, "affinity": [0]}, {"stage": 1, "affinity": [1]}], True, "ok")
    check_pinning([{"stage": 0, "affinity": [0, 1]}], False, "not requested: anything goes")
    for bad in ([{"stage": 0, "affinity": [0, 1]}, {"stage": 1, "affinity": [1]}],     # not pinned
                [{"stage": 0, "affinity": [1]}, {"stage": 1, "affinity": [1]}],        # both on one core
                []):                                                                    # nothing read back
        with pytest.raises(RuntimeError, match="pinning was requested"):
            check_pinning(bad, True, "large 1f1b m=8")


def test_stage_chunks_follow_the_job():
    from benchmarks.common import SIZES
    from benchmarks.pipeline import stage_chunks

    n, cut = SIZES["large"].num_layers(), SIZES["large"].cut()
    assert stage_chunks(SIZES["large"], "1f1b") == [[(0, cut)], [(cut, n)]]
    inter = stage_chunks(SIZES["large"], "interleaved-1f1b")
    assert [len(c) for c in inter] == [2, 2]
    assert min(r for cs in inter for r in cs)[0] == 0 and max(b for cs in inter for _, b in cs) == n


def test_kept_sections_from_before_standalone_costs_are_dropped_not_rendered():
    from benchmarks import run

    old = {"status": "ok", "step_s": 1.0, "ideal_s": 1.1}            # in-run ideal, no standalone, no read-back
    raw = {"pipeline": {"records": [old]}, "overhead": {"records": [_record(1.0, 0.9)]},
           "torch": {"pipe": [{"status": "ok"}]}, "jax": {"records": []}}
    assert run.drop_stale(raw) == ["pipeline", "torch"]
    assert set(raw) == {"overhead", "jax"}


def test_the_report_renders_every_section_from_plausible_records(monkeypatch):
    """A full run ends in `render`; a crash there would lose an hour of measuring."""
    from benchmarks import derive, run

    monkeypatch.setattr(derive.os, "cpu_count", lambda: 2)

    def rec(size, sched, m=8):
        r = _record(1.0, 0.9, sched)
        stages = [{"F": 0.01, "B": 0.02, "I": 0.011, "W": 0.01, "OPT": 0.001}] * 2
        r.update(size=size, m=m, ideal_spans_s=0.95, step_spread=0.1, standalone={"stages": stages, "observed":
                 {"affinity": [1], "os_threads": 9}}, stash_peak_bytes=[100, 50], stash_peak_items=[2, 1],
                 example_spans=[[0, 0, "0SEND_F0", 0.0, 0.001]])
        return r

    torch_rec = {"size": "large", "schedule": "1f1b", "m": 8, "status": "ok", "step_s": 0.4, "step_spread": 0.1,
                 "costs": [{"F": 0.011, "B": 0.021, "OPT": 0.0}] * 2,
                 "standalone": [{"F": 0.01, "B": 0.02, "OPT": 0.0}] * 2,
                 "observed": [{"affinity": [0], "threads": 1}, {"affinity": [1], "threads": 1}]}
    raw = {"machine": {"when": "now", "cpu": "cpu", "nproc": 2, "mem_gib": 1.0, "python": "3", "jax": "j",
                       "jaxlib": "j", "ray": "r", "optax": "o", "torch": "t", "load_start": [0.1, 0.1, 0.1]},
           "pinned": True,
           "pipeline": {"records": [rec("large", "1f1b"), rec("large", "zb-h1")]},
           "overhead": {"records": [rec("tiny", "1f1b")]},
           "jax": {"records": [_plain(2, 1.2), _plain(1, 1.6)]},
           "torch": {"status": "ok", "pipe": [torch_rec], "plain": [{**_plain(1, 0.5), "threads": 1}]},
           "memory": {"records": [{"size": "large", "m": 8, "schedule": "1f1b", "stage": 0, "peak_inflight": 2,
                                   "residual_bytes": 50, "peak_activation_bytes": 100, "param_bytes": 10}]}}
    md = run.render(raw, run.derive(raw), "full", [])
    for text in ("of honest bound", "vs plain, all cores", "meshpipe stage 1 on {1}", "torch rank 0 on {0} with 1",
                 "standalone timings on {1}", "(I + W) ÷ B per stage", "**0.900**"):
        assert text in md, text
    assert "of bound |" not in md and "with mean spans" not in md


def test_the_honest_bound_is_a_bound_whatever_the_plain_program_costs(monkeypatch):
    """base₁ = the faster of plain₁ and the stages' standalone F + B: a framework whose stages run faster
    apart than its whole model on one core does not beat "its" bound (torch did, by 1 %, before); a
    step that still beats it is refused, not published."""
    from benchmarks import derive, run

    monkeypatch.setattr(derive.os, "cpu_count", lambda: 2)
    assert formulas.honest_base_s(1.6, 8, 0.064) == (pytest.approx(0.512), "stages")
    assert formulas.honest_base_s(0.5, 8, 0.064) == (0.5, "plain1")
    assert formulas.honest_bound_s(1.6, 8, 2) == pytest.approx(0.9)        # without stage costs: plain₁ alone
    ideal = 0.3
    for plain1 in (0.3, 0.5, 1.6, 9.0):        # the bound never exceeds the ideal, so never a step at the ideal
        d = run.derive({"pipeline": {"records": [_record(step_s=ideal, ideal_s=ideal)]},
                        "jax": {"records": [_plain(1, plain1)]}})["pipeline"][0]
        assert d["honest_bound_s"] <= 0.064 * 9 / 2 + 1e-12 and d["of_honest_bound"] <= 1.0
    with pytest.raises(formulas.ImplausibleMeasurement, match="of the honest bound > 1"):
        run.derive({"pipeline": {"records": [_record(step_s=0.26, ideal_s=0.25)]},
                    "jax": {"records": [_plain(1, 0.5)]}})                # bound 0.281 s > step 0.26 s
    with pytest.raises(ValueError, match="stages_fb_s"):
        formulas.honest_base_s(1.0, 8, 0.0)


def test_the_step_counts_what_each_executor_call_costs_once():
    """Steps 4..11 at 4 steps per call: steps 4 and 8 start a call and carry the Ray task boundary
    (+4 ms). The median step (1 ms) would drop it; the per-call statistic keeps it (2 ms), and a
    partial call at either end of the window is left out rather than weighed as a whole one."""
    walls = [5.0, 1.0, 1.0, 1.0, 5.0, 1.0, 1.0, 1.0]                 # steps 4..11: calls 1 and 2
    assert formulas.call_period_s(walls, 4, 4) == pytest.approx(2.0)
    assert formulas.call_period_s([9.0] + walls + [9.0], 3, 4) == pytest.approx(2.0)   # steps 3 and 12: partial
    assert formulas.call_period_s([1.0, 2.0, 3.0, 50.0], 0, 1) == pytest.approx(2.5)  # 1 per call: the median
    assert formulas.call_period_s([1.0, 3.0], 1, 4) == pytest.approx(2.0)   # no complete call: the mean
    with pytest.raises(ValueError, match="no step periods"):
        formulas.call_period_s([], 0, 4)
    with pytest.raises(ValueError, match="per_call"):
        formulas.call_period_s([1.0], 0, 0)
