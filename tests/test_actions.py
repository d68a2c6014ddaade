"""The worker's step interpreter table (stages/actions.py), pure parts.

The handlers' numerics are covered end to end by tests/test_pipeline_numerics.py
(every schedule against a single-process jax.value_and_grad oracle); here: the
table covers every action kind, a kind without a handler is a clear error, and
the stash's byte accounting.
"""
from __future__ import annotations

import numpy as np
import pytest

from orchestrator.core.schedule import Action, Kind
from stages import actions


def test_every_action_kind_has_exactly_one_handler():
    assert set(actions.HANDLERS) == set(Kind)
    assert all(callable(h) for h in actions.HANDLERS.values())
    assert len(set(actions.HANDLERS.values())) == len(Kind)


@pytest.mark.parametrize("text, handler", [
    ("0F3", actions.forward), ("1B0c1", actions.backward), ("0I2", actions.backward_input),
    ("0W2", actions.backward_weight), ("1RECV_F0", actions.recv_forward),
    ("0RECV_B1", actions.recv_backward), ("0SEND_F0", actions.send_forward),
    ("1SEND_B0", actions.send_backward), ("0OPT", actions.optimizer_step),
])
def test_handler_for_resolves_each_kind(text, handler):
    assert actions.handler_for(Action.parse(text), "run stage 0 host 0") is handler


def test_a_kind_without_handler_is_an_error_naming_the_action(monkeypatch):
    monkeypatch.delitem(actions.HANDLERS, Kind.W)
    with pytest.raises(ValueError, match=r"run stage 0 host 0: cannot execute action 0W1 .*kind W has no handler"):
        actions.handler_for(Action.parse("0W1"), "run stage 0 host 0")


def test_stash_counts_bytes_and_peak_of_what_is_kept():
    st = actions.StepState(step=3, timeout=5.0)
    assert (st.step, st.done, st.timeout) == (3, 0, 5.0)
    a, b = np.zeros((4, 8), np.float32), np.zeros(16, np.float64)
    st.stash.add(("r", (0, 0)), {"x": a, "y": b})          # 128 + 128 bytes
    st.stash.add(("dy", (0, 0)), a)                        # +128
    assert (st.stash.now, st.stash.peak, st.stash.peak_items) == (384, 384, 1)
    st.stash.drop(("r", (0, 0)))
    st.stash.add(("r", (1, 0)), a)
    assert (st.stash.now, st.stash.peak, st.stash.peak_items) == (256, 384, 1)
    st.stash.drop(("missing", (9, 9)))                     # dropping what is not held changes nothing
    assert st.stash.now == 256
