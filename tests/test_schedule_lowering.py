"""Lowering passes: where SEND, RECV and OPT land, and that the passes are pure."""
import pytest

from orchestrator.core.schedule import (
    Kind, ScheduleError, add_comms, add_optimizer_step, generate, lower, validate,
)
from orchestrator.core.schedule.ir import COMM, comm_peer

CASES = [("gpipe", 3, 4, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 2, 1), ("eager-1f1b", 3, 5, 1),
         ("interleaved-1f1b", 2, 4, 2), ("interleaved-1f1b", 3, 6, 3),
         ("interleaved-1f1b", 1, 2, 3),
         ("zb-h1", 4, 6, 1), ("zb-h1", 1, 3, 1)]


def orders(sched):
    return [[a for a in row if a is not None] for row in sched.actions]


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_send_follows_producer_and_recv_precedes_consumer(name, p, m, v):
    low = lower(generate(name, p, m, v))
    validate(low)
    for order in orders(low):
        for i, a in enumerate(order):
            if a.kind in (Kind.SEND_F, Kind.SEND_B):
                prev = order[i - 1]
                want = {Kind.F} if a.kind is Kind.SEND_F else {Kind.B, Kind.I}
                assert prev.kind in want and prev.key == a.key, f"{a} does not follow its producer"
            if a.kind in (Kind.RECV_F, Kind.RECV_B):
                nxt = order[i + 1]
                want = {Kind.F} if a.kind is Kind.RECV_F else {Kind.B, Kind.I}
                assert nxt.kind in want and nxt.key == a.key, f"{a} does not precede its consumer"


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_every_send_has_its_receive_and_counts_match(name, p, m, v):
    low = lower(generate(name, p, m, v))
    comms = [a for _, _, a in low.cells() if a.kind in COMM]
    present = set(comms)
    for a in comms:
        assert comm_peer(a, p, v) in present
    sends = [a for a in comms if a.kind in (Kind.SEND_F, Kind.SEND_B)]
    # every virtual boundary crosses physical stages unless p == 1; F and B each cross it once
    assert len(sends) == (0 if p == 1 else 2 * m * (v * p - 1))
    assert len(comms) == 2 * len(sends)


def test_no_comm_at_pipeline_ends():
    low = lower(generate("interleaved-1f1b", 2, 2, 2))
    names = {str(a) for _, _, a in low.cells()}
    assert not any(n.startswith("0RECV_F") and "c" not in n for n in names)    # first virtual
    assert not any(n.startswith("1RECV_B") and n.endswith("c1") for n in names)  # last virtual
    assert "1SEND_F0" in names and "0RECV_F0c1" in names                       # wrap-around


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_opt_is_last_and_shares_one_column(name, p, m, v):
    low = lower(generate(name, p, m, v))
    assert all(order[-1].kind is Kind.OPT for order in orders(low))
    assert {len(row) for row in low.actions} == {low.num_slots}
    assert sum(a.kind is Kind.OPT for _, _, a in low.cells()) == p


def test_passes_are_pure_and_commute():
    sched = generate("zb-h1", 3, 4)
    before = sched.to_json()
    low = lower(sched)
    assert sched.to_json() == before and not sched.lowered and low.lowered
    assert lower(sched) == low
    assert add_comms(add_optimizer_step(sched)) == low


def test_passes_refuse_to_run_twice():
    low = lower(generate("1f1b", 2, 2))
    with pytest.raises(ScheduleError, match="already has comm actions"):
        lower(low)
    with pytest.raises(ScheduleError, match="already has OPT"):
        add_optimizer_step(add_optimizer_step(generate("1f1b", 2, 2)))
