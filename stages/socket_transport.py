"""Tiles over persistent sockets between stage actors (cluster `transport: socket`, the default).

Same plan, mailbox keys and counters as `RayTransport` (both are `TiledTransport`s);
only the hop differs. Every actor listens on TCP and, on Linux, on an abstract Unix
socket; its address is (ip, port, machine, unix name), `machine` being the kernel's
boot id. A sender reaches a peer on the same machine over the Unix socket, any other
over TCP; both connections start with the run-token handshake (`stages.frames`).

Moving one tensor from this host to destination host d (one payload per pair):
  shared memory  (same machine, at least SHM_MIN_BYTES for d): the sender asks d for
                 a grant; d's reader thread allocates d's destination blocks in shared
                 memory (`BufferPool` of memfd blocks, recycled) and answers with each
                 block's id and, for blocks this connection has not seen, its file
                 descriptor; the sender maps them once and writes every tile straight
                 into its place in d's shards (one copy, source shard -> destination
                 shard), then sends "done". d refuses the grant when its pool is full,
                 and the sender falls back to:
  stream         a tensor frame carrying the tiles as one byte stream laid out by
                 `orchestrator.core.reshard.stream`: destination blocks one after another,
                 each in its own C order; d's reader thread reads it straight into place
                 (one `recv_into` per block the sender supplies whole). The sender
                 gathers it from its shards (`sendmsg`) or stages a block whose pieces
                 are short with one numpy copy.
Either way d allocates each distinct destination block once, 64-byte aligned (CPU
`device_put` adopts it without a copy; replicas share it), and when every sending host
of the key is done, the shards go into the mailbox under `(*key, ASSEMBLED)`.

Every blocking socket operation has a timeout: connects, handshakes and grants
`io_timeout`, sends `io_timeout` per blocked write; reader threads poll their stop flag
between frames and give up mid-frame after `io_timeout`.
"""
from __future__ import annotations

import mmap
import os
import secrets
import select
import socket
import threading
import weakref

import numpy as np

from orchestrator.core.reshard.stream import blocks_on, stream_layout
from stages.bufpool import BufferPool, as_array, shm_block, shm_supported
from stages.frames import (
    Frame,
    FrameError,
    client_handshake,
    dtype_of,
    dtype_tag,
    frame_header,
    read_frame,
    read_grant,
    send_buffers,
    send_grant,
    server_handshake,
)
from stages.transport import Edge, TiledTransport

POLL_S = 0.5                # reader/acceptor wake-up interval to notice shutdown
STAGE_BELOW = 32 << 10      # a stream block whose pieces average fewer bytes is staged by one copy
SHM_MIN_BYTES = 1 << 20     # smaller payloads go as streams (a grant costs a round trip)
SHM_POOL_BYTES = 4 << 30    # shared-memory destination blocks a receiver keeps
ASSEMBLED = "assembled"     # last mailbox key element of a fully placed tensor
COPY_THREADS = 4            # at most this many threads write one payload into shared memory


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
    """Accepts token-checked connections (TCP, and Unix when `unix` names an abstract socket);
    one daemon reader thread per connection reads frames (into `destinations(header)` when
    that gives views, see `stages.frames.read_frame`) and calls `on_frame(frame, conn)`."""

    def __init__(self, host: str, token: bytes, on_frame, on_error, io_timeout: float, name: str = "",
                 destinations=None, unix: str | None = None):
        self.token, self.on_frame, self.on_error, self.io_timeout = token, on_frame, on_error, io_timeout
        self.destinations = destinations
        self.name = name
        self.closed = False
        self.refused = 0
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self.socks = [socket.create_server((host, 0), backlog=64)]
        self.address = (host, self.socks[0].getsockname()[1])
        if unix is not None:
            u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            u.bind("\0" + unix)
            u.listen(64)
            self.socks.append(u)
        self._threads = []
        for sock in self.socks:
            sock.settimeout(POLL_S)
            self._threads.append(threading.Thread(target=self._accept, args=(sock,), daemon=True,
                                                  name=f"{name} accept"))
            self._threads[-1].start()

    def _accept(self, sock: socket.socket) -> None:
        while not self.closed:
            try:
                conn, _ = sock.accept()
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
            if conn.family != socket.AF_UNIX:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(POLL_S)
            stop = lambda: self.closed
            while not self.closed:
                frame = read_frame(conn, stop, self.io_timeout, self.destinations)
                if frame is None:
                    return
                self.on_frame(frame, conn)
        except Exception as e:  # noqa: BLE001 - a reader must not die silently
            if not self.closed:
                self.on_error(f"{type(e).__name__}: {e}")
        finally:
            conn.close()

    def close(self) -> None:
        with self._lock:
            self.closed = True
            conns = list(self._conns)
        for sock in self.socks + conns:      # shutdown wakes a thread blocked in accept / recv at once
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=2 * POLL_S)


