"""What a job's data plane listens on, per cluster `transport` (pure; `meshpipe plan` prints it).

Each row: who listens (which actors), on what address and port, whether a client must
authenticate, and what a client who reaches it can do. The actors bind the node address Ray
reports for them (127.0.0.1 on an embedded cluster), never all interfaces; `tests/test_xla_pipeline.py`
reads the listening sockets of a run's processes back and finds none on 0.0.0.0.

Under `transport: xla` the job is one JAX world, and nothing of it is authenticated: JAX's
coordinator (a gRPC key-value store and barriers), XLA's transfer library (its control socket and
data sockets carry the tensors themselves on CPU, and on GPU/TPU when the platform has no
transfers of its own) and the collectives (gloo on CPU, NCCL on GPU) — the trust model of NCCL
on a private cluster network: whoever can reach those ports can read or disturb the training.
"""
from __future__ import annotations

__all__ = ["listeners"]

_UNAUTH = "none (unauthenticated)"


def listeners(checked) -> list[dict]:
    """The listening sockets the job's stage actors open, one row per kind (see the module doc).

    Example:
        >>> from types import SimpleNamespace as NS
        >>> cl = NS(data_plane="xla", platform="cpu", transport="auto", transport_same_machine="unix",
        ...         transport_tls=None)
        >>> checked = NS(cluster=cl, stages=[NS(index=0, hosts=(0, 1)), NS(index=1, hosts=(2,))])
        >>> [r["listener"] for r in listeners(checked)]
        ['jax coordinator (the world)', 'XLA transfer control socket', 'XLA transfer data sockets', 'gloo collectives']
    """
    cl = checked.cluster
    plane, stages = cl.data_plane, checked.stages
    every = "every stage actor"
    multi = [s.index for s in stages if len(s.hosts) > 1]
    rows = []
    if plane == "xla":
        rows.append(_row("jax coordinator (the world)", "cluster host 0's actor", "node address, a port picked at setup",
                         _UNAUTH, "the world's key-value store and barriers: stall or break its start-up, "
                         "heartbeats and every transfer's metadata"))
        rows.append(_row("XLA transfer control socket", every, "node address, a port picked at setup",
                         _UNAUTH, "request or offer tensors of the transfers under way"))
        rows.append(_row("XLA transfer data sockets", every, "node address, 4 ephemeral ports",
                         _UNAUTH, "read or corrupt the activations and gradients in flight"))
        collectives = "gloo collectives" if cl.platform == "cpu" else "NCCL" if cl.platform == "gpu" else None
        if collectives and (multi or cl.platform == "gpu"):
            rows.append(_row(collectives, every if cl.platform == "gpu" else f"stages {multi}",
                             "the node's address, ephemeral ports", _UNAUTH,
                             "read or corrupt a stage's collectives (gradients, tensor-parallel partial sums)"))
        return rows
    if plane == "socket":
        tls = cl.transport_tls is not None
        rows.append(_row("meshpipe transport (TCP)", every, "node address, an ephemeral port",
                         "the run key (challenge-response)" + (" inside mutual TLS" if tls else ""),
                         "without the key: nothing; with it: send tensors the receiver expects"))
        if cl.transport_same_machine == "unix":
            rows.append(_row("meshpipe transport (abstract Unix socket)", every, "@meshpipe-<16 hex>, this machine",
                             "the run key (challenge-response)", "as the TCP listener, from this machine"))
    for s in multi:
        rows.append(_row(f"jax coordinator (stage {s})", f"stage {s} host 0", "node address, a port picked at setup",
                         _UNAUTH, "that stage's key-value store and barriers: stall its start-up and heartbeats"))
    return rows


def _row(listener: str, who: str, binds: str, auth: str, can: str) -> dict:
    return {"listener": listener, "who": who, "binds": binds, "authentication": auth, "a client can": can}
