"""Cloud TPU slice geometry (pure tables and arithmetic; no ray, no jax).

A TPU *slice* (GCP accelerator type `v5litepod-16`, topology `4x4`) is a set of
VMs ("hosts", Ray nodes) of `chips_per_host` chips joined by ICI. The tables
follow Ray's `ray._private.accelerators.tpu` (valid topologies, chips per host,
worker grids) so that what we accept is what Ray's TPU support recognises;
`tests/test_backends.py` cross-checks them against the installed Ray.

Naming, as in Ray: accelerator *version* `v5litepod`; *pod type* `v5litepod-16`
(version-cores); Ray gives worker 0 of each slice the resource
`TPU-<pod type>-head` and every host the labels `ray.io/tpu-slice-name`,
`ray.io/tpu-worker-id`, `ray.io/tpu-pod-type`, `ray.io/tpu-topology`.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

__all__ = ["SliceGeometry", "geometry", "VERSIONS", "VALID_TOPOLOGIES", "WORKER_DIMS",
           "chip_bounds", "aligned_block", "process_bounds", "normalize_version", "TpuTypeError"]

# version -> (TensorCores per chip, jax devices per chip)
VERSIONS: dict[str, tuple[int, int]] = {
    "v2": (2, 2), "v3": (2, 2), "v4": (2, 1), "v5p": (2, 1),
    "v5litepod": (1, 1), "v6e": (1, 1), "v7x": (2, 2),
}
_ALIASES = {"v5e": "v5litepod", "tpu7x": "v7x"}


def _cubes(max_x: int, max_y: int, max_z: int) -> set[str]:
    r = range(4, max_x + 1, 4)
    return {f"{x}x{y}x{z}" for x in r for y in range(4, max_y + 1, 4) for z in range(4, max_z + 1, 4)}


VALID_TOPOLOGIES: dict[str, set[str]] = {
    "v2": {"4x4", "4x8", "8x8", "8x16", "16x16"},
    "v3": {"4x4", "4x8", "8x8", "8x16", "16x16", "16x32", "32x32"},
    "v4": {"2x2x1", "2x2x2", "2x2x4", "2x4x4"} | _cubes(12, 12, 16),
    "v5p": {"2x2x1", "2x2x2", "2x2x4", "2x4x4"} | _cubes(16, 16, 24),
    "v5litepod": {"1x1", "2x2", "2x4", "2x8", "4x4", "4x8", "8x8", "8x16", "16x16"},
    "v6e": {"1x1", "2x2", "2x4", "2x8", "4x4", "4x8", "8x8", "8x16", "16x16"},
    "v7x": {"2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16", "8x16x16"},
}

# topology -> worker (host) grid: (y, x) for 2D, (z, y, x) for 3D; worker id is row-major.
WORKER_DIMS: dict[str, tuple[int, ...]] = {
    "2x2": (1, 1), "2x4": (1, 2), "4x4": (2, 2), "4x8": (2, 4), "8x8": (4, 4), "8x16": (4, 8),
    "16x16": (8, 8),
    "2x2x1": (1, 1, 1), "2x2x2": (1, 1, 2), "2x2x4": (1, 1, 4), "2x4x4": (1, 2, 4), "4x4x4": (2, 2, 4),
    "4x4x8": (2, 2, 8), "4x8x8": (2, 4, 8), "8x8x8": (4, 4, 8), "8x8x16": (4, 4, 16),
    "8x16x16": (4, 8, 16), "16x16x16": (8, 8, 16), "16x16x24": (8, 8, 24),
}

_SINGLE_HOST_TOPOLOGIES = ("1x1", "2x2", "2x4")    # v5e/v6e: one VM holds the whole slice
_EIGHT_CHIP_VERSIONS = ("v5litepod", "v6e")
_TYPE_RE = re.compile(r"^(v\d+[a-z]*|tpu\d+[a-z]*)-(\d+)$")
_TOPO_RE = re.compile(r"^\d+x\d+(x\d+)?$")


def normalize_version(v: str) -> str:
    v = v.strip().lower()
    return _ALIASES.get(v, v)


class TpuTypeError(ValueError):
    """A bad `tpu:` section: `key` is the key under `tpu` at fault, the message the rule."""

    def __init__(self, key: str, rule: str):
        super().__init__(rule)
        self.key = key


def chip_bounds(chips: int) -> str:
    """TPU_CHIPS_PER_PROCESS_BOUNDS for `chips` chips of one host ("x,y,z")."""
    try:
        return {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}[chips]
    except KeyError:
        raise ValueError(f"a TPU process drives 1, 2, 4 or 8 chips of one host, not {chips}") from None


@dataclass(frozen=True)
class SliceGeometry:
    """One slice type: its chips, hosts and the names Ray gives it.

    Example:
        >>> g = geometry("v5litepod-16", "4x4")
        >>> g.hosts, g.chips_per_host, g.head_resource
        (4, 4, 'TPU-v5litepod-16-head')
    """

    version: str
    pod_type: str
    topology: str
    chips: int
    chips_per_host: int
    devices_per_chip: int

    @property
    def hosts(self) -> int:
        return max(1, self.chips // self.chips_per_host)

    @property
    def head_resource(self) -> str:
        return f"TPU-{self.pod_type}-head"

    @property
    def worker_dims(self) -> Optional[tuple[int, ...]]:
        return WORKER_DIMS.get(self.topology) if self.hosts > 1 else None


def geometry(tpu_type: str, topology: str, chips_per_host: Optional[int] = None) -> SliceGeometry:
    """Validate a (type, topology) pair and derive its geometry.

    Raises:
      TpuTypeError: `.key` names the `tpu.<key>` at fault, the message is the rule.
    """
    m = _TYPE_RE.match(tpu_type.strip().lower())
    if not m:
        raise TpuTypeError("type", "must be a GCP TPU accelerator type '<version>-<cores>', e.g. "
                           "v5litepod-16, v6e-16, v4-16")
    version, cores = normalize_version(m.group(1)), int(m.group(2))
    if version not in VERSIONS:
        raise TpuTypeError("type", f"unknown TPU version {m.group(1)!r}; known: {', '.join(sorted(VERSIONS))}")
    topo = topology.strip().lower()
    if not _TOPO_RE.match(topo) or topo not in VALID_TOPOLOGIES[version]:
        raise TpuTypeError("topology", f"not a {version} slice topology; valid: "
                           f"{', '.join(sorted(VALID_TOPOLOGIES[version], key=_size))}")
    cores_per_chip, devices_per_chip = VERSIONS[version]
    chips = math.prod(int(d) for d in topo.split("x"))
    if chips * cores_per_chip != cores:
        raise TpuTypeError("topology", f"{tpu_type} has {cores // cores_per_chip} chips ({cores} cores, "
                           f"{cores_per_chip} per chip) but topology {topo} has {chips}; type and topology "
                           "must describe the same slice")
    default = chips if (version in _EIGHT_CHIP_VERSIONS and topo in _SINGLE_HOST_TOPOLOGIES) else 4
    per_host = chips_per_host or default
    if per_host not in (1, 2, 4, 8) or (per_host < chips and chips % per_host):
        raise TpuTypeError("chips_per_host", f"must be 1, 2, 4 or 8 and divide the slice's {chips} chips")
    return SliceGeometry(version, f"{version}-{cores}", topo, chips, min(per_host, chips), devices_per_chip)


def _size(topo: str) -> int:
    return math.prod(int(d) for d in topo.split("x"))


def _coords(worker: int, dims: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for d in reversed(dims):
        out.append(worker % d)
        worker //= d
    return tuple(reversed(out))


def _index(coords: tuple[int, ...], dims: tuple[int, ...]) -> int:
    i = 0
    for c, d in zip(coords, dims):
        i = i * d + c
    return i


def aligned_block(geom: SliceGeometry, first: int, count: int) -> Optional[tuple[str, tuple[int, ...]]]:
    """The subslice topology whose aligned block of workers is exactly [first, first+count), if any.

    Returns (subslice topology, its worker dims) or None. A block is aligned when
    its origin is a multiple of its shape in every worker-grid dimension, so the
    slice tiles into such blocks (ICI-aligned subslices, as Ray labels them).
    """
    parent = geom.worker_dims
    if parent is None or geom.hosts <= 1:
        return None
    for topo, dims in WORKER_DIMS.items():
        if (len(dims) != len(parent) or math.prod(dims) != count or topo == geom.topology
                or topo not in VALID_TOPOLOGIES[geom.version]
                or any(p % d for p, d in zip(parent, dims))):
            continue
        origin = _coords(first, parent)
        if any(o % d for o, d in zip(origin, dims)):
            continue
        ids = set()
        for off in range(count):
            rel = _coords(off, dims)
            ids.add(_index(tuple(o + r for o, r in zip(origin, rel)), parent))
        if ids == set(range(first, first + count)):
            return topo, dims
    return None


def process_bounds(dims: tuple[int, ...]) -> str:
    """TPU_PROCESS_BOUNDS ("x,y,z") for a worker grid given as (y, x) or (z, y, x)."""
    if len(dims) == 2:
        return f"{dims[1]},{dims[0]},1"
    return f"{dims[2]},{dims[1]},{dims[0]}"
