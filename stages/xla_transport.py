"""Stage edges as XLA's own device-to-device transfers, in one JAX world (cluster `transport: xla`).

Every stage actor of the job is one process of one `jax.distributed` world
(`stages.jaxinit.join_world`); each stage's mesh is its own processes' devices (`stage_meshes`).
An edge moves with cross-process `jax.device_put` — NCCL on GPU, the TPU runtime's transfers on
TPU, XLA's socket transfer library on CPU — along meshmeshpipe's reshard plan
(`orchestrator.core.reshard.direct`): the whole array when both sides cut it alike, else the
plan's tiles as single-device arrays, all leaves of a microbatch's edge in ONE batched call.

Basic flow:
  compute thread   SEND hands the leaf over and returns (`send`); RECV waits (bounded) until the
                   transfer thread has issued the receive, then until the arrays are ready
                   (`recv`); `begin(step, tag)` at each step's (and eval batch's) start queues
                   that program's transfers.
  transfer thread  issues, in the world's order (`orchestrator.core.schedule.transfers`), every
                   transfer of every begun program: as sender it waits (bounded) for the compute
                   thread's leaves, cuts the tiles on device and calls `device_put`; as receiver
                   it calls `device_put` on placeholders, assembles each local destination shard
                   on device (fan-out to replicas by device copies) and hands the global arrays to
                   RECV; any other process makes the same call on placeholders, which only draws
                   XLA's transfer keys (why every process makes every call: that module's doc).
Nothing here waits for the wire on the compute thread: a SEND is a dict insert.

Deadlines: a RECV waits at most its timeout for the thread and then for the data (a dead sender's
data never comes: `device_put` to a dead process returns at once without error); the thread
waits at most `io_timeout` for a leaf the compute thread owes it. A failure on the thread is kept
and raised, with its cause, by the next SEND, RECV or flush; the thread stops there (one failed
transfer breaks the world's key order, so nothing after it could be trusted).
"""
from __future__ import annotations

import collections
import logging
import threading
import time

import numpy as np

from orchestrator.core.edges import StageGeom, edge_plan
from orchestrator.core.reshard.direct import landing_device, pieces_on, whole_array
from stages.transport import Transport

log = logging.getLogger(__name__)

POLL_MIN_S, POLL_MAX_S = 50e-6, 2e-3     # a RECV's readiness poll: from, growing to
STOP_CHECK_S = 0.1                        # how often a waiting RECV looks whether the actor was told to stop


class TransferError(RuntimeError):
    """The transfer thread failed; raised on the compute thread with the thread's cause."""


def stage_meshes(geoms, axis_names=None):
    """Every stage's `jax.sharding.Mesh` from the world's devices: stage s gets the devices of the
    processes `geoms[s].hosts` (process index = cluster host index), host-major, in device-id
    order within a host — the plan's flat order (`orchestrator.core.edges`).

    Raises:
      RuntimeError: a stage whose processes do not hold exactly its mesh's devices.
    """
    import jax
    from jax.sharding import Mesh

    by_process = collections.defaultdict(list)
    for d in jax.devices():
        by_process[d.process_index].append(d)
    meshes = []
    for s, g in enumerate(geoms):
        devices = [d for h in g.hosts for d in sorted(by_process.get(h, ()), key=lambda d: d.id)]
        shape = tuple(n for _, n in g.mesh)
        if len(devices) != int(np.prod(shape)) or any(len(by_process.get(h, ())) != g.devices_per_host
                                                      for h in g.hosts):
            raise RuntimeError(f"stage {s}: processes {list(g.hosts)} hold {len(devices)} devices "
                               f"({ {h: len(by_process.get(h, ())) for h in g.hosts} }); its mesh {dict(g.mesh)} "
                               f"needs {g.devices_per_host} per host")
        meshes.append(Mesh(np.array(devices).reshape(shape), tuple(a for a, _ in g.mesh)))
    return meshes


