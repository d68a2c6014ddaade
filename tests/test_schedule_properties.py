"""Property tests: all generated, lowered schedules validate and run; broken ones are rejected."""
import random
from dataclasses import replace

import pytest
from hypothesis import assume, given, settings, strategies as st

from orchestrator.core.schedule import (
    SCHEDULES, Action, Kind, ScheduleError, generate, lower, simulate, validate,
)
from orchestrator.core.schedule.ir import COMM

FAST = settings(max_examples=150, deadline=None)
SOME = settings(max_examples=60, deadline=None)


@st.composite
def params(draw):
    name = draw(st.sampled_from(list(SCHEDULES)))
    p = draw(st.integers(1, 8))
    if name == "interleaved-1f1b":
        v = draw(st.integers(1, 4))
        m = p * draw(st.integers(1, max(1, 32 // p)))
    else:
        v, m = 1, draw(st.integers(1, 32))
    return name, p, m, v


def costs_for(p):
    cost = st.floats(0.05, 5.0, allow_nan=False)
    one = st.one_of(st.fixed_dictionaries({"F": cost, "B": cost}),
                    st.fixed_dictionaries({"F": cost, "I": cost, "W": cost}))
    return st.one_of(one, st.lists(one, min_size=p, max_size=p))


@FAST
@given(params(), st.data())
def test_generated_lowered_schedules_validate_and_never_deadlock(case, data):
    name, p, m, v = case
    sched = generate(name, p, m, v)
    validate(sched)
    low = lower(sched)
    validate(low)
    costs = data.draw(costs_for(p))
    transfer = data.draw(st.one_of(st.floats(0, 2),
                                   st.lists(st.floats(0, 2), min_size=p, max_size=p)))
    r = simulate(low, costs, transfer)
    assert len(r.spans) == sum(1 for _ in low.cells())
    assert 0 <= r.bubble_fraction < 1
    assert all(1 <= peak <= m * v for peak in r.peak_inflight)
    assert r.step_time >= max(t1 for _, _, t1 in r.spans)


def _rows(sched):
    return [list(r) for r in sched.actions]


@SOME
@given(params(), st.booleans(), st.randoms(use_true_random=False))
def test_swapping_a_forward_with_its_backward_is_rejected(case, lowered, rnd):
    sched = generate(*case)
    sched = lower(sched) if lowered else sched
    f = rnd.choice([a for _, _, a in sched.cells() if a.kind is Kind.F])
    back = next(a for _, _, a in sched.cells()
                if a.kind in (Kind.B, Kind.I) and a.key == f.key)
    rows = _rows(sched)
    row = rows[f.stage]
    i, j = row.index(f), row.index(back)
    row[i], row[j] = row[j], row[i]
    with pytest.raises(ScheduleError) as err:
        validate(replace(sched, actions=rows))
    assert err.value.rule == "F-before-B"
    assert f"[{back}]" in str(err.value) and "\ns0 " in str(err.value)


@SOME
@given(params(), st.randoms(use_true_random=False))
def test_dropping_a_receive_is_rejected(case, rnd):
    name, p, m, v = case
    assume(p >= 2)
    low = lower(generate(*case))
    recv = rnd.choice([a for _, _, a in low.cells() if a.kind in (Kind.RECV_F, Kind.RECV_B)])
    rows = [[None if a == recv else a for a in row] for row in low.actions]
    with pytest.raises(ScheduleError) as err:
        validate(replace(low, actions=rows))
    assert err.value.rule == "sends-match-receives"
    assert "[" in str(err.value) and "\ns0 " in str(err.value)


@SOME
@given(params(), st.randoms(use_true_random=False))
def test_moving_a_receive_after_its_consumer_is_rejected(case, rnd):
    name, p, m, v = case
    assume(p >= 2)
    low = lower(generate(*case))
    recv = rnd.choice([a for _, _, a in low.cells() if a.kind in (Kind.RECV_F, Kind.RECV_B)])
    rows = _rows(low)
    row = rows[recv.stage]
    i = row.index(recv)
    row[i], row[i + 1] = row[i + 1], row[i]            # the consumer follows its RECV directly
    with pytest.raises(ScheduleError) as err:
        validate(replace(low, actions=rows))
    assert err.value.rule == "recv-before-consume"


@settings(max_examples=100, deadline=None)
@given(params(), st.booleans(), st.randoms(use_true_random=False))
def test_any_swap_is_rejected_or_still_runs(case, lowered, rnd: random.Random):
    """Soundness: whatever two slots of a stage are swapped, validate either
    rejects the result or it lowers (if needed) and simulates without deadlock."""
    sched = generate(*case)
    sched = lower(sched) if lowered else sched
    s = rnd.randrange(sched.p)
    rows = _rows(sched)
    i, j = rnd.randrange(len(rows[s])), rnd.randrange(len(rows[s]))
    rows[s][i], rows[s][j] = rows[s][j], rows[s][i]
    broken = replace(sched, actions=rows)
    try:
        validate(broken)
    except ScheduleError as err:
        assert err.rule and "\ns0 " in str(err)
        return
    runnable = broken if broken.lowered else lower(broken)
    validate(runnable)
    costs = [{"F": rnd.uniform(0.1, 3), "B": rnd.uniform(0.1, 3)} for _ in range(sched.p)]
    simulate(runnable, costs, transfer=rnd.uniform(0, 1))


@SOME
@given(params())
def test_comm_actions_only_where_stages_differ(case):
    low = lower(generate(*case))
    if low.p == 1:
        assert not any(a.kind in COMM for _, _, a in low.cells())
    assert all(isinstance(a, Action) for _, _, a in low.cells())
