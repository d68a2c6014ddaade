"""Moving tile data by a `ReshardPlan`: numpy slicing on the sender, placement on the receiver.

Basic flow, for one tensor and one plan:
  1. every source host s, for every destination host d in `plan.sends[s]`, calls
     `pack(plan, s, d, shards)` with its own source shards and gets the list of tile
     arrays for d, in plan order; for d != s it ships that list as ONE object;
  2. every destination host d collects what it got, one list per source host, and
     calls `assemble(plan, d, received)`, which returns each local destination
     device's full shard.

Local copies flow exactly like transfers, minus the network: when a host is on
both sides, `pack(plan, h, h, shards)` returns the local tiles (views of its own
source shards, no copy) and the host hands that list to `assemble` as the entry
for source host h. `received` may be either a mapping {src_host: list} (hosts that
send nothing to d may be left out) or one flat list in `plan.recvs[d]` order,
which is the per-source lists concatenated in ascending source-host order, the
local list included at its host's position.

No jax here: on workers the shards are numpy views of `jax.Array` shards, and the
assembled arrays become a `jax.Array` via `jax.make_array_from_single_device_arrays`.
"""
from __future__ import annotations

from typing import Mapping, Sequence, Union

import numpy as np

from orchestrator.core.reshard.plan import MeshSide, ReshardPlan, shard_boxes

Received = Union[Sequence[np.ndarray], Mapping[int, Sequence[np.ndarray]]]


def pack(plan: ReshardPlan, src_host: int, dst_host: int,
         shards: Mapping[int, np.ndarray]) -> list[np.ndarray]:
    """The arrays `src_host` provides to `dst_host`, in `plan.sends[src_host][dst_host]` order.

    Args:
      plan: the plan.
      src_host: the sending host.
      dst_host: the receiving host (== src_host for local copies).
      shards: source device -> its full source shard; only the devices the plan
        reads on src_host are needed.

    Returns:
      One array per tile: a view into the shard (callers that ship it serialise it;
      callers that keep it locally should not mutate the shard before `assemble`).

    Example:
        >>> from orchestrator.core.reshard.plan import make_plan
        >>> side = MeshSide(np.arange(2), np.array([0, 1]), ("x",), ("x",))
        >>> dst = MeshSide(np.arange(1), np.array([1]), ("y",), ())
        >>> plan = make_plan((4,), np.int64, side, dst)
        >>> pack(plan, 0, 1, {0: np.array([10, 11])})
        [array([10, 11])]
    """
    out = []
    for tile in plan.sends.get(src_host, {}).get(dst_host, ()):
        shard = shards[tile.src_device]
        if tuple(shard.shape) != plan.src_shard_shape:
            raise ValueError(f"source device {tile.src_device} shard has shape {tuple(shard.shape)}, "
                             f"plan expects {plan.src_shard_shape}")
        out.append(shard[tile.src_slice])
    return out


def _flatten(plan: ReshardPlan, dst_host: int, received: Received) -> list[np.ndarray]:
    if not isinstance(received, Mapping):
        return list(received)
    unknown = set(received) - set(plan.sends)
    if unknown:
        raise ValueError(f"host {dst_host} got tiles from {sorted(unknown)}, not source hosts of the plan")
    flat: list[np.ndarray] = []
    for s in sorted(plan.sends):
        want = len(plan.sends[s].get(dst_host, ()))
        got = list(received.get(s, ()))
        if len(got) != want:
            raise ValueError(f"host {dst_host} expects {want} tiles from host {s}, got {len(got)}")
        flat.extend(got)
    return flat


def assemble(plan: ReshardPlan, dst_host: int, received: Received) -> dict[int, np.ndarray]:
    """Build every destination shard of `dst_host` from its tiles, local copies included.

    Args:
      plan: the plan.
      dst_host: the receiving host.
      received: {src_host: arrays from `pack(plan, src_host, dst_host, ...)`}, or one
        flat list in `plan.recvs[dst_host]` order (see the module docstring).

    Returns:
      dst device -> its shard (a new array of `plan.dtype`), for every destination
      device on `dst_host`.

    Raises:
      ValueError: wrong number of tiles or a tile of the wrong shape.

    Example:
        >>> from orchestrator.core.reshard.plan import make_plan
        >>> src = MeshSide(np.arange(2), np.array([0, 1]), ("x",), ("x",))
        >>> dst = MeshSide(np.arange(1), np.array([1]), ("y",), ())
        >>> plan = make_plan((4,), np.int64, src, dst)
        >>> got = {0: pack(plan, 0, 1, {0: np.array([10, 11])}),
        ...        1: pack(plan, 1, 1, {1: np.array([12, 13])})}
        >>> assemble(plan, 1, got)
        {0: array([10, 11, 12, 13])}
    """
    tiles = plan.recvs.get(dst_host, ())
    arrays = _flatten(plan, dst_host, received)
    if len(arrays) != len(tiles):
        raise ValueError(f"host {dst_host} expects {len(tiles)} tiles, got {len(arrays)}")
    for tile, array in zip(tiles, arrays):
        if tuple(np.shape(array)) != tile.shape:
            raise ValueError(f"tile {tile} arrived with shape {tuple(np.shape(array))}")
    whole = tuple(plan.dst_shard_shape)
    out: dict[int, np.ndarray] = {}
    for tile, array in zip(tiles, arrays):
        # a tile that IS a whole destination shard is used as it arrived (no copy) when it is
        # contiguous and 64-byte aligned, so a CPU device_put can adopt the buffer too
        if tile.shape == whole and _aligned(array):
            for dev, _ in tile.targets:
                out[dev] = array
    for dev in plan.dst.devices_on(dst_host):
        if dev not in out:
            out[dev] = aligned_empty(whole, plan.dtype)
    for tile, array in zip(tiles, arrays):
        for dev, where in tile.targets:
            if out[dev] is not array:
                out[dev][where] = array
    return out


def _aligned(array: np.ndarray, alignment: int = 64) -> bool:
    return isinstance(array, np.ndarray) and array.flags.c_contiguous and array.ctypes.data % alignment == 0


def aligned_empty(shape, dtype, alignment: int = 64) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an `alignment`-byte boundary.

    XLA:CPU adopts aligned host buffers in `device_put` without copying; an
    unaligned one is copied (orders of magnitude slower for large arrays; docs/decisions.md, "Transport buffers").
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + alignment, np.uint8)
    offset = (-raw.ctypes.data) % alignment
    return raw[offset: offset + nbytes].view(dtype).reshape(shape)


def shards_of(array: np.ndarray, side: MeshSide) -> dict[int, np.ndarray]:
    """Slice a global numpy array into `side`'s shards (views): device -> shard.

    The single-process reference for what each device should hold.

    Example:
        >>> side = MeshSide(np.arange(2), np.array([0, 0]), ("x",), ("x",))
        >>> shards_of(np.arange(4), side)
        {0: array([0, 1]), 1: array([2, 3])}
    """
    return {d: array[tuple(slice(lo, hi) for lo, hi in box)]
            for d, box in shard_boxes(side, array.shape).items()}
