"""The world's transfer order and device-direct plans (`transport: xla`), pure: no jax, no ray."""
from __future__ import annotations

import numpy as np
import pytest

from orchestrator.core.reshard import MeshSide, make_plan
from orchestrator.core.reshard.direct import landing_device, pieces_on, whole_array
from orchestrator.core.schedule import (
    Action,
    Kind,
    Schedule,
    ScheduleError,
    forward_only,
    generate,
    lower,
)
from orchestrator.core.schedule.ir import comm_peer
from orchestrator.core.schedule.transfers import Transfer, world_order

CASES = [("gpipe", 3, 4, 1), ("1f1b", 4, 8, 1), ("eager-1f1b", 3, 6, 1), ("interleaved-1f1b", 2, 4, 2),
         ("interleaved-1f1b", 4, 8, 2), ("zb-h1", 3, 6, 1), ("1f1b", 2, 1, 1)]


def _chunks(p: int, v: int) -> list:
    return [[(10 * (c * p + s), 10 * (c * p + s) + 10) for c in range(v)] for s in range(p)]


def _run_threads(low: Schedule, order) -> None:
    """Simulate every stage as a compute thread plus a transfer thread that issues `order` in turn:
    a SEND item blocks until its stage's compute has run the SEND; a RECV of the compute blocks until
    its item was issued. Fails (no progress) where the order would make a process wait for itself."""
    p, v = low.p, low.v
    item_of = {}
    for i, t in enumerate(order):
        kind = Kind.SEND_F if t.kind == "F" else Kind.SEND_B
        item_of[Action(t.src, kind, t.microbatch, t.src_chunk)] = i
    rows = [[a for a in row if a is not None] for row in low.actions]
    pc = [0] * p
    sent: set[int] = set()
    issued = 0
    while issued < len(order) or any(pc[s] < len(rows[s]) for s in range(p)):
        moved = False
        for s in range(p):                       # compute threads: run until a RECV not yet issued
            while pc[s] < len(rows[s]):
                a = rows[s][pc[s]]
                if a.kind in (Kind.RECV_F, Kind.RECV_B) and item_of[comm_peer(a, p, v)] >= issued:
                    break
                if a.kind in (Kind.SEND_F, Kind.SEND_B):
                    sent.add(item_of[a])
                pc[s] += 1
                moved = True
        while issued < len(order) and issued in sent:     # the transfer threads (one shared order)
            issued += 1
            moved = True
        assert moved, f"stuck: item {issued} ({order[issued]}) never sent; stages at {pc}"


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_world_order_covers_every_transfer_once_and_never_waits_on_itself(name, p, m, v):
    low = lower(generate(name, p, m, v))
    order = world_order(low, _chunks(p, v))
    sends = [a for _, _, a in low.cells() if a.kind in (Kind.SEND_F, Kind.SEND_B)]
    assert len(order) == len(sends) == len(set(order))
    _run_threads(low, order)
    for t in order:                           # the boundary is the layer the activation enters
        src_layers, dst_layers = _chunks(p, v)[t.src][t.src_chunk], _chunks(p, v)[t.dst][t.dst_chunk]
        assert t.boundary == (src_layers[1] if t.kind == "F" else src_layers[0])
        assert t.boundary == (dst_layers[0] if t.kind == "F" else dst_layers[1])


def test_eval_order_and_wrap_around_edge():
    p, v = 2, 2
    order = world_order(lower(forward_only(p, 4, v)), _chunks(p, v))
    assert {t.kind for t in order} == {"F"} and len(order) == 4 * 3
    wraps = [t for t in order if t.dst < t.src]
    assert wraps and all((t.src, t.src_chunk, t.dst, t.dst_chunk) == (1, 0, 0, 1) for t in wraps)
    _run_threads(lower(forward_only(p, 4, v)), order)


