"""Placement: connect to (or start) Ray, gang-reserve hosts, describe each stage actor.

Basic flow:
  1. `connect(cluster)` — an existing Ray session is reused; `address: null`
     starts an embedded local Ray (`address="local"`), loopback-only by
     default (see below); otherwise `ray.init(address=...)` within
     `cluster.timeouts.connect_s` (`orchestrator.driver.connect`).
  2. `reserve(checked, name)` — ONE placement group for the job (gang): one
     bundle per host the job uses, bundle i = cluster host i. First the backend
     checks the live nodes (`check_live`: e.g. GPUs per node, intact TPU slices)
     and binds bundles to nodes where it must (`sites`), then a pre-check
     against the cluster's alive nodes (`check_fits`) fails at once for a
     request no node set could ever hold (a resource the cluster lacks, more
     STRICT_SPREAD bundles than nodes, ...). Then it waits for the group with a
     deadline; if Ray cannot place it in time, the group is removed and the
     error lists what was required and what the cluster has.
  3. `actor_options(...)` — per stage host: its bundle, what the actor requests
     (CPUs, GPUs, TPU chips, extras), a recognisable name (`<run>/stage<s>/host<h>`)
     and the runtime_env (devices, platform, how jax initialises) set before jax loads.
The platform-specific answers (bundle contents, TPU slice pinning by node labels,
environment, jax init, live-cluster checks) come from `orchestrator.core.backends`;
`orchestrator.core.hosts.plan_hosts(checked)` is the same computation as a pure dry run.
Every wait here is bounded.

Network exposure of an embedded cluster: Ray's own rule is to advertise (and
bind its GCS, raylet, object manager, agents and workers on) the machine's
routable address, and `ray.init` turns a `_node_ip_address` of 127.0.0.1 back
into that address. Ray's macOS/Windows single-machine mode,
`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, makes every one of those servers bind
127.0.0.1 instead; `connect` sets it (for this process and the Ray processes it
spawns) for the duration of `ray.init` when `cluster.node_ip_address` is
loopback (the default), and restores it after. The dashboard follows
`cluster.dashboard_host` (127.0.0.1 by default). Anything else is an explicit
choice in the cluster YAML, and a warning says what is exposed. Ray's token
authentication is left exactly as Ray sets it.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
from typing import Mapping, Sequence

from orchestrator.core.backends import HostPlacement, Node, PlacementError, get_backend  # noqa: F401 - pure: no ray, no jax; re-exported
from orchestrator.core.hosts import bundles, plan_hosts  # noqa: F401 - plan_hosts re-exported

log = logging.getLogger("meshpipe")

LOOPBACK = ("127.0.0.1", "localhost", "::1")




def connect(cluster, namespace: str) -> bool:
    """Make sure this process is connected to Ray; True if we started it (and must stop it)."""
    import ray

    from orchestrator.driver.ray_internals import check_ray_version

    if ray.is_initialized():
        return False
    check_ray_version(embedded=cluster.address is None)   # outside the tested Ray: warn, or refuse (module doc)
    if cluster.address is None:
        node_ip = getattr(cluster, "node_ip_address", "127.0.0.1")
        loopback = node_ip in LOOPBACK
        with loopback_only() if loopback else contextlib.nullcontext():
            ctx = ray.init(address="local", num_cpus=cluster.num_cpus, namespace=namespace,
                           include_dashboard=getattr(cluster, "dashboard", None),
                           dashboard_host=cluster.dashboard_host, log_to_driver=True,
                           logging_level=logging.WARNING,
                           **({} if loopback else {"_node_ip_address": node_ip}))
        if loopback:
            try:
                verify_loopback(cluster)
            except PlacementError:
                ray.shutdown()
                raise
        else:
            log.warning("the embedded Ray's GCS, raylet, object manager and worker ports listen on all "
                        "interfaces (cluster.node_ip_address = %s, GCS at %s): anyone who reaches them can run "
                        "code on this machine; Ray's token authentication is the only guard", node_ip,
                        ctx.address_info.get("gcs_address"))
        if cluster.dashboard_host not in LOOPBACK:
            log.warning("the Ray dashboard listens on %s (cluster.dashboard_host = %s): its HTTP API, job "
                        "submission included, lets anyone who reaches it run code on this machine; Ray's "
                        "token authentication is the only guard", ctx.dashboard_url or "its port",
                        cluster.dashboard_host)
    else:
        from orchestrator.driver.connect import init

        init(cluster.address, namespace, cluster.timeouts.connect_s)   # bounded: ray.init alone has no deadline
    return True


def loopback_only():
    """While starting an embedded Ray: make it bind and advertise 127.0.0.1 only (module doc;
    the private switch lives in `orchestrator.driver.ray_internals`)."""
    from orchestrator.driver.ray_internals import single_machine_mode

    return single_machine_mode()


def verify_loopback(cluster) -> None:
    """After starting an embedded Ray: refuse to go on if any of its processes listens beyond
    loopback on an address the cluster YAML did not ask for (a Ray upgrade that ignores the
    single-machine switch must not expose this machine silently).

    Raises:
      PlacementError: naming each exposed ip:port and process.
    """
    from orchestrator.driver.ray_internals import beyond_loopback

    allowed = {cluster.dashboard_host} if cluster.dashboard_host not in LOOPBACK else set()
    exposed = beyond_loopback(allowed)
    if exposed:
        raise PlacementError(f"the embedded Ray listens beyond loopback although the cluster YAML asks for "
                             f"loopback only (node_ip_address {getattr(cluster, 'node_ip_address', '127.0.0.1')}, "
                             f"dashboard_host {cluster.dashboard_host}): {', '.join(exposed)}; refusing to run. "
                             "Set cluster.node_ip_address to expose it on purpose.")


def live_nodes() -> list[Node]:
    """The connected cluster's alive nodes, with what each has free now (when Ray says)."""
    import ray

    from orchestrator.driver.ray_internals import available_resources

    avail = available_resources()   # (a private API: without it, totals stand in for what is free)
    return [Node.from_ray(n, avail.get(n["NodeID"])) for n in ray.nodes() if n.get("Alive")]


