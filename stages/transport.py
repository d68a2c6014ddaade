"""Moving tensors between stages along a resharding plan.

The schedule decides *when* a tensor moves; the transport decides *how*. The
plan (`orchestrator.core.reshard`, pure) says which tiles of which source shard each
destination host needs; this module executes it with Ray:

  send:  the sender cuts the tiles for each destination host out of its own
         addressable shards (`reshard.pack`) and pushes them as ONE call into
         that host's mailbox (`deliver`), keyed (step, kind, microbatch, src host).
  recv:  the receiver takes one payload per sending host (bounded wait),
         assembles its local shards (`reshard.assemble`), puts each on its device
         and builds the global `jax.Array` with the destination sharding.
No host ever gathers the whole tensor unless its own shards are the whole tensor.

`Transport` is the interface the worker uses; `TiledTransport` holds the plan/pack/
assemble part every tile transport shares, `RayTransport` ships with Ray calls and
`stages.socket_transport.SocketTransport` (cluster `transport: socket`) with framed streams over
TCP or Unix sockets and shared memory on one machine. `stages.xla_transport.XlaTransport`
(`transport: xla`) moves the same plans device to device with XLA's own transfers in one JAX
world. Which one a worker gets: `stages.dataplane`.
"""
from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass

import numpy as np

from orchestrator.core.edges import StageGeom, edge_plan
from orchestrator.core.reshard import assemble, pack


@dataclass(frozen=True)
class Edge:
    """One direction of a stage boundary as seen from this stage.

    `stage` is the peer's stage index, `geom` its geometry, `axes` the logical
    axes of the tensor crossing (the activation leaving the earlier layer).
    """

    stage: int
    geom: StageGeom
    axes: tuple


class Transport:
    """What the stage worker needs: send/recv along an edge, and a host → device helper."""

    def send(self, key: tuple, array, edge: Edge) -> None:
        raise NotImplementedError

    def recv(self, key: tuple, shape: tuple, dtype, sharding, edge: Edge, timeout: float):
        raise NotImplementedError

    def recv_operand(self, key: tuple, shape: tuple, dtype, sharding, edge: Edge, timeout: float):
        """What a jitted program can take for the tensor (default: `recv`'s jax.Array)."""
        return self.recv(key, shape, dtype, sharding, edge, timeout)

    def flush(self, timeout: float) -> None:
        raise NotImplementedError

    def set_io_timeout(self, seconds: float) -> None:
        """The seconds any wait of the transport's own (a frame under way, a blocked write) may take
        from now on: the worker's RECV deadline, which follows the driver's progress deadline
        (`StageWorker.set_recv_deadline`). A transport whose only waits are the RECVs' (the Ray
        transport: their `timeout`) ignores it."""

    def begin(self, step: int, tag: str) -> None:
        """A program of the schedule starts on this stage: training step `step` ("F") or its eval
        batch b ("E<b>"). A transport that issues transfers in a world-wide order
        (`stages.xla_transport`) queues that program's; the default ignores it."""

    def expect(self, edge: Edge, shape: tuple, dtype) -> None:
        """Announce a tensor that may arrive along `edge` (before any peer sends it). A transport
        that reads headers from the network accepts only announced tensors; the default ignores it."""

    @staticmethod
    def from_host(arr: np.ndarray, sharding):
        """A host-side global array (identical on every host of the stage) as a sharded jax.Array."""
        import jax

        return jax.make_array_from_callback(arr.shape, sharding, lambda idx: arr[idx])


