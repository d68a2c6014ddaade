"""Moving tensors between stages along a resharding plan.

The schedule decides *when* a tensor moves; the transport decides *how*. The
plan (`orchestrator.reshard`, pure) says which tiles of which source shard each
destination host needs; this module executes it with Ray:

  send:  the sender cuts the tiles for each destination host out of its own
         addressable shards (`reshard.pack`) and pushes them as ONE call into
         that host's mailbox (`deliver`), keyed (step, kind, microbatch, src host).
  recv:  the receiver takes one payload per sending host (bounded wait),
         assembles its local shards (`reshard.assemble`), puts each on its device
         and builds the global `jax.Array` with the destination sharding.
No host ever gathers the whole tensor unless its own shards are the whole tensor.

`Transport` is the interface the worker uses; a faster transport (e.g. NCCL
between GPU hosts) can replace `RayTransport` without touching the plan.
"""
from __future__ import annotations

import numpy as np

from orchestrator.edges import StageGeom, edge_plan
from orchestrator.reshard import assemble, pack


class Transport:
    """What the stage worker needs: send/recv along an edge, and a host → device helper."""

    def send(self, key: tuple, array, direction: str) -> None:
        raise NotImplementedError

    def recv(self, key: tuple, shape: tuple, dtype, sharding, direction: str, timeout: float):
        raise NotImplementedError

    def flush(self, timeout: float) -> None:
        raise NotImplementedError

    @staticmethod
    def from_host(arr: np.ndarray, sharding):
        """A host-side global array (identical on every host of the stage) as a sharded jax.Array."""
        import jax

        return jax.make_array_from_callback(arr.shape, sharding, lambda idx: arr[idx])


class RayTransport(Transport):
    def __init__(self, worker):
        import jax

        cfg = worker.cfg
        self.worker = worker
        self.me = cfg.hosts[cfg.host]
        self.geom = StageGeom.of(cfg.mesh, cfg.hosts, cfg.devices_per_host, cfg.layout)
        self.peer_geom = {"prev": cfg.prev_geom, "next": cfg.next_geom}
        spec = cfg.spec
        self.axes = {"prev": spec.layers[cfg.layers[0] - 1].out_axes if cfg.layers[0] > 0 else None,
                     "next": spec.layers[cfg.layers[1] - 1].out_axes}
        devices = list(worker.mesh.devices.flat)
        self.flat = {d.id: i for i, d in enumerate(devices)}
        me = jax.process_index()
        self.local = [(i, d) for i, d in enumerate(devices) if d.process_index == me]
        self.sent_bytes = 0
        self.sent_bytes_to = {"prev": 0, "next": 0}   # the same, per neighbour (telemetry)
        self._inflight: list = []

    def _peers(self, direction: str) -> list:
        return self.worker.next if direction == "next" else self.worker.prev

    def send(self, key, array, direction):
        peer_geom = self.peer_geom[direction]
        plan = edge_plan(self.geom, peer_geom, self.axes[direction], array.shape, array.dtype)
        by_device = {self.flat[s.device.id]: s for s in array.addressable_shards}
        peers = self._peers(direction)
        for dst_host, tiles in plan.sends.get(self.me, {}).items():
            if not tiles:
                continue
            shards = {d: np.asarray(by_device[d].data) for d in {t.src_device for t in tiles}}
            payload = pack(plan, self.me, dst_host, shards)
            self.sent_bytes += sum(p.nbytes for p in payload)
            self.sent_bytes_to[direction] += sum(p.nbytes for p in payload)
            peer = peers[peer_geom.hosts.index(dst_host)]
            self._inflight.append(peer.deliver.options(concurrency_group="io").remote((*key, self.me), payload))

    def recv(self, key, shape, dtype, sharding, direction, timeout):
        import jax

        plan = edge_plan(self.peer_geom[direction], self.geom, self.axes[direction], shape, dtype)
        received = {src: self.worker.inbox.take((*key, src), timeout)
                    for src, per_dst in plan.sends.items() if per_dst.get(self.me)}
        local = assemble(plan, self.me, received)
        arrays = [jax.device_put(local[i], d) for i, d in self.local]
        return jax.make_array_from_single_device_arrays(tuple(shape), sharding, arrays)

    def flush(self, timeout):
        """Wait (bounded) until this step's pushes were accepted; surfaces a dead receiver."""
        import ray

        if self._inflight:
            ray.get(self._inflight, timeout=timeout)
        self._inflight.clear()


def make_transport(worker) -> Transport:
    return RayTransport(worker)
