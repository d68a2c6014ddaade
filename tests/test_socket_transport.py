"""The socket transport (cluster `transport: socket`): frames, the token handshake, and
end-to-end numerics equal to the single-process reference (same tolerance as Ray's)."""
from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from stages.mailbox import Mailbox
from stages.frames import IOV_MAX, MIN_RUN, FrameError, encode_frame, read_frame, runs, send_buffers
from stages.socket_conn import Listener, _Conn
from stages.socket_transport import SocketTransport

TOKEN = b"t" * 32


def roundtrip(key, arrays, destinations=None):
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(5)
        b.settimeout(5)
        bufs = encode_frame(key, arrays)
        sender = threading.Thread(target=send_buffers, args=(a, bufs))
        sender.start()
        got = read_frame(b, io_timeout=5, destinations=destinations)
        sender.join(5)
        a.close()
        assert read_frame(b, io_timeout=5) is None      # clean EOF between frames
    return got.key, got.arrays


def test_frame_roundtrip_dtypes_shapes_and_strides():
    base = np.arange(48, dtype=np.float32).reshape(6, 8)
    arrays = [np.float32(3.5) * np.ones(()), np.arange(5, dtype=np.int32), base,
              base[:, 1::3],                      # non-contiguous view
              base.T,                             # F-ordered view
              np.zeros((0, 4), np.float32),       # empty
              np.array([1, -2], dtype=">i4")]     # explicit endianness survives
    key, got = roundtrip((7, "F", 2, 0, 1), arrays)
    assert key == (7, "F", 2, 0, 1)
    assert len(got) == len(arrays)
    for want, have in zip(arrays, got):
        assert have.shape == want.shape and have.dtype == want.dtype
        np.testing.assert_array_equal(have, want)
        assert have.flags.c_contiguous and have.ctypes.data % 64 == 0 or have.nbytes == 0