_WHERE = {"CPU": "cluster.cpus_per_host", "GPU": "cluster.platform/devices_per_host",
          "TPU": "cluster.platform/devices_per_host"}


def check_fits(bundle: Mapping[str, float], count: int, strategy: str,
               nodes: Sequence[Mapping[str, float]]) -> None:
    """Fail now if `count` copies of `bundle` can never be placed on `nodes` (their total resources).

    Pure: `nodes` are the alive nodes' total resources (`ray.nodes()[i]["Resources"]`).
    Bundles are identical, so a node holds `min_r floor(node[r] / bundle[r])` of
    them, and the request fits iff: PACK/SPREAD — the sum over nodes >= count;
    STRICT_PACK — one node holds count; STRICT_SPREAD — count nodes hold one.
    What is in use right now is not considered (that is what the wait is for).

    Raises:
      PlacementError: naming what is required, what the cluster has, and the key to change.

    Example:
        >>> check_fits({"CPU": 1}, 2, "PACK", [{"CPU": 8}])  # fits: returns None
        >>> try:
        ...     check_fits({"CPU": 1}, 2, "STRICT_SPREAD", [{"CPU": 8}])
        ... except PlacementError as e:
        ...     print(str(e).split("; ")[0])
        cannot place 2 host bundles {'CPU': 1} with strategy STRICT_SPREAD: it puts every bundle on a different node, but only 1 of the cluster's 1 alive node(s) can hold one (change cluster.placement_strategy or cluster.hosts)
    """
    eps = 1e-6
    need = {r: float(v) for r, v in bundle.items() if v > 0}

    def holds(node: Mapping[str, float]) -> int:
        return min((math.floor(node.get(r, 0.0) / v + eps) for r, v in need.items()), default=count)

    per_node = [holds(n) for n in nodes]
    totals: dict[str, float] = {}
    for n in nodes:
        for r, v in n.items():
            totals[r] = totals.get(r, 0.0) + float(v)
    shown = {r: totals.get(r, 0.0) for r in sorted(set(need) | {"CPU", "GPU", "TPU"}) if r in need or totals.get(r)}
    head = f"cannot place {count} host bundles {dict(bundle)} with strategy {strategy}"
    tail = f"the cluster has {shown} in all"
    if not nodes:
        raise PlacementError(f"{head}: the Ray cluster has no alive node")
    absent = [r for r in need if totals.get(r, 0.0) <= 0]
    if absent:
        keys = ", ".join(_WHERE.get(r, f"cluster.resources_per_host.{r}") for r in absent)
        raise PlacementError(f"{head}: the cluster has no {', '.join(repr(r) for r in absent)} resource "
                             f"at all (required {count} × {need[absent[0]]:g} = {count * need[absent[0]]:g}, "
                             f"available 0; change {keys}); {tail}")
    short = [r for r in need if count * need[r] > totals.get(r, 0.0) + eps]
    if short:
        req = ", ".join(f"{r}: {count} × {need[r]:g} = {count * need[r]:g}" for r in short)
        have = ", ".join(f"{r}: {totals.get(r, 0.0):g}" for r in short)
        keys = ", ".join(_WHERE.get(r, f"cluster.resources_per_host.{r}") for r in short)
        raise PlacementError(f"{head}: required {req}, but the cluster has only {have} (change {keys} or "
                             f"cluster.hosts); {tail}")
    if not any(per_node):
        raise PlacementError(f"{head}: no single node can hold one bundle (a bundle cannot span "
                             f"nodes; nodes have {[{r: float(n.get(r, 0.0)) for r in need} for n in nodes]}); {tail}")
    if strategy == "STRICT_SPREAD" and sum(1 for k in per_node if k) < count:
        raise PlacementError(f"{head}: it puts every bundle on a different node, but only "
                             f"{sum(1 for k in per_node if k)} of the cluster's {len(nodes)} alive node(s) can "
                             f"hold one (change cluster.placement_strategy or cluster.hosts); {tail}")
    if strategy == "STRICT_PACK" and max(per_node) < count:
        raise PlacementError(f"{head}: it puts every bundle on one node, but the largest node holds "
                             f"{max(per_node)} (change cluster.placement_strategy); {tail}")
    if sum(per_node) < count:
        raise PlacementError(f"{head}: the alive nodes hold {per_node} bundle(s) each, "
                             f"{sum(per_node)} in all (bundles cannot span nodes); {tail}")


