"""The benchmark's derived quantities (benchmarks/formulas.py), pure: worked examples by hand."""
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


def test_vs_plain_and_of_bound():
    v = formulas.vs_plain(plain_s=0.08, step_s=0.1)
    assert v == pytest.approx(0.8)
    assert formulas.of_bound(v, formulas.bound(8, 2)) == pytest.approx(0.8 * 9 / 8)


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
    (lambda: formulas.of_bound(1.0, 0.0), "bound_fraction"),
])
def test_a_zero_denominator_is_an_error_naming_it(call, name):
    with pytest.raises(ValueError, match=f"{name} must be > 0"):
        call()


def test_module_docstring_example_holds():
    import doctest

    result = doctest.testmod(formulas)
    assert result.attempted == 2 and result.failed == 0
