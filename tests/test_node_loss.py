"""Node loss reported as the cause (#35, item 7), pure: the loop stops a run without restarts
with the loss (not the survivors' errors it caused), the loss outranks what was seen first, and
`compiled_graph` with restarts on a multi-node cluster is refused by rule. On Ray:
tests/test_node_loss_multinode.py (-m multinode) and tests/test_driver_kill.py (-m chaos).
"""
from __future__ import annotations

import pytest

from orchestrator.core.contract import ActorId
from orchestrator.core.recovery import DIED, ERROR, NODE_LOST, STORAGE, Failure, RestartPolicy, node_loss
from orchestrator.driver.attempts import AttemptFailed, run_attempts


class _Attempt:
    def __init__(self, error):
        self.error = error

    def run(self):
        raise self.error

    def close(self, after_failure: bool, hung=()):
        return {"graceful_s": 0.0, "stuck": []}


class _Run:
    def __init__(self):
        self.stops = []

    def committed(self):
        return 4

    def restart(self, failed, attempt, restarts):       # never reached: no restarts
        raise AssertionError("restarted")

    def stop(self, failed, decision):
        self.stops.append((failed.failure.cause, decision.reason))
        return RuntimeError(f"stopped: {failed.failure.cause}: {decision.reason}")

    def placement_lost(self, e):
        raise AssertionError("placement")


def _stop(failure: Failure, max_restarts: int):
    run, gloo = _Run(), RuntimeError("Gloo: Connection reset by peer")
    failed = AttemptFailed(failure, {}, gloo, steps_done=5)
    with pytest.raises(RuntimeError) as ei:
        run_attempts(lambda first, rec: _Attempt(failed), 0, RestartPolicy(max_restarts), run)
    return ei.value, gloo, run


def test_without_restarts_a_lost_node_stops_as_the_loss_not_as_the_survivors_error():
    seen = Failure(ERROR, 0, 0, 5, "RuntimeError: Gloo: Connection reset by peer")
    lost = node_loss(seen, {"ab" * 28: {"labels": [ActorId(0, 1)], "why": "its raylet does not accept connections",
                                        "address": "10.0.0.2"}})
    e, gloo, run = _stop(lost, max_restarts=0)
    assert e is not gloo and run.stops == [(NODE_LOST, "failure.max_restarts is 0")]
    assert (lost.stage, lost.host, lost.node) == (0, 1, "ab" * 28)
    assert lost.fields()["consequence"] == "error: stage 0 host 0: RuntimeError: Gloo: Connection reset by peer"
    assert lost.fields()["cause"] == "node lost"
    e, gloo, run = _stop(seen, max_restarts=0)         # no node gone: the error as it was
    assert e is gloo and run.stops == []


def test_a_storage_failure_stops_as_itself_with_or_without_restarts():
    for max_restarts in (0, 3):
        f = Failure(STORAGE, 1, 0, 5, "OSError", errno=28, path="/ck/step_00000006")
        e, gloo, run = _stop(f, max_restarts)
        assert e is not gloo and run.stops[0][0] == STORAGE and "ENOSPC" in run.stops[0][1]
        assert f.fields()["errno"] == "ENOSPC"


def test_the_loss_outranks_whatever_was_seen_first():
    lost = {"n1": {"labels": [ActorId(1, 0)], "why": "Ray marks it dead", "address": ""}}
    for first in (Failure(ERROR, 0, 0, 5, "Gloo"), Failure(DIED, 0, 0, 5, "actor died"),
                  Failure("hang", None, None, 5, "no progress")):
        f = node_loss(first, lost)
        assert (f.cause, f.stage, f.host, f.node) == (NODE_LOST, 1, 0, "n1")
        assert f.consequence.startswith(first.cause)


def test_compiled_graph_with_restarts_is_refused_on_several_nodes_only(tmp_path):
    from orchestrator.core.recovery import compiled_graph_restarts
    from tests.test_bad_input import has_all

    assert compiled_graph_restarts("compiled_graph", 1, 1) is None         # one node: a lost actor recovers
    assert compiled_graph_restarts("compiled_graph", 0, 5) is None         # no restarts: nothing to promise
    assert compiled_graph_restarts("step_calls", 2, 5) is None
    has_all(compiled_graph_restarts("compiled_graph", 2, 3), "cluster.executor = 'compiled_graph'",
            "failure.max_restarts = 2", "a cluster of 3 nodes", "refused", "step_calls")


@pytest.mark.parametrize("module", ["orchestrator.core.recovery", "orchestrator.driver.reaper"])
def test_the_docstring_examples_run(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0