class _Route:
    """One leaf of one kind of transfer, as every process calls it: the plan, whether it moves
    whole, the call's destination shardings, the placeholders a process without the data passes,
    and (receivers) how the local destination shards are built."""

    def __init__(self, plan, src_mesh, dst_mesh, src_spec, dst_spec, me: int):
        import jax
        from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

        self.plan, self.whole = plan, whole_array(plan)
        self.dst_sharding = NamedSharding(dst_mesh, PartitionSpec(*dst_spec))
        src_flat, dst_flat = list(src_mesh.devices.flat), list(dst_mesh.devices.flat)
        self.dst_flat = dst_flat
        dtype = plan.dtype
        sending = me in plan.src.host_ids

        def placeholder(shape, sharding):      # a source array with no data here (none on this process)
            return jax.make_array_from_single_device_arrays(shape, sharding, [], dtype=dtype)

        if self.whole:
            src_sharding = NamedSharding(src_mesh, PartitionSpec(*src_spec))
            self.targets = [self.dst_sharding]
            self.placeholders = None if sending else [placeholder(plan.shape, src_sharding)]
        else:
            tiles = plan.tiles
            self.targets = [SingleDeviceSharding(dst_flat[landing_device(t)]) for t in tiles]
            self.placeholders = [None if t.src_host == me else placeholder(t.shape, SingleDeviceSharding(
                src_flat[t.src_device])) for t in tiles]
            self.mine = [i for i, t in enumerate(tiles) if t.src_host == me]
            self.cuts = {i: (tiles[i].src_device, None if tiles[i].shape == plan.src_shard_shape
                             else tiles[i].src_slice) for i in self.mine}
            self.pieces = pieces_on(plan, me) if me in plan.dst.host_ids else {}
            self._assemblers: dict = {}

    def sources(self, array, flat: dict) -> list:
        """The call's arrays on the sending host: its real tiles (cut on device), placeholders elsewhere."""
        if self.whole:
            return [array]
        xs = list(self.placeholders)
        by_device = {flat[s.device.id]: s.data for s in array.addressable_shards}
        for i in self.mine:
            dev, cut = self.cuts[i]
            xs[i] = by_device[dev] if cut is None else by_device[dev][cut]
        return xs

    def arrived(self, got: list):
        """The global destination array from this host's part of the call's results."""
        import jax

        if self.whole:
            return got[0]
        shards = []
        for dev, pieces in self.pieces.items():
            device = self.dst_flat[dev]
            parts = [got[p.tile] if p.landed == dev else jax.device_put(got[p.tile], device) for p in pieces]
            if len(pieces) == 1 and tuple(parts[0].shape) == tuple(self.plan.dst_shard_shape):
                shards.append(parts[0])                     # the tile is the shard (or its on-device copy)
            else:
                shards.append(self._assembler(dev, pieces)(*parts))
        return jax.make_array_from_single_device_arrays(self.plan.shape, self.dst_sharding, shards)

    def _assembler(self, dev: int, pieces):
        """A jitted program placing the pieces into one destination shard (on the pieces' device)."""
        fn = self._assemblers.get(dev)
        if fn is None:
            import jax
            import jax.numpy as jnp

            shape, dtype, wheres = tuple(self.plan.dst_shard_shape), self.plan.dtype, [p.where for p in pieces]

            def place(*parts):
                out = jnp.zeros(shape, dtype)
                for part, where in zip(parts, wheres):
                    out = out.at[where].set(part)
                return out

            fn = self._assemblers[dev] = jax.jit(place)
        return fn