def reserve(checked, name: str, timeout: float, wait_for_fit: float = 0.0, avoid: Sequence[str] = ()):
    """Create and wait for the job's placement group, or raise PlacementError (nothing left behind).

    Args:
      timeout: how long Ray may take to place the group (`cluster.timeouts.init_s`).
      wait_for_fit: a restart's placement (`failure.placement_timeout_s`): while the live nodes
        cannot hold the job (e.g. a lost node not yet replaced), look again every second for up to
        this long instead of failing at once; the group's own wait then gets what is left of it.
      avoid: node ids known to be gone (a node Ray has not marked dead yet is not counted).
    """
    import time

    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    cl = checked.cluster
    backend = get_backend(cl)
    n = sum(len(s.hosts) for s in checked.stages)
    key = "failure.placement_timeout_s" if wait_for_fit else "cluster.timeouts.init_s"
    until = time.monotonic() + wait_for_fit
    while True:
        nodes = [x for x in live_nodes() if x.node_id not in avoid]
        try:
            backend.check_live(n, nodes)           # platform rules against live resources/labels (names the key)
            sites = backend.sites(n, nodes)
            wanted = bundles(checked, sites)
            common = {k: min(b.get(k, 0.0) for b in wanted) for k in wanted[0]}   # e.g. without the TPU head resource
            check_fits(common, len(wanted), cl.placement_strategy, [dict(x.resources) for x in nodes])  # before any group
            break
        except PlacementError as e:
            if time.monotonic() >= until:
                if wait_for_fit:
                    raise PlacementError(f"{e} (still so after waiting {wait_for_fit:g} s for the cluster to "
                                         f"fit the job again: {key})") from e
                raise
            time.sleep(1.0)
    if wait_for_fit:
        timeout = max(1.0, until - time.monotonic())
    selectors = [backend.label_selector(site) for site in sites]
    extra = {"bundle_label_selector": selectors} if any(selectors) else {}
    pg = placement_group(wanted, strategy=cl.placement_strategy, name=name, **extra)
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
            f"{checked.cluster.placement_strategy} within {timeout:g} s ({key}): "
            f"required {total} in all; "
            f"the cluster has {ray.cluster_resources()} over {len(nodes)} node(s), "
            f"available now {ray.available_resources()}")
    return pg


def actor_options(checked, stage, host: int, pg, run: str) -> dict:
    """Ray options for the actor of `host` (index within the stage) of `stage`."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cl = checked.cluster
    backend = get_backend(cl)
    n = sum(len(s.hosts) for s in checked.stages)
    addresses = _bundle_addresses(pg, stage.hosts) if backend.needs_addresses else None
    hp = backend.place([stage], backend.sites(n), addresses)[host]
    return {
        "name": f"{run}/stage{stage.index}/host{host}",
        **hp.actor,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=hp.bundle,
            placement_group_capture_child_tasks=False),
        "runtime_env": {"env_vars": actor_env(checked, hp.env)},
        "max_restarts": 0,
    }


def actor_env(checked, backend_env: dict) -> dict:
    """A stage actor's environment: the cluster's env_vars, the backend's (ours win: the schema
    forbids clashes), the quiet warning filter (`orchestrator.driver.quiet`) unless the user set
    PYTHONWARNINGS, and the job's directory first on PYTHONPATH (a model factory beside the job).

    Ray expands `${PYTHONPATH}` to the value the node's environment has.
    """
    from orchestrator.driver.quiet import actor_env as quiet_env

    user = dict(getattr(checked.cluster, "env_vars", {}))
    env = {**quiet_env(), **user, **backend_env}
    if checked.import_dir:
        rest = user.get("PYTHONPATH", "${PYTHONPATH}")
        env["PYTHONPATH"] = f"{checked.import_dir}{os.pathsep}{rest}"
    return env


def _bundle_addresses(pg, bundles_wanted) -> dict[int, str]:
    """{bundle index: IP of the node holding it} for the bundles given (the group is ready)."""
    import ray
    from ray.util import placement_group_table

    where = placement_group_table(pg).get("bundles_to_node_id", {})
    ips = {n["NodeID"]: n.get("NodeManagerAddress", "") for n in ray.nodes()}
    return {b: ips.get(where.get(b), "") for b in bundles_wanted if where.get(b) in ips}
