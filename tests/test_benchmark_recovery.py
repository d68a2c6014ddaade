"""benchmarks/recovery.py's arithmetic (pure): ETTR, the per-restart terms and the report."""
from __future__ import annotations


def test_ettr_and_restart_terms_from_a_summary(tmp_path):
    from benchmarks.recovery import markdown, measure

    (tmp_path / "kill-30").write_text("1000.0")
    (tmp_path / "kill-70").write_text("2000.0")
    rec = {"cause": "actor died", "resumed_from": 20, "steps_lost": 10, "teardown_s": 0.5, "placement_s": 0.2,
           "start_s": 9.0, "restore_s": 0.7, "first_step_s": 3.1, "compile_s": 2.0, "recovery_s": 12.0}
    got = {"step_times_s": [5.0] + [0.1] * 99,
           "recoveries": [{**rec, "detected_at": 1000.25}, {**rec, "resumed_from": 60, "detected_at": 2000.5}]}
    m = measure(got, wall=50.0, base_wall=25.0, steps=100, flags=tmp_path)
    assert m["ettr"] == 100 * 0.1 / 50.0 and m["vs_uninterrupted"] == 0.5
    assert [r["killed_in_step"] for r in m["restarts"]] == [30, 70]
    assert [r["detection_s"] for r in m["restarts"]] == [0.25, 0.5]
    assert abs(m["restarts"][0]["recompile_s"] - 3.0) < 1e-12          # first step minus a steady one
    result = {"uninterrupted": {"wall_s": 25.0, "step_s_median": 0.1, "ettr": 0.4, "vs_uninterrupted": 1.0},
              "cached": m, "recompile_ratio": 0.25,
              "conditions": {"size_text": "GPT", "steps": 100, "every": 20, "kill_steps": [30, 70],
                             "load_before": (3.0, 0, 0), "load_after": (4.0, 0, 0), "note": "under load",
                             "machine": {"nproc": 2, "affinity": 2}}}
    text = markdown(result)
    assert "| kills, compile cache on | 50.0 | 100.0 | 0.200 | 0.500 | 2 | 0.38 |" in text
    assert "cache on ÷ off: 0.250" in text and "load average 3.0 before" in text
