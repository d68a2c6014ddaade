"""A minimal stage actor that moves one tensor with the pipeline's real transports.

Tests and benchmarks need the stage transports (`stages.transport.RayTransport`,
`stages.socket_transport.SocketTransport`) between actors whose meshes differ,
without models, optimizers or schedules. `ReshardProbe` builds its mesh, mailbox
and transports the way `StageWorker.setup` does and exposes the same `deliver`
entry point, so its `send` / `recv` run the very code a pipeline stage runs.

Basic flow (the driver creates the actors with `probe_options`):
  1. multi-host stages only: `coordinator_address()` on host 0, then
     `init_distributed(...)` on every host of the stage (one jax.distributed
     world per stage, as `StageWorker.setup` does);
  2. `configure(geoms, stage, host, axes, actors)` — this actor becomes host
     `host` of stage `stage` among `geoms` (every stage's `StageGeom`; `actors`
     is every stage's handles, as `StageWorker.connect` gets them). It builds the
     stage mesh (the first prod(mesh) global devices, host-major), a fresh
     mailbox, a fresh `RayTransport` and, given the run `token`, the socket
     transports of SOCKETS, whose addresses every probe then gets through
     `connect_sockets(addresses)` (`ProbeSet.configure` does all of this); call
     it again for the next case once nothing is in flight;
  3. `send(key, seed, shape, dtype, to_stage, via=...)` on every host of the source
     stage, `recv(key, shape, dtype, from_stage, via=...)` on every host of the
     destination stage (`via`: "ray" or a name in SOCKETS). The sender builds `random_array(seed, …)` with its own
     sharding; the receiver returns its addressable shards with their global
     index as JAX reports it, so the driver checks them against numpy slices.
"""
from __future__ import annotations

import os
import socket
import time
from typing import Any, Sequence

import numpy as np

from orchestrator.core.edges import StageGeom
from orchestrator.core.model.layout import partition_spec
from stages.mailbox import Mailbox


# socket transports a probe builds, by name: the pipeline's default; streams only (what peers on
# different machines use); shared memory for every payload; shared memory refused (pool full)
SOCKETS = {"socket": {}, "tcp": {"shared_memory": False}, "shm": {"shm_min_bytes": 0},
           "shm-full": {"shm_min_bytes": 0, "shm_pool_bytes": 0}}


