"""A minimal stage actor that moves one tensor with the pipeline's real transport.

Tests and benchmarks need `stages.transport.RayTransport` between two actors
whose meshes differ, without models, optimizers or schedules. `ReshardProbe`
carries exactly the attributes `RayTransport` reads from a `StageWorker`
(`cfg`, `mesh`, `inbox`, `prev`, `next`) and the same `deliver` entry point,
so a probe's `send` / `recv` run the very code a pipeline stage runs.

Basic flow (the driver creates the actors with `probe_options`):
  1. multi-host stages only: `coordinator_address()` on host 0, then
     `init_distributed(...)` on every host of the stage (a jax.distributed world
     per stage, as `StageWorker.setup` does);
  2. `configure(geom, host, axes, prev_geom=…, next_geom=…, prev=…, next=…)` —
     builds the stage mesh (the first `prod(mesh)` global devices, host-major)
     and a fresh `RayTransport`; can be called again for the next case;
  3. `send(key, seed, shape, dtype, direction)` on every host of the source
     stage, `recv(key, shape, dtype, direction)` on every host of the
     destination stage. The sender builds `random_array(seed, …)` with its own
     sharding; the receiver returns its addressable shards with their global
     index as JAX reports it, so the driver checks them against numpy slices.

`direction` is the transport's: "next" sends like SEND_F and receives like
RECV_B's peer; "prev" is the gradient direction.
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from orchestrator.edges import StageGeom
from stages.layout import partition_spec
from stages.mailbox import Mailbox


def random_array(seed: int, shape: Sequence[int], dtype: Any = np.float32) -> np.ndarray:
    """The deterministic test tensor for `seed` (float: standard normal; int: full range bits).

    Example:
        >>> a = random_array(0, (2, 3))
        >>> a.dtype, a.shape, bool((a == random_array(0, (2, 3))).all())
        (dtype('float32'), (2, 3), True)
    """
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(tuple(shape), dtype=np.float32).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, tuple(shape), dtype=dtype, endpoint=True)


def probe_options(devices: int, num_cpus: float = 0.25) -> dict:
    """Actor options: `devices` simulated CPU devices, set before jax loads in the actor."""
    return {"num_cpus": num_cpus, "max_restarts": 0, "runtime_env": {"env_vars": {
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}}}


@dataclass(frozen=True)
class _Layer:
    out_axes: tuple


@dataclass(frozen=True)
class _OneLayerSpec:
    """Stands in for `ModelSpec`: one layer whose output carries the probe's axes."""

    layers: tuple[_Layer, ...]


@dataclass(frozen=True)
class ProbeConfig:
    """The fields of `stages.worker.WorkerConfig` that `RayTransport` reads.

    `layers == (1, 1)` with a one-layer spec makes the transport's "prev" and
    "next" axes both the probe's `axes`.
    """

    hosts: tuple[int, ...]
    host: int
    mesh: Mapping[str, int]
    layout: Mapping[str, Any]
    devices_per_host: int
    spec: _OneLayerSpec
    layers: tuple[int, int]
    prev_geom: StageGeom | None
    next_geom: StageGeom | None

    @staticmethod
    def of(geom: StageGeom, host: int, axes: Sequence[str | None], prev_geom: StageGeom | None = None,
           next_geom: StageGeom | None = None) -> "ProbeConfig":
        return ProbeConfig(hosts=geom.hosts, host=host, mesh=dict(geom.mesh), layout=dict(geom.layout),
                           devices_per_host=geom.devices_per_host,
                           spec=_OneLayerSpec((_Layer(tuple(axes)),)), layers=(1, 1),
                           prev_geom=prev_geom, next_geom=next_geom)


