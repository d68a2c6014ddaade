"""`platform: gpu` — NVIDIA GPU nodes; a host is `devices_per_host` whole GPUs of one node.

Answers:
  hosts/devices   nodes' `GPU` resources; a host bundle never spans nodes, so
                  `devices_per_host` must fit in one node (checked against
                  `gpu.gpus_per_node` at config time, against live nodes at placement).
  bundle          {"CPU": cpus_per_host, "GPU": devices_per_host, **resources_per_host}
                  (+ `accelerator_type:<T>` when `gpu.accelerator_type` is set, Ray's
                  convention for pinning a GPU model).
  actor           num_gpus = devices_per_host: Ray then sets CUDA_VISIBLE_DEVICES to
                  the GPUs it assigned; we never set it ourselves (Ray's value wins,
                  and several stage hosts on one node get disjoint GPUs).
  env             JAX_PLATFORMS=cuda; XLA_PYTHON_CLIENT_PREALLOCATE / _MEM_FRACTION
                  from `gpu.preallocate` / `gpu.memory_fraction` (when several host
                  actors share a node each owns its GPUs, so the fraction is per GPU).
  jax init        multi-host stage: explicit coordinator (host 0 picks a free port),
                  num_processes, process_id, local_device_ids 0..n-1 (the visible
                  GPUs, renumbered by CUDA_VISIBLE_DEVICES); NCCL between processes.
"""
from __future__ import annotations

from orchestrator.core.backends.base import Backend, PlacementError
from orchestrator.core.backends.jaxinit import JaxInit

__all__ = ["GpuBackend"]


class GpuBackend(Backend):
    platform = "gpu"

    @property
    def gpu(self):
        return self.cluster.gpu

    def check_cluster(self):
        cl, g = self.cluster, self.cluster.gpu
        out = []
        if g is not None and g.gpus_per_node is not None:
            if cl.devices_per_host > g.gpus_per_node:
                out.append(("devices_per_host", cl.devices_per_host,
                            f"more GPUs per host than a node has (gpu.gpus_per_node = {g.gpus_per_node}); "
                            "a host is GPUs of one node: use at most that many and more hosts"))
            elif cl.placement_strategy == "STRICT_PACK" and cl.hosts * cl.devices_per_host > g.gpus_per_node:
                out.append(("placement_strategy", cl.placement_strategy,
                            f"STRICT_PACK puts all {cl.hosts} hosts × {cl.devices_per_host} GPUs = "
                            f"{cl.hosts * cl.devices_per_host} GPUs on one node, but a node has "
                            f"gpu.gpus_per_node = {g.gpus_per_node}; use PACK"))
        return out

    def _type_resource(self) -> dict[str, float]:
        t = self.gpu.accelerator_type if self.gpu is not None else None
        return {f"accelerator_type:{t}": 0.001} if t else {}

    def check_live(self, n_hosts, nodes):
        d = self.cluster.devices_per_host
        typed = next(iter(self._type_resource()), None)
        gpus = {n.node_id: int(n.resources.get("GPU", 0)) for n in nodes
                if typed is None or n.resources.get(typed, 0) > 0}
        have = ", ".join(f"{nid[:8]}: {g}" for nid, g in gpus.items() if g) or "none"
        what = f" of type {self.gpu.accelerator_type}" if typed else ""
        if not gpus or max(gpus.values()) < d:
            raise PlacementError(
                f"cluster.devices_per_host = {d}: more GPUs per host than any live node has "
                f"(GPUs{what} per node: {have}); a host bundle is GPUs of one node")

    def bundle(self, host, site):
        return {"CPU": float(self.cluster.cpus_per_host), "GPU": float(self.cluster.devices_per_host),
                **self.extra_resources(), **self._type_resource()}

    def actor_resources(self):
        return {"num_cpus": float(self.cluster.cpus_per_host), "num_gpus": float(self.cluster.devices_per_host),
                "resources": {**self.extra_resources(), **self._type_resource()}}

    def env(self, stage, host, site, addresses):
        env = {"JAX_PLATFORMS": "cuda", "PYTHONUNBUFFERED": "1"}
        g = self.gpu
        if g is not None:
            env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true" if g.preallocate else "false"
            if g.memory_fraction is not None:
                env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{g.memory_fraction:g}"
        return env

    def jax_init(self, stage, host):
        n = len(stage.hosts)
        if n == 1:
            return JaxInit("none", 1, 0)
        return JaxInit("explicit", n, host, tuple(range(stage.devices_per_host)))
