"""Tiles over framed TCP streams between stage actors (cluster `transport: socket`).

Same plan, packing, mailbox keys and counters as `RayTransport` (both are
`TiledTransport`s); only the hop differs: instead of one Ray actor call per send,
the sender writes one frame on a persistent TCP connection to the destination
host, and a reader thread there puts `(key, arrays)` into the worker's Mailbox.

Wire format (no pickle anywhere):
  handshake:  connector sends HELLO = struct "!4sH" (b"MPH1", token length) + token;
              the listener answers b"\\x01" or drops the connection (hmac.compare_digest).
  frame:      struct "!4sIQ" (b"MPF1", JSON header length, raw data length),
              then the JSON header {"key": [...], "arrays": [[dtype str, shape], ...]},
              then every array's C-order bytes, back to back.
Receivers read the data straight into fresh 64-byte-aligned buffers (`aligned_empty`),
so a CPU `device_put` can adopt them without a copy.

Every blocking socket operation has a timeout: connects and handshakes `io_timeout`,
sends `io_timeout` per blocked write, reader threads poll their stop flag between frames
and give up mid-frame after `io_timeout`.
"""
from __future__ import annotations

import hmac
import json
import select
import socket
import struct
import threading
import time

import numpy as np

from orchestrator.reshard.tiles import aligned_empty
from stages.transport import TiledTransport

HELLO = struct.Struct("!4sH")
HELLO_MAGIC = b"MPH1"
FRAME = struct.Struct("!4sIQ")
FRAME_MAGIC = b"MPF1"
ACK = b"\x01"
MAX_HEADER = 1 << 20
POLL_S = 0.5            # reader/acceptor wake-up interval to notice shutdown


class FrameError(ConnectionError):
    """A malformed frame or a broken stream."""


# -- frames (pure) -------------------------------------------------------------
def encode_frame(key: tuple, arrays) -> list:
    """The buffers of one frame: [fixed header + JSON header, array bytes...] (array bytes are views)."""
    metas, bufs = [], []
    for a in arrays:
        a = np.asarray(a)
        if a.dtype.hasobject or a.dtype.fields is not None:
            raise TypeError(f"cannot frame dtype {a.dtype} (plain numeric dtypes only)")
        if not a.flags.c_contiguous:
            a = a.copy(order="C")          # (np.ascontiguousarray would turn a 0-d array into 1-d)
        metas.append([a.dtype.str, list(a.shape)])
        if a.nbytes:
            bufs.append(memoryview(a.reshape(-1).view(np.uint8)))
    head = json.dumps({"key": list(key), "arrays": metas}, separators=(",", ":")).encode()
    total = sum(b.nbytes for b in bufs)
    return [FRAME.pack(FRAME_MAGIC, len(head), total) + head, *bufs]


def _recv_exact(sock: socket.socket, view: memoryview, stop=None, deadline: float | None = None,
                at_boundary: bool = False) -> bool:
    """Fill `view` from `sock`. Returns False on a clean EOF before the first byte when `at_boundary`.

    A socket timeout re-polls while `stop()` is false and `deadline` (monotonic) is not passed.
    """
    got, n = 0, view.nbytes
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got)
        except TimeoutError:
            if stop is not None and stop():
                raise FrameError("transport closed") from None
            if deadline is not None and time.monotonic() > deadline and not (at_boundary and got == 0):
                raise FrameError(f"stream stalled: {got} of {n} bytes within the deadline") from None
            continue
        if k == 0:
            if at_boundary and got == 0:
                return False
            raise FrameError(f"connection closed mid-frame ({got} of {n} bytes)")
        got += k
    return True


def read_frame(sock: socket.socket, stop=None, io_timeout: float = 60.0):
    """One frame from `sock` as (key tuple, [arrays]); None on a clean EOF between frames."""
    fixed = bytearray(FRAME.size)
    if not _recv_exact(sock, memoryview(fixed), stop, None, at_boundary=True):
        return None
    deadline = time.monotonic() + io_timeout       # the rest of a started frame must come in time
    magic, head_len, total = FRAME.unpack(fixed)
    if magic != FRAME_MAGIC or head_len > MAX_HEADER:
        raise FrameError(f"bad frame header {bytes(fixed)!r}")
    head = bytearray(head_len)
    _recv_exact(sock, memoryview(head), stop, deadline)
    meta = json.loads(head)
    arrays, want = [], 0
    for dtype, shape in meta["arrays"]:
        dt = np.dtype(dtype)
        if dt.hasobject:
            raise FrameError(f"refusing dtype {dtype}")
        a = aligned_empty(tuple(shape), dt)
        want += a.nbytes
        arrays.append(a)
    if want != total:
        raise FrameError(f"frame announces {total} data bytes, its arrays need {want}")
    for a in arrays:
        if a.nbytes:
            _recv_exact(sock, memoryview(a.reshape(-1).view(np.uint8)), stop, deadline)
    return tuple(meta["key"]), arrays


def client_handshake(sock: socket.socket, token: bytes) -> None:
    """Send the run token and wait for the listener's acknowledgement (sock's timeout applies)."""
    sock.sendall(HELLO.pack(HELLO_MAGIC, len(token)) + token)
    ack = sock.recv(1)
    if ack != ACK:
        raise ConnectionRefusedError("the peer's transport refused the connection (wrong run token?)")