class XlaTransport(Transport):
    """Edges as XLA transfers in one JAX world (see the module docstring).

    Args:
      me: this process's cluster host index (= its process index in the world).
      stage: this stage's index; geoms: every stage's `StageGeom`; meshes: every stage's Mesh
        (`stage_meshes`; this stage's entry is the worker's own mesh).
      programs: {"F": the training step's world order, "E": the eval's} (tuples of `Transfer`).
      leaves: callable (boundary, kind) -> [(leaf index, global shape, dtype, logical axes)] of
        what crosses that boundary ("B": the floating leaves only).
      io_timeout: seconds the thread waits for a leaf the compute thread owes it.
    """

    def __init__(self, *, me: int, stage: int, geoms, meshes, programs: dict, leaves, io_timeout: float = 60.0,
                 inbox=None):
        self.me, self.stage, self.geoms, self.meshes = me, stage, tuple(geoms), list(meshes)
        self.inbox = inbox          # the worker's mailbox: once closed (the actor was told to stop), RECV stops
        self.programs, self.leaves, self.io_timeout = programs, leaves, float(io_timeout)
        # a one-device stage takes host inputs as they are (`StageWorker.host_operand`), as under socket
        self.single_device = self.meshes[stage].devices.size == 1
        self.send_calls, self.send_blocked_s = 0, 0.0
        self.sent_bytes = 0
        self.sent_bytes_to: dict[str, int] = {}
        self.whole_sends = self.tile_sends = self.calls = 0
        self.flat = [{d.id: i for i, d in enumerate(m.devices.flat)} for m in self.meshes]
        self._routes: dict = {}
        self._cv = threading.Condition()
        self._outgoing: dict = {}
        self._arrived: dict = {}
        self._queue: collections.deque = collections.deque()
        self._begun = self._done = 0
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"xla transfers host {me}", daemon=True)
        self._thread.start()

    def warm_up(self, timeout: float) -> float:
        """A one-element transfer from every process to the next, every process making every call
        (before any step, so the world's transfer keys stay in step): XLA binds its transfer
        sockets and opens connections now, not in the first step; a process that cannot reach its
        successor fails setup, naming it. Returns the seconds it took."""
        import jax
        from jax.sharding import SingleDeviceSharding

        t0 = time.monotonic()
        first = {}
        for d in jax.devices():
            first.setdefault(d.process_index, d)
        world = sorted(first)
        if len(world) < 2:
            return 0.0
        got = None
        for i, src in enumerate(world):
            dst = world[(i + 1) % len(world)]
            if src == self.me:
                x = jax.device_put(np.full((1,), src, np.int32), first[src])
            else:
                x = jax.make_array_from_single_device_arrays((1,), SingleDeviceSharding(first[src]), [],
                                                             dtype=np.int32)
            y = jax.device_put(x, SingleDeviceSharding(first[dst]))
            if dst == self.me:
                got = (src, y)
        src, y = got
        while not y.is_ready():
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"xla transport host {self.me}: the warm-up transfer from process {src} did "
                                   f"not arrive within {timeout:.0f} s")
            time.sleep(POLL_MAX_S)
        if int(np.asarray(y.addressable_data(0))[0]) != src:
            raise RuntimeError(f"xla transport host {self.me}: the warm-up transfer from process {src} arrived "
                               f"with {np.asarray(y.addressable_data(0))}, not [{src}]")
        return time.monotonic() - t0

    # -- compute thread ----------------------------------------------------------------
    def begin(self, step: int, tag: str) -> None:
        """Queue the transfers of the program starting now: a training step ("F") or eval batch ("E<b>")."""
        order = self.programs["F" if tag == "F" else "E"]
        with self._cv:
            self._raise()
            self._queue.append((step, tag, order))
            self._begun += 1
            self._cv.notify_all()

    def send(self, key, array, edge) -> None:
        t0 = time.perf_counter()
        with self._cv:
            self._raise()
            self._outgoing[tuple(key)] = array
            self._cv.notify_all()
        self.send_calls += 1
        self.send_blocked_s += time.perf_counter() - t0

    def recv(self, key, shape, dtype, sharding, edge, timeout):
        deadline = time.monotonic() + timeout
        key = tuple(key)
        with self._cv:
            while key not in self._arrived:
                self._raise()
                self._stopped(key)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"xla transport host {self.me}: {key} was not issued within {timeout:.0f} s "
                                       f"(the transfer thread is at program {self._done + 1} of {self._begun})")
                self._cv.wait(min(left, STOP_CHECK_S))
            array = self._arrived.pop(key)
        wait, checked = POLL_MIN_S, time.monotonic()
        while not array.is_ready():
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"xla transport host {self.me}: {key} did not arrive within {timeout:.0f} s "
                                   "(its sender is dead, hung or out of step)")
            if now - checked > STOP_CHECK_S:
                self._stopped(key)
                checked = now
            time.sleep(wait)
            wait = min(2 * wait, POLL_MAX_S)
        return array

    def _stopped(self, key) -> None:
        """MailboxClosed when the worker was told to stop (`StageWorker.abort_step`): a consequence of a
        failure elsewhere, raised now instead of at the RECV's deadline."""
        if self.inbox is not None and self.inbox.closed:
            from stages.mailbox import MailboxClosed

            raise MailboxClosed(f"xla transport host {self.me}: stopped ({self.inbox.closed}) while waiting for {key}")

    def flush(self, timeout: float) -> None:
        """Every program begun so far issued (bounded); raises the thread's failure with its cause."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._done < self._begun:
                self._raise()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"xla transport host {self.me}: {self._begun - self._done} program(s) of "
                                       f"transfers not issued within {timeout:.0f} s (waiting for "
                                       f"{sorted(self._outgoing)[:4] or 'a leaf'})")
                self._cv.wait(left)
            self._raise()

    def set_io_timeout(self, seconds: float) -> None:
        self.io_timeout = float(seconds)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=5.0)

    def _raise(self) -> None:
        if self._error is not None:
            raise TransferError(f"xla transport host {self.me}: the transfer thread failed: "
                                f"{type(self._error).__name__}: {self._error}") from self._error

    # -- transfer thread ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._queue and not self._closed:
                        self._cv.wait()
                    if self._closed:
                        return
                    step, tag, order = self._queue[0]
                for t in order:
                    self.issue(step, tag, t)
                with self._cv:
                    self._queue.popleft()
                    self._done += 1
                    self._cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - kept and raised on the compute thread
            log.error("xla transport host %s: transfer thread failed: %s", self.me, e)
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def issue(self, step: int, tag: str, t) -> None:
        """Make `t`'s one batched call (every process of the world does, in the same order)."""

        sender, receiver = self.me in self.geoms[t.src].hosts, self.me in self.geoms[t.dst].hosts
        base = t.key(step, tag)
        routes = self._routes_of(t)
        xs, targets = [], []
        for j, route in routes:
            if sender:
                array = self._owed(base + (j,))
                xs += route.sources(array, self.flat[t.src])
            else:
                xs += route.placeholders
            targets += route.targets
        got = _put(xs, targets)
        self.calls += 1         # transfers issued (each one or more device_put calls: `_put`)
        if sender:
            for _, route in routes:
                n = route.plan.cross_host_bytes
                self.sent_bytes += n
                self.sent_bytes_to[str(t.dst)] = self.sent_bytes_to.get(str(t.dst), 0) + n
                if route.whole:
                    self.whole_sends += 1
                else:
                    self.tile_sends += 1
        if receiver:
            out, at = {}, 0
            for j, route in routes:
                n = len(route.targets)
                out[base + (j,)] = route.arrived(got[at:at + n])
                at += n
            with self._cv:
                self._arrived.update(out)
                self._cv.notify_all()

    def _owed(self, key: tuple):
        """The leaf the compute thread sends under `key` (bounded wait)."""
        deadline = time.monotonic() + self.io_timeout
        with self._cv:
            while key not in self._outgoing:
                if self._closed:
                    raise TransferError(f"closed while waiting for {key}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the compute thread did not send {key} within {self.io_timeout:.0f} s")
                self._cv.wait(left)
            return self._outgoing.pop(key)

    def _routes_of(self, t) -> list:
        """[(leaf index, _Route)] of transfer `t`'s kind (memoised: the same every microbatch)."""
        memo = (t.kind, t.src, t.dst, t.boundary)
        got = self._routes.get(memo)
        if got is None:
            src, dst = self.geoms[t.src], self.geoms[t.dst]
            got = []
            for j, shape, dtype, axes in self.leaves(t.boundary, t.kind):
                plan = edge_plan(src, dst, axes, shape, dtype)
                got.append((j, _Route(plan, self.meshes[t.src], self.meshes[t.dst], plan.src.spec,
                                      plan.dst.spec, self.me)))
            self._routes[memo] = got
        return got


