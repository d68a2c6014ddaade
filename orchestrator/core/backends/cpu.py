"""`platform: cpu` — the laptop: simulated hosts of simulated XLA CPU devices.

Each host actor gets `--xla_force_host_platform_device_count=devices_per_host`
and `JAX_PLATFORMS=cpu` before jax loads; a multi-host stage joins one JAX world
through an explicit coordinator (host 0 of the stage picks a free port), and CPU
collectives go over gloo. Bundles reserve only CPUs (fractional is fine) plus any
`resources_per_host`; nothing pins them to particular nodes.
"""
from __future__ import annotations

from orchestrator.core.backends.base import Backend

__all__ = ["CpuBackend"]


class CpuBackend(Backend):
    platform = "cpu"

    def env(self, stage, host, site, addresses):
        return {"XLA_FLAGS": f"--xla_force_host_platform_device_count={stage.devices_per_host}",
                "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
