"""Platform backends: `cpu` (simulated devices, the laptop), `gpu`, `tpu`.

Each backend is a small class registered by its module on import (see
`base.Backend`); `get_backend(cluster)` returns the one for `cluster.platform`.
All of it is pure — no ray, no jax — so config checks and `meshpipe plan` can
ask a backend what placement will do without starting anything.

Example:
    >>> from orchestrator.core.backends import get_backend, platforms
    >>> platforms()
    ['cpu', 'gpu', 'tpu']
"""
from orchestrator.core.backends import cpu as _cpu, gpu as _gpu, tpu as _tpu  # noqa: F401  (they register)
from orchestrator.core.backends.base import Backend, HostPlacement, Node, PlacementError, get_backend, platforms
from orchestrator.core.backends.jaxinit import JaxInit

__all__ = ["Backend", "HostPlacement", "Node", "PlacementError", "JaxInit", "get_backend", "platforms",
           ]
