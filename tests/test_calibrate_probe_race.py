"""`meshpipe calibrate`'s send ping-pong with its race forced open, in one process.

A socket transport refuses a tensor it was not told to expect (`SocketTransport.expect`): the
frame closes its connection. The probes' ping-pong once expected each size only when that
size's turn came, after the receiver had bounced the last tensor of the size before; the sender,
holding that bounce, could send its next size first (a calibrate run at 13:32 lost host 1's
connection so). Now both probes `expect_sends` every size before either starts (the driver
waits for both). These tests open that window on purpose instead of waiting for the scheduler:
two `CalibrationProbe`s in this process, transports connected as the driver connects them, each
`pingpong` in a thread, and the receiver held, after bouncing a size's last tensor, until the
sender's first tensor of the next size has reached its transport (accepted or refused). Under
`expect_sends` the ping-pong completes; with the receiver expecting each size only at its turn
(the line the fix removed), the same ordering gets the early tensor refused.

The holds wrap the receiver's transport and listener objects from here; the product modules
carry no test hook. Sizes straddle `SHM_MIN_BYTES`, so the stream and the shared-memory paths
both run where this machine shares memory. Every wait has a deadline.
"""
from __future__ import annotations

import secrets
import threading

import pytest

from stages.calibrate_probe import CalibrationProbe
from stages.frames import PeerError
from stages.socket_transport import SHM_MIN_BYTES
from stages.transport import Edge

SIZES = [4 << 10, 256 << 10, 2 * SHM_MIN_BYTES]   # two stream sizes, one over the shared-memory threshold
REPS = 2
WAIT_S = 20.0        # deadline of every wait here (the whole test takes a few seconds)
REFUSED = "matches no tensor this host expects"


class Watch:
    """What the receiver's transport did with each tensor's first frame: accepted or refused
    (with the reason), keyed ("cal", nbytes, round, "a"|"b"); `wait_for` waits on it."""

    def __init__(self, listener):
        self.cv = threading.Condition()
        self.accepted: set[tuple] = set()
        self.refused: dict[tuple, str] = {}
        dest, on_frame = listener.destinations, listener.on_frame

        def destinations(header, nbytes, conn):      # a tensor frame's expectation is checked here
            try:
                return dest(header, nbytes, conn)
            except PeerError as e:
                self._note(header.get("key"), str(e))
                raise

        def frame(f, conn):                          # ... a shared-memory grant request's here
            try:
                on_frame(f, conn)
            except PeerError as e:
                self._note(f.key, str(e))
                raise
            self._note(f.key, None)

        listener.destinations, listener.on_frame = destinations, frame

    def _note(self, key, refused: str | None) -> None:
        base = tuple(key or ())[:4]
        with self.cv:
            if refused is None:
                self.accepted.add(base)
            else:
                self.refused[base] = refused
            self.cv.notify_all()

    def wait_for(self, base: tuple) -> None:
        with self.cv:
            if not self.cv.wait_for(lambda: base in self.accepted or base in self.refused, WAIT_S):
                raise TimeoutError(f"{base} did not reach the receiver within {WAIT_S:g} s")


def hold_after_each_size(rx: CalibrationProbe, watch: Watch, log: list) -> None:
    """Make `rx`, after bouncing a size's last tensor, wait until the sender's first tensor of
    the next size has reached it: the window in which the old code had not yet expected it."""
    send = rx.transport.send

    def held(key, array, edge):
        send(key, array, edge)
        _, nbytes, r, _ = key
        if r == REPS and nbytes != SIZES[-1]:
            nxt = ("cal", SIZES[SIZES.index(nbytes) + 1], 0, "a")
            watch.wait_for(nxt)
            log.append(("reached", nxt))

    rx.transport.send = held


def expect_at_turn(rx: CalibrationProbe, peer: int, registered: threading.Event, log: list) -> None:
    """The receiver as before the fix: it expects a size only at that size's first receive."""
    recv, seen = rx.transport.recv_operand, set()

    def recv_operand(key, shape, dtype, sharding, edge, timeout):
        if key[1] not in seen:
            seen.add(key[1])
            rx.transport.expect(Edge(peer, rx.geoms[peer], (None,)), shape, dtype)
            log.append(("expected", key[1]))
            registered.set()
        return recv(key, shape, dtype, sharding, edge, timeout)

    rx.transport.recv_operand = recv_operand


