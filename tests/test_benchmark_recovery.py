"""benchmarks/recovery.py's arithmetic (pure): ETTR, its bound, the steady-state ETTR, the per-restart
terms and the report."""
from __future__ import annotations

import doctest

import pytest


def _summary(first_step_s: float = 5.0) -> dict:
    rec = {"cause": "actor died", "resumed_from": 20, "steps_lost": 10, "teardown_s": 0.5, "placement_s": 0.2,
           "start_s": 9.0, "restore_s": 0.7, "first_step_s": 3.1, "compile_s": 2.0, "recovery_s": 12.0}
    return {"step_times_s": [first_step_s] + [0.1] * 99, "startup_s": 4.0, "executor": {"steps_per_call": 4},
            "recoveries": [{**rec, "detected_at": 1000.25}, {**rec, "resumed_from": 60, "detected_at": 2000.5}]}


def test_ettr_and_restart_terms_from_a_summary(tmp_path):
    from benchmarks.common import load_note
    from benchmarks.recovery import markdown, measure

    (tmp_path / "kill-30").write_text("1000.0")
    (tmp_path / "kill-70").write_text("2000.0")
    m = measure(_summary(), wall=50.0, base_wall=25.0, steps=100, flags=tmp_path)
    assert m["ettr"] == 100 * 0.1 / 50.0 and m["vs_uninterrupted"] == 0.5
    assert [r["killed_in_step"] for r in m["restarts"]] == [30, 70]
    assert [r["steps_rerun"] for r in m["restarts"]] == [10, 10] and m["steps_rerun"] == 20
    assert m["ettr_bound"] == 100 / 120                  # kills at 30 and 70, checkpoints every 20: 0.833
    # start-up: placement, actors and set-up (4 s) + the first call's wait (5 s) less its 4 steady steps
    assert abs(m["startup_s"] - (4.0 + 5.0 - 4 * 0.1)) < 1e-12
    assert abs(m["ettr_steady"] - 100 * 0.1 / (50.0 - 8.6)) < 1e-12
    assert [r["detection_s"] for r in m["restarts"]] == [0.25, 0.5]
    assert abs(m["restarts"][0]["recompile_s"] - 3.0) < 1e-12          # first step minus a steady one
    result = {"uninterrupted": {"wall_s": 25.0, "step_s_median": 0.1, "ettr": 0.4, "ettr_bound": 1.0,
                                "ettr_steady": 0.5, "startup_s": 5.0, "vs_uninterrupted": 1.0},
              "cached": m, "recompile_ratio": 0.25,
              "conditions": {"size_text": "GPT", "steps": 100, "every": 20, "kill_steps": [30, 70],
                             "load_before": (3.0, 0, 0), "load_after": (4.0, 0, 0),
                             "note": load_note((3.0, 0, 0), (4.0, 0, 0), cores=2),
                             "machine": {"nproc": 2, "affinity": 2}}}
    text = markdown(result)
    assert "| kills, compile cache on | 50.0 | 100.0 | 0.200 | 0.833 | 0.242 | 8.6 | 0.500 | 2 | 0.38 |" in text
    assert "| uninterrupted | 25.0 | 100.0 | 0.400 | 1.000 | 0.500 | 5.0 | 1.000 | 0 |" in text
    assert "cache on ÷ off: 0.250" in text and "load average 3.0 before" in text


def test_uninterrupted_run_has_bound_one_and_an_ettr_past_its_bound_fails(tmp_path):
    """No kill: bound 1. An ETTR above N / (N + steps re-run) cannot be true (the wall holds every
    step run, the re-run ones too): the benchmark stops instead of publishing it."""
    import benchmarks.recovery as bench
    from benchmarks.recovery import ettrs, measure

    base = {**_summary(), "recoveries": []}
    m = measure(base, wall=25.0, base_wall=25.0, steps=100)
    assert m["ettr_bound"] == 1.0 and m["steps_rerun"] == 0 and m["restarts"] == []
    (tmp_path / "kill-30").write_text("1000.0")
    (tmp_path / "kill-70").write_text("2000.0")
    with pytest.raises(SystemExit, match=r"ettr = 0\.9091 exceeds its bound .* = 100 / \(100 \+ 20\) = 0\.8333"):
        measure(_summary(first_step_s=0.1), wall=11.0, base_wall=25.0, steps=100, flags=tmp_path)
    with pytest.raises(SystemExit, match="ettr_steady = .* exceeds its bound"):     # raw fine, steady not
        ettrs(100, 0.1, 14.0, 4.0, 20)
    with pytest.raises(SystemExit, match="not shorter than the run's wall"):
        ettrs(100, 0.1, 4.0, 4.0, 0)
    with pytest.raises(SystemExit, match="2 restarts recorded for 1 kills"):
        (tmp_path / "kill-70").unlink()
        measure(_summary(), wall=50.0, base_wall=25.0, steps=100, flags=tmp_path)
    assert doctest.testmod(bench).failed == 0
