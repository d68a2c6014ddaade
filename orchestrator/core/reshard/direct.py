"""A reshard plan as device-to-device transfers (cluster `transport: xla`). Pure: numpy only.

XLA's cross-process `jax.device_put` moves an array only between equal HLO shardings: shard k
of the source goes to device k of the destination. meshpipe's plan covers every other layout
change, so an edge moves in one of two ways:

  whole   when the two sides cut the array into the same blocks at the same flat mesh
          positions and every destination device needs its shard from another host exactly
          once (`whole_array`): one `device_put` of the global array, whose bytes are then the
          plan's lower bound;
  tiles   otherwise: every tile of `plan.tiles` as a single-device array, sent from its source
          device to the FIRST of its destination devices (`landing_device`) — one copy per
          destination host — all tiles of an edge in one batched `device_put`. The receiving
          host then builds each local destination shard (`pieces_on`): a tile that is a whole
          shard is used as it landed (another device wanting it gets an on-device copy: the
          fan-out of a replicated destination), smaller tiles are placed into the shard by
          one on-device program.
Device ids here are flat mesh positions, as everywhere in `orchestrator.core.reshard`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from orchestrator.core.reshard.plan import ReshardPlan, _grid

__all__ = ["Piece", "landing_device", "pieces_on", "whole_array"]


@dataclass(frozen=True)
class Piece:
    """One tile's part in one destination shard: `tile` indexes `plan.tiles`, `where` is its place
    in the shard, `landed` the device the tile arrives on (another device needs a copy first)."""

    tile: int
    where: tuple[slice, ...]
    landed: int


def whole_array(plan: ReshardPlan) -> bool:
    """Whether one `device_put` of the whole array moves exactly what the plan moves (module doc).

    Example:
        >>> from orchestrator.core.reshard import MeshSide, make_plan
        >>> a = MeshSide(np.arange(2), np.array([0, 0]), ("data",), ("data",))
        >>> b = MeshSide(np.arange(2), np.array([1, 1]), ("model",), ("model",))
        >>> c = MeshSide(np.arange(2), np.array([1, 1]), ("model",), (None, "model"))
        >>> whole_array(make_plan((4, 4), np.float32, a, b)), whole_array(make_plan((4, 4), np.float32, a, c))
        (True, False)
    """
    src, dst = plan.src, plan.dst
    if src.devices.shape != dst.devices.shape or plan.src_shard_shape != plan.dst_shard_shape:
        return False
    sg, dg = _grid(src, plan.shape), _grid(dst, plan.shape)
    flat_src, flat_dst = src.devices.ravel().tolist(), dst.devices.ravel().tolist()
    if any(sg.block_of[a] != dg.block_of[b] for a, b in zip(flat_src, flat_dst)):
        return False
    if any(t.is_local for t in plan.tiles):
        return False
    shard = int(np.prod(plan.dst_shard_shape, dtype=np.int64)) * plan.dtype.itemsize
    return len(flat_dst) * shard == plan.lower_bound_bytes == plan.cross_host_bytes


def landing_device(tile) -> int:
    """The destination device a tile is received on: the first device of its host that wants it."""
    return tile.targets[0][0]


def pieces_on(plan: ReshardPlan, host: int) -> dict[int, tuple[Piece, ...]]:
    """Destination device on `host` -> the pieces its shard is built from, in `plan.tiles` order.

    Example:
        >>> from orchestrator.core.reshard import MeshSide, make_plan
        >>> src = MeshSide(np.arange(2), np.array([0, 0]), ("data",), ("data",))
        >>> dst = MeshSide(np.arange(2), np.array([1, 1]), ("model",), ())      # replicated
        >>> got = pieces_on(make_plan((4,), np.float32, src, dst), 1)
        >>> [(d, [(p.tile, p.landed) for p in ps]) for d, ps in got.items()]
        [(0, [(0, 0), (1, 0)]), (1, [(0, 0), (1, 0)])]
    """
    out: dict[int, list[Piece]] = {d: [] for d in plan.dst.devices_on(host)}
    for i, t in enumerate(plan.tiles):
        if t.dst_host != host:
            continue
        for dev, where in t.targets:
            out[dev].append(Piece(i, tuple(where), landing_device(t)))
    return {d: tuple(ps) for d, ps in out.items()}