def started(fn, *args) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        try:
            out["result"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            out["error"] = e

    t = threading.Thread(target=run, daemon=True, name=f"pingpong {fn.__self__.host}")
    t.start()
    return t, out


def joined(*threads: threading.Thread) -> None:
    for t in threads:
        t.join(WAIT_S)
        assert not t.is_alive(), f"{t.name} still running after {WAIT_S:g} s"


@pytest.fixture
def probes():
    """Probe-stages 0 (sends first) and 1 on hosts 0 and 1, transports open and connected."""
    token = secrets.token_bytes(32)
    tx, rx = CalibrationProbe(0), CalibrationProbe(1)
    try:
        addrs = [tx.open_transport(0, [0, 1], token, WAIT_S), rx.open_transport(1, [0, 1], token, WAIT_S)]
        for p in (tx, rx):
            p.connect([[addrs[0]], [addrs[1]]])
        yield tx, rx
    finally:
        tx.close()
        rx.close()


def test_pingpong_completes_when_the_next_size_arrives_before_the_receiver_turns_to_it(probes):
    tx, rx = probes
    watch, log = Watch(rx.transport.listener), []
    hold_after_each_size(rx, watch, log)
    tx.expect_sends(1, SIZES)
    rx.expect_sends(0, SIZES)
    rx_thread, rx_out = started(rx.pingpong, 0, False, SIZES, REPS, WAIT_S)
    tx_thread, tx_out = started(tx.pingpong, 1, True, SIZES, REPS, WAIT_S)
    joined(tx_thread, rx_thread)

    assert "error" not in tx_out and "error" not in rx_out, (tx_out.get("error"), rx_out.get("error"))
    # the forced ordering happened: every later size reached the receiver while it was held
    assert log == [("reached", ("cal", n, 0, "a")) for n in SIZES[1:]]
    assert rx_out["result"] == []
    got = tx_out["result"]
    assert [r["nbytes"] for r in got] == SIZES and all(r["kind"] == "send" and r["k"] == 2 for r in got)
    assert all(r["seconds"] > 0 for r in got), got
    assert not watch.refused and rx.transport.listener.rejected == tx.transport.listener.rejected == 0
    assert {("cal", n, r, "a") for n in SIZES for r in range(REPS + 1)} <= watch.accepted


def test_the_same_ordering_gets_the_early_tensor_refused_when_sizes_are_expected_at_their_turn(probes):
    """The check that the ordering above exercises the race: without `expect_sends` on the
    receiver (it expects each size only when its turn comes, as before the fix), the sender's
    first tensor of the second size arrives unexpected and its connection is closed."""
    tx, rx = probes
    watch, log = Watch(rx.transport.listener), []
    registered = threading.Event()
    hold_after_each_size(rx, watch, log)
    expect_at_turn(rx, 0, registered, log)
    tx.expect_sends(1, SIZES)
    rx_thread, rx_out = started(rx.pingpong, 0, False, SIZES, REPS, WAIT_S)
    assert registered.wait(WAIT_S), "the receiver never turned to the first size"   # (so it is not raced too)
    tx_thread, tx_out = started(tx.pingpong, 1, True, SIZES, REPS, WAIT_S)
    early = ("cal", SIZES[1], 0, "a")
    try:
        watch.wait_for(early)
    finally:                      # both sides now wait for tensors that will not come: end them
        for p in (tx, rx):
            p.inbox.close("the test saw what it waited for")
        joined(tx_thread, rx_thread)

    assert early in watch.refused and REFUSED in watch.refused[early], watch.refused
    assert rx.transport.listener.rejected == 1
    assert ("cal", SIZES[0], REPS, "a") in watch.accepted and early not in watch.accepted
    # the refusal came before the receiver expected the size: exactly the window the fix closed
    assert log == [("expected", SIZES[0]), ("reached", early), ("expected", SIZES[1])], log
    assert "error" in tx_out and "result" not in tx_out, tx_out
