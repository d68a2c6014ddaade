"""Placement: connect to (or start) Ray, gang-reserve hosts, describe each stage actor.

Basic flow:
  1. `connect(cluster)` — an existing Ray session is reused; `address: null`
     starts an embedded local Ray (`address="local"`) bound to 127.0.0.1;
     otherwise `ray.init(address=...)`.
  2. `reserve(checked, name)` — ONE placement group for the job (gang): one
     bundle per host the job uses, bundle i = cluster host i. It waits for the
     group with a deadline; if Ray cannot place it, the group is removed and the
     error lists what was required and what the cluster has.
  3. `actor_options(...)` — per stage host: its bundle, fractional CPUs, extra
     resources, a recognisable name (`<run>/stage<s>/host<h>`) and the
     runtime_env that gives the process its simulated devices before jax loads.
Every wait here is bounded.
"""
from __future__ import annotations

import logging

log = logging.getLogger("meshpipe")


class PlacementError(RuntimeError):
    pass


def connect(cluster, namespace: str) -> bool:
    """Make sure this process is connected to Ray; True if we started it (and must stop it)."""
    import ray

    if ray.is_initialized():
        return False
    if cluster.address is None:
        ray.init(address="local", num_cpus=cluster.num_cpus, namespace=namespace,
                 include_dashboard=getattr(cluster, "dashboard", None),
                 dashboard_host=cluster.dashboard_host, log_to_driver=True, logging_level=logging.WARNING)
        if cluster.dashboard_host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("the Ray dashboard listens on %s: anyone who reaches it can run code on this machine",
                        cluster.dashboard_host)
    else:
        ray.init(address=cluster.address, namespace=namespace, logging_level=logging.WARNING)
    return True


def bundles(checked) -> list[dict[str, float]]:
    cl = checked.cluster
    used = sum(len(s.hosts) for s in checked.stages)
    one = {"CPU": float(cl.cpus_per_host), **{k: float(v) for k, v in cl.resources_per_host.items()}}
    return [dict(one) for _ in range(used)]


def reserve(checked, name: str, timeout: float):
    """Create and wait for the job's placement group, or raise PlacementError (nothing left behind)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    wanted = bundles(checked)
    pg = placement_group(wanted, strategy=checked.cluster.placement_strategy, name=name)
    ready, _ = ray.wait([pg.ready()], timeout=timeout)
    if not ready:
        remove_placement_group(pg)
        total: dict[str, float] = {}
        for b in wanted:
            for k, v in b.items():
                total[k] = total.get(k, 0.0) + v
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        raise PlacementError(
            f"Ray could not place {len(wanted)} host bundles {wanted[0]} with strategy "
            f"{checked.cluster.placement_strategy} within {timeout:.0f} s: required {total} in all; "
            f"the cluster has {ray.cluster_resources()} over {len(nodes)} node(s), "
            f"available now {ray.available_resources()}")
    return pg


def actor_options(checked, stage, host: int, pg, run: str) -> dict:
    """Ray options for the actor of `host` (index within the stage) of `stage`."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cl = checked.cluster
    bundle = stage.hosts[host]
    env = {
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={stage.devices_per_host}",
        "JAX_PLATFORMS": "cpu",
        "PYTHONUNBUFFERED": "1",
    }
    return {
        "name": f"{run}/stage{stage.index}/host{host}",
        "num_cpus": float(cl.cpus_per_host),
        "resources": {k: float(v) for k, v in cl.resources_per_host.items()},
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=bundle,
            placement_group_capture_child_tasks=False),
        "runtime_env": {"env_vars": env},
        "max_restarts": 0,
    }