def random_array(seed: int, shape: Sequence[int], dtype: Any = np.float32) -> np.ndarray:
    """The deterministic test tensor for `seed` (float: standard normal; int: full-range integers).

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


class ReshardProbe:
    """One host of a stage that only moves tensors (see the module docstring)."""

    def __init__(self, name: str = "probe"):
        self.name = name
        self.inbox = Mailbox(name)
        self.actors: list[list] = []
        self.geoms: tuple[StageGeom, ...] = ()
        self.stage = 0
        self.axes: tuple = ()
        self.mesh = None
        self.transports: dict = {}
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

    @property
    def transport(self):
        """The Ray-call transport (always built by `configure`)."""
        return self.transports["ray"]

    def configure(self, geoms: Sequence[StageGeom], stage: int, host: int, axes: Sequence[str | None],
                  actors: Sequence[Sequence], token: bytes | None = None) -> dict:
        """Become host `host` (index in `geoms[stage].hosts`) of stage `stage`; returns the mesh's device
        ids and, with `token`, the socket transport's listening address."""
        import jax
        from jax.sharding import Mesh

        from stages.socket_transport import SocketTransport
        from stages.transport import RayTransport

        geom = geoms[stage]
        shape = tuple(n for _, n in geom.mesh)
        n = int(np.prod(shape))
        devices = list(jax.devices())
        if len(devices) < n:
            raise RuntimeError(f"{self.name}: mesh {dict(geom.mesh)} needs {n} devices, have {len(devices)}")
        devices = devices[:n]
        owners = [d.process_index for d in devices]
        if owners != sorted(owners) or owners.count(jax.process_index()) != geom.devices_per_host:
            raise RuntimeError(f"{self.name}: device owners {owners} do not match host {host} of {geom}")
        self.geoms, self.stage, self.axes = tuple(geoms), stage, tuple(axes)
        self.actors = [list(row) for row in actors]
        self.mesh = Mesh(np.array(devices).reshape(shape), tuple(name for name, _ in geom.mesh))
        # a fresh mailbox per case: nothing a failed earlier case left behind can be taken by this one
        self.inbox.close("reconfigured")
        self._close_transports()
        self.inbox, self.delivered = type(self.inbox)(self.name), []
        args = {"me": geom.hosts[host], "geom": geom, "mesh": self.mesh, "inbox": self.inbox,
                "peers": lambda s: self.actors[s]}
        self.transports = {"ray": RayTransport(**args)}
        if token:
            for name, options in SOCKETS.items():
                self.transports[name] = SocketTransport(**args, token=token, stage=stage, geoms=self.geoms,
                                                        io_timeout=60.0, **options)
        return {"mesh": [d.id for d in devices], "local": [i for i, _ in self.transport.local],
                "addresses": {name: self.transports[name].address for name in SOCKETS} if token else None}

    def connect_sockets(self, addresses: dict) -> None:
        """Every stage's hosts' socket addresses ([stage][host]), per socket transport name."""
        for name, rows in addresses.items():
            self.transports[name].connect(rows)

    def expect(self, shape: Sequence[int], dtype: Any, from_stage: int) -> None:
        """Let every socket transport accept `shape`/`dtype` from `from_stage` (before it is sent)."""
        for name in SOCKETS:
            if name in self.transports:
                self.transports[name].expect(self.edge(from_stage), tuple(shape), np.dtype(dtype))

    def transport_counts(self) -> dict:
        """Per socket transport: payloads sent through shared memory and as streams."""
        return {name: {"shm": t.shm_sends, "stream": t.stream_sends}
                for name, t in self.transports.items() if name in SOCKETS}

    def _close_transports(self) -> None:
        for t in self.transports.values():
            t.close()
        self.transports = {}

    def edge(self, stage: int):
        """The transport's view of the boundary with `stage` for this probe's tensor."""
        from stages.transport import Edge

        return Edge(stage, self.geoms[stage], self.axes)

    def deliver(self, key, payload) -> None:
        self.delivered.append(tuple(key))
        self.inbox.put(key, payload)

    def mailbox_state(self) -> dict:
        """Keys delivered since the last call (then forgotten) and how many items wait untaken."""
        keys, self.delivered = self.delivered, []
        return {"delivered": keys, "pending": len(self.inbox)}

    def shutdown(self) -> None:
        self.inbox.close("shutdown")
        self._close_transports()
        if self._stage_hosts > 1:
            import jax

            jax.distributed.shutdown()

    # -- moving one tensor -------------------------------------------------------
    def sharding(self):
        from jax.sharding import NamedSharding, PartitionSpec

        layout = dict(self.geoms[self.stage].layout)
        return NamedSharding(self.mesh, PartitionSpec(*partition_spec(self.axes, layout)))

    def source_array(self, seed: int, shape: Sequence[int], dtype: Any = np.float32):
        """`random_array(seed, …)` as a jax.Array with this stage's sharding (each host fills its own shards)."""
        import jax

        host = random_array(seed, shape, dtype)
        return jax.block_until_ready(jax.make_array_from_callback(tuple(shape), self.sharding(),
                                                                  lambda idx: host[idx]))

    def send(self, key: tuple, seed: int, shape: Sequence[int], dtype: Any, to_stage: int,
             timeout: float = 60.0, via: str = "ray") -> dict:
        """Send `random_array(seed, shape, dtype)` to stage `to_stage`; returns bytes pushed and seconds."""
        array = self.source_array(seed, shape, dtype)
        transport = self.transports[via]
        before = transport.sent_bytes
        t0 = time.perf_counter()
        transport.send(tuple(key), array, self.edge(to_stage))
        t1 = time.perf_counter()
        transport.flush(timeout)
        return {"sent_bytes": transport.sent_bytes - before, "send_s": t1 - t0,
                "flushed_s": time.perf_counter() - t0}

    def recv(self, key: tuple, shape: Sequence[int], dtype: Any, from_stage: int, timeout: float = 60.0,
             via: str = "ray") -> dict:
        """Receive from stage `from_stage`; returns this host's shards as JAX places them.

        Returns:
          {"shards": [(index, data)], "full": global numpy array or None, "sharding_ok": bool}
          where index is the shard's global (start, stop) per dim from `Shard.index`,
          and "full" is set only when this host holds the whole array.
        """
        import jax

        sharding = self.sharding()
        array = self.transports[via].recv(tuple(key), tuple(shape), np.dtype(dtype), sharding,
                                          self.edge(from_stage), timeout)
        jax.block_until_ready(array)
        shards = []
        for s in array.addressable_shards:
            index = tuple((sl.indices(n)[0], sl.indices(n)[1]) for sl, n in zip(s.index, array.shape))
            shards.append((index, np.asarray(s.data)))
        return {"shards": shards, "full": np.asarray(array) if array.is_fully_addressable else None,
                "sharding_ok": array.sharding == sharding and array.dtype == np.dtype(dtype),
                "pid": os.getpid()}