class ReshardProbe:
    """One host of a stage that only moves tensors (see the module docstring)."""

    def __init__(self, name: str = "probe"):
        self.name = name
        self.inbox = Mailbox(name)
        self.prev: list = []
        self.next: list = []
        self.cfg: ProbeConfig | None = None
        self.mesh = None
        self.transport = None
        self.axes: tuple = ()
        self.delivered: list = []
        self._stage_hosts = 1

    # -- lifecycle -----------------------------------------------------------
    def coordinator_address(self) -> str:
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def init_distributed(self, coordinator: str, num_processes: int, process_id: int,
                         timeout_s: int = 60) -> dict:
        import jax

        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id, initialization_timeout=int(timeout_s))
        self._stage_hosts = num_processes
        return {"process": jax.process_index(), "devices": [d.id for d in jax.devices()],
                "local": [d.id for d in jax.local_devices()]}

    def configure(self, geom: StageGeom, host: int, axes: Sequence[str | None],
                  prev_geom: StageGeom | None = None, next_geom: StageGeom | None = None,
                  prev: Sequence = (), next: Sequence = ()) -> dict:
        """Become host `host` (index in `geom.hosts`) of the stage `geom`; returns the mesh's device ids."""
        import jax
        from jax.sharding import Mesh

        from stages.transport import RayTransport

        shape = tuple(n for _, n in geom.mesh)
        n = int(np.prod(shape))
        devices = list(jax.devices())
        if len(devices) < n:
            raise RuntimeError(f"{self.name}: mesh {dict(geom.mesh)} needs {n} devices, have {len(devices)}")
        devices = devices[:n]
        owners = [d.process_index for d in devices]
        if owners != sorted(owners) or owners.count(jax.process_index()) != geom.devices_per_host:
            raise RuntimeError(f"{self.name}: device owners {owners} do not match host {host} of {geom}")
        self.mesh = Mesh(np.array(devices).reshape(shape), tuple(name for name, _ in geom.mesh))
        self.cfg = ProbeConfig.of(geom, host, axes, prev_geom, next_geom)
        self.axes = tuple(axes)
        self.prev, self.next = list(prev), list(next)
        self.transport = RayTransport(self)
        return {"mesh": [d.id for d in devices], "local": [i for i, _ in self.transport.local]}

    def deliver(self, key, payload) -> None:
        self.delivered.append(tuple(key))
        self.inbox.put(key, payload)

    def mailbox_state(self) -> dict:
        """Keys delivered since the last call (then forgotten) and how many items wait untaken."""
        keys, self.delivered = self.delivered, []
        return {"delivered": keys, "pending": len(self.inbox)}

    def shutdown(self) -> None:
        self.inbox.close("shutdown")
        if self._stage_hosts > 1:
            import jax

            jax.distributed.shutdown()

    # -- moving one tensor -------------------------------------------------------
    def sharding(self):
        from jax.sharding import NamedSharding, PartitionSpec

        return NamedSharding(self.mesh, PartitionSpec(*partition_spec(self.axes, dict(self.cfg.layout))))

    def source_array(self, seed: int, shape: Sequence[int], dtype: Any = np.float32):
        """`random_array(seed, …)` as a jax.Array with this stage's sharding (each host fills its own shards)."""
        import jax

        host = random_array(seed, shape, dtype)
        return jax.block_until_ready(jax.make_array_from_callback(tuple(shape), self.sharding(),
                                                                  lambda idx: host[idx]))

    def send(self, key: tuple, seed: int, shape: Sequence[int], dtype: Any = np.float32,
             direction: str = "next", timeout: float = 60.0) -> dict:
        """Send `random_array(seed, shape, dtype)` along `direction`; returns bytes pushed and seconds."""
        array = self.source_array(seed, shape, dtype)
        before = self.transport.sent_bytes
        t0 = time.perf_counter()
        self.transport.send(tuple(key), array, direction)
        t1 = time.perf_counter()
        self.transport.flush(timeout)
        return {"sent_bytes": self.transport.sent_bytes - before, "send_s": t1 - t0,
                "flushed_s": time.perf_counter() - t0}

    def recv(self, key: tuple, shape: Sequence[int], dtype: Any = np.float32, direction: str = "prev",
             timeout: float = 60.0) -> dict:
        """Receive along `direction`; returns this host's shards as JAX places them.

        Returns:
          {"shards": [(index, data)], "full": global numpy array or None, "sharding_ok": bool}
          where index is the shard's global (start, stop) per dim from `Shard.index`,
          and "full" is set only when this host holds the whole array.
        """
        import jax

        sharding = self.sharding()
        array = self.transport.recv(tuple(key), tuple(shape), np.dtype(dtype), sharding, direction, timeout)
        jax.block_until_ready(array)
        shards = []
        for s in array.addressable_shards:
            index = tuple((sl.indices(n)[0], sl.indices(n)[1]) for sl, n in zip(s.index, array.shape))
            shards.append((index, np.asarray(s.data)))
        return {"shards": shards, "full": np.asarray(array) if array.is_fully_addressable else None,
                "sharding_ok": array.sharding == sharding and array.dtype == np.dtype(dtype),
                "pid": os.getpid()}
