"""The stash timeline: bytes a stage keeps between actions, ZB-H1 against 1F1B, by hand."""
import pytest

from orchestrator.core.schedule import ScheduleError, generate, lower, simulate, stash_timeline

R, H = 10, 4        # bytes one F keeps (residuals); bytes one I keeps for its W


def _line(result, stage):
    return [(str(a), n) for a, n in result.timeline[stage]]


def test_1f1b_p2_m3_by_hand():
    r = stash_timeline(lower(generate("1f1b", 2, 3)), {"F": R})
    # stage 0: F0 F1 B0 F2 B1 B2; stage 1: F0 B0 F1 B1 F2 B2
    assert _line(r, 0) == [("0F0", 10), ("0F1", 20), ("0B0", 10), ("0F2", 20), ("0B1", 10), ("0B2", 0)]
    assert _line(r, 1) == [("1F0", 10), ("1B0", 0), ("1F1", 10), ("1B1", 0), ("1F2", 10), ("1B2", 0)]
    assert r.peak == [20, 10] and r.peak_items == [2, 1]


def test_zb_h1_p2_m3_by_hand():
    r = stash_timeline(lower(generate("zb-h1", 2, 3)), {"F": R, "I": H})
    # stage 0: F0 F1 I0 W0 F2 I1 W1 I2 W2 — each W right after its I
    assert _line(r, 0) == [("0F0", 10), ("0F1", 20), ("0I0", 14), ("0W0", 10), ("0F2", 20),
                           ("0I1", 14), ("0W1", 10), ("0I2", 4), ("0W2", 0)]
    # stage 1: F0 I0 F1 I1 W0 F2 I2 W1 W2 — each W one backward late: a held microbatch
    # (H) sits beside the next one's residuals (R), never two residual sets
    assert _line(r, 1) == [("1F0", 10), ("1I0", 4), ("1F1", 14), ("1I1", 8), ("1W0", 4), ("1F2", 14),
                           ("1I2", 8), ("1W1", 4), ("1W2", 0)]
    assert r.peak == [20, 14] and r.peak_items == [2, 2]
    # the 1F1B-style count (peak in-flight × residuals) says 20 for stage 1
    assert [n * R for n in simulate(lower(generate("zb-h1", 2, 3)), {"F": 1, "B": 2}).peak_inflight] == [20, 20]


def test_zb_h1_with_held_equal_to_residuals_is_the_in_flight_count():
    for p, m in [(2, 3), (3, 6), (4, 8)]:
        low = lower(generate("zb-h1", p, m))
        r = stash_timeline(low, {"F": R, "I": R})
        assert r.peak == [n * R for n in simulate(low, {"F": 1, "B": 2}).peak_inflight]


@pytest.mark.parametrize("sched", ["gpipe", "1f1b", "eager-1f1b"])
def test_b_schedules_are_in_flight_times_residuals(sched):
    low = lower(generate(sched, 4, 8))
    r = stash_timeline(low, {"F": R})
    assert r.peak == [n * R for n in simulate(low, {"F": 1, "B": 2}).peak_inflight]
    assert all(line[-1][1] == 0 for line in r.timeline)       # every step ends with nothing kept


def test_per_stage_and_per_chunk_sizes():
    low = lower(generate("interleaved-1f1b", 2, 2, 2))
    r = stash_timeline(low, [{"F": [1, 100]}, {"F": [1, 100]}])
    line = _line(r, 0)
    assert dict(line)["0F0c1"] - dict(line)["0F1"] == 100       # chunk 1's F keeps chunk 1's size
    assert stash_timeline(low, {"F": 3}).peak != r.peak


def test_malformed_sizes_name_stage_and_key():
    zb = lower(generate("zb-h1", 2, 2))
    with pytest.raises(ScheduleError, match=r"kept\[0\]: no 'I' size"):
        stash_timeline(zb, {"F": R})
    with pytest.raises(ScheduleError, match=r"unknown keys \['B'\]"):
        stash_timeline(zb, {"F": R, "I": H, "B": 1})
    with pytest.raises(ScheduleError, match=r"got 1 per-stage"):
        stash_timeline(zb, [{"F": R, "I": H}])
    with pytest.raises(ScheduleError, match=r"kept\[1\]\['F'\]=-1"):
        stash_timeline(zb, [{"F": R, "I": H}, {"F": -1, "I": H}])
    with pytest.raises(ScheduleError, match=r"1 per-chunk values, but the schedule runs chunk 1"):
        stash_timeline(lower(generate("interleaved-1f1b", 2, 2, 2)), {"F": [R]})