class ProbeSet:
    """The actors the reshard tests and benchmark use, by role.

    `a`: one 8-device host (stage A); `b`: one 8-device host (stage B);
    `pair`: a 2-host × 2-device stage B that `start` joins into one JAX world.
    `close` shuts them down and kills them (bounded, idempotent).
    """

    def __init__(self, ray, cls: type = ReshardProbe, timeout: float = 60.0):
        remote = ray.remote(concurrency_groups={"io": 4})(cls)
        self.ray, self.timeout = ray, timeout
        self.a = remote.options(**probe_options(8)).remote("stage A host 0")
        self.b = remote.options(**probe_options(8)).remote("stage B host 0")
        self.pair = [remote.options(**probe_options(2)).remote(f"stage B host {i}") for i in range(2)]

    def start(self) -> list[dict]:
        """Join the two-host stage's own JAX world (bounded); returns each host's world info."""
        coord = self.ray.get(self.pair[0].coordinator_address.remote(), timeout=self.timeout)
        return self.ray.get([p.init_distributed.remote(coord, 2, i, 60) for i, p in enumerate(self.pair)],
                            timeout=self.timeout + 60)

    def stage_b(self, geom: StageGeom) -> list:
        return self.pair if len(geom.hosts) == 2 else [self.b]

    def configure(self, geoms: Sequence[StageGeom], axes: Sequence[str | None], token: bytes) -> list[list]:
        """Make actor "a" stage 0 and `stage_b(geoms[1])` stage 1, every transport connected.

        Returns the actors per stage.
        """
        actors = [[self.a], self.stage_b(geoms[1])]
        got = self.ray.get([x.configure.remote(geoms, stage, i, axes, actors, token)
                            for stage, row in enumerate(actors) for i, x in enumerate(row)], timeout=self.timeout)
        addresses = {name: [[g["addresses"][name] for g in got[:1]], [g["addresses"][name] for g in got[1:]]]
                     for name in SOCKETS}
        self.ray.get([x.connect_sockets.remote(addresses) for row in actors for x in row], timeout=self.timeout)
        return actors

    def close(self) -> None:
        actors = [self.a, self.b, *self.pair]
        try:
            self.ray.wait([x.shutdown.remote() for x in actors], num_returns=len(actors), timeout=10)
        finally:
            for x in actors:
                self.ray.kill(x, no_restart=True)