class _Shape:
    """What every arrival of one plan on one host shares (computed once per plan)."""

    def __init__(self, plan, me: int):
        self.plan = plan
        self.blocks = blocks_on(plan, me)
        self.firsts = sorted(set(self.blocks.values()))
        self.senders = frozenset(s for s, per_dst in plan.sends.items() if per_dst.get(me))


class _Arrival:
    """One tensor arriving on this host: its destination blocks and the source hosts still to come."""

    def __init__(self, shape: _Shape, pool: BufferPool, shm: BufferPool | None = None):
        plan, blocks, firsts = shape.plan, shape.blocks, shape.firsts
        taken = [shm.take_block(plan.dst_shard_shape, plan.dtype) for _ in firsts] if shm else []
        if taken and all(taken):
            self.buffers = {b: a for b, (a, _) in zip(firsts, taken)}
            self.shm_ids = {b: blk.id for b, (_, blk) in zip(firsts, taken)}
        else:
            self.buffers = {b: pool.take(plan.dst_shard_shape, plan.dtype) for b in firsts}
            self.shm_ids = None
        self.shards = {d: self.buffers[b] for d, b in blocks.items()}   # replicas share a buffer
        self.views = {b: memoryview(a.reshape(-1).view(np.uint8)) for b, a in self.buffers.items()}
        self.waiting = set(shape.senders)


# -- sending -------------------------------------------------------------------------
class _Conn:
    """One outgoing connection (TCP, or Unix to a same-machine peer); `maps` caches the
    peer's shared-memory blocks this connection was granted (block id -> mmap)."""

    def __init__(self, address: tuple, token: bytes, io_timeout: float, unix: str | None = None):
        self.address = tuple(address)
        self.lock = threading.Lock()
        self.maps: dict[int, mmap.mmap] = {}
        if unix is None:
            sock = socket.create_connection(self.address[:2], timeout=io_timeout)
        else:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if unix is None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            else:
                sock.settimeout(io_timeout)
                sock.connect("\0" + unix)
            client_handshake(sock, token)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.unix = unix is not None

    def send(self, buffers) -> None:
        with self.lock:
            send_buffers(self.sock, buffers)

    def grant(self, request: bytes) -> dict:
        """Send a grant request and read the answer; maps newly granted blocks. Call with `lock` held."""
        send_buffers(self.sock, [request])
        message, fds = read_grant(self.sock)
        try:
            sizes = {int(b): int(n) for b, n in message.get("new", [])}
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


