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


READY_CHECK = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from stages.actions import _ready

mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))

def prog(x, w):                  # the first leaf is cheap, the others wait for a matmul chain
    y = x
    for _ in range(12):
        y = jnp.tanh(y @ w)
    return {"a": x[0, 0] + 1, "b": y, "c": [y.sum(), x * 2]}

f = jax.jit(prog)
x = jax.device_put(jnp.ones((512, 512)) * 0.01, NamedSharding(mesh, P("data", "model")))
w = jax.device_put(jnp.eye(512), NamedSharding(mesh, P(None, "model")))
jax.block_until_ready(f(x, w))
out = f(x, w)
pending = [leaf.is_ready() for leaf in jax.tree_util.tree_leaves(out)]
jax.block_until_ready(out)
out = f(x, w)
same = _ready(out) is out
import json
ready = [leaf.is_ready() for leaf in jax.tree_util.tree_leaves(out)]
out = f(x, w)
_ready({"0": np.ones(2), "1": out})
print(json.dumps([pending, ready, same, [leaf.is_ready() for leaf in jax.tree_util.tree_leaves(out)]]))
"""


def test_ready_waits_for_every_output_of_the_program_by_waiting_on_one():
    """A handler's span must cover its program (module invariant). `_ready` waits on one leaf only:
    on a 2×2 mesh, right after dispatch the outputs are still pending (so this check can tell), and
    after `_ready` every leaf — the slow ones included — is ready."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", READY_CHECK], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    pending, ready, same, behind_host = json.loads(r.stdout.strip().splitlines()[-1])
    assert not all(pending), "every output was ready at dispatch: this check cannot tell a wait from none"
    assert ready == [True] * 4 and same
    assert behind_host == [True] * 4       # a host array first in the tree: the wait goes on to a device leaf


def test_ready_passes_host_arrays_and_empty_trees_through():
    tree = {"x": np.ones(3), "y": [np.zeros(2)]}
    assert actions._ready(tree) is tree and actions._ready({}) == {} and actions._ready(None) is None
