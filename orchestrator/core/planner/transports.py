"""How a stage edge's bytes travel under each transport, and whose thread waits for them. Pure.

Three transports (`cluster.transport`; `auto` is `xla` on GPU/TPU and `socket` on CPU here):
  ray, socket  host-staged: the sender copies the shards it sends device → host (D2H,
               `np.asarray` per shard), the bytes cross the wire (one framed TCP / Unix
               stream per host pair; Ray's object store), and the receiver copies them
               host → device (H2D) once per local device that holds them
               (`TiledTransport._to_array`): a replicated destination on an 8-GPU host
               pays 8 copies.
  xla          device-direct: one JAX world per job; XLA's cross-host transfers (NCCL on
               GPU, the TPU runtime over ICI / DCN) move each tile device to device on their
               own stream. A destination host receives each distinct piece once, the pieces
               in parallel (one device pair per piece: `lanes`), and broadcasts it on device
               to the host's other devices that hold it (`replicas`, the fan-out) over the
               `host` link class's collective figures.

Who waits (`EdgeCost`, what `Topology.edge` returns and the simulator plays):
  send_block_s  the sender's compute thread: `issue_s` + `blocking` × (D2H + wire).
                `blocking` is 1 for ray and socket (today their SEND copies and writes on the
                compute thread; the conservative default until a non-blocking send is measured
                as such) and 0 for xla (issuing returns at once); `links.send_blocking` and
                `links.send_issue_us` override the transport's figures.
  transfer_s    from the SEND's start until the receiver can read the data: D2H + wire
                (+ H2D where the receiver's thread does not do it) for the staged
                transports; wire + fan-out for xla; + `Topology.transfer_overhead_s`.
  recv_block_s  the receiver's compute thread after arrival: the staged transports' H2D
                (× replicas when each device gets its own copy); 0 for xla.

Copies between device and host memory go over `links.host_copy` (α-β; default from the
platform: a quarter of the PCIe data-sheet figure for pageable copies on GPU; none on CPU,
whose devices are host memory already).

Link figures per transport (`default_links`): a link class is the same wires for every
transport, but not the same path. Under `socket` two hosts of one node talk through host
memory (Unix socket + shared memory) and two nodes over TCP on the host NIC (100 GbE);
under `xla` the same pairs talk over NVLink / ICI and, across nodes, NCCL over the GPUs'
own RDMA NICs (400 Gb/s per GPU); a TPU slice's hosts over ICI, slices over DCN. The
collectives inside a stage are always XLA's own, so their defaults are the `xla` row.
Figures a cluster gives in `links:` describe ITS transport's stage edges (what
`meshpipe calibrate` measures); the platform defaults below are nominal.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Mapping, Optional

import numpy as np

__all__ = ["TransportModel", "TRANSPORTS", "EdgeLayout", "EdgeCost", "resolve", "default_links",
           "edge_layout", "edge_record", "HOST_COPY_SHARE_OF_PCIE"]


@dataclass(frozen=True)
class TransportModel:
    """What the cost model needs to know about one transport (module docstring).

    Attributes:
      name: ray | socket | xla.
      device_direct: the wire runs device to device (no D2H / H2D).
      blocking: fraction of D2H + wire the sender's compute thread waits, in [0, 1].
      issue_s: the sender's compute-thread cost of issuing one SEND (seconds).
      h2d_per_device: the receiver copies host → device once per local device holding a piece
        (else once per host, then an on-device broadcast).
      recv_on_thread: the receiver's H2D runs on its compute thread.
    """

    name: str
    device_direct: bool
    blocking: float
    issue_s: float
    h2d_per_device: bool = True
    recv_on_thread: bool = True


TRANSPORTS: Mapping[str, TransportModel] = {
    "ray": TransportModel("ray", False, 1.0, 0.0),
    "socket": TransportModel("socket", False, 1.0, 0.0),
    "xla": TransportModel("xla", True, 0.0, 100e-6, h2d_per_device=False, recv_on_thread=False),
}

HOST_COPY_SHARE_OF_PCIE = 0.25     # pageable D2H / H2D reach about this share of PCIe (assumed; measured by
#                                    benchmarks/gpu_transfer_check.py where a GPU is lent)

# Stage-edge link figures per platform and transport: class -> (GB/s per device, µs). None: from the data sheet.
_CPU = {"host": (10.0, 10.0), "group": (1.0, 50.0), "dcn": (1.0, 50.0)}
_LINKS: Mapping[str, Mapping[str, Mapping[str, Optional[tuple[float, float]]]]] = {
    "cpu": {"ray": _CPU, "socket": _CPU, "xla": _CPU},
    "gpu": {
        # same node: Unix socket + shared memory (a host-memory copy); across nodes: TCP on 100 GbE
        "socket": {"host": (10.0, 20.0), "group": (10.0, 20.0), "dcn": (12.5, 30.0)},
        "ray": {"host": (5.0, 1000.0), "group": (5.0, 1000.0), "dcn": (12.5, 1000.0)},
        # NVLink inside a node / NVLink domain (None: the GPU's data sheet), NCCL on a 400 Gb/s NIC per GPU
        "xla": {"host": None, "group": None, "dcn": (50.0, 10.0)},
    },
    "tpu": {
        # the TPU VMs' own network between hosts of a slice and between slices
        "socket": {"host": (10.0, 20.0), "group": (6.25, 100.0), "dcn": (6.25, 100.0)},
        "ray": {"host": (5.0, 1000.0), "group": (6.25, 1000.0), "dcn": (6.25, 1000.0)},
        # ICI inside a slice (None: one ICI link of the chip's data sheet), DCN between slices
        "xla": {"host": None, "group": None, "dcn": (6.25, 100.0)},
    },
}
_DEVICE_LINK = {"gpu": (450.0, 5.0), "tpu": (45.0, 5.0)}     # NVLink / ICI when the model is not known
_HOST_COPY = {"gpu": (64.0 * HOST_COPY_SHARE_OF_PCIE, 10.0), "tpu": (8.0, 10.0)}    # (GB/s, µs)


def resolve(platform: str, transport: Optional[str]) -> str:
    """The transport the cost model charges: `auto` (and None) is `xla` on GPU/TPU, `socket` on CPU.

    Example:
        >>> resolve("gpu", "auto"), resolve("cpu", "auto"), resolve("tpu", "socket")
        ('xla', 'socket', 'socket')
    """
    if transport in (None, "auto"):
        return "xla" if platform in ("gpu", "tpu") else "socket"
    if transport not in TRANSPORTS:
        raise ValueError(f"transport = {transport!r}: the cost model knows {', '.join(TRANSPORTS)} (and auto)")
    return transport


def default_links(platform: str, transport: str, device_link_gbps: Optional[float] = None
                  ) -> tuple[dict[str, tuple[float, float]], dict[str, tuple[float, float]], Optional[tuple]]:
    """Nominal (stage-edge links, collective links, host copy) of a platform under a transport.

    Each link is (GB/s, µs) per class; `device_link_gbps` is NVLink / one ICI link from the
    device's data sheet (None: a generic figure). Collectives are XLA's own on every
    transport (the `xla` row); on CPU they are the stage-edge figures (empty dict), as before.

    Example:
        >>> edges, coll, copy = default_links("gpu", "socket", 450)
        >>> edges["dcn"], coll["dcn"], coll["host"], copy
        ((12.5, 30.0), (50.0, 10.0), (450, 5.0), (16.0, 10.0))
    """
    rows = _LINKS[platform]

    def fill(row):
        dev = (device_link_gbps, _DEVICE_LINK[platform][1]) if device_link_gbps else _DEVICE_LINK.get(platform)
        return {c: (v if v is not None else dev) for c, v in row.items()}

    edges = fill(rows[transport])
    coll = {} if platform == "cpu" else fill(rows["xla"])
    return edges, coll, _HOST_COPY.get(platform)


@dataclass(frozen=True)
class EdgeLayout:
    """Where one edge's bytes land, as shares of the whole activation (`edge_layout`).

    Attributes:
      dst_share: the distinct bytes the busiest destination host holds, ÷ the array's.
      src_share: the same for the busiest source host (what it copies device → host).
      lanes: distinct pieces on that destination host (device pairs moving in parallel).
      replicas: devices of that host holding each piece (the fan-out; 1: none).
    The default (whole array to one device, no fan-out) is what the search's dynamic
    programme charges before it knows the two stages' layouts.
    """

    dst_share: float = 1.0
    src_share: float = 1.0
    lanes: int = 1
    replicas: int = 1


@dataclass(frozen=True)
class EdgeCost:
    """One edge's one-way cost (module docstring), with its parts for `--explain` and JSON."""

    transfer_s: float
    send_block_s: float
    recv_block_s: float
    d2h_s: float = 0.0
    wire_s: float = 0.0
    h2d_s: float = 0.0
    fanout_s: float = 0.0

    @property
    def delay_s(self) -> float:
        """What the receiver waits from the SEND's start until it can compute."""
        return max(self.transfer_s, self.send_block_s) + self.recv_block_s

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("transfer_s", "send_block_s", "recv_block_s", "d2h_s", "wire_s",
                                              "h2d_s", "fanout_s")}


def edge_layout(src, dst, out_axes, devices_per_host: int) -> EdgeLayout:
    """The `EdgeLayout` of an activation with logical `out_axes` (batch first) leaving a stage
    laid out as MeshChoice `src` for one laid out as `dst` (devices row-major in each choice's
    axis order, `devices_per_host` per host, as the stage worker builds its `Mesh`).

    Example:
        >>> from orchestrator.core.planner.cost import MeshChoice
        >>> tp8 = MeshChoice(1, 8, ("data", "model"), (("mlp", "model"),), "mlp")
        >>> edge_layout(tp8, tp8, ("batch", None, "embed"), 8)          # replicated: one piece, 8 copies
        EdgeLayout(dst_share=1.0, src_share=1.0, lanes=1, replicas=8)
        >>> dp8 = MeshChoice(8, 1, ("data", "model"), (), "dp")
        >>> edge_layout(tp8, dp8, ("batch", None, "embed"), 8)
        EdgeLayout(dst_share=1.0, src_share=1.0, lanes=8, replicas=1)
    """
    d_share, d_lanes, d_reps = _host_pieces(dst.order, tuple(sorted(dst.sizes().items())), _sharded(dst, out_axes),
                                            devices_per_host)
    s_share, _, _ = _host_pieces(src.order, tuple(sorted(src.sizes().items())), _sharded(src, out_axes),
                                 devices_per_host)
    return EdgeLayout(d_share, s_share, d_lanes, d_reps)


def _sharded(choice, out_axes) -> tuple[str, ...]:
    """Mesh axes the activation is split over: batch over data (× fsdp), a rules axis over model."""
    rules = dict(choice.rules) if choice.model > 1 else {}
    model = any(a in rules for a in tuple(out_axes)[1:] if a)
    return ("data", "fsdp") + (("model",) if model else ())


@functools.lru_cache(maxsize=4096)
def _host_pieces(order, sizes_items, sharded, dph) -> tuple[float, int, int]:
    """(share of the array, distinct pieces, devices per piece) on the host holding the most."""
    sizes = dict(sizes_items)
    names = list(order) + [a for a in sizes if a not in order]
    shape = [sizes[a] for a in names]
    coords = np.indices(shape).reshape(len(shape), -1)
    split = [i for i, a in enumerate(names) if a in sharded and sizes[a] > 1]
    total = int(np.prod([shape[i] for i in split])) if split else 1
    piece = np.ravel_multi_index(tuple(coords[i] for i in split), [shape[i] for i in split]) if split \
        else np.zeros(coords.shape[1], dtype=np.int64)
    host = np.arange(coords.shape[1]) // max(1, dph)
    best = (0.0, 1, 1)
    for h in np.unique(host):
        mine = piece[host == h]
        n = len(np.unique(mine))
        cand = (n / total, n, max(1, len(mine) // n))
        best = max(best, cand)
    return best


def edge_record(model, topo, e: int, a, b, micro: int) -> dict:
    """Edge e's record for a plan (`search.evaluate`): the activation leaving stage a's last layer for
    stage b (`StageChoice`s), costed by `Topology.edge` on the two stages' layouts; forward and
    backward (the gradient, b → a) share the simulator's per-edge figures, so each part is the
    slower direction's."""
    layer = model.layers[a.layers[1] - 1]
    nbytes = layer.out_bytes(micro)
    src, dst = a.hosts[0] + a.hosts[1] - 1, b.hosts[0]
    cls = topo.class_of_hosts([src, dst])
    dph = topo.devices_per_host
    fwd = topo.edge(cls, nbytes, edge_layout(a.choice, b.choice, layer.out_axes, dph)).to_dict()
    bwd = topo.edge(cls, nbytes, edge_layout(b.choice, a.choice, layer.out_axes, dph)).to_dict()
    parts = {k: max(fwd[k], bwd[k]) for k in fwd}
    delay = max(parts["transfer_s"], parts["send_block_s"]) + parts["recv_block_s"]
    return {"edge": [e, e + 1], "bytes": nbytes, "link": cls, "transport": topo.transport.name,
            "time_s": delay, **parts}