def test_an_order_a_process_would_wait_on_itself_for_is_refused():
    """Stage 1 sends B0 in an earlier column than its RECV of F0 arrives (a hand-made grid no
    generator makes): the order would issue B0 first, which stage 1 can only send after F0."""
    a = Action
    rows = ((a(0, Kind.F, 0), None, a(0, Kind.SEND_F, 0), a(0, Kind.RECV_B, 0), a(0, Kind.B, 0)),
            (a(1, Kind.RECV_F, 0), a(1, Kind.SEND_B, 0), None, None, None))
    with pytest.raises(ScheduleError, match="would wait for itself"):
        world_order(Schedule("bad", 2, 1, 1, rows, lowered=True), [[(0, 1)], [(1, 2)]])
    with pytest.raises(ScheduleError, match="not lowered"):
        world_order(generate("1f1b", 2, 2), [[(0, 1)], [(1, 2)]])


def test_transfer_keys_are_the_workers_mailbox_keys():
    f, b = Transfer("F", 3, 0, 1, 1, 1, 7), Transfer("B", 3, 1, 1, 0, 1, 7)
    assert f.key(5, "E2") == (5, "E2", 3, 1) and b.key(5, "E2") == (5, "B", 3, 1)


def _side(hosts, axes, spec, shape=None):
    hosts = np.array(hosts)
    return MeshSide(np.arange(hosts.size).reshape(shape or hosts.shape), hosts.reshape(shape or hosts.shape),
                    axes, spec)


def test_whole_array_only_where_one_device_put_moves_the_lower_bound():
    data = _side([0, 0], ("data",), ("data",))
    # the same blocks at the same positions on another host: whole
    assert whole_array(make_plan((8, 4), np.float32, data, _side([1, 1], ("model",), ("model",))))
    # a 2-host source onto one host, cut alike: whole
    assert whole_array(make_plan((8, 4), np.float32, _side([0, 1], ("data",), ("data",)),
                                 _side([2, 2], ("data",), ("data",))))
    # another cut, fewer devices, or a replicated destination (one copy per host, not per device): tiles
    assert not whole_array(make_plan((8, 4), np.float32, data, _side([1, 1], ("model",), (None, "model"))))
    assert not whole_array(make_plan((8, 4), np.float32, _side([0] * 4, ("data",), ("data",)),
                                     _side([1, 1], ("data",), ("data",))))
    assert not whole_array(make_plan((8, 4), np.float32, _side([0, 0], ("data",), ()),
                                     _side([1, 1], ("model",), ())))
    # replicated on both sides but each destination device on its own host: whole is the lower bound
    assert whole_array(make_plan((8, 4), np.float32, _side([0, 0], ("data",), ()), _side([1, 2], ("m",), ())))


def test_pieces_build_every_destination_shard_from_one_copy_per_host():
    """{data: 2} batch-sharded -> {model: 4} replicated batch, embed-sharded, on one host: every tile
    lands once on the host (its first wanting device) and the shards, rebuilt from the pieces the
    way the receiver does, equal the reference slices."""
    src = _side([0, 0], ("data",), ("data", None))
    dst = _side([1] * 4, ("model",), (None, "model"))
    shape = (8, 8)
    plan = make_plan(shape, np.float32, src, dst)
    full = np.arange(64, dtype=np.float32).reshape(shape)
    from orchestrator.core.reshard import shards_of

    src_shards = shards_of(full, src)
    tiles = [src_shards[t.src_device][t.src_slice] for t in plan.tiles]
    assert sum(t.nbytes for t in plan.tiles) == plan.lower_bound_bytes      # one copy per host
    got = pieces_on(plan, 1)
    for dev, want in shards_of(full, dst).items():
        out = np.zeros(plan.dst_shard_shape, np.float32)
        for piece in got[dev]:
            assert piece.landed == landing_device(plan.tiles[piece.tile])
            out[piece.where] = tiles[piece.tile]
        np.testing.assert_array_equal(out, want)


def test_the_thread_simulation_catches_an_order_that_waits_on_itself():
    """The check above can fail: issuing 1F1B's gradients before the activations they depend on sticks."""
    low = lower(generate("1f1b", 2, 4))
    order = world_order(low, _chunks(2, 1))
    backwards_first = tuple(sorted(order, key=lambda t: t.kind != "B"))
    with pytest.raises(AssertionError, match="stuck"):
        _run_threads(low, backwards_first)
