"""A stage host's I/O: its transport, its edges, its rows of the batch, and the few scalars stages swap.

Basic flow: `StageWorker.setup` builds one `StageIO` after the stage's programs
(`make_transport` picks the transport by `cluster.transport`, `plan_edges` says what
crosses each chunk's boundaries); `connect` hands it every stage's actor handles. The
step's handlers (`stages.actions`) reach the rest of the pipeline only through it:
`transport.send` / `recv_operand` along `edge_in` / `edge_out`, `host_operand` for this
host's rows of the batch, `sum_over_stages` (the global gradient norm's square, the
loss-scale's non-finite counts) and `exchange_tie` (a tied array's gradient).

Invariants:
  - Every wait here has a deadline (the handler's `timeout`).
  - Host 0 of a stage sends its scalar for the stage (every host of a stage holds the same
    value: its arrays are global), every host takes one from each other stage.
  - A new transport is one entry in `TRANSPORTS` (a class taking `TRANSPORT_ARGS`).
"""
from __future__ import annotations

import dataclasses
import socket

import numpy as np

from orchestrator.core.contract import WorkerConfig


def plan_edges(cfg: WorkerConfig, transport=None) -> tuple[list, list]:
    """Per chunk: where its input comes from and its output goes (virtual stage c·p + s ± 1), one
    (Edge, global shape, dtype) per leaf of the activation that crosses; None where it does not.
    With `transport`, tells it what may arrive (`Transport.expect`: activations in, gradients back)."""
    from orchestrator.core.edges import leaf_dtype
    from stages.transport import Edge

    p, v = cfg.num_stages, len(cfg.layer_chunks)

    def leaves(layer: int, peer: int):
        geom = cfg.geoms[peer % p]
        return [(Edge(peer % p, geom, tuple(leaf.axes)), leaf.batched(cfg.microbatch_size), leaf_dtype(leaf.dtype))
                for leaf in cfg.spec.layers[layer].outputs]

    edge_in, edge_out = [], []
    for c, (start, stop) in enumerate(cfg.layer_chunks):
        virtual = c * p + cfg.stage
        before, after = virtual - 1, virtual + 1
        edge_in.append(None if before < 0 else leaves(start - 1, before))
        edge_out.append(None if after >= p * v else leaves(stop - 1, after))
        if transport is not None:
            for edge, shape, dtype in (edge_in[c] or []) + (edge_out[c] or []):
                transport.expect(edge, shape, dtype)
    return edge_in, edge_out


def in_flight(cfg: WorkerConfig) -> int:
    """How many tensors of one expected kind (one edge leaf) may have arrived here and not been
    taken yet: a training step's microbatches (the next step's cannot come before this host
    has taken them: a sender needs this stage's gradients first), plus every evaluation
    batch's (forward-only: the first stage may run all of them ahead), with one more step's
    worth as margin. The socket transport refuses a connection that makes it hold more."""
    return cfg.microbatches * (2 + (cfg.data.eval_batches if cfg.data is not None else 0))


def _ray_transport(cfg: WorkerConfig, args: dict, io_timeout: float, transfer_address=None):
    from stages.transport import RayTransport

    return RayTransport(**args)


def _socket_transport(cfg: WorkerConfig, args: dict, io_timeout: float, transfer_address=None):
    from orchestrator.core.tls import TlsError
    from stages.socket_transport import SocketTransport

    tls = cfg.transport.tls
    try:
        return SocketTransport(**args, token=cfg.transport.token, stage=cfg.stage, geoms=cfg.geoms,
                               io_timeout=io_timeout,    # then set_recv_deadline's
                               shared_memory=cfg.transport.same_machine == "unix",
                               tls=None if tls is None else dataclasses.asdict(tls), in_flight=in_flight(cfg))
    except TlsError as e:        # the driver checked its own copy; this node's differs
        raise RuntimeError(f"{cfg.who} on {socket.gethostname()}: {e}") from None


