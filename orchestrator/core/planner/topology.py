"""The cluster as the planner sees it: hosts, link classes (α-β), device memory and speed. Pure.

Three link classes, from the closest to the farthest:
  host   devices of one host (NVLink, a TPU VM's ICI, shared memory for CPU devices);
  group  hosts of one node group: `hosts_per_group` consecutive hosts (an ICI slice,
         an NVLink domain; by default the whole cluster for TPU, each host alone otherwise);
  dcn    hosts of different node groups (the data-centre network).
A message of `n` bytes on a link costs `latency + n / bandwidth` (α-β). A collective
over a group of devices is charged on the farthest class the group spans, with the
ring formulas XLA's own auto-sharding uses per mesh dimension:

  all-reduce      2 (k-1)/k · bytes / β + 2 (k-1) α
  all-gather      (k-1)/k · bytes(result) / β + (k-1) α
  reduce-scatter  (k-1)/k · bytes(operand) / β + (k-1) α
  all-to-all      (k-1)/k · bytes / β + (k-1) α
  permute         bytes / β + α

Stage-to-stage transfers go over meshpipe's transport and collectives inside a
multi-host stage over JAX's own (gloo on CPU, NCCL on GPU), so a cross-host class may
carry separate figures for collectives (`links.<class>.collectives`;
`Topology.collective_link`), used for collectives over mesh axes that span its hosts;
without them, the class's own figures. Within a host the class's figures are those
of collectives already (`calibrate` fits `links.host` from them).

Defaults (`DEFAULTS`) are nominal figures per platform, to be replaced by a cluster's
`links:` / `device:` sections (`meshpipe calibrate` measures them and writes both).
`device.tflops` / `memory_bandwidth_gbps` are per device with EVERY host computing at
once (a pipeline's steady state); `device.lone_tflops` / `lone_memory_bandwidth_gbps`
with one host computing while the others idle (`lone_flops`, ...). On a real cluster they
agree; simulated hosts sharing a machine's cores (this project's CPU tests) compute slower
when all are busy. The cost model charges the all-busy figures to every plan (`search`,
step 3: the lone ones, from big probe programs, overstate a stage's small kernels on
simulated devices); the lone ones are the record of what host 0 does alone.
`device.action_overhead_us` (default 0) is the runtime's fixed cost of one action
(F, B, OPT) on a stage; the cost model adds it to each action of each stage.
`device.transfer_overhead_us` (default 0) is the runtime's fixed cost of one
stage-to-stage transfer beyond its link's α-β time; added to every stage edge.
`device.kernel_overhead_us` (default 0) is the time of one kernel (a compiled program's
fusion, dot, copy, collective) beyond its flops and bytes, every host computing at once;
`device.lone_kernel_overhead_us` with one host computing (recorded, not charged). The cost model adds
kernels × it to each phase of each layer (`LayerProfile.kernels`).
`device.shared_slowdown` (default 1, ≥ 1) is how many times slower a STAGE-SIZED program (a
chain of small matmuls, `stages.calibrate_probe`) runs with every host computing than on host 0
alone. Plans on more than one host are charged device figures that much slower
(`Topology.shared`, `search` step 3); plans on one host are not. Simulated hosts sharing a
machine's cores slow each other's small stage programs far more than the big probes' all-busy
figures show (their lone and all-busy runs split the cores alike); the measurements that showed
it are in `docs/decisions.md` ("Stages on both hosts slow each other").
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping, Optional

__all__ = ["LinkClass", "Topology", "DEFAULTS", "CLASSES", "collective_time", "from_cluster"]

CLASSES = ("host", "group", "dcn")   # nearest first


@dataclass(frozen=True)
class LinkClass:
    """One class of link: per-message latency (s) and bandwidth (bytes/s); `per_array_s`: what
    each further array of one combined all-reduce adds (collectives; `links.*.per_array_us`)."""

    name: str
    latency_s: float
    bandwidth: float
    per_array_s: float = 0.0

    def time(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth


# Nominal per-platform figures (bandwidth GB/s, latency µs; device memory GB, TFLOP/s, GB/s).
DEFAULTS: Mapping[str, Mapping[str, object]] = {
    "cpu": {"host": (10.0, 10.0), "group": (1.0, 50.0), "dcn": (1.0, 50.0),
            "memory_gb": 2.0, "tflops": 0.02, "memory_bandwidth_gbps": 10.0},
    "gpu": {"host": (150.0, 5.0), "group": (25.0, 10.0), "dcn": (25.0, 10.0),
            "memory_gb": 40.0, "tflops": 100.0, "memory_bandwidth_gbps": 1500.0},
    "tpu": {"host": (45.0, 5.0), "group": (45.0, 5.0), "dcn": (6.25, 100.0),
            "memory_gb": 16.0, "tflops": 197.0, "memory_bandwidth_gbps": 819.0},
}


@dataclass(frozen=True)
class Topology:
    """Hosts × devices and what links and devices can do.

    Attributes:
      hosts, devices_per_host: the cluster's shape (a stage takes whole consecutive hosts).
      hosts_per_group: consecutive hosts that share the `group` link class.
      links: one `LinkClass` per name in `CLASSES` (stage-edge transfers; collectives within a host).
      collective_links: per cross-host class, the α-β of collectives over a mesh axis spanning
        its hosts where measured or given (`collective_link`); absent: `links`.
      memory_bytes, flops, memory_bandwidth: per device (flops, memory_bandwidth: with every
        host computing at once).
      lone_flops, lone_memory_bandwidth: per device with only one host computing (the record:
        the cost model charges the all-busy figures); None: not measured.
      action_overhead_s: the runtime's fixed cost of one action on a stage (seconds).
      transfer_overhead_s: the runtime's fixed cost of one stage-edge transfer beyond α-β (seconds).
      kernel_overhead_s, lone_kernel_overhead_s: one kernel's time beyond its flops and bytes,
        every host computing / one host alone (seconds; lone: recorded, not charged; None: not measured).
      shared_slowdown: a stage-sized program's time with every host computing ÷ host 0 alone (≥ 1):
        the factor plans on more than one host are charged (`shared`).
    """

    hosts: int
    devices_per_host: int
    hosts_per_group: int
    links: Mapping[str, LinkClass]
    memory_bytes: float
    flops: float
    memory_bandwidth: float
    platform: str = "cpu"
    notes: tuple[str, ...] = field(default=())
    action_overhead_s: float = 0.0
    transfer_overhead_s: float = 0.0
    collective_links: Mapping[str, LinkClass] = field(default_factory=dict)
    lone_flops: Optional[float] = None
    lone_memory_bandwidth: Optional[float] = None
    kernel_overhead_s: float = 0.0
    lone_kernel_overhead_s: Optional[float] = None
    shared_slowdown: float = 1.0

    def shared(self) -> "Topology":
        """This topology as a plan on MORE than one host sees it: every device figure
        `shared_slowdown` times slower (flops and bandwidth divided, the kernel time multiplied).

        Example:
            >>> t = Topology(2, 2, 1, {c: LinkClass(c, 1e-5, 1e9) for c in CLASSES}, 1e9, 1e11, 1e10,
            ...              kernel_overhead_s=1e-6, shared_slowdown=2.0)
            >>> t.shared().flops, t.shared().memory_bandwidth, t.shared().kernel_overhead_s, t.flops
            (50000000000.0, 5000000000.0, 2e-06, 100000000000.0)
        """
        c = self.shared_slowdown
        if c == 1.0:
            return self
        return replace(self, flops=self.flops / c, memory_bandwidth=self.memory_bandwidth / c,
                       kernel_overhead_s=self.kernel_overhead_s * c)

    def collective_link(self, cls: str) -> LinkClass:
        """What one collective over devices spanning link class `cls` is charged on.

        Example:
            >>> t = Topology(2, 2, 1, {c: LinkClass(c, 1e-5, 1e9) for c in CLASSES}, 1e9, 1e12, 1e11,
            ...              collective_links={"dcn": LinkClass("dcn", 2e-3, 1e8)})
            >>> t.collective_link("dcn").latency_s, t.collective_link("host").latency_s
            (0.002, 1e-05)
        """
        return self.collective_links.get(cls) or self.links[cls]

    def edge_time(self, cls: str, nbytes: float) -> float:
        """One stage-edge transfer of `nbytes` over link class `cls`: α-β plus the runtime's fixed cost."""
        return self.links[cls].time(nbytes) + self.transfer_overhead_s

    @property
    def num_devices(self) -> int:
        return self.hosts * self.devices_per_host

    def with_link(self, name: str, bandwidth_gbps: float, latency_us: float) -> "Topology":
        """A copy with one link class replaced, for its transfers and collectives alike (`--explain`, tests)."""
        links = dict(self.links)
        links[name] = LinkClass(name, latency_us * 1e-6, bandwidth_gbps * 1e9)
        coll = {k: v for k, v in self.collective_links.items() if k != name}
        return replace(self, links=links, collective_links=coll)

    def class_of_hosts(self, hosts: Iterable[int]) -> str:
        """The farthest link class a set of cluster hosts spans."""
        hs = set(hosts)
        if len(hs) <= 1:
            return "host"
        groups = {h // self.hosts_per_group for h in hs}
        return "group" if len(groups) == 1 else "dcn"

    def class_of_devices(self, first_host: int, positions: Iterable[int]) -> str:
        """The farthest class spanned by devices at these flat positions of a stage starting at `first_host`."""
        return self.class_of_hosts(first_host + p // self.devices_per_host for p in positions)


def collective_time(kind: str, nbytes: float, k: int, link: LinkClass) -> float:
    """α-β ring time of one collective over k participants (see the module docstring)."""
    if k <= 1 or nbytes <= 0:
        return 0.0
    a, b = link.latency_s, link.bandwidth
    frac = (k - 1) / k
    if kind == "all-reduce":
        return 2 * frac * nbytes / b + 2 * (k - 1) * a
    if kind in ("all-gather", "reduce-scatter", "all-to-all"):
        return frac * nbytes / b + (k - 1) * a
    if kind == "collective-permute":
        return nbytes / b + a
    raise ValueError(f"unknown collective kind {kind!r}")


def from_cluster(cluster) -> Topology:
    """The `Topology` of a `ClusterConfig`: its `links:` and `device:` sections over platform defaults."""
    d = DEFAULTS[cluster.platform]
    links, coll = {}, {}
    given = getattr(cluster, "links", None)
    notes = []
    for name in CLASSES:
        lc = getattr(given, name, None) if given is not None else None
        bw, lat = (lc.bandwidth_gbps, lc.latency_us) if lc is not None else d[name]
        if lc is None:
            notes.append(f"links.{name}: platform default {bw:g} GB/s, {lat:g} µs")
        links[name] = LinkClass(name, lat * 1e-6, bw * 1e9, float(getattr(lc, "per_array_us", None) or 0.0) * 1e-6)
        c = getattr(lc, "collectives", None)
        if c is not None and name != "host":
            coll[name] = LinkClass(name, c.latency_us * 1e-6, c.bandwidth_gbps * 1e9, float(c.per_array_us or 0.0) * 1e-6)
    hpg = getattr(given, "hosts_per_group", None) if given is not None else None
    if hpg is None:
        if cluster.platform == "tpu" and cluster.tpu is not None:
            hpg = max(1, cluster.hosts // cluster.tpu.slices)
        else:
            hpg = 1
    dev = getattr(cluster, "device", None)

    def pick(key: str) -> float:
        v = getattr(dev, key, None) if dev is not None else None
        if v is None:
            notes.append(f"device.{key}: platform default {d[key]:g}")
            return float(d[key])
        return float(v)

    mem, tf, bw = pick("memory_gb"), pick("tflops"), pick("memory_bandwidth_gbps")
    lone = {k: getattr(dev, k, None) if dev is not None else None
            for k in ("lone_tflops", "lone_memory_bandwidth_gbps", "lone_kernel_overhead_us")}
    shared = float(getattr(dev, "shared_slowdown", None) or 1.0) if dev is not None else 1.0
    if shared > 1.0:
        notes.append(f"device.shared_slowdown {shared:.3g}: plans on more than one host are charged {shared:.3g}× the "
                     "device time (hosts share hardware); a one-stage plan on one host is not")
    over = {}
    for key in ("action_overhead_us", "transfer_overhead_us", "kernel_overhead_us"):
        over[key] = getattr(dev, key, None) if dev is not None else None
        if over[key] is None:
            notes.append(f"device.{key}: not set, 0 (meshpipe calibrate measures it)")
    return Topology(cluster.hosts, cluster.devices_per_host, hpg, links, mem * 1e9, tf * 1e12, bw * 1e9,
                    cluster.platform, tuple(notes), float(over["action_overhead_us"] or 0.0) * 1e-6,
                    float(over["transfer_overhead_us"] or 0.0) * 1e-6, coll,
                    None if lone["lone_tflops"] is None else float(lone["lone_tflops"]) * 1e12,
                    None if lone["lone_memory_bandwidth_gbps"] is None
                    else float(lone["lone_memory_bandwidth_gbps"]) * 1e9,
                    float(over["kernel_overhead_us"] or 0.0) * 1e-6,
                    None if lone["lone_kernel_overhead_us"] is None else float(lone["lone_kernel_overhead_us"]) * 1e-6,
                    shared)
