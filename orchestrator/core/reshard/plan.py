"""Cross-mesh resharding plans: which tile goes from which source device to which host.

Between two pipeline stages a tensor leaves one mesh (devices, axis names,
PartitionSpec, hosts) and must arrive on another. `make_plan` turns the global
shape, the dtype and the two `MeshSide`s into a `ReshardPlan`, a pure value that
senders and receivers follow without making decisions of their own.

Basic flow:
  1. `_grid` reads a side's sharding the way `jax.sharding.NamedSharding` does:
     array dim d with spec entry ("a", "b") is cut into size(a) * size(b) equal
     blocks, block index = idx_a * size(b) + idx_b; mesh axes not named by the
     spec replicate. A shard is therefore identified by its block index tuple,
     and two devices hold identical or disjoint boxes.
  2. For every destination host, every destination shard there is intersected
     with the source blocks it overlaps. Because both sides' boxes are identical
     or disjoint, these intersections ("pieces") are identical or disjoint too, so
     deduplicating by global box gives each host the exact set of data it needs,
     each piece once, with the list of its local devices that want it.
  3. A piece that some source device on the same host already holds becomes a
     local copy. Every other piece crosses the network once; its sender is the
     least-loaded source host (bytes already assigned, then host id) among the
     hosts holding a replica, and within that host the least-loaded replica device
     (then device id). Pieces are assigned largest first, so equal replicas share
     the work evenly.

Invariants (checked by tests/test_reshard_plan*.py):
  - assembling every destination shard from the tiles reproduces the global array's slices;
  - no piece of data reaches a destination host twice, and data a host already holds is
    never sent to it: `cross_host_bytes == lower_bound_bytes`, where the lower bound is
    computed independently from the two shardings;
  - `sends[s][d]` for all source hosts s, concatenated in ascending s, is `recvs[d]`.

Host ids are integers comparable across the two sides (same id = same process);
device ids are integers unique within one side. numpy only: no jax, no ray.
"""
from __future__ import annotations

import functools
import itertools
import math
from collections import defaultdict
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import numpy as np

Box = tuple[tuple[int, int], ...]
SpecEntry = Any  # None | str | tuple[str, ...]


class ReshardError(ValueError):
    """A sharding that cannot hold the shape, or a malformed mesh side."""


def _canon_entry(entry: Any) -> SpecEntry:
    """None | "a" | ("a", "b"); ("a",) becomes "a" and () becomes None, as in JAX."""
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, (tuple, list)) and all(isinstance(a, str) for a in entry):
        return None if not entry else entry[0] if len(entry) == 1 else tuple(entry)
    raise ReshardError(f"spec entry {entry!r} must be None, a mesh axis name or a tuple of them")


