"""Authenticated sockets between stage actors: the listening and the connecting side of
`stages.socket_transport` (which holds the tensor protocol over them).

Every actor listens on TCP and, on Linux, on an abstract Unix socket (`Listener`); its
address is (ip, port, machine, unix name), `machine` being the kernel's boot id
(`machine_id`). A sender (`_Conn`) reaches a peer on the same machine over the Unix socket,
any other over TCP; both connections start with the mutual challenge-response handshake over
the run key (`stages.frames`). With a TLS context every TCP connection is TLS with mutual
certificate checks, the HMAC handshake inside it; Unix connections are not wrapped.

Before authentication a connection costs no thread: one selector thread per listener accepts
and drives every pending handshake, at most MAX_PENDING at once (a new one evicts the oldest),
each for at most HANDSHAKE_S; at most MAX_PEERS authenticated connections are served, each by
one daemon reader thread that hands frames to its owner. A peer that breaks the protocol after
authenticating (`PeerError`) loses its connection, not the run.

Every blocking socket operation has a timeout: handshakes HANDSHAKE_S, connects and grants
`io_timeout`, sends `io_timeout` per blocked write; reader threads poll their stop flag every
POLL_S between frames and give up mid-frame after `io_timeout`.
"""
from __future__ import annotations

import logging
import mmap
import os
import select
import selectors
import socket
import ssl
import threading
import time

from stages.bufpool import shm_supported
from stages.frames import (
    HANDSHAKE_S,
    FrameError,
    PeerError,
    ServerHandshake,
    client_handshake,
    read_frame,
    read_grant,
    send_buffers,
)

POLL_S = 0.5                # reader/acceptor wake-up interval to notice shutdown
MAX_PENDING = 64            # unauthenticated connections a listener holds at once (a new one evicts the oldest)
MAX_PEERS = 256             # authenticated connections a listener serves

log = logging.getLogger(__name__)



def machine_id() -> str | None:
    """This machine's identity for same-machine shared memory (None: never share memory)."""
    if not shm_supported():
        return None
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{socket.gethostname()}/{f.read().strip()}"
    except OSError:
        return None