class TiledTransport(Transport):
    """The part every tile-moving transport shares: the memoised reshard plan, packing
    one payload per destination host (with byte counters), and assembling received tiles.

    Subclasses implement `_push(key, edge, dst_host, plan, shards)`, which ships what
    `plan.sends[self.me][dst_host]` names, cut from `shards` (source device -> numpy
    shard, C-contiguous), to that host.

    Args:
      me: this host's cluster host index; geom: this stage's geometry; mesh: its
      jax Mesh (flat device order = the plan's device ids); inbox: this actor's
      Mailbox; peers: callable stage index -> that stage's actor handles.
    """

    def __init__(self, *, me: int, geom: StageGeom, mesh, inbox, peers):
        import jax

        self.me, self.geom, self.inbox, self.peers = me, geom, inbox, peers
        devices = list(mesh.devices.flat)
        self.flat = {d.id: i for i, d in enumerate(devices)}
        here = jax.process_index()
        self.local = [(i, d) for i, d in enumerate(devices) if d.process_index == here]
        self.single_device = len(devices) == 1
        self.on_host = devices[0].platform == "cpu"    # device memory is host memory: no D2H to start
        self.sent_bytes = 0
        self.sent_bytes_to: dict[str, int] = {}   # per destination stage (telemetry)
        self._plans: dict = {}
        self._dest_lists: dict = {}     # id(plan) -> (plan, [(dst host, source devices, bytes)]) (`_dests`)
        self._fast_plans: dict = {}     # (id(edge), outgoing, shape, dtype) -> (edge, plan) (`_plan`)
        self._send_cv = threading.Condition()
        self._queued: collections.deque = collections.deque()   # (key, array, edge) handed over, not yet sent
        self._sender: threading.Thread | None = None            # made by the first send
        self._send_error: BaseException | None = None
        self._send_closed = False
        self.send_calls, self.send_blocked_s = 0, 0.0   # the compute thread's time inside `send` (telemetry)

    def _plan(self, edge: Edge, outgoing: bool, shape, dtype):
        """The edge's reshard plan, memoised here: a dict hit instead of rebuilding MeshSides per action.
        The first lookup is by the Edge object's identity (the worker's edges live as long as it
        does), which spares hashing the Edge's whole geometry on every SEND / RECV; the entry
        keeps its Edge, so an id is never mistaken for another object's."""
        fast_key = (id(edge), outgoing, tuple(shape), dtype)
        got = self._fast_plans.get(fast_key)
        if got is not None and got[0] is edge:
            return got[1]
        memo_key = (edge, outgoing, tuple(shape), np.dtype(dtype).str)
        plan = self._plans.get(memo_key)
        if plan is None:
            src, dst = (self.geom, edge.geom) if outgoing else (edge.geom, self.geom)
            plan = self._plans[memo_key] = edge_plan(src, dst, edge.axes, shape, dtype)
        self._fast_plans[fast_key] = (edge, plan)
        return plan

    def _push(self, key: tuple, edge: Edge, dst_host: int, plan, shards: dict) -> None:
        raise NotImplementedError

    def connect(self, addresses) -> None:
        """Every stage's hosts' transport addresses ([stage][host]); unused by transports that need none."""

    def close(self) -> None:
        """Release what the transport holds (sockets, threads): the sender thread here."""
        self._stop_sender()

    def _dests(self, plan) -> list:
        """Per destination host this host sends tiles of `plan` to: (host, source devices, bytes),
        memoised per plan (plans are memoised, so their ids are stable while the entry keeps it)."""
        got = self._dest_lists.get(id(plan))
        if got is None or got[0] is not plan:
            got = self._dest_lists[id(plan)] = (plan, [
                (dst, tuple(sorted({t.src_device for t in tiles})), sum(t.nbytes for t in tiles))
                for dst, tiles in plan.sends.get(self.me, {}).items() if tiles])
        return got[1]

    # -- sending: the compute thread hands over, the sender thread moves ------------------
    def send(self, key, array, edge):
        """Hand `array` over for sending and return: its device-to-host copies start now (all shards
        at once, `copy_to_host_async`), the cutting and the wire run on this transport's sender
        thread (`_send_now`, FIFO). A failure there is raised by the next `send` or `flush`."""
        t0 = time.perf_counter()
        with self._send_cv:
            self._raise_send_error()
            if self._sender is None:
                self._sender = threading.Thread(target=self._send_loop, name=f"transport sender host {self.me}",
                                                daemon=True)
                self._sender.start()
            if not self.on_host:
                array.copy_to_host_async()
            self._queued.append((key, array, edge))
            self._send_cv.notify_all()
        self.send_calls += 1
        self.send_blocked_s += time.perf_counter() - t0

    def _send_loop(self) -> None:
        while True:
            with self._send_cv:
                while not self._queued and not self._send_closed:
                    self._send_cv.wait()
                if not self._queued:
                    return
                key, array, edge = self._queued[0]
            try:
                if self._send_error is None:
                    self._send_now(key, array, edge)
            except BaseException as e:  # noqa: BLE001 - raised on the compute thread by the next send/flush
                with self._send_cv:
                    self._send_error = e
            finally:
                with self._send_cv:
                    self._queued.popleft()
                    self._send_cv.notify_all()

    def _raise_send_error(self) -> None:
        """(Under `_send_cv`.) The sender thread's failure, raised with its cause."""
        e = self._send_error
        if e is not None:
            if isinstance(e, (ConnectionError, TimeoutError)):
                raise type(e)(f"sending (on the sender thread): {e}") from e
            raise RuntimeError(f"sending (on the sender thread) failed: {type(e).__name__}: {e}") from e

    def _drain(self, timeout: float) -> None:
        """Wait (bounded) until every send handed over has gone out; raises the sender's failure."""
        deadline = time.monotonic() + timeout
        with self._send_cv:
            while self._queued and self._send_error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"transport host {self.me}: {len(self._queued)} send(s) still under way "
                                       f"after {timeout:.0f} s (the next: {self._queued[0][0]})")
                self._send_cv.wait(left)
            self._raise_send_error()

    def _stop_sender(self, timeout: float = 5.0) -> None:
        with self._send_cv:
            self._send_closed = True
            self._queued.clear()
            self._send_cv.notify_all()
        if self._sender is not None:
            self._sender.join(timeout)

    def _send_now(self, key, array, edge):
        """One send, on the sender thread: each destination host's tiles cut from this host's shards
        (the device-to-host copies `send` started) and pushed (`_push`)."""
        plan = self._plan(edge, True, array.shape, array.dtype)
        if self.single_device:                         # the array is its only shard
            by_device = {0: array}
        else:
            by_device = {self.flat[s.device.id]: s.data for s in array.addressable_shards}
        to = str(edge.stage)
        for dst_host, srcs, nbytes in self._dests(plan):
            shards = {d: np.asarray(by_device[d]) for d in srcs}
            self.sent_bytes += nbytes
            self.sent_bytes_to[to] = self.sent_bytes_to.get(to, 0) + nbytes
            self._push(key, edge, dst_host, plan, shards)

    def recv(self, key, shape, dtype, sharding, edge, timeout):
        """The tensor `key` as a jax.Array with `sharding` (bounded wait)."""
        return self._to_array(self._local_shards(key, shape, dtype, edge, timeout), shape, sharding)

    def from_host(self, arr: np.ndarray, sharding):
        """A host-side global array as an operand for a jitted program: as it is on a one-device
        stage (see `recv_operand`), else a jax.Array with `sharding`."""
        if self.single_device:
            return arr
        return Transport.from_host(arr, sharding)

    def recv_operand(self, key, shape, dtype, sharding, edge, timeout):
        """The tensor `key` in the cheapest form a jitted program takes: when this stage's whole
        mesh is one device, the numpy array itself (jit moves it in C++, far cheaper than a Python
        `device_put` + `make_array`; figures in docs/decisions.md); otherwise `recv`'s jax.Array."""
        local = self._local_shards(key, shape, dtype, edge, timeout)
        if self.single_device:
            return local[self.local[0][0]]
        return self._to_array(local, shape, sharding)

    def _local_shards(self, key, shape, dtype, edge, timeout) -> dict:
        """Destination device -> this host's numpy shard of tensor `key`."""
        plan = self._plan(edge, False, shape, dtype)
        deadline = time.monotonic() + timeout          # one deadline for all senders
        received = {src: self.inbox.take((*key, src), max(0.0, deadline - time.monotonic()))
                    for src, per_dst in plan.sends.items() if per_dst.get(self.me)}
        return assemble(plan, self.me, received)

    def _to_array(self, local: dict, shape, sharding):
        """This host's shards as the global array. Replicas share one host buffer (`assemble`): it
        goes to the device once; the other replicas are on-device copies of it (on CPU, where
        `device_put` adopts an aligned host buffer without copying, every device adopts it)."""
        import jax

        if len(self.local) == 1:                       # (the single-device call is cheaper)
            arrays = [jax.device_put(local[self.local[0][0]], self.local[0][1])]
            return jax.make_array_from_single_device_arrays(tuple(shape), sharding, arrays)
        first: dict[int, int] = {}                     # id(host buffer) -> position of its first device
        for k, (i, _) in enumerate(self.local):
            first.setdefault(id(local[i]), k)
        if self.local[0][1].platform == "cpu" or len(first) == len(self.local):
            arrays = jax.device_put([local[i] for i, _ in self.local], [d for _, d in self.local])
        else:
            heads = sorted(set(first.values()))
            put = dict(zip(heads, jax.device_put([local[self.local[k][0]] for k in heads],
                                                 [self.local[k][1] for k in heads])))
            arrays = [put[k] if k in put else jax.device_put(put[first[id(local[i])]], d)
                      for k, (i, d) in enumerate(self.local)]
        return jax.make_array_from_single_device_arrays(tuple(shape), sharding, arrays)


class RayTransport(TiledTransport):
    """Tiles through Ray calls into the peers' mailboxes (constructor: see `TiledTransport`)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._inflight: list = []

    def _push(self, key, edge, dst_host, plan, shards):
        # contiguous tiles travel as zero-copy buffers; strided views would be pickled inline
        payload = [t if t.flags.c_contiguous else np.ascontiguousarray(t)
                   for t in pack(plan, self.me, dst_host, shards)]
        peer = self.peers(edge.stage)[edge.geom.hosts.index(dst_host)]
        self._inflight.append(peer.deliver.options(concurrency_group="io").remote((*key, self.me), payload))

    def flush(self, timeout):
        """Wait (bounded) until this step's sends went out and their pushes were accepted; surfaces
        a dead receiver."""
        import ray

        deadline = time.monotonic() + timeout
        self._drain(timeout)
        if self._inflight:
            ray.get(self._inflight, timeout=max(0.0, deadline - time.monotonic()))
        self._inflight.clear()
