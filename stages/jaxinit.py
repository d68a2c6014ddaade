"""Worker side of `orchestrator.core.backends.jaxinit`: join this stage's JAX world.

The driver put a `JaxInit` value into the actor's environment (`MESHPIPE_JAX_INIT`);
`initialize` reads it back, calls `jax.distributed.initialize` as planned and checks
that jax gave this process the index the plan expects.
"""
from __future__ import annotations

import os
from typing import Optional

from orchestrator.core.backends.jaxinit import ENV_KEY, JaxInit

__all__ = ["initialize"]


def _spec(stage_hosts: int, host: int) -> JaxInit:
    text = os.environ.get(ENV_KEY)
    if text:
        return JaxInit.from_env(text)
    # an actor created without a backend's env (older callers): the CPU/GPU default
    return JaxInit("explicit", stage_hosts, host) if stage_hosts > 1 else JaxInit()


def initialize(stage_hosts: int, host: int, coordinator: Optional[str], timeout_s: float,
               who: str = "") -> JaxInit:
    """Worker side: join this stage's JAX world as the placement planned it.

    Raises:
      RuntimeError: jax assigned a different process index or count than planned
        (e.g. TPU auto-detection saw another worker id than the bundle's).
    """
    spec = _spec(stage_hosts, host)
    if spec.num_processes != stage_hosts or spec.process_id != host:
        raise RuntimeError(f"{who}: placement planned process {spec.process_id} of {spec.num_processes}, "
                           f"but this is host {host} of a {stage_hosts}-host stage")
    if spec.mode == "none":
        return spec
    import jax

    jax.distributed.initialize(**spec.kwargs(coordinator, timeout_s))
    if spec.mode == "explicit" and spec.process_id == 0:
        _check_coordinator_is_ours(coordinator, who)
    got = (jax.process_index(), jax.process_count())
    if got != (spec.process_id, spec.num_processes):
        raise RuntimeError(f"{who}: jax.distributed ({spec.mode}) made this process {got[0]} of {got[1]}; "
                           f"the plan needs {spec.process_id} of {spec.num_processes} (on TPU the process "
                           "index is the TPU worker id: the host bundle is on the wrong worker)")
    return spec


def _check_coordinator_is_ours(coordinator: str, who: str) -> None:
    """Host 0 picked the coordinator port by bind-then-close; make sure this process, not
    another local user who raced for the port, now listens on it.

    Raises:
      RuntimeError: another process holds the port (the stage's other hosts may have
        talked to it: the run must not continue).
    """
    try:
        import psutil
    except ImportError:   # pragma: no cover - ray[default] brings psutil
        return
    ip, _, port = coordinator.rpartition(":")
    mine = {c.laddr.port for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    if int(port) not in mine:
        raise RuntimeError(f"{who}: the jax.distributed coordinator port {coordinator} is not held by this "
                           "process after initialisation (another process took it between picking and "
                           "binding); refusing to continue")
