"""Generators: parameter errors, phase shapes, and the closed-form bubbles and stashes."""
from fractions import Fraction

import pytest

from orchestrator.core.schedule import (
    SCHEDULES, Kind, ScheduleError, check_params, generate, lower, simulate, validate,
)

GRID = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 5, 8, 16)]


def unit_sim(name, p, m, v=1, transfer=0):
    """Simulate with unit costs: F=B=1 (I=W=1/2); per-chunk costs 1/v when interleaved."""
    if name == "zb-h1":
        costs = {"F": Fraction(1), "I": Fraction(1, 2), "W": Fraction(1, 2)}
    else:
        costs = {"F": Fraction(1, v), "B": Fraction(1, v)}
    return simulate(lower(generate(name, p, m, v)), costs, transfer)


def test_names_are_exactly_the_documented_ones():
    assert list(SCHEDULES) == ["gpipe", "1f1b", "eager-1f1b", "interleaved-1f1b", "zb-h1"]


@pytest.mark.parametrize("args, pattern", [
    (("1f1b", 0, 4), r"p \(stages\) must be >= 1, got p=0"),
    (("gpipe", 2, 0), r"m \(microbatches\) must be >= 1, got m=0"),
    (("interleaved-1f1b", 2, 4, 0), r"v \(virtual chunks per stage\) must be >= 1, got v=0"),
    (("interleaved-1f1b", 4, 6, 2), r"needs m divisible by p .*got m=6, p=4"),
    (("1f1b", 2, 4, 2), r"1f1b has no virtual chunks: v must be 1, got v=2"),
    (("zb-h1", 2, 4, 3), r"zb-h1 has no virtual chunks: v must be 1, got v=3"),
    (("1f1b", 2.0, 4), r"p \(stages\) must be an int, got p=2.0"),
    (("1f1b", 2, True), r"m \(microbatches\) must be an int, got m=True"),
])
def test_bad_parameters_are_named(args, pattern):
    with pytest.raises(ScheduleError, match=pattern):
        check_params(*args)
    with pytest.raises(ScheduleError, match=pattern):
        generate(*args)


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ScheduleError) as err:
        generate("pipedream", 2, 4)
    assert "'pipedream'" in str(err.value)
    for name in SCHEDULES:
        assert name in str(err.value)
    assert isinstance(err.value, ValueError)


def test_generators_check_their_own_parameters():
    with pytest.raises(ScheduleError, match="got p=0"):
        SCHEDULES["gpipe"](0, 4)


@pytest.mark.parametrize("name", ["1f1b", "eager-1f1b", "zb-h1"])
def test_fewer_microbatches_than_stages_is_allowed(name):
    """Decision (see generators.py): m < p is allowed; the warmup is capped at m."""
    s = generate(name, p=4, m=2)
    validate(s)
    validate(lower(s))


def _order(sched, s):
    return [a for a in sched.actions[s] if a is not None]


@pytest.mark.parametrize("p, m", [(4, 8), (4, 2), (3, 3), (1, 4)])
def test_1f1b_phases(p, m):
    sched = generate("1f1b", p, m)
    for s in range(p):
        kinds = [a.kind for a in _order(sched, s)]
        warmup = min(p - 1 - s, m)
        assert kinds[:warmup] == [Kind.F] * warmup               # warmup: forwards only
        steady = m - warmup
        assert kinds[warmup:warmup + 2 * steady] == [Kind.F, Kind.B] * steady
        assert kinds[warmup + 2 * steady:] == [Kind.B] * warmup  # cooldown: backwards only


def test_gpipe_phases():
    sched = generate("gpipe", 3, 5)
    for s in range(3):
        assert [a.kind for a in _order(sched, s)] == [Kind.F] * 5 + [Kind.B] * 5


