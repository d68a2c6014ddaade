"""The byte stream of one (source host, destination host) payload: what goes where.

A stream transport (`stages.socket_transport`) writes the tiles that source host s
owes destination host d as ONE byte stream, ordered so that the receiver can read
it straight into its destination shards with as few, as large reads as possible:
destination blocks in ascending order (a "block" is one distinct destination shard
on d; replicas share it), and within a block, the block's own C order. When s
supplies a whole block (the usual case) the receiver reads that block with one
`recv_into`; the sender gathers the block's bytes from its source shards (or stages
them with one numpy copy when those pieces are short).

`stream_layout(plan, s, d)` computes, once per plan and pair:
  recv:     merged runs (block device, byte offset in the block, nbytes), in stream order;
  send:     merged runs (source device, byte offset in its shard, nbytes), in stream order;
  segments: per block, the slice of `send` runs that carries it, its tiles, and
            whether s supplies the whole block (then the sender may stage it).
Both run lists describe the same bytes in the same order (tests check this against
`assemble`). numpy only.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from orchestrator.core.reshard.plan import ReshardPlan, Tile, shard_boxes


@dataclass(frozen=True)
class Segment:
    """The part of a stream that fills one destination block."""

    block: int                  # the block's first destination device (its buffer's key)
    whole: bool                 # this source host supplies the entire block, in C order
    tiles: tuple[Tile, ...]     # this source host's tiles for the block, plan order
    send: tuple[int, int]       # [start, stop) into StreamLayout.send


@dataclass(frozen=True)
class StreamLayout:
    nbytes: int
    recv: np.ndarray            # int64 (n, 3): block device, byte offset, nbytes
    send: np.ndarray            # int64 (m, 3): source device, byte offset, nbytes
    segments: tuple[Segment, ...]


def blocks_on(plan: ReshardPlan, host: int) -> dict[int, int]:
    """Destination device on `host` -> its block's first device (replicas share a block)."""
    boxes = shard_boxes(plan.dst, plan.shape)
    first: dict = {}
    return {d: first.setdefault(boxes[d], d) for d in sorted(plan.dst.devices_on(host))}


def region_runs(shape, container, starts, k: int) -> np.ndarray:
    """Element offsets, in C order, of the runs of a box of `shape` at `starts` inside a
    C-contiguous `container`, each run covering dims [k:] of the box (dims after k span
    the container fully).

    Example:
        >>> region_runs((2, 3), (4, 5), (1, 2), 1).tolist()     # rows 1-2, cols 2-4 of a 4x5
        [7, 12]
    """
    strides = np.cumprod((1,) + tuple(container[::-1]))[-2::-1] if container else np.ones(0, np.int64)
    offsets = np.zeros(1, np.int64)
    for j in range(k):
        offsets = (offsets[:, None] + (starts[j] + np.arange(shape[j], dtype=np.int64)) * strides[j]).reshape(-1)
    if k < len(shape):
        offsets = offsets + starts[k] * strides[k]
    return offsets


def _split_dim(shape, container) -> int:
    """The smallest k such that every dim after k spans `container` fully."""
    k = len(shape) - 1
    while k > 0 and shape[k] == container[k]:
        k -= 1
    return max(k, 0)


def _merge(rows: np.ndarray) -> np.ndarray:
    """Merge consecutive runs (key, offset, nbytes) with the same key and adjacent bytes."""
    if len(rows) < 2:
        return rows
    key, off, n = rows[:, 0], rows[:, 1], rows[:, 2]
    starts = np.ones(len(rows), bool)
    starts[1:] = (key[1:] != key[:-1]) | (off[1:] != off[:-1] + n[:-1])
    group = np.cumsum(starts) - 1
    return np.stack([key[starts], off[starts], np.bincount(group, weights=n).astype(np.int64)], axis=1)


def stream_layout(plan: ReshardPlan, src_host: int, dst_host: int) -> StreamLayout:
    """The stream of `plan.sends[src_host][dst_host]` (see the module docstring)."""
    tiles = plan.sends.get(src_host, {}).get(dst_host, ())
    item = plan.dtype.itemsize
    blocks = blocks_on(plan, dst_host)
    suppliers: dict[int, set] = {}
    for t in plan.recvs.get(dst_host, ()):
        suppliers.setdefault(blocks[t.targets[0][0]], set()).add(t.src_host)
    src_shape, dst_shape = plan.src_shard_shape, plan.dst_shard_shape
    per_block: dict[int, list] = {}
    for t in tiles:
        shape = t.shape
        if int(np.prod(shape, dtype=np.int64)) == 0:
            continue
        where = t.targets[0][1]
        k = max(_split_dim(shape, dst_shape), _split_dim(shape, src_shape))
        run = int(np.prod(shape[k:], dtype=np.int64)) * item
        dst_off = region_runs(shape, dst_shape, [s.start for s in where], k) * item
        src_off = region_runs(shape, src_shape, [s.start for s in t.src_slice], k) * item
        per_block.setdefault(blocks[t.targets[0][0]], []).append((t, dst_off, src_off, run))
    recv, send, segments = [], [], []
    for block in sorted(per_block):
        parts = per_block[block]
        dst_off = np.concatenate([p[1] for p in parts])
        src_off = np.concatenate([p[2] for p in parts])
        dev = np.concatenate([np.full(len(p[1]), p[0].src_device, np.int64) for p in parts])
        run = np.concatenate([np.full(len(p[1]), p[3], np.int64) for p in parts])
        order = np.argsort(dst_off, kind="stable")
        r = _merge(np.stack([np.full(len(order), block, np.int64), dst_off[order], run[order]], axis=1))
        s = _merge(np.stack([dev[order], src_off[order], run[order]], axis=1))
        start = sum(len(x) for x in send)
        recv.append(r)
        send.append(s)
        segments.append(Segment(block, suppliers[block] == {src_host}, tuple(p[0] for p in parts),
                                (start, start + len(s))))
    empty = np.zeros((0, 3), np.int64)
    recv_a = np.concatenate(recv) if recv else empty
    send_a = np.concatenate(send) if send else empty
    nbytes = int(recv_a[:, 2].sum())
    if nbytes != int(send_a[:, 2].sum()) or nbytes != sum(t.nbytes for t in tiles):
        raise RuntimeError(f"stream {src_host}->{dst_host}: run bytes disagree (a bug in stream_layout)")
    return StreamLayout(nbytes, recv_a, send_a, tuple(segments))
