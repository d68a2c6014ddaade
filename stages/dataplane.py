"""How a stage worker joins JAX, builds its mesh and its transport, per cluster `transport`.

Three small functions the worker's `setup` calls in turn, so the choice of data plane lives in
one place:
  `join_jax`        `ray`/`socket`: the stage's own JAX world as the platform's backend planned it
                    (`stages.jaxinit.initialize`: none, one per multi-host stage, or TPU
                    auto-detection); `xla`: the job's one world (`stages.jaxinit.join_world`,
                    process index = cluster host index).
  `stage_mesh`      the stage's `Mesh` from its own processes' devices, host-major.
  `make_transport`  `RayTransport`, `SocketTransport` or `XlaTransport`.
`gather` is the stage-local all-gather the worker's parameter read-out and tied weights use: a
jitted identity to the replicated sharding over the stage's own mesh, so only the stage's
processes take part (`multihost_utils.process_allgather` would need every process of the world).
"""
from __future__ import annotations

import socket

import numpy as np


def join_jax(cfg, coordinator: str | None, reservation, node_ip: str, recv_s: float) -> str | None:
    """Join JAX as `cfg.transport` needs; returns XLA's transfer address under `xla` (else None).

    `reservation`: the socket holding the coordinator's port (host 0 of a multi-host stage, or
    cluster host 0 of an `xla` world), closed once the coordinator holds the port."""
    timeout = cfg.timeouts.get("jax_distributed_init_s", 60)
    if cfg.transport == "xla":
        from stages.jaxinit import join_world

        world = sum(len(g.hosts) for g in cfg.geoms)
        step_s = float(cfg.timeouts.get("step_s", 600.0))
        # JAX declares a silent process dead (and aborts the world) only well after the driver would
        # have named it and torn the world down (`stages.jaxinit`'s module doc)
        return join_world(world, cfg.cluster_host, coordinator, node_ip, timeout, who=cfg.who,
                          reservation=reservation, transfer_timeout_s=recv_s, heartbeat_s=2 * step_s + 60)
    from stages.jaxinit import initialize

    initialize(cfg.stage_hosts, cfg.host, coordinator, timeout, who=cfg.who, reservation=reservation)
    return None


def stage_mesh(cfg):
    """This stage's named Mesh (device order checked host-major)."""
    import jax
    from jax.sharding import Mesh

    if cfg.transport == "xla":
        from stages.xla_transport import stage_meshes

        return stage_meshes(cfg.geoms)[cfg.stage]
    devices = np.array(jax.devices())
    n = int(np.prod(list(cfg.mesh.values())))
    if devices.size != n:
        raise RuntimeError(f"{cfg.who}: mesh {cfg.mesh} needs {n} devices, the stage has {devices.size}")
    owners = [d.process_index for d in devices]
    if owners != sorted(owners) or owners.count(cfg.host) != cfg.devices_per_host:
        raise RuntimeError(f"{cfg.who}: jax device order {owners} is not host-major with "
                           f"{cfg.devices_per_host} devices per host")
    return Mesh(devices.reshape(tuple(cfg.mesh.values())), tuple(cfg.mesh))


def make_transport(worker, transfer_address: str | None = None):
    """The worker's transport for `cfg.transport` (the worker's mesh, inbox and peers set)."""
    cfg = worker.cfg
    if cfg.transport == "xla":
        return _xla(worker, transfer_address)
    args = {"me": cfg.hosts[cfg.host], "geom": cfg.geoms[cfg.stage], "mesh": worker.mesh,
            "inbox": worker.inbox, "peers": lambda stage: worker.actors[stage]}
    if cfg.transport == "socket":
        from orchestrator.core.tls import TlsError
        from stages.socket_transport import SocketTransport

        try:
            return SocketTransport(**args, token=cfg.transport_token, stage=cfg.stage, geoms=cfg.geoms,
                                   io_timeout=worker.recv_s,    # then set_recv_deadline's
                                   shared_memory=cfg.transport_same_machine == "unix",
                                   tls=cfg.transport_tls, in_flight=worker._in_flight())
        except TlsError as e:        # the driver checked its own copy; this node's differs
            raise RuntimeError(f"{cfg.who} on {socket.gethostname()}: {e}") from None
    from stages.transport import RayTransport

    return RayTransport(**args)


def _xla(worker, transfer_address: str | None):
    from stages.jaxinit import listens_on
    from stages.xla_transport import XlaTransport, leaf_specs, stage_meshes

    cfg = worker.cfg
    meshes = stage_meshes(cfg.geoms)
    meshes[cfg.stage] = worker.mesh
    rows = cfg.data.global_batch // cfg.microbatches
    transport = XlaTransport(me=cfg.cluster_host, stage=cfg.stage, geoms=cfg.geoms, meshes=meshes,
                             programs=dict(cfg.transfers), leaves=leaf_specs(cfg.spec, rows),
                             io_timeout=worker.recv_s, inbox=worker.inbox)
    transport.warm_up(cfg.timeouts.get("init_s", 120.0))
    if transfer_address and not listens_on(transfer_address):
        transport.close()
        raise RuntimeError(f"{cfg.who}: XLA's transfer socket {transfer_address} is not held by this process "
                           "after the first transfer (another process took the port); refusing to continue")
    transport.transfer_address = transfer_address
    return transport


def gather(leaf) -> np.ndarray:
    """The whole of a stage array on this host: a collective over the stage's own processes only."""
    if leaf.is_fully_addressable:
        return np.asarray(leaf)
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = leaf.sharding.mesh
    whole = jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, PartitionSpec()))(leaf)
    return np.asarray(whole.addressable_data(0))