@pytest.mark.parametrize("p, m", [(4, 8), (4, 3), (2, 5)])
def test_eager_has_one_extra_warmup_forward_per_later_stage(p, m):
    eager, plain = generate("eager-1f1b", p, m), generate("1f1b", p, m)
    for s in range(p):
        first_b = [a.kind for a in _order(eager, s)].index(Kind.B)
        first_b_plain = [a.kind for a in _order(plain, s)].index(Kind.B)
        # 1f1b: p-1-s warmup forwards; eager: p-1-s more, one per later stage (capped at m)
        assert first_b_plain == min((p - 1 - s) + 1, m)
        assert first_b == min((p - 1 - s) + (p - 1 - s) + 1, m)


def test_interleaved_with_one_chunk_is_eager_1f1b():
    assert generate("interleaved-1f1b", 4, 8, 1).actions == generate("eager-1f1b", 4, 8).actions


def test_interleaved_megatron_forward_order():
    order = [str(a) for a in _order(generate("interleaved-1f1b", 2, 4, 2), 0) if a.kind is Kind.F]
    assert order == ["0F0", "0F1", "0F0c1", "0F1c1", "0F2", "0F3", "0F2c1", "0F3c1"]


def test_zb_h1_delays_each_w_by_the_stage_index():
    sched = generate("zb-h1", 4, 8)
    for s in range(4):
        order = _order(sched, s)
        for a in order:
            if a.kind is Kind.W and a.microbatch + s < 8:
                before = order[order.index(a) - 1]
                assert (before.kind, before.microbatch) == (Kind.I, a.microbatch + s)


@pytest.mark.parametrize("p, m", GRID)
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "eager-1f1b"])
def test_unit_cost_bubble_is_p_minus_1_over_m_plus_p_minus_1(name, p, m):
    r = unit_sim(name, p, m)
    assert r.bubble_fraction == Fraction(p - 1, m + p - 1)
    assert r.step_time == 2 * (m + p - 1)


@pytest.mark.parametrize("p, k", [(1, 1), (1, 3), (2, 1), (2, 4), (3, 2), (4, 1), (4, 2), (4, 4),
                                  (8, 2)])
@pytest.mark.parametrize("v", [1, 2, 3, 4])
def test_unit_cost_interleaved_bubble(p, k, v):
    m = p * k
    r = unit_sim("interleaved-1f1b", p, m, v)
    assert r.bubble_fraction == Fraction(p - 1, v * m + p - 1)


@pytest.mark.parametrize("p, m", [(p, m) for p, m in GRID if p >= 2])
def test_zb_h1_bubble_is_below_1f1b(p, m):
    zb, ref = unit_sim("zb-h1", p, m), unit_sim("1f1b", p, m)
    assert zb.bubble_fraction < ref.bubble_fraction
    if m >= p:   # the zero-bubble paper's H1 bubble: (p-1)(F + I - W) per stage
        assert zb.bubble_fraction == Fraction(p - 1, 2 * m + p - 1)
    assert max(zb.peak_inflight) <= p


@pytest.mark.parametrize("p, m", GRID)
def test_peak_inflight(p, m):
    assert unit_sim("1f1b", p, m).peak_inflight == [min(p - s, m) for s in range(p)]
    assert unit_sim("gpipe", p, m).peak_inflight == [m] * p
    assert unit_sim("eager-1f1b", p, m).peak_inflight == [min(2 * (p - s) - 1, m) for s in range(p)]


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (8, 32)])
def test_eager_hides_transfer_that_1f1b_exposes(p, m):
    costs = {"F": 1, "B": 2}
    for transfer in (0.25, 1.0):
        eager = simulate(lower(generate("eager-1f1b", p, m)), costs, transfer).step_time
        plain = simulate(lower(generate("1f1b", p, m)), costs, transfer).step_time
        assert eager < plain
    assert (simulate(lower(generate("eager-1f1b", p, m)), costs).step_time
            == simulate(lower(generate("1f1b", p, m)), costs).step_time)