def _xla_transport(cfg: WorkerConfig, args: dict, io_timeout: float, transfer_address=None):
    """XLA's own transfers in the job's one JAX world (`stages.dataplane.join_jax` joined it and
    returned `transfer_address`, the socket XLA's transfer server must hold)."""
    from stages.jaxinit import listens_on
    from stages.xla_transport import XlaTransport, leaf_specs, stage_meshes

    meshes = stage_meshes(cfg.geoms)
    meshes[cfg.stage] = args["mesh"]
    transport = XlaTransport(me=cfg.cluster_host, stage=cfg.stage, geoms=cfg.geoms, meshes=meshes,
                             programs=cfg.transport.orders(), leaves=leaf_specs(cfg.spec, cfg.microbatch_size),
                             io_timeout=io_timeout, inbox=args["inbox"])
    transport.warm_up(cfg.timeouts.init_s)
    if transfer_address and not listens_on(transfer_address):
        transport.close()
        raise RuntimeError(f"{cfg.who}: XLA's transfer socket {transfer_address} is not held by this process "
                           "after the first transfer (another process took the port); refusing to continue")
    transport.transfer_address = transfer_address
    return transport


# cluster.transport -> (cfg, {me, geom, mesh, inbox, peers}, io timeout, XLA's transfer address)
#   -> a stages.transport.Transport
TRANSPORTS = {"ray": _ray_transport, "socket": _socket_transport, "xla": _xla_transport}


def make_transport(cfg: WorkerConfig, mesh, inbox, peers, io_timeout: float, transfer_address: str | None = None):
    """This host's transport of kind `cfg.transport.kind` (`TRANSPORTS`); `transfer_address`: under
    `xla`, what `stages.dataplane.join_jax` returned."""
    make = TRANSPORTS.get(cfg.transport.kind)
    if make is None:
        raise ValueError(f"{cfg.who}: cluster.transport = {cfg.transport.kind!r}: this stage runtime knows "
                         f"{', '.join(sorted(TRANSPORTS))}")
    args = {"me": cfg.stage_spec.hosts[cfg.host], "geom": cfg.geoms[cfg.stage], "mesh": mesh, "inbox": inbox,
            "peers": peers}
    return make(cfg, args, io_timeout, transfer_address)


class StageIO:
    """See the module docstring.

    Attributes:
      transport: the stage's `stages.transport.Transport`.
      edge_in, edge_out: per chunk, `plan_edges`' leaves (None at the pipeline's ends).
      rows_in, rows_lab: this host's rows of a microbatch's inputs (first stage) and labels (last), or None.
      actors: every stage's actor handles ([stage][host]), set by `StageWorker.connect`.
    """

    def __init__(self, cfg: WorkerConfig, transport, inbox, rows_in=None, rows_lab=None):
        self.cfg, self.transport, self.inbox = cfg, transport, inbox
        self.rows_in, self.rows_lab = rows_in, rows_lab
        self.edge_in, self.edge_out = plan_edges(cfg, transport)
        self.actors: list[list] = []

    def host_operand(self, local, rows, shape, sharding):
        """This host's rows of a microbatch as the jitted program's operand."""
        if self.transport.single_device:
            return local                  # one device: the host holds every row (see recv_operand)
        from stages.data import rows_array

        return rows_array(local, rows, shape, sharding)

    def sum_over_stages(self, step: int, local: float, timeout: float, tag: str = "NORM") -> float:
        """`local` summed over every stage (see the module docstring): host 0 of each stage sends its
        scalar to every host of the other stages, each host adds what the others sent."""
        cfg = self.cfg
        if cfg.num_stages == 1:
            return local
        refs = []
        if cfg.host == 0:
            for s, row in enumerate(self.actors):
                if s != cfg.stage:
                    refs += [a.deliver.options(concurrency_group="io").remote((step, tag, cfg.stage), local)
                             for a in row]
        total = local + sum(float(self.inbox.take((step, tag, s), timeout))
                            for s in range(cfg.num_stages) if s != cfg.stage)
        _settle(refs, timeout)
        return total

    def exchange_tie(self, step: int, tie: int, mine: np.ndarray, timeout: float) -> np.ndarray:
        """A tied array's gradient swapped with the stage holding the tie's other side
        (`stages.ties`): host 0 sends this stage's (global) array to every host of that stage,
        every host takes the one that stage's host 0 sent (bounded wait)."""
        cfg = self.cfg
        a, b = cfg.tie_stages[tie]
        peer = b if cfg.stage == a else a
        refs = []
        if cfg.host == 0:
            refs = [h.deliver.options(concurrency_group="io").remote((step, "TIE", tie, cfg.stage), mine)
                    for h in self.actors[peer]]
        got = self.inbox.take((step, "TIE", tie, peer), timeout)
        _settle(refs, timeout)
        return got


def _settle(refs: list, timeout: float) -> None:
    if refs:
        import ray

        ray.get(refs, timeout=timeout)