class SocketTransport(TiledTransport):
    """Tiles over persistent, token-authenticated sockets (see the module docstring).

    Args: as `RayTransport`, plus `token` (the run's secret, from the driver), `stage`
    and `geoms` (this stage's index and every stage's `StageGeom`: receivers look up
    the plan of an incoming tensor by its sending stage), `host` (the IP to listen on:
    the node IP; None asks Ray), `io_timeout` (seconds a connect, handshake, grant,
    blocked write or started frame may take), `shared_memory` (False: streams only),
    `shm_min_bytes` and `shm_pool_bytes` (see SHM_MIN_BYTES, SHM_POOL_BYTES).
    After construction `address` is (ip, port, machine, unix name); `connect(addresses)`
    takes every stage's hosts' addresses ([stage][host]) before the first send.
    """

    def __init__(self, *, me, geom, mesh, inbox, peers, token: bytes, stage: int = 0, geoms=(),
                 host: str | None = None, io_timeout: float = 60.0, shared_memory: bool = True,
                 shm_min_bytes: int = SHM_MIN_BYTES, shm_pool_bytes: int = SHM_POOL_BYTES):
        if not token:
            raise ValueError("SocketTransport needs the run token")
        super().__init__(me=me, geom=geom, mesh=mesh, inbox=inbox, peers=peers)
        if host is None:
            import ray

            host = ray.util.get_node_ip_address()
        self.stage, self.geoms = stage, tuple(geoms)
        self.token, self.io_timeout = bytes(token), io_timeout
        self.machine = machine_id() if shared_memory else None
        self.pool = BufferPool()      # stream destination blocks and staged send blocks, recycled
        self.shm = BufferPool(shm_pool_bytes, shm_block) if self.machine else None
        self.shm_min_bytes = shm_min_bytes
        self._copy_threads = min(COPY_THREADS, len(os.sched_getaffinity(0)))
        self._copier = None           # thread pool for shared-memory writes, made on first use
        self.shm_sends = self.stream_sends = 0
        self._arrivals: dict[tuple, _Arrival] = {}
        self._arrivals_lock = threading.Lock()
        self._granted = weakref.WeakKeyDictionary()   # accepted connection -> shm block ids it holds
        self._layouts: dict = {}
        self._shapes: dict = {}
        self._incoming: dict = {}     # (stage, axes, shape, dtype) of a tensor frame -> plan
        self._error: str | None = None
        self._addresses: list[list[tuple]] = []
        self._conns: dict[tuple, _Conn] = {}
        self._conns_lock = threading.Lock()
        unix = f"meshpipe-{secrets.token_hex(8)}" if self.machine else None
        self.listener = Listener(host, self.token, self._on_frame, self._on_error, io_timeout,
                                 name=f"transport host {me}", destinations=self._destinations, unix=unix)
        self.address = (*self.listener.address, self.machine, unix)

    # -- receiving (reader threads) ---------------------------------------------------
    def _incoming_plan(self, tensor: dict):
        memo = (tensor["stage"], tuple(tensor["axes"]), tuple(tensor["shape"]), tensor["dtype"])
        plan = self._incoming.get(memo)
        if plan is None:
            stage = tensor["stage"]
            if not isinstance(stage, int) or not 0 <= stage < len(self.geoms):
                raise FrameError(f"tensor frame from unknown stage {stage!r}")
            edge = Edge(stage, self.geoms[stage], memo[1])
            plan = self._incoming[memo] = self._plan(edge, False, memo[2], dtype_of(memo[3]))
        return plan

    def _layout(self, plan, src: int, dst: int):
        """`stream_layout` and its receive runs as a list, memoised per plan (plans are memoised,
        so their ids are stable; the memo keeps each plan alive)."""
        memo = (id(plan), src, dst)
        got = self._layouts.get(memo)
        if got is None:
            layout = stream_layout(plan, src, dst)
            got = self._layouts[memo] = (plan, layout, layout.recv.tolist())
        return got[1], got[2]

    def _bytes_to(self, plan, dst_host: int) -> int:
        """Bytes `dst_host` receives of one tensor (all senders), memoised per plan."""
        memo = (id(plan), "bytes", dst_host)
        got = self._layouts.get(memo)
        if got is None:
            got = self._layouts[memo] = (plan, sum(t.nbytes for t in plan.recvs[dst_host]))
        return got[1]

    def _shape(self, plan) -> _Shape:
        got = self._shapes.get(id(plan))
        if got is None:
            got = self._shapes[id(plan)] = _Shape(plan, self.me)
        return got

    def _arrival(self, key: tuple, plan, shm: bool) -> tuple[tuple, int, _Arrival]:
        base, src = key[:-1], key[-1]
        if src not in plan.sends:
            raise FrameError(f"{key}: host {src} is not a source host of this edge")
        with self._arrivals_lock:
            arrival = self._arrivals.get(base)
            if arrival is None:
                arrival = self._arrivals[base] = _Arrival(self._shape(plan), self.pool, self.shm if shm else None)
        return base, src, arrival

    def _destinations(self, header: dict):
        """A tensor frame's stream lands in its places in the destination blocks."""
        if header.get("shm"):              # grant requests and "done" notes carry no data
            return []
        tensor = header.get("tensor")
        if tensor is None:
            return None
        plan = self._incoming_plan(tensor)
        _, src, arrival = self._arrival(tuple(header["key"]), plan, shm=False)
        views = arrival.views
        return [views[b][off:off + n] for b, off, n in self._layout(plan, src, self.me)[1]]

    def _on_frame(self, frame: Frame, conn: socket.socket) -> None:
        shm = frame.header.get("shm")
        if shm == "request":
            self._grant(frame, conn)
        elif shm == "done" or "tensor" in frame.header:
            self._landed(frame.key[:-1], frame.key[-1])
        else:
            self.inbox.put(frame.key, frame.arrays)

    def _grant(self, frame: Frame, conn: socket.socket) -> None:
        """Answer a same-machine sender: this tensor's shared-memory blocks (fds for new ones)."""
        plan = self._incoming_plan(frame.header["tensor"])
        _, _, arrival = self._arrival(frame.key, plan, shm=True)
        if arrival.shm_ids is None or conn.family != socket.AF_UNIX:
            send_grant(conn, {"blocks": None}, [])
            return
        seen = self._granted.setdefault(conn, set())
        new = [i for i in arrival.shm_ids.values() if i not in seen]
        blocks = [self.shm.blocks[i] for i in new]
        send_grant(conn, {"blocks": [[b, i] for b, i in arrival.shm_ids.items()],
                          "new": [[blk.id, blk.nbytes] for blk in blocks]}, [blk.fd for blk in blocks])
        seen.update(new)

    def _landed(self, base: tuple, src: int) -> None:
        with self._arrivals_lock:
            arrival = self._arrivals[base]
            arrival.waiting.discard(src)
            done = not arrival.waiting and self._arrivals.pop(base, None) is not None
        if done:
            self.inbox.put((*base, ASSEMBLED), arrival.shards)

    def _local_shards(self, key, shape, dtype, edge, timeout) -> dict:
        """The shards the reader threads placed (see `TiledTransport.recv` / `recv_operand`)."""
        plan = self._plan(edge, False, shape, dtype)
        if self._shape(plan).senders:
            return self.inbox.take((*key, ASSEMBLED), timeout)
        return _Arrival(self._shape(plan), self.pool).shards      # nothing to move (an empty tensor)

    def _on_error(self, reason: str) -> None:
        self._error = self._error or reason
        self.inbox.close(f"socket transport: {reason}")   # a waiting recv fails now, not at its deadline

    # -- sending -------------------------------------------------------------------------
    def connect(self, addresses) -> None:
        self._addresses = [[tuple(a) for a in row] for row in addresses]

    def _unix_name(self, address: tuple) -> str | None:
        """The peer's Unix socket when it runs on this machine (and shares memory), else None."""
        if self.machine and len(address) == 4 and address[2] == self.machine and address[3]:
            return address[3]
        return None

    def _conn(self, address: tuple) -> _Conn:
        conn = self._conns.get(address)
        if conn is None:
            with self._conns_lock:
                conn = self._conns.get(address)
                if conn is None:
                    conn = self._conns[address] = self._connect(address)
        return conn

    def _connect(self, address: tuple) -> _Conn:
        unix = self._unix_name(address)
        if unix is not None:
            try:
                return _Conn(address, self.token, self.io_timeout, unix)
            except (FileNotFoundError, ConnectionRefusedError):
                pass    # same machine id but another network namespace (containers): use TCP
        return _Conn(address, self.token, self.io_timeout)

    def _push(self, key, edge, dst_host, plan, shards):
        if not self._addresses:
            raise RuntimeError("SocketTransport.send before connect(addresses)")
        address = self._addresses[edge.stage][edge.geom.hosts.index(dst_host)]
        header = {"key": [*key, self.me], "arrays": [],
                  "tensor": {"stage": self.stage, "axes": list(edge.axes), "shape": list(plan.shape),
                             "dtype": dtype_tag(plan.dtype)}}
        try:
            conn = self._conn(address)
            with conn.lock:
                if conn.unix and self._bytes_to(plan, dst_host) >= self.shm_min_bytes:
                    if self._write_shared(conn, header, plan, dst_host, shards):
                        self.shm_sends += 1
                        return
                stream = self._stream(self._layout(plan, self.me, dst_host)[0], plan, shards, self.pool)
                send_buffers(conn.sock, [frame_header(header, sum(v.nbytes for v in stream)), *stream])
                self.stream_sends += 1
        except OSError as e:
            self._drop(address)
            raise ConnectionError(f"sending {key} to host {dst_host} at {address[0]}:{address[1]}: {e}") from e

    def _write_shared(self, conn: _Conn, header: dict, plan, dst_host: int, shards) -> bool:
        """Ask for the destination's shared-memory blocks and write the tiles into them; False if refused."""
        grant = conn.grant(frame_header({**header, "shm": "request"}, 0))
        if grant.get("blocks") is None:
            return False
        blocks = blocks_on(plan, dst_host)
        where = {int(b): int(i) for b, i in grant["blocks"]}
        shape, dtype = plan.dst_shard_shape, plan.dtype
        copies = [(as_array(conn.maps[where[blocks[t.targets[0][0]]]], shape, dtype)[t.targets[0][1]],
                   shards[t.src_device][t.src_slice]) for t in plan.sends[self.me][dst_host]]
        self._copy(copies)
        send_buffers(conn.sock, [frame_header({"key": header["key"], "arrays": [], "shm": "done"}, 0)])
        return True

    def _copy(self, copies: list) -> None:
        """dst[...] = src for every pair, split over this process's cores (numpy releases the GIL)."""
        parts = [(d, s) if d.ndim == 0 else (d[i:j], s[i:j]) for d, s in copies
                 for i, j in _row_chunks(d.shape[0] if d.ndim else 1, self._copy_threads)]
        if self._copy_threads < 2 or len(parts) < 2:
            for d, s in parts:
                d[...] = s
            return
        if self._copier is None:
            from concurrent.futures import ThreadPoolExecutor

            self._copier = ThreadPoolExecutor(self._copy_threads, thread_name_prefix="transport copy")
        list(self._copier.map(lambda pair: pair[0].__setitem__(Ellipsis, pair[1]), parts, timeout=self.io_timeout))

    @staticmethod
    def _stream(layout, plan, shards, pool) -> list:
        """The stream's buffers: views into the source shards, or a staged block where pieces are short."""
        mvs = {d: memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8)) for d, a in shards.items()}
        out = []
        for seg in layout.segments:
            runs_ = layout.send[seg.send[0]:seg.send[1]]
            if seg.whole and len(runs_) > 1 and runs_[:, 2].mean() < STAGE_BELOW:
                block = pool.take(plan.dst_shard_shape, plan.dtype)   # free again once sent
                for t in seg.tiles:
                    block[t.targets[0][1]] = shards[t.src_device][t.src_slice]
                out.append(memoryview(block.reshape(-1).view(np.uint8)))
            else:
                out.extend(mvs[d][off:off + n] for d, off, n in runs_.tolist())
        return out

    def _drop(self, address) -> None:
        with self._conns_lock:
            conn = self._conns.pop(address, None)
        if conn is not None:
            conn.close()

    def flush(self, timeout):
        """Nothing is in flight after a send returns; surfaces a broken connection or a failed reader."""
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
        if self.shm is not None:
            self.shm.close()
        if self._copier is not None:
            self._copier.shutdown(wait=True, cancel_futures=True)


def _row_chunks(rows: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) ranges splitting `rows` leading rows into at most `parts` non-empty chunks.

    Example:
        >>> _row_chunks(5, 2), _row_chunks(1, 4), _row_chunks(0, 2)
        ([(0, 2), (2, 5)], [(0, 1)], [(0, 0)])
    """
    parts = max(1, min(parts, rows))
    edges = [rows * k // parts for k in range(parts + 1)]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a] or [(0, 0)]
