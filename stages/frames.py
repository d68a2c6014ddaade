"""The socket transport's wire format (pure: sockets and numpy, no jax, no ray, no pickle).

  handshake:  the connector sends HELLO = struct "!4sH" (b"MPH1", token length) + token;
              the listener answers b"\\x01" or drops the connection (hmac.compare_digest).
  frame:      struct "!4sIQ" (b"MPF1", JSON header length, data length), the JSON
              header {"key": [...], "arrays": [[dtype str, shape], ...], ...}, then the
              data: every array's C-order bytes back to back, or a tensor frame's byte
              stream (header "tensor"; `orchestrator.core.reshard.stream` lays it out).
  grant:      (Unix sockets only, listener -> connector) struct "!4sI" (b"MPG1", JSON
              length) + JSON, with file descriptors attached (SCM_RIGHTS).

Arrays are written straight from their memory (strided ones as a gather list of their
contiguous runs, `sendmsg`) and read straight into their destinations (`recvmsg_into`).
Every read takes a stop flag and a deadline: nothing blocks forever.
"""
from __future__ import annotations

import hmac
import json
import os
import socket
import struct
import time
from typing import NamedTuple

import numpy as np

from orchestrator.core.reshard.tiles import aligned_empty

HELLO = struct.Struct("!4sH")
HELLO_MAGIC = b"MPH1"
FRAME = struct.Struct("!4sIQ")
FRAME_MAGIC = b"MPF1"
GRANT = struct.Struct("!4sI")
GRANT_MAGIC = b"MPG1"
ACK = b"\x01"
MAX_HEADER = 1 << 20
IOV_MAX = 1024          # buffers per sendmsg / recvmsg_into call (Linux's limit)
MIN_RUN = 4096          # strided arrays with shorter contiguous runs are copied before sending
RECV_BATCH = 4 << 20    # bytes of destination views offered to one recvmsg_into call
MAX_FDS = 250           # file descriptors one grant may carry (Linux: SCM_MAX_FD = 253)


class FrameError(ConnectionError):
    """A malformed frame or a broken stream."""


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
    head = json.dumps(header, separators=(",", ":")).encode()
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
    i = 0
    while i < len(views):
        i = _advance(views, i, sock.sendmsg(views[i:i + IOV_MAX]))


def _recv_views(sock: socket.socket, views: list, stop=None, deadline: float | None = None) -> None:
    """Fill every writable memoryview in `views`, in order (scatter reads, RECV_BATCH bytes offered a call)."""
    views = [v for v in views if v.nbytes]
    got, i = 0, 0
    while i < len(views):
        j, offered = i, 0
        while j < len(views) and j - i < IOV_MAX and offered < RECV_BATCH:
            offered += views[j].nbytes
            j += 1
        try:
            k = sock.recvmsg_into(views[i:j])[0]
        except TimeoutError:
            if stop is not None and stop():
                raise FrameError("transport closed") from None
            if deadline is not None and time.monotonic() > deadline:
                raise FrameError(f"stream stalled after {got} bytes within the deadline") from None
            continue
        if k == 0:
            raise FrameError(f"connection closed mid-frame (after {got} data bytes)")
        got += k
        i = _advance(views, i, k)


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


def read_frame(sock: socket.socket, stop=None, io_timeout: float = 60.0, destinations=None) -> Frame | None:
    """One frame from `sock`; None on a clean EOF between frames.

    `destinations(header)` may return writable memoryviews to read the frame's data into,
    in order (they must hold exactly its data bytes); None (or no callable) reads the
    header's "arrays" into fresh 64-byte-aligned arrays.
    """
    fixed = bytearray(FRAME.size)
    if not _recv_exact(sock, memoryview(fixed), stop, None, at_boundary=True):
        return None
    deadline = time.monotonic() + io_timeout       # the rest of a started frame must come in time
    magic, head_len, total = FRAME.unpack(fixed)
    if magic != FRAME_MAGIC or head_len > MAX_HEADER:
        raise FrameError(f"bad frame header {bytes(fixed)!r}")
    head = bytearray(head_len)
    _recv_exact(sock, memoryview(head), stop, deadline)
    header = json.loads(head)
    views = destinations(header) if destinations is not None else None
    arrays = None
    if views is None:
        arrays = []
        for dtype, shape in header["arrays"]:
            dt = dtype_of(dtype)
            if dt.hasobject or dt.fields is not None:
                raise FrameError(f"refusing dtype {dtype}")
            arrays.append(aligned_empty(tuple(int(n) for n in shape), dt))
        views = [memoryview(a.reshape(-1).view(np.uint8)) for a in arrays]
    want = sum(v.nbytes for v in views)
    if want != total:
        raise FrameError(f"frame announces {total} data bytes, its destinations hold {want}")
    _recv_views(sock, views, stop, deadline)
    return Frame(tuple(header["key"]), arrays, header)


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


def send_grant(sock: socket.socket, message: dict, fds: list[int]) -> None:
    """A grant: fixed header + JSON, the fds riding on its first byte."""
    if len(fds) > MAX_FDS:
        raise ValueError(f"a grant carries at most {MAX_FDS} file descriptors, not {len(fds)}")
    body = json.dumps(message, separators=(",", ":")).encode()
    data = GRANT.pack(GRANT_MAGIC, len(body)) + body
    sent = socket.send_fds(sock, [data], fds) if fds else sock.send(data)
    if sent < len(data):
        sock.sendall(data[sent:])


def read_grant(sock: socket.socket) -> tuple[dict, list[int]]:
    """(message, received fds) of the next grant on `sock` (its timeout applies)."""
    first, fds, _, _ = socket.recv_fds(sock, GRANT.size, MAX_FDS)
    if not first:
        raise FrameError("connection closed while waiting for a grant")
    try:
        fixed = bytearray(GRANT.size)
        fixed[:len(first)] = first
        if len(first) < GRANT.size:
            _recv_exact(sock, memoryview(fixed)[len(first):])
        magic, n = GRANT.unpack(fixed)
        if magic != GRANT_MAGIC or n > MAX_HEADER:
            raise FrameError(f"bad grant header {bytes(fixed)!r}")
        body = bytearray(n)
        _recv_exact(sock, memoryview(body))
        return json.loads(body), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise

