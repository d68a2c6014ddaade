"""The backend interface: what a platform answers about hosts, bundles, environments and jax.

A backend is a small class, one per `cluster.platform`, that registers itself
when its module is imported (as JAX's `ClusterEnv.__init_subclass__` does for
cluster environments). It answers the same few questions for every platform:

  check_cluster()      cluster-only rules (pure)            → problems at config load
  check_stages(...)    which submesh shapes are legal (pure) → problems at `check_job`
  sites(n, nodes)      which Ray node each host bundle must land on (labels), from
                       the live cluster's resources/labels (or placeholders, dry)
  check_live(n, nodes) whether the live cluster can hold the hosts → PlacementError
  bundle / actor_resources / env / jax_init
                       the Ray resources per host bundle, what each actor requests,
                       its environment and how it joins its submesh's JAX world

`place(stages, sites, addresses)` combines them into one `HostPlacement` per
stage host — a pure value that `placement` turns into Ray options, that
`meshpipe plan`/tests print and compare, and that needs no Ray to compute.

Invariants: cluster host i is placement-group bundle i; stage hosts are
consecutive cluster hosts (`check.py`); nothing here imports ray or jax.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Optional, Sequence

from orchestrator.core.backends.jaxinit import ENV_KEY, JaxInit

__all__ = ["Backend", "Node", "HostPlacement", "PlacementError", "Problem3", "get_backend", "platforms"]

Problem3 = tuple[str, Any, str]   # (key path, value, rule) — one `key = value: rule` line


class PlacementError(RuntimeError):
    """The live cluster cannot hold the job (the message names key, value and rule)."""


@dataclass(frozen=True)
class Node:
    """A live Ray node as backends see it (from `ray.nodes()`).

    Attributes:
      node_id, address: Ray node id and IP (`NodeManagerAddress`).
      resources: the node's total resources; available: what is free now (if known).
      labels: Ray node labels (`ray.io/tpu-slice-name`, `ray.io/tpu-worker-id`, ...).
    """

    node_id: str
    address: str
    resources: Mapping[str, float]
    labels: Mapping[str, str] = field(default_factory=dict)
    available: Optional[Mapping[str, float]] = None

    @staticmethod
    def from_ray(d: Mapping[str, Any], available: Optional[Mapping[str, float]] = None) -> "Node":
        return Node(d["NodeID"], d.get("NodeManagerAddress", ""), dict(d.get("Resources") or {}),
                    dict(d.get("Labels") or {}), available)

    def free(self, resource: str) -> float:
        pool = self.available if self.available is not None else self.resources
        return float(pool.get(resource, 0.0))


@dataclass(frozen=True)
class HostPlacement:
    """Everything placement decides for one host of one stage (pure, printable).

    Attributes:
      stage, host: stage index and host index within the stage.
      bundle: placement-group bundle index (= cluster host index).
      bundle_resources: the Ray resources reserved by that bundle.
      label_selector: Ray node labels the bundle must land on ({} = anywhere).
      actor: what the actor requests inside its bundle (num_cpus, num_gpus, resources).
      env: the actor's environment variables (set before jax is imported).
      jax_init: how the actor joins its submesh's JAX world.
    """

    stage: int
    host: int
    bundle: int
    bundle_resources: dict[str, float]
    label_selector: dict[str, str]
    actor: dict[str, Any]
    env: dict[str, str]
    jax_init: JaxInit

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "host": self.host, "bundle": self.bundle,
                "bundle_resources": dict(self.bundle_resources), "label_selector": dict(self.label_selector),
                "actor": dict(self.actor), "env": dict(self.env), "jax_init": self.jax_init.to_dict()}


class Backend:
    """Base class; subclasses set `platform` and register themselves on definition.

    Example:
        >>> from orchestrator.core.backends import get_backend
        >>> from orchestrator.core.config import parse_cluster
        >>> b = get_backend(parse_cluster({"hosts": 2, "devices_per_host": 4}))
        >>> type(b).__name__, b.bundle(0, None)
        ('CpuBackend', {'CPU': 1.0})
    """

    platform: ClassVar[str] = ""
    needs_addresses: ClassVar[bool] = False   # env() uses the stage hosts' node IPs (placement looks them up)
    _registry: ClassVar[dict[str, type["Backend"]]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.platform:
            Backend._registry[cls.platform] = cls

    def __init__(self, cluster):
        self.cluster = cluster

    # -- config time (pure) -------------------------------------------------
    def check_cluster(self) -> list[Problem3]:
        """Problems with the cluster config alone; key paths relative to the cluster file."""
        return []

    def check_stages(self, stage_hosts: Sequence[Sequence[int]]) -> list[Problem3]:
        """Problems with the stages' host assignments (`pipeline.stages[i].hosts` keys)."""
        return []

    # -- the live cluster ---------------------------------------------------
    def sites(self, n_hosts: int, nodes: Optional[Sequence[Node]] = None) -> list[Any]:
        """Per cluster host, where its bundle must land (None: anywhere the resources are)."""
        return [None] * n_hosts

    def check_live(self, n_hosts: int, nodes: Sequence[Node]) -> None:
        """Raise PlacementError if the live cluster cannot hold `n_hosts` host bundles."""

    # -- per host -------------------------------------------------------------
    def extra_resources(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.cluster.resources_per_host.items()}

    def bundle(self, host: int, site: Any) -> dict[str, float]:
        return {"CPU": float(self.cluster.cpus_per_host), **self.extra_resources()}

    def label_selector(self, site: Any) -> dict[str, str]:
        return {}

    def actor_resources(self) -> dict[str, Any]:
        return {"num_cpus": float(self.cluster.cpus_per_host), "resources": self.extra_resources()}

    def env(self, stage, host: int, site: Any, addresses: Sequence[str]) -> dict[str, str]:
        """Environment of the actor of `host` (index in the stage) of `stage`.

        `addresses` are the IPs of the stage's hosts' nodes (placeholders when dry).
        """
        return {"PYTHONUNBUFFERED": "1"}

    def jax_init(self, stage, host: int) -> JaxInit:
        n = len(stage.hosts)
        return JaxInit("explicit", n, host) if n > 1 else JaxInit("none", 1, 0)

    # -- all together -------------------------------------------------------
    def place(self, stages, sites: Optional[Sequence[Any]] = None,
              addresses: Optional[Mapping[int, str]] = None) -> list[HostPlacement]:
        """One HostPlacement per stage host; `sites`/`addresses` per cluster host (None: dry run)."""
        n = max((b for s in stages for b in s.hosts), default=-1) + 1
        sites = list(sites) if sites is not None else self.sites(n)
        out = []
        for st in stages:
            addrs = [(addresses or {}).get(b) or f"<address of host {b}>" for b in st.hosts]
            for i, b in enumerate(st.hosts):
                init = self.jax_init(st, i)
                env = {**self.env(st, i, sites[b], addrs), ENV_KEY: init.to_env()}
                out.append(HostPlacement(st.index, i, b, self.bundle(b, sites[b]), self.label_selector(sites[b]),
                                         self.actor_resources(), env, init))
        return out


def get_backend(cluster) -> Backend:
    """The backend instance for `cluster.platform`."""
    try:
        cls = Backend._registry[cluster.platform]
    except KeyError:
        raise ValueError(f"no backend for platform {cluster.platform!r}; known: {sorted(Backend._registry)}") from None
    return cls(cluster)


def platforms() -> list[str]:
    return sorted(Backend._registry)
