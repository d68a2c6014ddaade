"""Which host bundles a job needs and what each stage host gets, as a pure dry run.

`driver.placement` reserves exactly these bundles and starts actors with these
values; `meshpipe plan` prints them without starting Ray.
"""
from __future__ import annotations

from orchestrator.core.backends import HostPlacement, get_backend

__all__ = ["bundles", "plan_hosts", "describe"]


def bundles(checked, sites=None) -> list[dict[str, float]]:
    """One bundle per host the job uses, as the platform's backend asks (CPUs, GPUs/TPU chips, extras).

    `sites` (from `backend.sites`) bind TPU bundles to slices; None gives the dry-run bundles.
    """
    backend = get_backend(checked.cluster)
    n = sum(len(s.hosts) for s in checked.stages)
    sites = backend.sites(n) if sites is None else sites
    return [backend.bundle(b, sites[b]) for b in range(n)]


def plan_hosts(checked, nodes=None, addresses=None) -> list[HostPlacement]:
    """Dry run of placement: per stage host, its bundle, label selector, actor request, env, jax init.

    Pure (no Ray): `nodes` (`backends.Node`s of a live cluster) bind TPU slices by
    name, `addresses` ({cluster host: node IP}) fill in coordinator addresses;
    without them the values are placeholders. `actor_options` uses the same values.
    """
    backend = get_backend(checked.cluster)
    n = sum(len(s.hosts) for s in checked.stages)
    return backend.place(checked.stages, backend.sites(n, nodes), addresses)


def describe(checked) -> list[dict]:
    """`plan_hosts` as JSON-able dicts (for `meshpipe plan --json`)."""
    return [h.to_dict() for h in plan_hosts(checked)]