def _entry_axes(entry: SpecEntry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else entry


@dataclass(frozen=True, eq=False)
class MeshSide:
    """One side of a reshard: a mesh of devices, the hosts owning them, and a spec.

    Attributes:
      devices: integer device ids laid out in the mesh's shape, e.g. shape (2, 2).
      hosts: same shape; the host (worker process) owning each device.
      axis_names: one name per mesh axis.
      spec: PartitionSpec-like tuple, one entry per leading array dim: None, an
        axis name, or a tuple of axis names (split major-to-minor). Normalised:
        ("a",) is stored as "a" and () as None.

    Arrays are copied read-only; sides compare and hash by value, so they can key caches.

    Example:
        >>> side = MeshSide(np.arange(4).reshape(2, 2), np.array([[0, 0], [1, 1]]),
        ...                 ("data", "model"), ("data", None))
        >>> side.describe()
        "mesh(data=2, model=2) P('data', None)"
        >>> side.devices_on(1)
        (2, 3)
    """

    devices: np.ndarray
    hosts: np.ndarray
    axis_names: tuple[str, ...]
    spec: tuple = ()

    def __post_init__(self):
        devices = np.array(self.devices)
        hosts = np.array(self.hosts)
        axis_names = tuple(self.axis_names)
        if devices.size and not np.issubdtype(devices.dtype, np.integer):
            raise ReshardError(f"devices must be integer ids, got dtype {devices.dtype}")
        if hosts.size and not np.issubdtype(hosts.dtype, np.integer):
            raise ReshardError(f"hosts must be integer ids, got dtype {hosts.dtype}")
        if hosts.shape != devices.shape:
            raise ReshardError(f"hosts shape {hosts.shape} differs from devices shape {devices.shape}")
        if devices.ndim != len(axis_names) or not all(isinstance(a, str) for a in axis_names):
            raise ReshardError(f"axis_names {axis_names} must name each of the {devices.ndim} mesh axes")
        if len(set(axis_names)) != len(axis_names):
            raise ReshardError(f"axis_names {axis_names} repeat a name")
        if devices.size == 0 or len(np.unique(devices)) != devices.size:
            raise ReshardError(f"device ids {devices.tolist()} must be non-empty and distinct")
        devices = devices.astype(np.int64)
        hosts = hosts.astype(np.int64)
        devices.setflags(write=False)
        hosts.setflags(write=False)
        set_ = functools.partial(object.__setattr__, self)
        set_("devices", devices)
        set_("hosts", hosts)
        set_("axis_names", axis_names)
        set_("spec", tuple(_canon_entry(e) for e in self.spec))
        set_("_host_of", dict(zip(devices.ravel().tolist(), hosts.ravel().tolist())))
        set_("_key", (devices.shape, tuple(devices.ravel().tolist()), tuple(hosts.ravel().tolist()),
                      axis_names, self.spec))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MeshSide) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return (f"MeshSide({self.describe()}, devices={self.devices.tolist()}, "
                f"hosts={self.hosts.tolist()})")

    @property
    def mesh_shape(self) -> dict[str, int]:
        """Axis name -> size, in mesh order."""
        return dict(zip(self.axis_names, self.devices.shape))

    @property
    def host_ids(self) -> tuple[int, ...]:
        """The distinct hosts of this side, ascending."""
        return tuple(sorted(set(self._host_of.values())))

    def host_of(self, device: int) -> int:
        """The host owning `device`."""
        return self._host_of[device]

    def devices_on(self, host: int) -> tuple[int, ...]:
        """The devices of this side that `host` owns, ascending."""
        return tuple(sorted(d for d, h in self._host_of.items() if h == host))

    def describe(self) -> str:
        """Axis names, sizes and spec, e.g. ``mesh(x=2, y=2) P('x', None)``."""
        axes = ", ".join(f"{a}={n}" for a, n in self.mesh_shape.items())
        return f"mesh({axes}) P({', '.join(repr(e) for e in self.spec)})"


@dataclass(frozen=True)
class _Grid:
    """A side's sharding of one shape: blocks per dim, block extent, block of each device."""

    blocks: tuple[int, ...]
    extent: tuple[int, ...]
    block_of: Mapping[int, tuple[int, ...]]

    def box(self, block: tuple[int, ...]) -> Box:
        return tuple((b * e, (b + 1) * e) for b, e in zip(block, self.extent))


def _grid(side: MeshSide, shape: tuple[int, ...]) -> _Grid:
    """Read `side`'s sharding of `shape`; raises ReshardError naming the rule broken."""
    if len(side.spec) > len(shape):
        raise ReshardError(f"spec has {len(side.spec)} entries for a {len(shape)}-dim array")
    sizes = side.mesh_shape
    used: set[str] = set()
    for entry in side.spec:
        for a in _entry_axes(entry):
            if a not in sizes:
                raise ReshardError(f"spec names mesh axis {a!r}, not one of {side.axis_names}")
            if a in used:
                raise ReshardError(f"spec uses mesh axis {a!r} twice")
            used.add(a)
    dim_axes = [_entry_axes(e) for e in side.spec] + [()] * (len(shape) - len(side.spec))
    blocks = tuple(math.prod(sizes[a] for a in axes) for axes in dim_axes)
    for d, (n, b) in enumerate(zip(shape, blocks)):
        if n % b:
            raise ReshardError(f"dim {d} of size {n} does not split into {b} equal blocks "
                               f"(spec entry {side.spec[d]!r})")
    position = {a: i for i, a in enumerate(side.axis_names)}
    block_of = {}
    for coord in np.ndindex(side.devices.shape):
        block = []
        for axes in dim_axes:
            idx = 0
            for a in axes:
                idx = idx * sizes[a] + coord[position[a]]
            block.append(idx)
        block_of[int(side.devices[coord])] = tuple(block)
    return _Grid(blocks, tuple(n // b for n, b in zip(shape, blocks)), block_of)


def shard_boxes(side: MeshSide, shape: Sequence[int]) -> dict[int, Box]:
    """The global box, (start, stop) per dim, that each device of `side` holds.

    Matches ``NamedSharding(mesh, P(*spec)).devices_indices_map(shape)``.

    Example:
        >>> side = MeshSide(np.arange(4).reshape(2, 2), np.zeros((2, 2), int), ("x", "y"), ("y",))
        >>> shard_boxes(side, (4, 3))
        {0: ((0, 2), (0, 3)), 1: ((2, 4), (0, 3)), 2: ((0, 2), (0, 3)), 3: ((2, 4), (0, 3))}
    """
    shape = tuple(int(n) for n in shape)
    try:
        grid = _grid(side, shape)
    except ReshardError as e:
        raise ReshardError(f"shape {shape} on {side.describe()}: {e}") from None
    return {d: grid.box(b) for d, b in grid.block_of.items()}


def shard_shape(side: MeshSide, shape: Sequence[int]) -> tuple[int, ...]:
    """The shape every shard of `side` has for a global `shape` (all shards are equal)."""
    return tuple(b - a for a, b in next(iter(shard_boxes(side, shape).values())))


def _intersect(a: Box, b: Box) -> Box:
    return tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))


def _volume(box: Box) -> int:
    return math.prod(max(0, hi - lo) for lo, hi in box)


def _local(box: Box, origin: Box) -> tuple[slice, ...]:
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin))


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


@dataclass(frozen=True)
class Tile:
    """One piece of data that one source device provides to one destination host.

    Attributes:
      src_host, src_device: who reads it.
      src_slice: where it sits in that source device's shard (local coordinates).
      box: where it sits in the global array, (start, stop) per dim.
      dst_host: the host that receives it (== src_host for a local copy).
      targets: (dst_device, dst_slice) for each device on dst_host that needs it;
        dst_slice is in that device's shard coordinates.
      nbytes: size of the tile's data.
    """

    src_host: int
    src_device: int
    src_slice: tuple[slice, ...]
    box: Box
    dst_host: int
    targets: tuple[tuple[int, tuple[slice, ...]], ...]
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(hi - lo for lo, hi in self.box)

    @property
    def is_local(self) -> bool:
        """True when the data is already on dst_host: a copy, not a transfer."""
        return self.src_host == self.dst_host

    def __repr__(self) -> str:
        box = ", ".join(f"{lo}:{hi}" for lo, hi in self.box)
        to = ",".join(f"d{d}" for d, _ in self.targets)
        return (f"Tile(h{self.src_host}:d{self.src_device} [{box}] -> h{self.dst_host}:{{{to}}}, "
                f"{self.nbytes} B)")


_MAPPINGS = ("sends", "recvs")