def test_strided_arrays_travel_as_their_runs_and_land_in_given_destinations():
    """Gather writes from strided views (more runs than one sendmsg takes; short runs copied once)
    and scatter reads into caller-given destination views (more than one recvmsg_into takes)."""
    rng = np.random.default_rng(0)
    src = rng.standard_normal((2 * IOV_MAX + 7, 2 * MIN_RUN // 4), dtype=np.float32)
    wide = src[:, :MIN_RUN // 4]                   # runs of exactly MIN_RUN bytes: gathered, not copied
    narrow = src[:40, 3:7]                         # 16-byte runs: copied once
    assert len(runs(wide)) == wide.shape[0] > IOV_MAX and runs(narrow) is None
    assert all(np.shares_memory(np.frombuffer(m, np.uint8), src) for m in runs(wide)[:3])
    dst = np.full((wide.shape[0], 3 * MIN_RUN // 4), -1.0, np.float32)
    small = np.full((50, 9), -1.0, np.float32)
    places = [dst[:, MIN_RUN // 4: 2 * MIN_RUN // 4], small[5:45, 2:6]]
    views = [v for p in places for v in runs(p, min_run=0)]
    assert len(views) > IOV_MAX
    key, got = roundtrip((3, "F", 0, 0, 1), [wide, narrow], destinations=lambda header, nbytes: views)
    assert key == (3, "F", 0, 0, 1) and got is None
    np.testing.assert_array_equal(places[0], wide)
    np.testing.assert_array_equal(places[1], narrow)
    assert (dst == -1).sum() == dst.size - wide.size and (small == -1).sum() == small.size - narrow.size


def test_frame_destinations_must_hold_exactly_its_bytes():
    short = [memoryview(bytearray(20))]
    with pytest.raises(FrameError, match="destinations hold 20"):
        roundtrip((0,), [np.zeros((2, 3), np.float32)], destinations=lambda h, n: short)


def test_frame_refuses_object_dtype_and_garbage():
    with pytest.raises(TypeError):
        encode_frame((0,), [np.array([object()])])
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5)
        a.sendall(b"GARBAGE-GARBAGE-GARBAGE")
        with pytest.raises(FrameError):
            read_frame(b, io_timeout=5)


def test_listener_refuses_a_wrong_token_and_delivers_with_the_right_one():
    box, errors = Mailbox("test"), []
    listener = Listener("127.0.0.1", TOKEN, lambda frame, conn: box.put(frame.key, frame.arrays),
                        errors.append, io_timeout=5)
    try:
        with pytest.raises(ConnectionError):
            _Conn(listener.address, b"x" * 32, io_timeout=5)
        with pytest.raises(ConnectionError):
            _Conn(listener.address, TOKEN[:-1], io_timeout=5)
        conn = _Conn(listener.address, TOKEN, io_timeout=5)
        conn.send(encode_frame((1, "B", 0, 0, 3), [np.arange(6, dtype=np.float32).reshape(2, 3)]))
        got = box.take((1, "B", 0, 0, 3), timeout=5)
        np.testing.assert_array_equal(got[0], np.arange(6, dtype=np.float32).reshape(2, 3))
        assert listener.refused == 2 and not errors
        conn.close()
    finally:
        listener.close()


def test_transport_needs_a_token():
    with pytest.raises(ValueError, match="token"):
        SocketTransport(me=0, geom=None, mesh=None, inbox=Mailbox(), peers=None, token=b"",
                        host="127.0.0.1")


@pytest.mark.ray
def test_gpt_1f1b_over_ray_calls_matches_reference(tmp_path, no_leaks):
    """The other transport (`transport: ray`); the default (socket) runs in test_pipeline_numerics."""
    from orchestrator.core.config import check_job, parse_cluster, parse_job
    from orchestrator.driver.runner import run_job
    from tests.test_pipeline_numerics import CLUSTER, assert_same_training, gpt_job

    checked = check_job(parse_job(gpt_job(tmp_path, "1f1b")), parse_cluster({**CLUSTER, "transport": "ray"}))
    assert checked.cluster.transport == "ray"
    pipe = run_job(checked, echo=lambda s: None)
    ref = run_job(checked, reference=True, echo=lambda s: None)
    assert_same_training(pipe, ref)
    assert {w["transport"] for w in pipe["workers"]} == {"RayTransport"}
    assert pipe["losses"][-1] < pipe["losses"][0]


def _pair(**options):
    """Two one-device stages' transports in this process (both meshes on CPU device 0)."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from orchestrator.core.edges import StageGeom

    geoms = tuple(StageGeom.of({"data": 1}, (host,), 1, {"batch": "data"}) for host in (0, 1))
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    ts = [SocketTransport(me=g.hosts[0], geom=g, mesh=mesh, inbox=Mailbox(f"stage {i}"), peers=None, token=TOKEN,
                          stage=i, geoms=geoms, host="127.0.0.1", io_timeout=5, **options)
          for i, g in enumerate(geoms)]
    return ts, geoms, NamedSharding(mesh, PartitionSpec("data"))


@pytest.mark.parametrize("unix_reachable", [True, False])
def test_same_machine_peers_share_memory_and_fall_back_to_tcp(unix_reachable):
    """A peer on this machine is reached over its Unix socket and gets big payloads through shared
    memory; when that socket cannot be reached (another network namespace), TCP carries them."""
    import jax

    from stages.transport import Edge

    (a, b), geoms, sharding = _pair(shm_min_bytes=0)
    try:
        if a.machine is None:
            pytest.skip("no shared memory on this platform")
        addr_b = b.address if unix_reachable else (*b.address[:3], "meshpipe-nobody-listens-here")
        for t in (a, b):
            t.connect([[a.address], [addr_b]])
        axes = ("batch", "embed")
        x = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
        b.expect(Edge(0, geoms[0], axes), x.shape, np.float32)
        a.send((0, "F", 0, 0), jax.device_put(x, sharding), Edge(1, geoms[1], axes))
        got = b.recv((0, "F", 0, 0), x.shape, np.float32, sharding, Edge(0, geoms[0], axes), timeout=5)
        np.testing.assert_array_equal(np.asarray(got), x)
        a.flush(5)                              # the sender thread's counters are final
        conn = next(iter(a._conns.values()))
        assert conn.unix is unix_reachable
        assert (a.shm_sends, a.stream_sends) == ((1, 0) if unix_reachable else (0, 1))
    finally:
        a.close()
        b.close()


def test_io_timeout_follows_the_recv_deadline_set_by_the_driver():
    """`set_io_timeout` (what `StageWorker.set_recv_deadline` passes on: the RECV deadline that follows
    the driver's progress deadline) moves every wait of the transport's own: a frame a reader starts
    (a stalled one fails after the new deadline, not the 5 s the transport was built with) and an open
    connection's sends."""
    import time
    from types import SimpleNamespace

    import jax

    from stages.frames import dtype_tag, frame_header
    from stages.transport import Edge
    from stages.worker import StageWorker

    (a, b), geoms, sharding = _pair()
    try:
        for t in (a, b):
            t.connect([[a.address], [b.address]])
        axes = ("batch", "embed")
        x = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
        b.expect(Edge(0, geoms[0], axes), x.shape, np.float32)
        a.send((0, "F", 0, 0), jax.device_put(x, sharding), Edge(1, geoms[1], axes))
        b.recv((0, "F", 0, 0), x.shape, np.float32, sharding, Edge(0, geoms[0], axes), timeout=5)
        conn = next(iter(a._conns.values()))
        assert conn.sock.gettimeout() == 5
        from orchestrator.core.contract import Timeouts

        worker = SimpleNamespace(cfg=SimpleNamespace(timeouts=Timeouts(step_s=600.0)), transport=a, recv_s=600.0,
                                 recv_seq=-1, _recv_lock=threading.Lock())
        assert StageWorker.set_recv_deadline(worker, 0.7) == 1.0        # the RECV deadline's floor
        assert a.io_timeout == a.listener.io_timeout == conn.io_timeout == 1.0
        a.send((1, "F", 0, 0), jax.device_put(x, sharding), Edge(1, geoms[1], axes))
        b.recv((1, "F", 0, 0), x.shape, np.float32, sharding, Edge(0, geoms[0], axes), timeout=5)
        assert conn.sock.gettimeout() == 1.0            # taken up by the next send (on the sender thread)

        b.set_io_timeout(0.5)
        stall = _Conn(b.address, TOKEN, io_timeout=5)
        try:
            header = {"key": [2, "F", 0, 0, 0], "arrays": [],
                      "tensor": {"stage": 0, "axes": list(axes), "shape": list(x.shape), "dtype": dtype_tag(np.float32)}}
            t0 = time.monotonic()
            stall.send([frame_header(header, x.nbytes), x.tobytes()[:16]])   # then nothing more
            while not b.inbox.closed and time.monotonic() - t0 < 10:
                time.sleep(0.02)
            took = time.monotonic() - t0
        finally:
            stall.close()
        assert b.inbox.closed and "stalled" in b.inbox.closed, b.inbox.closed
        assert 0.5 <= took < 3.0, took       # the new deadline (+ the reader's poll), not the 5 s it had
    finally:
        a.close()
        b.close()


def test_the_newest_recv_deadline_setting_wins_whatever_order_they_run_in():
    """The driver sends RECV deadlines fire and forget to the actor's "io" group, which runs up to
    four calls at once, so two settings sent back to back may run in either order (CI once saw a
    stale 79.6 s win over the 60 s sent after it): each is numbered and an older one is ignored."""
    from types import SimpleNamespace

    from orchestrator.core.contract import Timeouts
    from stages.worker import StageWorker

    class Io:
        def __init__(self):
            self.set = []

        def set_io_timeout(self, seconds):
            self.set.append(seconds)

    io = Io()
    worker = SimpleNamespace(cfg=SimpleNamespace(timeouts=Timeouts(step_s=600.0)), transport=io, recv_s=600.0,
                             recv_seq=-1, _recv_lock=threading.Lock())
    assert StageWorker.set_recv_deadline(worker, 60.0, 2) == 60.0       # the newer one runs first
    assert StageWorker.set_recv_deadline(worker, 79.6, 1) == 60.0       # the older one arrives late
    assert (worker.recv_s, worker.recv_seq, io.set) == (60.0, 2, [60.0])
    assert StageWorker.set_recv_deadline(worker, 45.0, 3) == 45.0
    assert (worker.recv_s, io.set) == (45.0, [60.0, 45.0])


def test_send_returns_at_once_and_the_sender_threads_failure_surfaces_at_the_next_send_or_flush():
    """SEND only hands the tensor over: with the receiver gone, `send` itself returns, and the sender
    thread's ConnectionError (naming the peer) is raised by the next `send` and by `flush`."""
    import jax

    from stages.transport import Edge

    (a, b), geoms, sharding = _pair(shared_memory=False)
    try:
        for t in (a, b):
            t.connect([[a.address], [b.address]])
        b.close()                                   # the peer is gone before anything is sent
        x = jax.device_put(np.ones((8, 4), np.float32), sharding)
        edge = Edge(1, geoms[1], ("batch", "embed"))
        a.send((0, "F", 0, 0), x, edge)             # returns: the failure is the sender thread's
        with pytest.raises(ConnectionError, match="127.0.0.1"):
            a.flush(5)
        with pytest.raises(ConnectionError, match="sender thread"):
            a.send((1, "F", 0, 0), x, edge)
    finally:
        a.close()


def test_a_stuck_wire_fails_the_sender_thread_at_the_io_deadline():
    """A receiver that stops reading mid-tensor: the sender thread's blocked write gives up after
    `io_timeout` (1 s here) and the flush raises it, instead of waiting for the wire forever."""
    import time

    import jax

    from stages.transport import Edge

    (a, b), geoms, sharding = _pair(shared_memory=False)
    stalled = threading.Event()
    real = b.listener.destinations

    def stall(header, nbytes, conn):                # the reader thread stops reading at the first frame
        stalled.set()
        time.sleep(30)
        return real(header, nbytes, conn)

    b.listener.destinations = stall
    try:
        for t in (a, b):
            t.connect([[a.address], [b.address]])
        a.set_io_timeout(1.0)
        axes = ("batch", "embed")
        x = np.ones((16384, 1024), np.float32)      # 64 MiB: more than the sockets' buffers hold
        b.expect(Edge(0, geoms[0], axes), x.shape, np.float32)
        t0 = time.monotonic()
        a.send((0, "F", 0, 0), jax.device_put(x, sharding), Edge(1, geoms[1], axes))
        with pytest.raises((ConnectionError, TimeoutError)):
            a.flush(20)
        assert stalled.is_set() and time.monotonic() - t0 < 20
    finally:
        a.close()
        b.close()