# -- receiving ---------------------------------------------------------------------
class Listener:
    """Accepts authenticated connections (TCP, and Unix when `unix` names an abstract socket)
    and gives each authenticated peer one daemon reader thread, which reads frames (into
    `destinations(header)` when that gives views, see `stages.frames.read_frame`) and calls
    `on_frame(frame, conn)`; `destinations` is called as `destinations(header, nbytes, conn)`.

    Before authentication a connection costs no thread: one selector thread accepts and
    drives every pending handshake (`ServerHandshake`), at most `max_pending` at once (a new
    one evicts the oldest), each for at most `handshake_s` seconds; at most `max_peers`
    authenticated connections are served. A peer that breaks the protocol after
    authenticating (`PeerError`) loses its connection, with the reason logged and counted in
    `rejected`, and `on_reject(conn)` is called; any other reader failure goes to `on_error(reason)`. `refused` counts
    connections dropped before authentication. With `tls` (a server `ssl.SSLContext`) every
    TCP connection must complete a TLS handshake first, within the same deadline; Unix
    connections are not wrapped.
    """

    def __init__(self, host: str, token: bytes, on_frame, on_error, io_timeout: float, name: str = "",
                 destinations=None, unix: str | None = None, max_pending: int = MAX_PENDING,
                 max_peers: int = MAX_PEERS, handshake_s: float = HANDSHAKE_S, tls: ssl.SSLContext | None = None,
                 on_reject=None):
        self.token, self.on_frame, self.on_error, self.io_timeout = token, on_frame, on_error, io_timeout
        self.on_reject = on_reject
        self.tls = tls
        self.destinations = destinations
        self.name = name
        self.max_pending, self.max_peers, self.handshake_s = max_pending, max_peers, handshake_s
        self.closed = False
        self.refused = self.rejected = 0
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._pending: dict[socket.socket, ServerHandshake] = {}    # insertion order = age
        self._lock = threading.Lock()
        self.socks = [socket.create_server((host, 0), backlog=128)]
        self.address = (host, self.socks[0].getsockname()[1])
        if unix is not None:
            u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            u.bind("\0" + unix)
            u.listen(128)
            self.socks.append(u)
        self._selector = selectors.DefaultSelector()
        for sock in self.socks:
            sock.setblocking(False)
            self._selector.register(sock, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"{name} accept")
        self._thread.start()

    def _drop_pending(self, conn: socket.socket, reason: str) -> None:
        self._pending.pop(conn, None)
        try:
            self._selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()
        self.refused += 1
        if self.refused <= 5 or self.refused % 1000 == 0:
            log.warning("%s: dropped an unauthenticated connection (%s; %d so far)", self.name, reason, self.refused)

    def _loop(self) -> None:
        while not self.closed:
            try:
                wait = POLL_S
                if self._pending:
                    wait = max(0.0, min(wait, next(iter(self._pending.values())).deadline - time.monotonic()))
                events = self._selector.select(wait)
            except OSError:
                return
            for sel_key, _ in events:
                if sel_key.data is None:
                    self._accept(sel_key.fileobj)
                else:
                    self._step(sel_key.fileobj, sel_key.data)
            now = time.monotonic()
            for conn in [c for c, h in self._pending.items() if h.deadline <= now]:
                self._drop_pending(conn, f"handshake not completed within {self.handshake_s:g} s")
        for conn in list(self._pending):
            conn.close()
        self._pending.clear()

    def _accept(self, sock: socket.socket) -> None:
        for _ in range(64):            # then let the pending handshakes and deadlines have a turn
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:       # out of file descriptors: shed the oldest pending, keep listening
                if self.closed:
                    return
                if self._pending:
                    self._drop_pending(next(iter(self._pending)), f"accept failed: {e}")
                else:
                    log.warning("%s: accept failed: %s", self.name, e)
                    time.sleep(POLL_S / 10)
                return
            if self.closed:
                conn.close()
                return
            if len(self._pending) >= self.max_pending:
                self._drop_pending(next(iter(self._pending)), f"more than {self.max_pending} handshakes pending")
            conn.setblocking(False)
            if self.tls is not None and conn.family != socket.AF_UNIX:
                try:
                    conn = self.tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
                except OSError as e:   # (reset before we got to it): this listener goes on
                    conn.close()
                    self.refused += 1
                    if self.refused <= 5 or self.refused % 1000 == 0:
                        log.warning("%s: dropped an unauthenticated connection (TLS: %s)", self.name, e)
                    continue
            shake = ServerHandshake(conn, self.token, time.monotonic() + self.handshake_s)
            self._pending[conn] = shake
            self._selector.register(conn, selectors.EVENT_READ, shake)

    def _step(self, conn: socket.socket, shake: ServerHandshake) -> None:
        try:
            if not shake.step():
                return
        except (OSError, FrameError) as e:
            self._drop_pending(conn, str(e))
            return
        self._pending.pop(conn, None)
        self._selector.unregister(conn)
        with self._lock:
            self._conns = {c: t for c, t in self._conns.items() if t.is_alive()}
            if self.closed or len(self._conns) >= self.max_peers:
                conn.close()
                self.refused += 1
                log.warning("%s: refused an authenticated connection: %d peers already served",
                            self.name, len(self._conns))
                return
            conn.settimeout(POLL_S)
            if conn.family != socket.AF_UNIX:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t = self._conns[conn] = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                                     name=f"{self.name} reader")
        t.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            stop = lambda: self.closed
            dest = None if self.destinations is None else (lambda header, n: self.destinations(header, n, conn))
            while not self.closed:
                frame = read_frame(conn, stop, self.io_timeout, dest)
                if frame is None:
                    return
                self.on_frame(frame, conn)
        except PeerError as e:
            if not self.closed:
                self.rejected += 1
                log.warning("%s: closed a peer's connection: %s", self.name, e)
                if self.on_reject is not None:
                    self.on_reject(conn)
        except Exception as e:  # noqa: BLE001 - a reader must not die silently
            if not self.closed:
                self.on_error(f"{type(e).__name__}: {e}")
        finally:
            conn.close()

    def threads(self) -> int:
        """Threads this listener runs now (the selector thread and one reader per live peer)."""
        with self._lock:
            return int(self._thread.is_alive()) + sum(t.is_alive() for t in self._conns.values())

    def close(self) -> None:
        with self._lock:
            self.closed = True
            conns = list(self._conns)
            threads = list(self._conns.values())
        for sock in self.socks + conns:      # shutdown wakes a thread blocked in recv at once
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        for t in [self._thread, *threads]:
            if t is not threading.current_thread():
                t.join(timeout=2 * POLL_S)
        self._selector.close()


