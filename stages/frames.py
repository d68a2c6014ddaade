"""The socket transport's wire format (pure: sockets and numpy, no jax, no ray, no pickle).

  handshake:  mutual challenge-response over per-connection nonces; the run key never
              crosses the wire (`mac(label, a, b)` = HMAC-SHA256(key, label + a + b)):
                connector -> listener  HELLO = b"MPH2" + nonce_c (32 random bytes)
                listener -> connector  CHALLENGE = b"MPC2" + nonce_s + mac(b"server", nonce_c, nonce_s)
                connector -> listener  PROOF = mac(b"client", nonce_s, nonce_c)
                listener -> connector  b"\\x01" (or it drops the connection)
              Each side proves it holds the key over a nonce the other side just chose, so a
              recorded handshake replayed later fails, and the labels stop a reflected proof.
              Every message before authentication has a fixed size; the listener drives its
              half (`ServerHandshake`) without a thread and gives it HANDSHAKE_S seconds.
  frame:      struct "!4sIQ" (b"MPF1", JSON header length, data length), the JSON
              header {"key": [...], "arrays": [[dtype str, shape], ...], ...}, then the
              data: every array's C-order bytes back to back, or a tensor frame's byte
              stream (header "tensor"; `orchestrator.core.reshard.stream` lays it out).
  grant:      (Unix sockets only, listener -> connector) struct "!4sI" (b"MPG1", JSON
              length) + JSON, with file descriptors attached (SCM_RIGHTS).

Arrays are written straight from their memory (strided ones as a gather list of their
contiguous runs, `sendmsg`) and read straight into their destinations (`recvmsg_into`).
Over TLS (`ssl.SSLSocket`, cluster `transport_tls`) the same bytes go through `sendall` /
`recv_into` (TLS has no gather I/O): short runs are joined into records of TLS_RECORD bytes,
and the listener runs the TLS handshake, without a thread, before its half of the HMAC one.
Every read takes a stop flag and a deadline: nothing blocks forever. A frame that breaks
the protocol (bad magic, a header that is not the expected JSON, more bytes than allowed)
raises `PeerError`, before anything is allocated from its header.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import ssl
import struct
import time
from typing import NamedTuple

import numpy as np

from orchestrator.core.reshard.tiles import aligned_empty

NONCE = 32
HELLO = struct.Struct(f"!4s{NONCE}s")
HELLO_MAGIC = b"MPH2"
CHALLENGE = struct.Struct(f"!4s{NONCE}s32s")
CHALLENGE_MAGIC = b"MPC2"
PROOF = 32              # bytes of an HMAC-SHA256
HANDSHAKE_S = 5.0       # seconds a connector has to complete the listener's half of the handshake
FRAME = struct.Struct("!4sIQ")
FRAME_MAGIC = b"MPF1"
GRANT = struct.Struct("!4sI")
GRANT_MAGIC = b"MPG1"
ACK = b"\x01"
MAX_HEADER = 1 << 20   # bytes of a frame's JSON header
MAX_GRANT = 64 << 10   # bytes of a grant's JSON
MAX_FRAME_BYTES = 64 << 20   # data bytes of a frame read into fresh arrays (no destinations given)
MAX_DIMS = 32
IOV_MAX = 1024          # buffers per sendmsg / recvmsg_into call (Linux's limit)
MIN_RUN = 4096          # strided arrays with shorter contiguous runs are copied before sending
RECV_BATCH = 4 << 20    # bytes of destination views offered to one recvmsg_into call
MAX_FDS = 250           # file descriptors one grant may carry (Linux: SCM_MAX_FD = 253)
TLS_RECORD = 16 << 10   # bytes of one TLS record: shorter buffers are joined up to this before sending
_WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


class FrameError(ConnectionError):
    """A malformed frame or a broken stream."""


class PeerError(FrameError):
    """The peer broke the protocol (garbage, an unexpected tensor, a size not allowed): the
    receiver closes that one connection and logs why; the run goes on."""


class HandshakeRefused(ConnectionRefusedError):
    """The peer could not prove it holds the run key (or refused our proof)."""


# -- frames (pure) -------------------------------------------------------------
class Frame(NamedTuple):
    key: tuple
    arrays: list | None   # the arrays read (None for a frame read into given destinations)
    header: dict


def runs(a: np.ndarray, min_run: int = MIN_RUN) -> list[memoryview] | None:
    """`a`'s bytes as memoryviews of its contiguous runs in C order, or None when the runs
    are shorter than `min_run` bytes (then a copy is cheaper than a long gather list).

    Example:
        >>> base = np.zeros((4, 2048), np.float32)
        >>> [m.nbytes for m in runs(base[1:3, :1024])]
        [4096, 4096]
        >>> runs(base[:, :4]) is None
        True
    """
    if a.nbytes == 0:
        return []
    if a.flags.c_contiguous:
        return [memoryview(a.reshape(-1).view(np.uint8))]
    k, run = a.ndim, a.itemsize
    while k > 0 and (a.shape[k - 1] == 1 or a.strides[k - 1] == run):
        run *= a.shape[k - 1]
        k -= 1
    if run < min_run or any(st < 0 for st in a.strides[:k]):
        return None
    offsets = np.zeros(1, np.int64)
    for n, st in zip(a.shape[:k], a.strides[:k]):
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64) * st).reshape(-1)
    span = int(offsets[-1]) + run
    flat = np.lib.stride_tricks.as_strided(a, shape=(span // a.itemsize,), strides=(a.itemsize,))
    mv = memoryview(flat.view(np.uint8))
    return [mv[o:o + run] for o in offsets.tolist()]


def dtype_tag(dt) -> str:
    """A dtype as text that `dtype_of` reads back: numpy's `str` (e.g. '<f4'), or the name of an
    ml_dtypes type (bfloat16, float8_*), whose `str` is an opaque '<V2'."""
    dt = np.dtype(dt)
    return dt.name if dt.kind == "V" else dt.str


def dtype_of(tag: str) -> np.dtype:
    """The dtype of a `dtype_tag`; ml_dtypes names resolve through ml_dtypes (jax's own). Raw
    void ('<V2') and anything else that is not a plain numeric dtype is refused."""
    import ml_dtypes

    kind = getattr(ml_dtypes, str(tag), None) if str(tag).isidentifier() else None
    try:
        dt = np.dtype(kind if kind is not None else tag)
    except TypeError:
        raise FrameError(f"refusing dtype {tag}") from None
    if dt.kind == "V" and kind is None:
        raise FrameError(f"refusing dtype {tag}")
    return dt


def encode_frame(key: tuple, arrays) -> list:
    """The buffers of one frame: [fixed header + JSON header, runs of array bytes...].

    Array bytes are views (contiguous runs of strided arrays, see `runs`); arrays whose
    runs are short are copied once.
    """
    metas, bufs = [], []
    for a in arrays:
        a = np.asarray(a)
        if a.dtype.hasobject or a.dtype.fields is not None:
            raise TypeError(f"cannot frame dtype {a.dtype} (plain numeric dtypes only)")
        metas.append([dtype_tag(a.dtype), list(a.shape)])
        pieces = runs(a)
        if pieces is None:
            pieces = runs(a.copy(order="C"))   # (np.ascontiguousarray would turn a 0-d array into 1-d)
        bufs.extend(pieces)
    header = {"key": list(key), "arrays": metas}
    return [frame_header(header, sum(b.nbytes for b in bufs)), *bufs]


def frame_header(header: dict, data_bytes: int) -> bytes:
    """The fixed header and the JSON header of a frame whose data has `data_bytes` bytes."""
    return frame_bytes(json.dumps(header, separators=(",", ":")).encode(), data_bytes)


def frame_bytes(head: bytes, data_bytes: int) -> bytes:
    """`frame_header` for a header already serialised to JSON bytes (`head`)."""
    return FRAME.pack(FRAME_MAGIC, len(head), data_bytes) + head


def _advance(views: list, i: int, n: int) -> int:
    """Consume n bytes from views[i:], slicing a partly done view in place; returns the new i."""
    while n > 0:
        if n >= views[i].nbytes:
            n -= views[i].nbytes
            i += 1
        else:
            views[i] = views[i][n:]
            n = 0
    return i


def send_buffers(sock: socket.socket, buffers) -> None:
    """Write every buffer, in order, with as few syscalls as the kernel allows (gather writes)."""
    views = [memoryview(b).cast("B") if not isinstance(b, memoryview) else b for b in buffers]
    views = [v for v in views if v.nbytes]
    if isinstance(sock, ssl.SSLSocket):
        _send_tls(sock, views)
        return
    i = 0
    while i < len(views):
        i = _advance(views, i, sock.sendmsg(views[i:i + IOV_MAX]))


def _send_tls(sock: ssl.SSLSocket, views: list) -> None:
    """`send_buffers` over TLS: long buffers as they are, runs of short ones joined into a record."""
    pending, size = [], 0
    for v in views:
        if v.nbytes >= TLS_RECORD:
            if pending:
                sock.sendall(b"".join(pending))
                pending, size = [], 0
            sock.sendall(v)
            continue
        pending.append(v)
        size += v.nbytes
        if size >= TLS_RECORD:
            sock.sendall(b"".join(pending))
            pending, size = [], 0
    if pending:
        sock.sendall(b"".join(pending))


def _poll_timeout(stop, deadline: float | None, what: str) -> None:
    """After a socket timeout: raise if `stop()` or past `deadline`; with neither given, raise at once."""
    if stop is not None and stop():
        raise FrameError("transport closed") from None
    if deadline is None and stop is None:
        raise FrameError(f"timed out: {what}") from None
    if deadline is not None and time.monotonic() > deadline:
        raise FrameError(f"stream stalled: {what} within the deadline") from None


def _recv_views(sock: socket.socket, views: list, stop=None, deadline: float | None = None) -> None:
    """Fill every writable memoryview in `views`, in order (scatter reads, RECV_BATCH bytes offered a call)."""
    views = [v for v in views if v.nbytes]
    got, i, tls = 0, 0, isinstance(sock, ssl.SSLSocket)
    while i < len(views):
        j, offered = i, 0
        while j < len(views) and j - i < IOV_MAX and offered < RECV_BATCH:
            offered += views[j].nbytes
            j += 1
        try:
            k = sock.recvmsg_into(views[i:j])[0] if not tls else sock.recv_into(views[i])
        except TimeoutError:
            _poll_timeout(stop, deadline, f"{got} data bytes")
            continue
        if k == 0:
            raise FrameError(f"connection closed mid-frame (after {got} data bytes)")
        got += k
        i = _advance(views, i, k)


def _recv_exact(sock: socket.socket, view: memoryview, stop=None, deadline: float | None = None,
                at_boundary: bool = False) -> bool:
    """Fill `view` from `sock`. Returns False on a clean EOF before the first byte when `at_boundary`.

    A socket timeout re-polls while `stop()` is false and `deadline` (monotonic) is not passed
    (a frame boundary waits for `stop` only); with neither, the first timeout raises.
    """
    got, n = 0, view.nbytes
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got)
        except TimeoutError:
            _poll_timeout(stop, None if at_boundary and got == 0 and stop is not None else deadline,
                          f"{got} of {n} bytes")
            continue
        if k == 0:
            if at_boundary and got == 0:
                return False
            raise FrameError(f"connection closed mid-frame ({got} of {n} bytes)")
        got += k
    return True


def _header_arrays(header: dict, total: int, max_bytes: int) -> list[tuple[np.dtype, tuple]]:
    """The (dtype, shape) pairs a plain frame announces, checked before anything is allocated."""
    metas = header.get("arrays")
    if not isinstance(metas, list):
        raise PeerError("frame header has no 'arrays' list")
    out, want = [], 0
    for meta in metas:
        if not (isinstance(meta, list) and len(meta) == 2 and isinstance(meta[0], str)
                and isinstance(meta[1], list) and len(meta[1]) <= MAX_DIMS
                and all(type(n) is int and n >= 0 for n in meta[1])):
            raise PeerError(f"bad array entry {str(meta)[:80]!r} in a frame header")
        try:
            dt = dtype_of(meta[0])
        except (TypeError, FrameError):
            raise PeerError(f"unknown dtype {meta[0][:40]!r}") from None
        if dt.hasobject or dt.fields is not None or dt.itemsize == 0:
            raise PeerError(f"refusing dtype {meta[0][:40]!r}")
        n = dt.itemsize
        for d in meta[1]:
            n *= d
        want += n
        if want > max_bytes:
            raise PeerError(f"frame arrays need more than {max_bytes} bytes")
        out.append((dt, tuple(meta[1])))
    if want != total:
        raise PeerError(f"frame announces {total} data bytes, its arrays hold {want}")
    return out


def read_frame(sock: socket.socket, stop=None, io_timeout: float = 60.0, destinations=None,
               max_bytes: int = MAX_FRAME_BYTES) -> Frame | None:
    """One frame from `sock`; None on a clean EOF between frames.

    `destinations(header, nbytes)` (nbytes: the data bytes the frame announces) may return
    writable memoryviews to read the frame's data into, in order (they must hold exactly
    its data bytes; it may raise `PeerError`, best before allocating anything); None (or no
    callable) reads the header's "arrays" into fresh 64-byte-aligned arrays, at most
    `max_bytes` of them. A frame that breaks the protocol raises `PeerError`.
    """
    fixed = bytearray(FRAME.size)
    if not _recv_exact(sock, memoryview(fixed), stop, None, at_boundary=True):
        return None
    deadline = time.monotonic() + io_timeout       # the rest of a started frame must come in time
    magic, head_len, total = FRAME.unpack(fixed)
    if magic != FRAME_MAGIC or head_len > MAX_HEADER:
        raise PeerError(f"bad frame header {bytes(fixed)!r}")
    head = bytearray(head_len)
    _recv_exact(sock, memoryview(head), stop, deadline)
    try:
        header = json.loads(head)
    except ValueError:
        raise PeerError("frame header is not JSON") from None
    key = header.get("key") if isinstance(header, dict) else None
    if not (isinstance(key, list) and len(key) <= 16 and all(type(k) in (int, str) for k in key)):
        raise PeerError("frame header is not an object with a 'key' list of ints and strings")
    views = destinations(header, total) if destinations is not None else None
    arrays = None
    if views is None:
        arrays = [aligned_empty(shape, dt) for dt, shape in _header_arrays(header, total, max_bytes)]
        views = [memoryview(a.reshape(-1).view(np.uint8)) for a in arrays]
    want = sum(v.nbytes for v in views)
    if want != total:
        raise PeerError(f"frame announces {total} data bytes, its destinations hold {want}")
    _recv_views(sock, views, stop, deadline)
    return Frame(tuple(key), arrays, header)


def _mac(key: bytes, label: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(key, label + a + b, hashlib.sha256).digest()


def client_handshake(sock: socket.socket, key: bytes, timeout: float = HANDSHAKE_S) -> None:
    """The connector's half of the handshake (module docstring), within `timeout` seconds.

    Raises:
      HandshakeRefused: the listener's proof is wrong (it does not hold `key`) or it refused ours.
      FrameError / OSError: the connection broke or stalled (worth a retry).
    """
    deadline = time.monotonic() + timeout
    nonce_c = secrets.token_bytes(NONCE)
    sock.sendall(HELLO.pack(HELLO_MAGIC, nonce_c))
    got = bytearray(CHALLENGE.size)
    _recv_exact(sock, memoryview(got), deadline=deadline)
    magic, nonce_s, proof = CHALLENGE.unpack(got)
    if magic != CHALLENGE_MAGIC or not hmac.compare_digest(proof, _mac(key, b"server", nonce_c, nonce_s)):
        raise HandshakeRefused("the peer's transport could not prove it holds this run's key")
    sock.sendall(_mac(key, b"client", nonce_s, nonce_c))
    ack = bytearray(1)
    if not _recv_exact(sock, memoryview(ack), deadline=deadline, at_boundary=True) or ack != ACK:
        raise HandshakeRefused("the peer's transport refused this connection (wrong run key?)")


class ServerHandshake:
    """The listener's half of one connection's handshake on a non-blocking socket, driven
    by a selector: call `step()` whenever the socket is readable.

    Only fixed-size messages are read (HELLO, then PROOF), so a connector can make the
    listener hold at most HELLO.size + PROOF bytes; `deadline` (monotonic) is the caller's
    to enforce (close the socket once it passes). On an `ssl.SSLSocket` (wrapped with
    `do_handshake_on_connect=False`) the TLS handshake comes first, driven the same way; a
    connector that does not complete it (plaintext, no certificate, one the CA did not sign)
    is refused with OpenSSL's reason.
    """

    def __init__(self, sock: socket.socket, key: bytes, deadline: float):
        self.sock, self.key, self.deadline = sock, key, deadline
        self.buf, self.got = bytearray(HELLO.size), 0
        self.nonce_c = self.nonce_s = None
        self.tls_pending = isinstance(sock, ssl.SSLSocket)

    def step(self) -> bool:
        """Read what has arrived; True once the connector is authenticated (ACK sent).

        Raises:
          PeerError: the connector broke the protocol or its proof is wrong.
          OSError: the connection broke.
        """
        if self.tls_pending:
            try:
                self.sock.do_handshake()
            except _WOULD_BLOCK:
                return False
            except ssl.SSLError as e:
                raise PeerError(f"TLS handshake failed: {e.reason or e}") from None
            self.tls_pending = False
        while True:
            while self.got < len(self.buf):
                try:
                    k = self.sock.recv_into(memoryview(self.buf)[self.got:])
                except _WOULD_BLOCK:
                    return False
                if k == 0:
                    raise PeerError(f"closed during the handshake after {self.got} bytes")
                self.got += k
            if self.nonce_s is None:
                magic, self.nonce_c = HELLO.unpack(self.buf)
                if magic != HELLO_MAGIC:
                    raise PeerError(f"not a meshpipe handshake: {bytes(self.buf[:8])!r}")
                self.nonce_s = secrets.token_bytes(NONCE)
                self._send(CHALLENGE.pack(CHALLENGE_MAGIC, self.nonce_s,
                                          _mac(self.key, b"server", self.nonce_c, self.nonce_s)))
                self.buf, self.got = bytearray(PROOF), 0
                continue
            if not hmac.compare_digest(bytes(self.buf), _mac(self.key, b"client", self.nonce_s, self.nonce_c)):
                raise PeerError("wrong handshake proof (not this run's key, or a replay)")
            self._send(ACK)
            return True

    def _send(self, data: bytes) -> None:
        try:
            n = self.sock.send(data)     # a few bytes into a fresh socket's buffer: never partial
        except _WOULD_BLOCK:
            n = 0
        if n != len(data):
            raise PeerError("the connector does not read its handshake")


def send_grant(sock: socket.socket, message: dict, fds: list[int]) -> None:
    """A grant: fixed header + JSON, the fds riding on its first byte."""
    if len(fds) > MAX_FDS:
        raise ValueError(f"a grant carries at most {MAX_FDS} file descriptors, not {len(fds)}")
    body = json.dumps(message, separators=(",", ":")).encode()
    data = GRANT.pack(GRANT_MAGIC, len(body)) + body
    sent = socket.send_fds(sock, [data], fds) if fds else sock.send(data)
    if sent < len(data):
        sock.sendall(data[sent:])


def read_grant(sock: socket.socket, timeout: float) -> tuple[dict, list[int]]:
    """(message, received fds) of the next grant on `sock`, within `timeout` seconds in all
    (the socket's own timeout bounds each read); at most MAX_GRANT bytes of JSON."""
    deadline = time.monotonic() + timeout
    first, fds, _, _ = socket.recv_fds(sock, GRANT.size, MAX_FDS)
    try:
        if not first:
            raise FrameError("connection closed while waiting for a grant")
        fixed = bytearray(GRANT.size)
        fixed[:len(first)] = first
        if len(first) < GRANT.size:
            _recv_exact(sock, memoryview(fixed)[len(first):], deadline=deadline)
        magic, n = GRANT.unpack(fixed)
        if magic != GRANT_MAGIC or n > MAX_GRANT:
            raise PeerError(f"bad grant header {bytes(fixed)!r}")
        body = bytearray(n)
        _recv_exact(sock, memoryview(body), deadline=deadline)
        try:
            message = json.loads(body)
        except ValueError:
            raise PeerError("grant is not JSON") from None
        if not isinstance(message, dict):
            raise PeerError("grant is not a JSON object")
        return message, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