@dataclass(frozen=True, repr=False)
class ReshardPlan:
    """Everything senders and receivers need to move one tensor between two meshes.

    Attributes:
      shape, dtype: the global array.
      src, dst: the two sides.
      sends: src_host -> dst_host -> tiles that src_host provides to dst_host, sorted
        by global box; every source host has an entry (possibly empty); the entry
        with dst_host == src_host holds local copies.
      recvs: dst_host -> tiles it gets, i.e. sends[s][dst_host] concatenated over
        ascending source hosts s; every destination host has an entry.
      src_shard_shape, dst_shard_shape: the shape of each source / destination
        shard (the same for every device of a side).
      cross_host_bytes: bytes of all tiles whose src_host != dst_host.
      lower_bound_bytes: per destination host, bytes it needs that no source device on
        that host holds, summed over hosts (computed from the shardings alone).
      local_bytes: bytes of local-copy tiles (each counted once, however many targets).
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    src: MeshSide
    dst: MeshSide
    sends: Mapping[int, Mapping[int, tuple[Tile, ...]]]
    recvs: Mapping[int, tuple[Tile, ...]]
    src_shard_shape: tuple[int, ...]
    dst_shard_shape: tuple[int, ...]
    cross_host_bytes: int
    lower_bound_bytes: int
    local_bytes: int

    @property
    def tiles(self) -> tuple[Tile, ...]:
        """All tiles, destination hosts ascending, each in recvs order."""
        return tuple(t for h in sorted(self.recvs) for t in self.recvs[h])

    def pair_bytes(self) -> dict[tuple[int, int], tuple[int, int]]:
        """(src_host, dst_host) -> (tile count, bytes), for pairs that exchange anything."""
        return {(s, d): (len(ts), sum(t.nbytes for t in ts))
                for s, per in sorted(self.sends.items()) for d, ts in sorted(per.items()) if ts}

    def describe(self, max_pairs: int = 16) -> str:
        """Short text: both shardings, cross-host bytes vs lower bound, bytes per host pair.

        Args:
          max_pairs: host pairs listed; the rest are summarised in one line.
        """
        tiles = self.tiles
        n_local = sum(t.is_local for t in tiles)
        lines = [
            f"reshard {self.dtype.name}{list(self.shape)}: {self.src.describe()} -> {self.dst.describe()}",
            f"  {len(tiles)} tiles ({n_local} local): cross-host {_fmt_bytes(self.cross_host_bytes)}"
            f" (lower bound {_fmt_bytes(self.lower_bound_bytes)}), local {_fmt_bytes(self.local_bytes)}",
        ]
        pairs = list(self.pair_bytes().items())
        for (s, d), (n, b) in pairs[:max_pairs]:
            kind = "  (local)" if s == d else ""
            lines.append(f"  host {s} -> host {d}: {n} tiles, {_fmt_bytes(b)}{kind}")
        if len(pairs) > max_pairs:
            rest = sum(b for _, (_, b) in pairs[max_pairs:])
            lines.append(f"  ... {len(pairs) - max_pairs} more host pairs, {_fmt_bytes(rest)}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        """A JSON-ready summary (no tiles themselves)."""
        tiles = self.tiles
        return {
            "shape": list(self.shape),
            "dtype": self.dtype.name,
            "src": self.src.describe(),
            "dst": self.dst.describe(),
            "cross_host_bytes": self.cross_host_bytes,
            "lower_bound_bytes": self.lower_bound_bytes,
            "local_bytes": self.local_bytes,
            "tiles": len(tiles),
            "local_tiles": sum(t.is_local for t in tiles),
            "pairs": [{"src_host": s, "dst_host": d, "tiles": n, "bytes": b}
                      for (s, d), (n, b) in self.pair_bytes().items()],
        }

    def __repr__(self) -> str:
        return (f"ReshardPlan({self.dtype.name}{list(self.shape)}, {self.src.describe()} -> "
                f"{self.dst.describe()}, tiles={len(self.tiles)}, "
                f"cross_host_bytes={self.cross_host_bytes}, lower_bound_bytes={self.lower_bound_bytes}, "
                f"local_bytes={self.local_bytes})")

    # Read-only mappings do not pickle; ship plain dicts and re-wrap on arrival.
    def __getstate__(self) -> dict:
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        state["sends"] = {s: dict(per) for s, per in self.sends.items()}
        state["recvs"] = dict(self.recvs)
        return state

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        state["sends"] = _freeze({s: _freeze(per) for s, per in state["sends"].items()})
        state["recvs"] = _freeze(state["recvs"])
        for k, v in state.items():
            object.__setattr__(self, k, v)


def _freeze(d: dict) -> Mapping:
    return MappingProxyType(dict(sorted(d.items())))


def make_plan(shape: Sequence[int], dtype: Any, src: MeshSide, dst: MeshSide) -> ReshardPlan:
    """Plan moving a `shape`/`dtype` array from `src`'s sharding to `dst`'s.

    Raises:
      ReshardError: a spec longer than the array's rank, naming an unknown mesh axis
        or one axis twice, or a dim not divisible by its number of blocks; the message
        names the shape and both shardings.

    Example:
        >>> src = MeshSide(np.arange(2), np.array([0, 1]), ("x",), ("x",))
        >>> dst = MeshSide(np.arange(2), np.array([2, 2]), ("y",), (None, "y"))
        >>> plan = make_plan((4, 4), np.float32, src, dst)
        >>> plan.cross_host_bytes == plan.lower_bound_bytes == 64
        True
        >>> plan.recvs[2][0]
        Tile(h0:d0 [0:2, 0:2] -> h2:{d0}, 16 B)
    """
    shape = tuple(int(n) for n in shape)
    dtype = np.dtype(dtype)
    try:
        problem_side = "source"
        sg = _grid(src, shape)
        problem_side = "destination"
        dg = _grid(dst, shape)
    except ReshardError as e:
        raise ReshardError(f"cannot reshard {dtype.name}{list(shape)} from {src.describe()} to "
                           f"{dst.describe()}: {problem_side} {e}") from None
    itemsize = dtype.itemsize

    replicas: dict[tuple[int, ...], list[int]] = defaultdict(list)  # src block -> devices holding it
    for dev, block in sorted(sg.block_of.items()):
        replicas[block].append(dev)

    # Per destination host: the pieces it needs (global box -> source block, devices wanting it).
    needs: dict[int, dict[Box, tuple[tuple[int, ...], list[int]]]] = defaultdict(dict)
    empty = math.prod(shape) == 0
    for dev, dblock in sorted(dg.block_of.items()):
        dbox = dg.box(dblock)
        wants = needs[dst.host_of(dev)]
        if empty:
            continue
        ranges = [range(lo // e, (hi - 1) // e + 1) for (lo, hi), e in zip(dbox, sg.extent)]
        for sblock in itertools.product(*ranges):
            piece = _intersect(dbox, sg.box(sblock))
            wants.setdefault(piece, (sblock, []))[1].append(dev)

    # Choose a source for every piece: local if possible, else the least-loaded replica host.
    chosen: dict[tuple[int, Box], tuple[int, int]] = {}
    remote = []
    for h, wants in needs.items():
        for piece, (sblock, _) in wants.items():
            here = [d for d in replicas[sblock] if src.host_of(d) == h]
            if here:
                chosen[h, piece] = (h, here[0])
            else:
                remote.append((-_volume(piece), h, piece, sblock))
    host_load: dict[int, int] = defaultdict(int)
    dev_load: dict[int, int] = defaultdict(int)
    for neg_vol, h, piece, sblock in sorted(remote):
        nbytes = -neg_vol * itemsize
        s = min({src.host_of(d) for d in replicas[sblock]}, key=lambda x: (host_load[x], x))
        dev = min((d for d in replicas[sblock] if src.host_of(d) == s), key=lambda x: (dev_load[x], x))
        host_load[s] += nbytes
        dev_load[dev] += nbytes
        chosen[h, piece] = (s, dev)

    sends: dict[int, dict[int, list[Tile]]] = {s: defaultdict(list) for s in src.host_ids}
    for h, wants in needs.items():
        for piece, (_, devs) in sorted(wants.items()):
            s, sdev = chosen[h, piece]
            targets = tuple((d, _local(piece, dg.box(dg.block_of[d]))) for d in devs)
            tile = Tile(s, sdev, _local(piece, sg.box(sg.block_of[sdev])), piece, h, targets,
                        _volume(piece) * itemsize)
            sends.setdefault(s, defaultdict(list))[h].append(tile)
    sends_frozen = _freeze({s: _freeze({d: tuple(ts) for d, ts in per.items()}) for s, per in sends.items()})
    recvs = _freeze({h: tuple(t for s in sorted(sends) for t in sends_frozen[s].get(h, ()))
                     for h in dst.host_ids})
    all_tiles = [t for ts in recvs.values() for t in ts]
    return ReshardPlan(
        shape=shape, dtype=dtype, src=src, dst=dst, sends=sends_frozen, recvs=recvs,
        src_shard_shape=sg.extent, dst_shard_shape=dg.extent,
        cross_host_bytes=sum(t.nbytes for t in all_tiles if not t.is_local),
        lower_bound_bytes=_lower_bound(src, dst, sg, dg) * itemsize,
        local_bytes=sum(t.nbytes for t in all_tiles if t.is_local),
    )


def _lower_bound(src: MeshSide, dst: MeshSide, sg: _Grid, dg: _Grid) -> int:
    """Elements each destination host needs that none of its source devices hold, summed.

    Distinct blocks of one sharding are disjoint, so per host: volume of its distinct
    destination blocks minus their overlaps with its distinct source blocks.
    """
    total = 0
    for h in dst.host_ids:
        dblocks = {dg.block_of[d] for d in dst.devices_on(h)}
        sblocks = {sg.block_of[d] for d in src.devices_on(h)}
        for db in dblocks:
            dbox = dg.box(db)
            total += _volume(dbox) - sum(_volume(_intersect(dbox, sg.box(sb))) for sb in sblocks)
    return total


@functools.lru_cache(maxsize=1024)
def _cached_plan(shape: tuple[int, ...], dtype: np.dtype, src: MeshSide, dst: MeshSide) -> ReshardPlan:
    return make_plan(shape, dtype, src, dst)


def plan_cache(shape: Sequence[int], dtype: Any, src: MeshSide, dst: MeshSide) -> ReshardPlan:
    """`make_plan`, memoised on (shape, dtype, src, dst); returns the same plan object.

    Plans are immutable (frozen dataclasses, read-only mappings), so sharing is safe.
    `plan_cache.cache_info()` and `plan_cache.cache_clear()` work as with lru_cache.

    Example:
        >>> side = MeshSide(np.arange(2), np.array([0, 1]), ("x",), ("x",))
        >>> plan_cache([4], "float32", side, side) is plan_cache((4,), np.float32, side, side)
        True
    """
    return _cached_plan(tuple(int(n) for n in shape), np.dtype(dtype), src, dst)


plan_cache.cache_info = _cached_plan.cache_info  # type: ignore[attr-defined]
plan_cache.cache_clear = _cached_plan.cache_clear  # type: ignore[attr-defined]
