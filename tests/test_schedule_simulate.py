"""Simulator: cost and transfer forms, timing semantics, deadlock reports."""
from fractions import Fraction

import pytest

from orchestrator.core.schedule import Action, Kind, Schedule, ScheduleError, generate, lower, simulate
from orchestrator.core.schedule.ir import RECVS, comm_peer, edge_index


def test_needs_a_lowered_schedule():
    with pytest.raises(ScheduleError, match="call lower"):
        simulate(generate("1f1b", 2, 2), {"F": 1, "B": 1})


@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_single_microbatch_pays_every_transfer_twice(p):
    r = simulate(lower(generate("gpipe", p, 1)), {"F": 1, "B": 2}, transfer=Fraction(1, 4))
    assert r.step_time == 3 * p + 2 * (p - 1) * Fraction(1, 4)


def test_per_edge_transfer():
    low = lower(generate("gpipe", 4, 1))
    assert simulate(low, {"F": 1, "B": 1}, transfer=[1, 2, 3]).step_time == 8 + 2 * (1 + 2 + 3)
    assert simulate(low, {"F": 1, "B": 1}, transfer=[1, 2, 3, 100]).step_time == 8 + 12
    with pytest.raises(ScheduleError, match=r"got 2 per-edge values for p=4"):
        simulate(low, {"F": 1, "B": 1}, transfer=[1, 2])
    inter = lower(generate("interleaved-1f1b", 2, 2, 2))
    with pytest.raises(ScheduleError, match=r"need 2"):
        simulate(inter, {"F": 1, "B": 1}, transfer=[1])       # the wrap-around link is used
    with pytest.raises(ScheduleError, match=r"transfer\[1\]=-1"):
        simulate(inter, {"F": 1, "B": 1}, transfer=[1, -1])


def test_cost_forms_and_defaults():
    zb = lower(generate("zb-h1", 3, 4))
    assert (simulate(zb, {"F": 1, "B": 1}).spans
            == simulate(zb, {"F": 1, "I": 0.5, "W": 0.5}).spans)      # I = W = B/2
    one = lower(generate("1f1b", 3, 4))
    assert (simulate(one, {"F": 1, "I": 1, "W": 1}).step_time
            == simulate(one, {"F": 1, "B": 2}).step_time)             # B = I + W
    per_stage = simulate(one, [{"F": 1, "B": 1}, {"F": 1, "B": 1}, {"F": 2, "B": 4}])
    assert per_stage.bubble_per_stage[2] < per_stage.bubble_per_stage[0]
    assert per_stage.step_time >= 4 * 6                                # slowest stage's work
    with_opt = simulate(one, {"F": 1, "B": 1, "OPT": 3})
    assert with_opt.step_time == simulate(one, {"F": 1, "B": 1}).step_time + 3


@pytest.mark.parametrize("costs, pattern", [
    ({"F": 1}, r"need F and B \(or both I and W\)"),
    ({"F": 1, "B": 1, "X": 2}, r"unknown keys \['X'\]"),
    ({"F": -1, "B": 1}, r"costs\[0\]\['F'\]=-1"),
    ([{"F": 1, "B": 1}], r"got 1 per-stage dicts for p=2"),
])
def test_bad_costs_are_named(costs, pattern):
    with pytest.raises(ScheduleError, match=pattern):
        simulate(lower(generate("1f1b", 2, 2)), costs)


@pytest.mark.parametrize("name, p, m, v", [("1f1b", 4, 8, 1), ("interleaved-1f1b", 2, 4, 2),
                                           ("zb-h1", 3, 5, 1)])
def test_spans_respect_order_and_transfer(name, p, m, v):
    low = lower(generate(name, p, m, v))
    r = simulate(low, {"F": 1.0, "B": 2.0}, transfer=0.3)
    assert sorted(map(str, (a for a, _, _ in r.spans))) == sorted(str(a) for _, _, a in low.cells())
    at = {a: (t0, t1) for a, t0, t1 in r.spans}
    for s in range(p):
        mine = [x for x in r.spans if x[0].stage == s]
        assert all(t0 <= t1 for _, t0, t1 in mine)
        assert all(mine[i][2] <= mine[i + 1][1] for i in range(len(mine) - 1))
    for a, (t0, t1) in at.items():
        if a.kind in RECVS:
            assert t1 >= at[comm_peer(a, p, v)][0] + 0.3 - 1e-12
            assert edge_index(a, p) == edge_index(comm_peer(a, p, v), p)
    busy = [sum(t1 - t0 for a, t0, t1 in r.spans if a.stage == s and a.kind not in RECVS)
            for s in range(p)]
    assert r.bubble_per_stage == pytest.approx([1 - b / r.step_time for b in busy])
    assert r.bubble_fraction == pytest.approx(1 - sum(busy) / (p * r.step_time))


def test_deadlock_is_reported_with_stuck_actions_and_grid():
    a = Action.parse
    sched = Schedule("crossed", 2, 1, 1, (
        (a("0RECV_B0"), a("0F0"), a("0SEND_F0"), a("0B0")),
        (a("1RECV_F0"), a("1F0"), a("1B0"), a("1SEND_B0")),
    ), lowered=True)
    with pytest.raises(ScheduleError) as err:
        simulate(sched, {"F": 1, "B": 1})
    assert err.value.rule == "no-deadlock"
    assert err.value.cells == ((0, 0), (1, 0))
    msg = str(err.value)
    assert "stuck actions" in msg and "[0RECV_B0]" in msg and "[1RECV_F0]" in msg


def test_missing_send_is_a_deadlock():
    sched = Schedule("orphan", 2, 1, 1, ((Action(0, Kind.F, 0),),
                                         (Action(1, Kind.RECV_F, 0), Action(1, Kind.F, 0))),
                     lowered=True)
    with pytest.raises(ScheduleError, match="waits for 0SEND_F0, which never ran"):
        simulate(sched, {"F": 1, "B": 1})


def test_zero_costs():
    r = simulate(lower(generate("1f1b", 3, 3)), {"F": 0, "B": 0})
    assert r.step_time == 0 and r.bubble_fraction == 0
