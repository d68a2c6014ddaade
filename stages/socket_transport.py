"""Tiles over persistent sockets between stage actors (cluster `transport: socket`, the default).

Same plan, mailbox keys and counters as `RayTransport` (both are `TiledTransport`s);
only the hop differs. Every actor listens on TCP and, on Linux, on an abstract Unix
socket; its address is (ip, port, machine, unix name), `machine` being the kernel's
boot id. A sender reaches a peer on the same machine over the Unix socket, any other
over TCP; both connections start with the mutual challenge-response handshake over the
run key (`stages.frames`). With cluster `transport_tls` every TCP connection is TLS with
mutual certificate checks against the cluster's CA (`orchestrator.core.tls`), the HMAC
handshake inside it; the Unix socket and shared memory never leave the machine and are not
wrapped. Cluster `transport_same_machine: tcp` sends same-machine peers over TCP too (no
Unix socket, no shared memory: `shared_memory=False`). A receiver accepts only tensors it announced (`expect`) and
checks every frame against its own plan; a peer that breaks the protocol loses its
connection (`PeerError`, logged), not the run, and what that connection delivered and was
not yet taken is dropped with it.

The listening and connecting side (`Listener`, `_Conn`, `machine_id`: sockets, handshakes,
TLS, reader threads) is `stages.socket_conn`; this module is the tensor protocol over it.

Memory a peer can make a receiver hold is bounded by bytes: every tensor from the first
frame of it until the worker takes it (partly arrived, or assembled in the mailbox) counts
against `budget`, which is `in_flight` times the bytes of each tensor `expect` announced
(the worker passes what its schedule can have in flight; `IN_FLIGHT` otherwise). A frame
that would open a tensor past the budget, repeat a part already arrived, or name a tensor
already delivered and not yet taken closes its connection before anything is allocated; a
"done" counts only for a tensor whose shared memory was granted to that same connection.

A SEND on the compute thread only hands the tensor over (`TiledTransport.send`: the device-to-host
copies of all its shards start at once); the cutting and everything below run on the transport's
sender thread, one tensor after another, and a failure there is raised by the next SEND or flush.

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

Every blocking socket operation has a timeout: handshakes HANDSHAKE_S (the listener
drives them on one selector thread, see `stages.socket_conn.Listener`), connects and
grants `io_timeout`, sends `io_timeout` per blocked write; reader threads poll their stop
flag between frames and give up mid-frame after `io_timeout`. `io_timeout` is the worker's
RECV deadline: the configured `timeouts.step_s` at first, then what the driver's measured
progress deadline makes it (`set_io_timeout`), so no socket wait outlasts the step's.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import weakref

import numpy as np

from orchestrator.core.reshard.stream import blocks_on, stream_layout
from stages.bufpool import BufferPool, as_array, shm_block
from stages.frames import (
    Frame,
    PeerError,
    dtype_tag,
    frame_bytes,
    frame_header,
    send_buffers,
    send_grant,
)
from stages.socket_conn import Listener, _Conn, machine_id
from stages.transport import Edge, TiledTransport

STAGE_BELOW = 32 << 10      # a stream block whose pieces average fewer bytes is staged by one copy
SHM_MIN_BYTES = 1 << 20     # smaller payloads go as streams (a grant costs a round trip)
SHM_POOL_BYTES = 4 << 30    # shared-memory destination blocks a receiver keeps
ASSEMBLED = "assembled"     # last mailbox key element of a fully placed tensor
COPY_THREADS = 4            # at most this many threads write one payload into shared memory
MAX_ARRIVALS = 4096         # tensors partly arrived at once on one host (and `budget` bytes in all)
IN_FLIGHT = 64              # tensors of each expected kind a receiver holds at once, unless told (`in_flight`)

log = logging.getLogger(__name__)


class _Shape:
    """What every arrival of one plan on one host shares (computed once per plan)."""

    def __init__(self, plan, me: int):
        self.plan = plan
        self.blocks = blocks_on(plan, me)
        self.firsts = sorted(set(self.blocks.values()))
        self.senders = frozenset(s for s, per_dst in plan.sends.items() if per_dst.get(me))
        self.nbytes = len(self.firsts) * int(np.prod(plan.dst_shard_shape, dtype=np.int64)) * np.dtype(plan.dtype).itemsize


class _Arrival:
    """One tensor arriving on this host: its destination blocks, the source hosts still to come,
    and (source host -> connection) where a source was granted shared memory (`granted`)."""

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
        self.granted: dict[int, socket.socket] = {}


class SocketTransport(TiledTransport):
    """Tiles over persistent, token-authenticated sockets (see the module docstring).

    Args: as `RayTransport`, plus `token` (the run's secret, from the driver), `stage`
    and `geoms` (this stage's index and every stage's `StageGeom`: receivers look up
    the plan of an incoming tensor by its sending stage), `host` (the IP to listen on:
    the node IP; None asks Ray), `io_timeout` (seconds a connect, handshake, grant,
    blocked write or started frame may take), `shared_memory` (False: streams only),
    `shm_min_bytes` and `shm_pool_bytes` (see SHM_MIN_BYTES, SHM_POOL_BYTES), `tls`
    (cluster `transport_tls`: {cert_file, key_file, ca_file}; None: plain TCP), `in_flight`
    (how many tensors of each expected kind may be arrived and not yet taken at once: sets
    `budget`, see the module docstring).
    After construction `address` is (ip, port, machine, unix name); `connect(addresses)`
    takes every stage's hosts' addresses ([stage][host]) before the first send.
    """

    def __init__(self, *, me, geom, mesh, inbox, peers, token: bytes, stage: int = 0, geoms=(),
                 host: str | None = None, io_timeout: float = 60.0, shared_memory: bool = True,
                 shm_min_bytes: int = SHM_MIN_BYTES, shm_pool_bytes: int = SHM_POOL_BYTES,
                 tls: dict | None = None, in_flight: int = IN_FLIGHT):
        if not token:
            raise ValueError("SocketTransport needs the run token")
        self.tls_server = self.tls_client = None
        if tls is not None:
            from orchestrator.core.tls import contexts

            self.tls_server, self.tls_client = contexts(tls)    # TlsError names the cluster key
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
        self.in_flight = int(in_flight)
        self.budget = 0               # bytes of tensors this host may hold arrived and not yet taken (`expect`)
        self.held_bytes = 0           # ... and holds now:
        self._held: dict[tuple, tuple] = {}   # key base -> (connection that opened it, bytes), until taken
        self._granted = weakref.WeakKeyDictionary()   # accepted connection -> shm block ids it holds
        self._layouts: dict = {}
        self._routes: dict = {}       # (id(edge), destination host, id(plan)) -> _Route (`_route`)
        self._shapes: dict = {}
        self._incoming: dict = {}     # (stage, axes, shape, dtype) of a tensor frame -> plan
        self._error: str | None = None
        self._addresses: list[list[tuple]] = []
        self._conns: dict[tuple, _Conn] = {}
        self._conns_lock = threading.Lock()
        unix = f"meshpipe-{secrets.token_hex(8)}" if self.machine else None
        self.listener = Listener(host, self.token, self._on_frame, self._on_error, io_timeout,
                                 name=f"transport host {me}", destinations=self._destinations, unix=unix,
                                 tls=self.tls_server, on_reject=self._withdraw)
        self.address = (*self.listener.address, self.machine, unix)

    def set_io_timeout(self, seconds: float) -> None:
        """`io_timeout` from now on (the worker's RECV deadline, see the module docstring): a frame
        a reader starts, a grant, a connect and each open connection's next send get it; a frame
        already under way keeps the deadline it started with."""
        self.io_timeout = self.listener.io_timeout = float(seconds)
        with self._conns_lock:
            conns = list(self._conns.values())
        for conn in conns:
            conn.io_timeout = self.io_timeout

    def expect(self, edge: Edge, shape, dtype) -> None:
        """Accept tensors of `shape`/`dtype` from `edge.stage` along `edge` (call before the
        peers send). A tensor frame that matches no expected tensor closes its connection:
        a receiver allocates only what its own plan says. Each call adds `in_flight` such
        tensors to `budget` (call once per tensor of a microbatch: two leaves of one shape, twice)."""
        memo = (edge.stage, tuple(edge.axes), tuple(int(n) for n in shape), dtype_tag(dtype))
        plan = self._incoming[memo] = self._plan(edge, False, memo[2], np.dtype(dtype))
        self.budget += self.in_flight * self._shape(plan).nbytes

    # -- receiving (reader threads) ---------------------------------------------------
    def _incoming_plan(self, tensor):
        """The plan of an expected tensor a frame names (see `expect`); PeerError otherwise."""
        try:
            memo = (tensor["stage"], tuple(tensor["axes"]), tuple(tensor["shape"]), tensor["dtype"])
            plan = self._incoming.get(memo)
        except (TypeError, KeyError):
            plan = None
        if plan is None:
            raise PeerError(f"tensor frame {str(tensor)[:200]} matches no tensor this host expects")
        return plan

    def _layout(self, plan, src: int, dst: int):
        """`stream_layout`, its receive runs as a list and their bytes, memoised per plan (plans are
        memoised, so their ids are stable; the memo keeps each plan alive)."""
        memo = (id(plan), src, dst)
        got = self._layouts.get(memo)
        if got is None:
            layout = stream_layout(plan, src, dst)
            runs_ = layout.recv.tolist()
            got = self._layouts[memo] = (plan, layout, runs_, sum(n for _, _, n in runs_))
        return got[1], got[2], got[3]

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

    def _source(self, key: tuple, plan) -> tuple[tuple, int]:
        """(key base, source host) of a frame's key; PeerError when that host sends nothing here."""
        base, src = key[:-1], key[-1] if key else None
        if src not in plan.sends or not plan.sends[src].get(self.me):
            raise PeerError(f"{key}: host {src} sends nothing to this host on this edge")
        return base, src

    def _arrival(self, key: tuple, plan, shm: bool, conn: socket.socket) -> tuple[tuple, int, _Arrival]:
        """The arrival `key` adds to: one already open, or a new one opened by `conn` within `budget`."""
        base, src = self._source(key, plan)
        with self._arrivals_lock:
            arrival = self._arrivals.get(base)
            if arrival is None:
                if base in self._held:
                    raise PeerError(f"{key}: this tensor was delivered already and is not taken yet")
                shape = self._shape(plan)
                if self.held_bytes + shape.nbytes > self.budget or len(self._arrivals) >= MAX_ARRIVALS:
                    raise PeerError(f"{key}: {shape.nbytes} more bytes would make {self.held_bytes + shape.nbytes} "
                                    f"bytes of tensors arrived and not yet taken (or {MAX_ARRIVALS} partly "
                                    f"arrived), more than this host's {self.budget} ({self.in_flight} of each "
                                    f"expected tensor)")
                arrival = self._arrivals[base] = _Arrival(shape, self.pool, self.shm if shm else None)
                self._held[base] = (conn, shape.nbytes)
                self.held_bytes += shape.nbytes
            elif src not in arrival.waiting:
                raise PeerError(f"{key}: host {src}'s part of this tensor arrived already")
        return base, src, arrival

    def _destinations(self, header: dict, nbytes: int, conn: socket.socket):
        """A tensor frame's stream lands in its places in the destination blocks (checked against
        the plan's byte count before anything is allocated)."""
        if header.get("shm") in ("request", "done"):   # grant requests and "done" notes carry no data
            return []
        tensor = header.get("tensor")
        if tensor is None:
            raise PeerError(f"frame {str(header)[:200]} is neither a tensor, a grant request nor a 'done'")
        plan = self._incoming_plan(tensor)
        key = tuple(header["key"])
        _, src = self._source(key, plan)
        _, runs_, want = self._layout(plan, src, self.me)
        if nbytes != want:
            raise PeerError(f"{key}: frame announces {nbytes} data bytes, this host's plan receives {want} from host {src}")
        _, _, arrival = self._arrival(key, plan, False, conn)
        views = arrival.views
        return [views[b][off:off + n] for b, off, n in runs_]

    def _on_frame(self, frame: Frame, conn: socket.socket) -> None:
        if not frame.key:
            raise PeerError("frame with an empty key")
        how = frame.header.get("shm")
        if how == "request":
            self._grant(frame, conn)
        else:                     # a "done" or a tensor frame read into place (`_destinations`)
            self._landed(frame.key[:-1], frame.key[-1], conn if how == "done" else None)

    def _grant(self, frame: Frame, conn: socket.socket) -> None:
        """Answer a same-machine sender: this tensor's shared-memory blocks (fds for new ones)."""
        plan = self._incoming_plan(frame.header.get("tensor"))
        _, src, arrival = self._arrival(frame.key, plan, True, conn)
        if arrival.shm_ids is None or conn.family != socket.AF_UNIX:
            send_grant(conn, {"blocks": None}, [])
            return
        seen = self._granted.setdefault(conn, set())
        new = [i for i in arrival.shm_ids.values() if i not in seen]
        blocks = [self.shm.blocks[i] for i in new]
        send_grant(conn, {"blocks": [[b, i] for b, i in arrival.shm_ids.items()],
                          "new": [[blk.id, blk.nbytes] for blk in blocks]}, [blk.fd for blk in blocks])
        seen.update(new)
        arrival.granted[src] = conn

    def _landed(self, base: tuple, src: int, done_on: socket.socket | None = None) -> None:
        """Host `src`'s part of tensor `base` is in place: read from a stream, or (`done_on`: the
        connection a "done" came on) written into shared memory granted on that connection."""
        with self._arrivals_lock:
            arrival = self._arrivals.get(base)
            if arrival is None or src not in arrival.waiting:
                raise PeerError(f"{(*base, src)}: nothing of this tensor is awaited from host {src}")
            if done_on is not None and arrival.granted.get(src) is not done_on:
                raise PeerError(f"{(*base, src)}: a 'done' for a tensor whose shared memory was not "
                                f"granted to this connection (its data must come as a stream)")
            arrival.waiting.discard(src)
            done = not arrival.waiting and self._arrivals.pop(base, None) is not None
        if done:
            self.inbox.put((*base, ASSEMBLED), arrival.shards)

    def _withdraw(self, conn: socket.socket) -> None:
        """A connection broke the protocol (`Listener.on_reject`): drop every tensor it opened that
        is not taken yet (partly arrived, or assembled in the mailbox), freeing its budget."""
        with self._arrivals_lock:
            mine = [base for base, (owner, _) in self._held.items() if owner is conn]
            for base in mine:
                self._arrivals.pop(base, None)
                self.held_bytes -= self._held.pop(base)[1]
                self.inbox.discard((*base, ASSEMBLED))
        if mine:
            log.warning("transport host %s: dropped %d tensor(s) a rejected connection had opened",
                        self.me, len(mine))

    def _local_shards(self, key, shape, dtype, edge, timeout) -> dict:
        """The shards the reader threads placed (see `TiledTransport.recv` / `recv_operand`)."""
        plan = self._plan(edge, False, shape, dtype)
        if self._shape(plan).senders:
            shards = self.inbox.take((*key, ASSEMBLED), timeout)
            with self._arrivals_lock:
                held = self._held.pop(tuple(key), None)
                if held is not None:
                    self.held_bytes -= held[1]
            return shards
        return _Arrival(self._shape(plan), self.pool).shards      # nothing to move (an empty tensor)

    def _on_error(self, reason: str) -> None:
        self._error = self._error or reason
        self.inbox.close(f"socket transport: {reason}")   # a waiting recv fails now, not at its deadline

    # -- sending -------------------------------------------------------------------------
    def connect(self, addresses) -> None:
        self._addresses = [[tuple(a) for a in row] for row in addresses]
        self._routes.clear()

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
        return _Conn(address, self.token, self.io_timeout, tls=self.tls_client)

    def _route(self, edge: Edge, dst_host: int, plan) -> _Route:
        """What every send of `plan` along `edge` to `dst_host` shares, built once (`_Route`)."""
        memo = (id(edge), dst_host, id(plan))
        got = self._routes.get(memo)
        if got is None or got.edge is not edge or got.plan is not plan:
            tensor = {"stage": self.stage, "axes": list(edge.axes), "shape": list(plan.shape),
                      "dtype": dtype_tag(plan.dtype)}
            got = self._routes[memo] = _Route(
                edge, plan, self._addresses[edge.stage][edge.geom.hosts.index(dst_host)], tensor,
                self._bytes_to(plan, dst_host), _recipe(self._layout(plan, self.me, dst_host)[0]))
        return got

    def _push(self, key, edge, dst_host, plan, shards):
        if not self._addresses:
            raise RuntimeError("SocketTransport.send before connect(addresses)")
        route = self._route(edge, dst_host, plan)
        address = route.address
        try:
            conn = self._conn(address)
            with conn.lock:
                conn.retime()
                if conn.unix and route.nbytes >= self.shm_min_bytes:
                    header = {"key": [*key, self.me], "arrays": [], "tensor": route.tensor}
                    if self._write_shared(conn, header, plan, dst_host, shards):
                        self.shm_sends += 1
                        return
                stream = _gather(route.recipe, plan, shards, self.pool)
                # the header's JSON as `json.dumps({"key": ..., "arrays": [], "tensor": ...})` writes it,
                # with only the key serialised per send
                head = b'{"key":' + json.dumps([*key, self.me], separators=(",", ":")).encode() + route.tail
                send_buffers(conn.sock, [frame_bytes(head, sum(v.nbytes for v in stream)), *stream])
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

    def _drop(self, address) -> None:
        with self._conns_lock:
            conn = self._conns.pop(address, None)
        if conn is not None:
            conn.close()

    def flush(self, timeout):
        """Wait (bounded) until every send handed over went out; surfaces the sender thread's failure,
        a broken connection or a failed reader."""
        self._drain(timeout)
        if self._error:
            raise ConnectionError(f"socket transport: {self._error}")
        for address, conn in list(self._conns.items()):
            if conn.broken():
                self._drop(address)
                raise ConnectionError(f"socket transport: the peer at {address[0]}:{address[1]} closed the connection")

    def close(self) -> None:
        self._stop_sender()
        self.listener.close()
        with self._conns_lock:
            conns, self._conns = list(self._conns.values()), {}
        for c in conns:
            c.close()
        if self.shm is not None:
            self.shm.close()
        if self._copier is not None:
            self._copier.shutdown(wait=True, cancel_futures=True)


class _Route:
    """One (edge, destination host, plan) as a sender uses it on every send: the peer's address,
    the header's tensor entry (and its JSON tail after the key), the bytes the destination
    receives, and the stream's recipe (`_recipe`)."""

    def __init__(self, edge, plan, address: tuple, tensor: dict, nbytes: int, recipe: list):
        self.edge, self.plan, self.address, self.tensor, self.nbytes, self.recipe = (
            edge, plan, address, tensor, nbytes, recipe)
        self.tail = b',"arrays":[],"tensor":' + json.dumps(tensor, separators=(",", ":")).encode() + b"}"


def _recipe(layout) -> list:
    """A stream layout as a sender walks it: per segment, ("stage", segment) where its pieces are
    short (the sender copies them into one block), else ("runs", [(source device, offset, nbytes)])."""
    out = []
    for seg in layout.segments:
        runs_ = layout.send[seg.send[0]:seg.send[1]]
        if seg.whole and len(runs_) > 1 and runs_[:, 2].mean() < STAGE_BELOW:
            out.append(("stage", seg))
        else:
            out.append(("runs", [tuple(r) for r in runs_.tolist()]))
    return out


def _gather(recipe: list, plan, shards: dict, pool) -> list:
    """The stream's buffers for `recipe`: views into the source shards, or a staged block."""
    mvs = {d: memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8)) for d, a in shards.items()}
    out = []
    for how, what in recipe:
        if how == "stage":
            block = pool.take(plan.dst_shard_shape, plan.dtype)   # free again once sent
            for t in what.tiles:
                block[t.targets[0][1]] = shards[t.src_device][t.src_slice]
            out.append(memoryview(block.reshape(-1).view(np.uint8)))
        else:
            out.extend(mvs[d][off:off + n] for d, off, n in what)
    return out


def _row_chunks(rows: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) ranges splitting `rows` leading rows into at most `parts` non-empty chunks.

    Example:
        >>> _row_chunks(5, 2), _row_chunks(1, 4), _row_chunks(0, 2)
        ([(0, 2), (2, 5)], [(0, 1)], [(0, 0)])
    """
    parts = max(1, min(parts, rows))
    edges = [rows * k // parts for k in range(parts + 1)]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a] or [(0, 0)]
