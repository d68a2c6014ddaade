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
without them, on GPU/TPU the device-direct defaults (NVLink, ICI, NCCL's NICs), on CPU
the class's own figures. Within a host a given `links.host` stands for collectives
too (`calibrate` fits it from them).

A stage edge's cost depends on the transport as much as on the link
(`transports.py`: `Topology.edge` → `EdgeCost`): who waits (the sender's compute
thread for a blocking SEND, the receiver's for host-to-device copies), the copies
between device and host (`links.host_copy`), and a replicated destination's fan-out.
The schedule simulator plays those holds (`simulate(..., send_block=, recv_block=)`).

Defaults are nominal: device figures from the accelerator model's data sheet
(`hardware.py`; GPU memory × XLA's 0.75 memory fraction) or `DEFAULTS` per platform, link
figures per platform and transport (`transports.default_links`); a cluster's `links:` /
`device:` sections replace them (`meshpipe calibrate` measures them and writes both).
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

from orchestrator.core.planner.hardware import XLA_GPU_MEMORY_FRACTION, gpu_figures, tpu_figures
from orchestrator.core.planner.transports import (TRANSPORTS, EdgeCost, EdgeLayout, TransportModel,
                                                  default_links, resolve)

__all__ = ["LinkClass", "Topology", "DEFAULTS", "CLASSES", "aligned", "collective_time", "from_cluster"]

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


# Generic per-platform device figures (memory GB, TFLOP/s, GB/s) when the cluster does not name a model the
# data-sheet table knows (`hardware.py`); GPU: an H100's, with XLA's 0.75 memory fraction. Link figures per
# platform AND transport are `transports.default_links`.
DEFAULTS: Mapping[str, Mapping[str, float]] = {
    "cpu": {"memory_gb": 2.0, "tflops": 0.02, "memory_bandwidth_gbps": 10.0},
    "gpu": {"memory_gb": 80.0 * XLA_GPU_MEMORY_FRACTION, "tflops": 494.7, "memory_bandwidth_gbps": 3350.0},
    "tpu": {"memory_gb": 16.0, "tflops": 197.0, "memory_bandwidth_gbps": 819.0},
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
      transport: how stage edges travel and whose thread waits (`transports.TransportModel`).
      host_copy: the α-β of one device ↔ host copy as the host-staged transports make them
        (None: free, CPU devices are host memory).
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
    transport: TransportModel = TRANSPORTS["socket"]
    host_copy: Optional[LinkClass] = None

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

    def edge_time(self, cls: str, nbytes: float, layout: EdgeLayout = EdgeLayout()) -> float:
        """What the receiver of one stage-edge transfer of `nbytes` over link class `cls` waits from
        the SEND's start until it can compute (`edge(...).delay_s`)."""
        return self.edge(cls, nbytes, layout).delay_s

    def edge(self, cls: str, nbytes: float, layout: EdgeLayout = EdgeLayout()) -> EdgeCost:
        """One stage-edge transfer under this topology's transport (`transports` module docstring).

        Example:
            >>> t = Topology(2, 8, 1, {c: LinkClass(c, 0.0, 10e9) for c in CLASSES}, 1e9, 1e12, 1e11,
            ...              host_copy=LinkClass("copy", 0.0, 20e9))
            >>> e = t.edge("dcn", 1e9, EdgeLayout(replicas=8))     # socket: D2H, wire, 8 H2D copies
            >>> round(e.send_block_s, 3), round(e.transfer_s, 3), round(e.recv_block_s, 3)
            (0.15, 0.15, 0.4)
            >>> e = replace(t, transport=TRANSPORTS["xla"]).edge("dcn", 1e9, EdgeLayout(replicas=8))
            >>> e.send_block_s, round(e.transfer_s, 3), e.recv_block_s     # issue only; wire + fan-out
            (0.0001, 0.2, 0.0)
        """
        t, link = self.transport, self.links[cls]
        dst = nbytes * layout.dst_share
        near = self.collective_link("host")        # on-device broadcast among a host's devices
        if t.device_direct:
            piece = dst / max(1, layout.lanes)
            fan = near.time(piece) if layout.replicas > 1 else 0.0
            wire = link.time(piece)
            return EdgeCost(wire + fan + self.transfer_overhead_s, t.issue_s, 0.0, 0.0, wire, 0.0, fan)
        copy = self.host_copy
        d2h = copy.time(nbytes * layout.src_share) if copy is not None else 0.0
        wire = link.time(dst)
        one = copy.time(dst) if copy is not None else 0.0
        if t.h2d_per_device:
            h2d, fan = one * layout.replicas, 0.0
        else:
            h2d, fan = one, (near.time(dst / max(1, layout.lanes)) if layout.replicas > 1 else 0.0)
        block = t.issue_s + t.blocking * (d2h + wire)
        if t.recv_on_thread:
            return EdgeCost(d2h + wire + self.transfer_overhead_s, block, h2d + fan, d2h, wire, h2d, fan)
        return EdgeCost(d2h + wire + h2d + fan + self.transfer_overhead_s, block, 0.0, d2h, wire, h2d, fan)

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


def from_cluster(cluster, transport: Optional[str] = None) -> Topology:
    """The `Topology` of a `ClusterConfig`: its `links:` and `device:` sections over the defaults of
    its platform, accelerator model (`hardware.py`) and transport (`transports.default_links`).

    `transport` costs the cluster under another transport than its own (a what-if; None: its own).
    """
    platform = cluster.platform
    asked = transport if transport is not None else getattr(cluster, "transport", None)
    tname = resolve(platform, asked)
    notes: list[str] = []
    if asked in (None, "auto"):
        notes.append(f"transport auto: costed as {tname}")
    d, link_gbps = _device_defaults(cluster, notes)
    edge_d, coll_d, copy_d = default_links(platform, tname, link_gbps)
    links, coll = {}, {}
    given = getattr(cluster, "links", None)
    for name in CLASSES:
        lc = getattr(given, name, None) if given is not None else None
        bw, lat = (lc.bandwidth_gbps, lc.latency_us) if lc is not None else edge_d[name]
        if lc is None:
            notes.append(f"links.{name}: {platform} default under transport {tname}, {bw:g} GB/s, {lat:g} µs")
        links[name] = LinkClass(name, lat * 1e-6, bw * 1e9, float(getattr(lc, "per_array_us", None) or 0.0) * 1e-6)
        c = getattr(lc, "collectives", None)
        if c is not None and name != "host":
            coll[name] = LinkClass(name, c.latency_us * 1e-6, c.bandwidth_gbps * 1e9, float(c.per_array_us or 0.0) * 1e-6)
        elif name in coll_d and not (lc is not None and (name == "host" or tname == "xla")):
            # XLA's own collectives ride the device-direct wires whatever the stage transport; a given
            # `links.host` (calibrate fits it from collectives) or any link under xla stands for both
            bw_c, lat_c = coll_d[name]
            coll[name] = LinkClass(name, lat_c * 1e-6, bw_c * 1e9)
    hpg = getattr(given, "hosts_per_group", None) if given is not None else None
    if hpg is None:
        if platform == "tpu" and cluster.tpu is not None:
            hpg = max(1, cluster.hosts // cluster.tpu.slices)
        else:
            hpg = 1
    dev = getattr(cluster, "device", None)

    def pick(key: str) -> float:
        v = getattr(dev, key, None) if dev is not None else None
        if v is None:
            notes.append(f"device.{key}: default {d[key]:g}")
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
    transport, host_copy = _transport(TRANSPORTS[tname], given, copy_d, notes)
    return Topology(cluster.hosts, cluster.devices_per_host, hpg, links, mem * 1e9, tf * 1e12, bw * 1e9,
                    platform, tuple(notes), float(over["action_overhead_us"] or 0.0) * 1e-6,
                    float(over["transfer_overhead_us"] or 0.0) * 1e-6, coll,
                    None if lone["lone_tflops"] is None else float(lone["lone_tflops"]) * 1e12,
                    None if lone["lone_memory_bandwidth_gbps"] is None
                    else float(lone["lone_memory_bandwidth_gbps"]) * 1e9,
                    float(over["kernel_overhead_us"] or 0.0) * 1e-6,
                    None if lone["lone_kernel_overhead_us"] is None else float(lone["lone_kernel_overhead_us"]) * 1e-6,
                    shared, transport, host_copy)


def _device_defaults(cluster, notes: list[str]) -> tuple[dict, Optional[float]]:
    """Device figures (memory_gb, tflops, memory_bandwidth_gbps) the cluster's accelerator model
    gives by default, and its NVLink / one-ICI-link GB/s (None: unknown model)."""
    platform = cluster.platform
    if platform == "gpu":
        g = getattr(cluster, "gpu", None)
        kind = getattr(g, "accelerator_type", None)
        frac = getattr(g, "memory_fraction", None)
        f = gpu_figures(kind, frac)
        if f is None:
            f = gpu_figures("H100", frac)
            notes.append(f"gpu.accelerator_type {kind or 'not set'}: not in the data-sheet table, H100 figures assumed")
        notes.append(f"device defaults: {f['model']} data sheet, {f['hbm_gb']:g} GB × memory fraction "
                     f"{f['memory_fraction']:g} = {f['memory_gb']:g} GB usable per GPU")
        return {k: f[k] for k in ("memory_gb", "tflops", "memory_bandwidth_gbps")}, float(f["nvlink_gbps"])
    if platform == "tpu" and getattr(cluster, "tpu", None) is not None:
        from orchestrator.core.backends.tpu_topology import geometry

        geom = geometry(cluster.tpu.type, cluster.tpu.topology, cluster.tpu.chips_per_host)
        f = tpu_figures(geom.version, geom.devices_per_chip)
        if f is not None:
            notes.append(f"device defaults: TPU {geom.version} data sheet")
            return {k: f[k] for k in ("memory_gb", "tflops", "memory_bandwidth_gbps")}, f["ici_gbps"]
        notes.append(f"tpu.type {cluster.tpu.type}: not in the data-sheet table, generic TPU figures assumed")
    return dict(DEFAULTS[platform]), None


def _transport(model: TransportModel, given, copy_d, notes: list[str]) -> tuple[TransportModel, Optional[LinkClass]]:
    """The transport model with `links.send_blocking` / `send_issue_us` applied, and the host-copy link."""
    blocking = getattr(given, "send_blocking", None) if given is not None else None
    issue = getattr(given, "send_issue_us", None) if given is not None else None
    if blocking is not None or issue is not None:
        model = replace(model, blocking=model.blocking if blocking is None else float(blocking),
                        issue_s=model.issue_s if issue is None else float(issue) * 1e-6)
    else:
        notes.append(f"links.send_blocking: transport {model.name} default {model.blocking:g} "
                     f"(issue {model.issue_s * 1e6:g} µs)")
    hc = getattr(given, "host_copy", None) if given is not None else None
    if hc is not None:
        return model, LinkClass("host_copy", hc.latency_us * 1e-6, hc.bandwidth_gbps * 1e9)
    if copy_d is None or model.device_direct:
        return model, None
    notes.append(f"links.host_copy: default {copy_d[0]:g} GB/s, {copy_d[1]:g} µs (device ↔ host copies)")
    return model, LinkClass("host_copy", copy_d[1] * 1e-6, copy_d[0] * 1e9)


def aligned(h: int, k: int, hpg: int, hosts: int) -> bool:
    """Whether `k` hosts from host `h` keep to the node groups of `hpg` hosts each (of `hosts`): within
    one group, or whole groups from a group's start (any span when there is one group)."""
    if hpg <= 1 or hpg >= hosts:
        return True
    if k <= hpg:
        return h % hpg + k <= hpg
    return k % hpg == 0 and h % hpg == 0
