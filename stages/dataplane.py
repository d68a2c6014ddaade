"""How a stage worker joins JAX, builds its mesh and its transport, per cluster `transport`.

Two small functions the worker's `setup` calls before it builds its programs, so the choice of
JAX world lives in one place (the transport itself is one entry of `stages.stage_io.TRANSPORTS`):
  `join_jax`        `ray`/`socket`: the stage's own JAX world as the platform's backend planned it
                    (`stages.jaxinit.initialize`: none, one per multi-host stage, or TPU
                    auto-detection); `xla`: the job's one world (`stages.jaxinit.join_world`,
                    process index = cluster host index).
  `stage_mesh`      the stage's `Mesh` from its own processes' devices, host-major.
`gather` is the stage-local all-gather the worker's parameter read-out and tied weights use: a
jitted identity to the replicated sharding over the stage's own mesh, so only the stage's
processes take part (`multihost_utils.process_allgather` would need every process of the world).
"""
from __future__ import annotations

import numpy as np

from orchestrator.core.contract import WorkerConfig


def join_jax(cfg: WorkerConfig, coordinator: str | None, reservation, node_ip: str, recv_s: float) -> str | None:
    """Join JAX as `cfg.transport.kind` needs; returns XLA's transfer address under `xla` (else None).

    `reservation`: the socket holding the coordinator's port (host 0 of a multi-host stage, or
    cluster host 0 of an `xla` world), closed once the coordinator holds the port."""
    timeout = cfg.timeouts.jax_distributed_init_s
    if cfg.transport.kind == "xla":
        from stages.jaxinit import join_world

        step_s = float(cfg.timeouts.step_s)
        # JAX declares a silent process dead (and aborts the world) only well after the driver would
        # have named it and torn the world down (`stages.jaxinit`'s module doc)
        return join_world(cfg.world_size, cfg.cluster_host, coordinator, node_ip, timeout, who=cfg.who,
                          reservation=reservation, transfer_timeout_s=recv_s, heartbeat_s=2 * step_s + 60)
    from stages.jaxinit import initialize

    initialize(cfg.stage_hosts, cfg.host, coordinator, timeout, who=cfg.who, reservation=reservation)
    return None


def stage_mesh(cfg: WorkerConfig):
    """This stage's named Mesh (device order checked host-major)."""
    import jax
    from jax.sharding import Mesh

    if cfg.transport.kind == "xla":
        from stages.xla_transport import stage_meshes

        return stage_meshes(cfg.geoms)[cfg.stage]
    devices = np.array(jax.devices())
    shape = cfg.stage_spec.mesh_shape
    n = int(np.prod(list(shape.values())))
    if devices.size != n:
        raise RuntimeError(f"{cfg.who}: mesh {shape} needs {n} devices, the stage has {devices.size}")
    owners = [d.process_index for d in devices]
    if owners != sorted(owners) or owners.count(cfg.host) != cfg.stage_spec.devices_per_host:
        raise RuntimeError(f"{cfg.who}: jax device order {owners} is not host-major with "
                           f"{cfg.stage_spec.devices_per_host} devices per host")
    return Mesh(devices.reshape(tuple(shape.values())), tuple(shape))


def gather(leaf) -> np.ndarray:
    """The whole of a stage array on this host: a collective over the stage's own processes only."""
    if leaf.is_fully_addressable:
        return np.asarray(leaf)
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = leaf.sharding.mesh
    whole = jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, PartitionSpec()))(leaf)
    return np.asarray(whole.addressable_data(0))
