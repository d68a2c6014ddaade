"""Worker side of `orchestrator.core.backends.jaxinit`: join this stage's JAX world.

The driver put a `JaxInit` value into the actor's environment (`MESHPIPE_JAX_INIT`);
`initialize` reads it back, calls `jax.distributed.initialize` as planned and checks
that jax gave this process the index the plan expects.

The coordinator port (explicit mode, host 0 of the stage) is reserved without a race:
`reserve_port` binds a free port with SO_REUSEPORT and the actor keeps that socket
(bound, never listening) until `jax.distributed.initialize` has bound its gRPC server on
the same port — gRPC sets SO_REUSEPORT too, and Linux lets only sockets of the same
effective uid share a port that way, so no other local user can take it in between
(a bind-then-close pick left a window for exactly that). Where SO_REUSEPORT is missing,
the port is picked by bind-then-close; either way, host 0 checks afterwards that its own
process listens on the port (`coordinator_is_ours`) and refuses to continue otherwise.
`tests/test_jaxinit_port.py` checks both halves against the installed jax.

One world per job (cluster `transport: xla`, `join_world`): every stage actor is one process of
one `jax.distributed` world — process index = its cluster host index — whose coordinator runs in
cluster host 0's actor, reserved as above. XLA's cross-host transfer library is bound to the node
address too: its control socket on a port picked here (`jax_cross_host_transfer_socket_address`:
XLA publishes that address as given, so port 0 would be unreachable) and its data sockets on
ephemeral ports of the same address (`jax_cross_host_transport_addresses`; XLA's default is
0.0.0.0). JAX's heartbeat timeout is set above the driver's own hang detection, so the driver —
which can tell the hung actor from the ones waiting on it — always names a failure before JAX's
coordination service aborts the world's other processes.
"""
from __future__ import annotations

import os
import socket
from typing import Optional

from orchestrator.core.backends.jaxinit import ENV_KEY, JaxInit

__all__ = ["initialize", "join_world", "reserve_port", "coordinator_is_ours", "listens_on"]


def _spec(stage_hosts: int, host: int) -> JaxInit:
    text = os.environ.get(ENV_KEY)
    if text:
        return JaxInit.from_env(text)
    # an actor created without a backend's env (older callers): the CPU/GPU default
    return JaxInit("explicit", stage_hosts, host) if stage_hosts > 1 else JaxInit()