def server_handshake(sock: socket.socket, token: bytes) -> bool:
    """Check a connector's token (sock's timeout applies); True (and ACK sent) only when it matches."""
    try:
        hello = bytearray(HELLO.size)
        if not _recv_exact(sock, memoryview(hello), at_boundary=True):
            return False
        magic, n = HELLO.unpack(hello)
        if magic != HELLO_MAGIC or n > 1024:
            return False
        got = bytearray(n)
        _recv_exact(sock, memoryview(got))
        if not hmac.compare_digest(bytes(got), token):
            return False
        sock.sendall(ACK)
        return True
    except (OSError, FrameError):
        return False


# -- the transport ---------------------------------------------------------------
class Listener:
    """Accepts token-checked connections; one daemon reader thread per connection feeds `on_frame`."""

    def __init__(self, host: str, token: bytes, on_frame, on_error, io_timeout: float, name: str = ""):
        self.token, self.on_frame, self.on_error, self.io_timeout = token, on_frame, on_error, io_timeout
        self.name = name
        self.closed = False
        self.refused = 0
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self.sock = socket.create_server((host, 0), backlog=64)
        self.sock.settimeout(POLL_S)
        self.address = (host, self.sock.getsockname()[1])
        self._threads = [threading.Thread(target=self._accept, daemon=True, name=f"{name} accept")]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(self.io_timeout)
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True, name=f"{self.name} reader")
            with self._lock:
                if self.closed:
                    conn.close()
                    return
                self._conns.append(conn)
                self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            if not server_handshake(conn, self.token):
                self.refused += 1
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(POLL_S)
            stop = lambda: self.closed
            while not self.closed:
                frame = read_frame(conn, stop, self.io_timeout)
                if frame is None:
                    return
                self.on_frame(*frame)
        except Exception as e:  # noqa: BLE001 - a reader must not die silently
            if not self.closed:
                self.on_error(f"{type(e).__name__}: {e}")
        finally:
            conn.close()

    def close(self) -> None:
        with self._lock:
            self.closed = True
            conns = list(self._conns)
        self.sock.close()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=2 * POLL_S)


class _Conn:
    def __init__(self, address: tuple, token: bytes, io_timeout: float):
        self.address = tuple(address)
        self.lock = threading.Lock()
        sock = socket.create_connection(self.address, timeout=io_timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client_handshake(sock, token)
        except BaseException:
            sock.close()
            raise
        self.sock = sock

    def send(self, buffers) -> None:
        with self.lock:
            for b in buffers:
                self.sock.sendall(b)

    def broken(self) -> bool:
        """The peer never writes after the ACK: readable means EOF or an error."""
        readable, _, _ = select.select([self.sock], [], [], 0)
        return bool(readable)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class SocketTransport(TiledTransport):
    """Tiles over persistent, token-authenticated TCP connections (see the module docstring).

    Args: as `RayTransport`, plus `token` (the run's secret, from the driver), `host`
    (the IP to listen on: the node IP; None asks Ray) and `io_timeout` (seconds a
    connect, handshake, blocked write or started frame may take).
    After construction `address` is (host, port); `connect(addresses)` takes every
    stage's hosts' addresses ([stage][host]) before the first send.
    """

    def __init__(self, *, me, geom, mesh, inbox, peers, token: bytes, host: str | None = None,
                 io_timeout: float = 60.0):
        if not token:
            raise ValueError("SocketTransport needs the run token")
        super().__init__(me=me, geom=geom, mesh=mesh, inbox=inbox, peers=peers)
        if host is None:
            import ray

            host = ray.util.get_node_ip_address()
        self.token, self.io_timeout = bytes(token), io_timeout
        self._error: str | None = None
        self._addresses: list[list[tuple]] = []
        self._conns: dict[tuple, _Conn] = {}
        self._conns_lock = threading.Lock()
        self.listener = Listener(host, self.token, self._on_frame, self._on_error, io_timeout,
                                 name=f"transport host {me}")
        self.address = self.listener.address

    def _on_frame(self, key, arrays) -> None:
        self.inbox.put(key, arrays)

    def _on_error(self, reason: str) -> None:
        self._error = self._error or reason
        self.inbox.close(f"socket transport: {reason}")   # a waiting recv fails now, not at its deadline

    def connect(self, addresses) -> None:
        self._addresses = [[tuple(a) for a in row] for row in addresses]

    def _conn(self, address: tuple) -> _Conn:
        conn = self._conns.get(address)
        if conn is None:
            with self._conns_lock:
                conn = self._conns.get(address)
                if conn is None:
                    conn = self._conns[address] = _Conn(address, self.token, self.io_timeout)
        return conn

    def _push(self, key, payload, edge, dst_host):
        if not self._addresses:
            raise RuntimeError("SocketTransport.send before connect(addresses)")
        address = self._addresses[edge.stage][edge.geom.hosts.index(dst_host)]
        buffers = encode_frame((*key, self.me), payload)
        try:
            self._conn(address).send(buffers)
        except OSError as e:
            self._drop(address)
            raise ConnectionError(f"sending {key} to host {dst_host} at {address[0]}:{address[1]}: {e}") from e

    def _drop(self, address) -> None:
        with self._conns_lock:
            conn = self._conns.pop(address, None)
        if conn is not None:
            conn.close()

    def flush(self, timeout):
        """Nothing is in flight after sendall; surfaces a broken connection or a failed reader."""
        if self._error:
            raise ConnectionError(f"socket transport: {self._error}")
        for address, conn in list(self._conns.items()):
            if conn.broken():
                self._drop(address)
                raise ConnectionError(f"socket transport: the peer at {address[0]}:{address[1]} closed the connection")

    def close(self) -> None:
        self.listener.close()
        with self._conns_lock:
            conns, self._conns = list(self._conns.values()), {}
        for c in conns:
            c.close()