# -- sending -------------------------------------------------------------------------
class _Conn:
    """One outgoing connection (TCP — over TLS with a client `tls` context — or Unix to a
    same-machine peer); `maps` caches the peer's shared-memory blocks this connection was
    granted (block id -> mmap)."""

    def __init__(self, address: tuple, token: bytes, io_timeout: float, unix: str | None = None,
                 tls: ssl.SSLContext | None = None):
        self.address = tuple(address)
        self.tls = tls if unix is None else None
        self.lock = threading.Lock()
        self.maps: dict[int, mmap.mmap] = {}
        self.io_timeout = io_timeout
        deadline = time.monotonic() + io_timeout
        while True:   # a listener under a flood may evict a pending handshake: retry until io_timeout
            try:
                self.sock = self._open(token, min(io_timeout, HANDSHAKE_S), unix)
                break
            except (FrameError, ConnectionResetError, BrokenPipeError, TimeoutError, BlockingIOError, ssl.SSLEOFError):
                # (a Unix connect whose backlog is full fails with EAGAIN at once; an evicted TLS handshake ends in EOF)
                if time.monotonic() + 0.1 > deadline:
                    raise
                time.sleep(0.1)
        self.unix = unix is not None

    def _open(self, token: bytes, timeout: float, unix: str | None) -> socket.socket:
        if unix is None:
            sock = socket.create_connection(self.address[:2], timeout=timeout)
        else:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if unix is None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self.tls is not None:     # (a failed certificate check raises ssl.SSLError: no retry)
                    sock = self.tls.wrap_socket(sock)
            else:
                sock.settimeout(timeout)
                sock.connect("\0" + unix)
            client_handshake(sock, token, timeout)
            sock.settimeout(self.io_timeout)
        except BaseException:
            sock.close()
            raise
        return sock

    def retime(self) -> None:
        """Give the socket the current `io_timeout` (`SocketTransport.set_io_timeout` may have moved
        it since the last send). Call with `lock` held."""
        if self.sock.gettimeout() != self.io_timeout:
            self.sock.settimeout(self.io_timeout)

    def send(self, buffers) -> None:
        with self.lock:
            self.retime()
            send_buffers(self.sock, buffers)

    def grant(self, request: bytes) -> dict:
        """Send a grant request and read the answer; maps newly granted blocks. Call with `lock` held."""
        send_buffers(self.sock, [request])
        message, fds = read_grant(self.sock, self.io_timeout)
        try:
            try:
                sizes = {int(b): int(n) for b, n in message.get("new", [])}
            except (TypeError, ValueError):
                raise PeerError("grant lists its new blocks wrongly") from None
            if len(sizes) != len(fds):
                raise FrameError(f"grant announces {len(sizes)} new blocks, carries {len(fds)} descriptors")
            for (block, nbytes), fd in zip(sizes.items(), fds):
                self.maps[block] = mmap.mmap(fd, max(nbytes, 1))
        finally:
            for fd in fds:
                os.close(fd)
        return message

    def broken(self) -> bool:
        """Outside a grant exchange the peer never writes: readable means EOF or an error."""
        readable, _, _ = select.select([self.sock], [], [], 0)
        return bool(readable)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