def reserve_port(ip: str) -> tuple[str, Optional[socket.socket]]:
    """A free port on `ip`, as the coordinator address ("ip:port", "[v6]:port"), and the
    socket that holds it (bound with SO_REUSEPORT, not listening) until the caller closes
    it after jax's coordinator has bound the port; None where SO_REUSEPORT is missing
    (then the port was picked by bind-then-close and only `coordinator_is_ours` guards it).

    Example:
        >>> address, held = reserve_port("127.0.0.1")
        >>> address.startswith("127.0.0.1:"), held is not None
        (True, True)
        >>> held.close()
    """
    sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET)
    reuse = getattr(socket, "SO_REUSEPORT", None)
    try:
        if reuse is not None:
            sock.setsockopt(socket.SOL_SOCKET, reuse, 1)
        sock.bind((ip, 0))
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    if reuse is None:   # pragma: no cover - every Linux has it
        sock.close()
        sock = None
    return (f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"), sock


def initialize(stage_hosts: int, host: int, coordinator: Optional[str], timeout_s: float,
               who: str = "", reservation: Optional[socket.socket] = None) -> JaxInit:
    """Worker side: join this stage's JAX world as the placement planned it.

    `reservation`: the socket `reserve_port` returned on host 0, closed here once jax's
    coordinator holds the port (and in any case before returning).

    Raises:
      RuntimeError: jax assigned a different process index or count than planned
        (e.g. TPU auto-detection saw another worker id than the bundle's).
    """
    try:
        return _initialize(stage_hosts, host, coordinator, timeout_s, who)
    finally:
        if reservation is not None:
            reservation.close()


def _initialize(stage_hosts: int, host: int, coordinator: Optional[str], timeout_s: float, who: str) -> JaxInit:
    spec = _spec(stage_hosts, host)
    if spec.num_processes != stage_hosts or spec.process_id != host:
        raise RuntimeError(f"{who}: placement planned process {spec.process_id} of {spec.num_processes}, "
                           f"but this is host {host} of a {stage_hosts}-host stage")
    if spec.mode == "none":
        return spec
    import jax

    jax.distributed.initialize(**spec.kwargs(coordinator, timeout_s))
    if spec.mode == "explicit" and spec.process_id == 0 and not coordinator_is_ours(coordinator):
        raise RuntimeError(f"{who}: the jax.distributed coordinator port {coordinator} is not held by this "
                           "process after initialisation (another process took it between picking and "
                           "binding); refusing to continue")
    got = (jax.process_index(), jax.process_count())
    if got != (spec.process_id, spec.num_processes):
        raise RuntimeError(f"{who}: jax.distributed ({spec.mode}) made this process {got[0]} of {got[1]}; "
                           f"the plan needs {spec.process_id} of {spec.num_processes} (on TPU the process "
                           "index is the TPU worker id: the host bundle is on the wrong worker)")
    return spec


TRANSPORT_SOCKETS = 4       # XLA's data sockets per process (its own default count)


def join_world(world: int, process: int, coordinator: str, node_ip: str, timeout_s: float, who: str = "",
               reservation: Optional[socket.socket] = None, transfer_timeout_s: float = 60.0,
               heartbeat_s: float = 300.0) -> str:
    """Worker side of `transport: xla`: join the job's one JAX world as process `process` of `world`.

    Sets XLA's transfer library to `node_ip` first (module docstring), then initialises
    `jax.distributed` with the backend's device choice (`MESHPIPE_JAX_INIT`'s local device ids).
    Returns the transfer library's control address ("ip:port"); `listens_on` checks it later
    (XLA binds it on the first transfer).

    Raises:
      RuntimeError: jax made this process another index, or another process holds the
        coordinator port (host 0).
    """
    try:
        return _join_world(world, process, coordinator, node_ip, timeout_s, who, transfer_timeout_s, heartbeat_s)
    finally:
        if reservation is not None:
            reservation.close()


def _join_world(world, process, coordinator, node_ip, timeout_s, who, transfer_timeout_s, heartbeat_s) -> str:
    import jax

    spec = _spec(1, 0)
    if spec.mode == "auto":      # a TPU slice: the platform's own world (process index = TPU worker id)
        kwargs = spec.kwargs(None, timeout_s)
    else:
        ids = spec.local_device_ids
        kwargs = JaxInit("explicit", world, process, ids).kwargs(coordinator, timeout_s)
    kwargs["heartbeat_timeout_seconds"] = max(10, int(heartbeat_s))
    address, held = reserve_port(node_ip)
    if held is not None:
        held.close()            # XLA binds it without SO_REUSEPORT, on the first transfer: `listens_on` checks
    host = f"[{node_ip}]" if ":" in node_ip else node_ip
    jax.config.update("jax_cross_host_transfer_socket_address", address)
    jax.config.update("jax_cross_host_transport_addresses", ",".join([f"{host}:0"] * TRANSPORT_SOCKETS))
    jax.config.update("jax_cross_host_transfer_timeout_seconds", max(1, int(transfer_timeout_s)))
    jax.distributed.initialize(**kwargs)
    if spec.mode != "auto" and process == 0 and not coordinator_is_ours(coordinator):
        raise RuntimeError(f"{who}: the world's jax.distributed coordinator port {coordinator} is not held by "
                           "this process after initialisation; refusing to continue")
    got = (jax.process_index(), jax.process_count())
    if got != (process, world):
        raise RuntimeError(f"{who}: jax.distributed made this process {got[0]} of {got[1]}; the job's world needs "
                           f"{process} of {world} (on TPU the process index is the TPU worker id)")
    return address


def listens_on(address: str, pid: Optional[int] = None) -> bool:
    """Whether process `pid` (default: this one) listens on `address` ("ip:port")."""
    import psutil

    ip, _, port = address.rpartition(":")
    ip = ip.strip("[]")
    conns = psutil.Process(pid).net_connections(kind="inet")
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == int(port) and c.laddr.ip in (ip, f"::ffff:{ip}")
               for c in conns)


def coordinator_is_ours(coordinator: str, pid: Optional[int] = None) -> bool:
    """Whether process `pid` (default: this one) listens on the coordinator's port.

    Example:
        >>> with socket.create_server(("127.0.0.1", 0)) as s:
        ...     coordinator_is_ours(f"127.0.0.1:{s.getsockname()[1]}")
        True
    """
    try:
        import psutil
    except ImportError:   # pragma: no cover - ray[default] brings psutil
        return True
    port = int(coordinator.rpartition(":")[2])
    conns = psutil.Process(pid).net_connections(kind="inet")
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns)