def _put(xs: list, targets: list) -> list:
    """`jax.device_put(xs, targets)` as one call per group of arrays that share their source and
    destination devices, groups in order of first appearance. One call over arrays with DIFFERENT
    device lists delivered tiles to each other's places about half the time (jax 0.10.2, CPU, the
    DCN transfer library: XLA groups them by device list and draws the groups' transfer keys in an
    order the two processes need not share); within a group the keys follow the arrays' order."""
    import jax

    groups: dict = {}
    for i, (x, t) in enumerate(zip(xs, targets)):
        key = (tuple(d.id for d in x.sharding._device_assignment), tuple(d.id for d in t._device_assignment))
        groups.setdefault(key, []).append(i)
    got: list = [None] * len(xs)
    for idx in groups.values():
        for i, y in zip(idx, jax.device_put([xs[i] for i in idx], [targets[i] for i in idx])):
            got[i] = y
    return got


def leaf_specs(spec, microbatch_rows: int):
    """`XlaTransport`'s `leaves` for a model spec: (boundary, kind) -> the leaves crossing it."""
    from orchestrator.core.edges import _inexact, leaf_dtype

    memo: dict = {}

    def leaves(boundary: int, kind: str):
        got = memo.get((boundary, kind))
        if got is None:
            outs = spec.layers[boundary - 1].outputs
            got = memo[(boundary, kind)] = [
                (j, leaf.batched(microbatch_rows), leaf_dtype(leaf.dtype), tuple(leaf.axes))
                for j, leaf in enumerate(outs) if kind == "F" or _inexact(leaf.dtype)]
        return got

    return leaves


__all__ = ["StageGeom", "TransferError", "XlaTransport", "leaf_specs", "stage_meshes"]
