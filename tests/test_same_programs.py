"""benchmarks.same_programs: the normalized HLO names the computation, not where its source lives."""
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.same_programs import compare, normalized


def _hlo(fn, *args) -> str:
    return normalized(jax.jit(fn).lower(*args).compile().as_text())


def first_site(x, w):
    return jnp.tanh(x @ w) * 2.0


def second_site(a, b):          # the same computation, another function, name and line
    h = a @ b
    return jnp.tanh(h) * 2.0


def test_same_computation_from_two_sites_is_equal_and_a_changed_one_is_not():
    x, w = np.ones((4, 8), np.float32), np.ones((8, 3), np.float32)
    raw = jax.jit(first_site).lower(x, w).compile().as_text()
    assert "first_site" in raw or "test_same_programs" in raw      # the raw text does name the source
    assert _hlo(first_site, x, w) == _hlo(second_site, x, w)
    assert _hlo(first_site, x, w) != _hlo(lambda a, b: jnp.tanh(a @ b) * 3.0, x, w)
    assert _hlo(first_site, x, w) != _hlo(first_site, x, np.ones((8, 4), np.float32))


def test_compare_sorts_programs_into_same_different_and_one_sided():
    before = {"programs": {"s0/fwd": "a", "s0/bwd_acc": "b", "s0/update": "c"}, "jax": "x"}
    after = {"programs": {"s0/fwd": "a", "s0/bwd_acc": "B", "s0/update_checked": "d"}, "jax": "x"}
    got = compare(before, after)
    assert got["same"] == ["s0/fwd"] and got["different"] == ["s0/bwd_acc"]
    assert got["only_before"] == ["s0/update"] and got["only_after"] == ["s0/update_checked"]
