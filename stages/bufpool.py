"""Recycled 64-byte-aligned host buffers for the transports, on the heap or in shared memory.

A fresh large buffer costs its page faults (a sizable share of moving it over
loopback TCP; see docs/decisions.md), so receivers and senders take
buffers from a `BufferPool` instead of allocating them.

A pooled block is in use while anything but the pool references its memory: each
`take` hands out a new numpy view of a pool-owned block, and numpy views, and CPU
`jax.Array`s that adopted the memory in `device_put`, keep a reference to the
block's owner. When the last of them dies, the owner's reference count falls back
to the pool's own and the next `take` of that size may reuse it. Consequently
received arrays must never be donated to a jitted program (the worker donates only
parameters and optimizer state).

`shm_block` makes blocks in anonymous shared memory (`memfd_create`): a receiver
passes their file descriptors to a sender on the same machine (SCM_RIGHTS), which
maps them and writes tiles straight into the receiver's destination shards.
"""
from __future__ import annotations

import mmap
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

ALIGN = 64
SMALL_BYTES = 64 << 10      # below this `take` allocates: faults are few, a pooled view costs more


@dataclass(eq=False)
class Block:
    """One pooled allocation: `owner` exports the memory (an ndarray or an mmap)."""

    owner: Any
    nbytes: int
    id: int
    fd: int | None = None            # shared-memory blocks: the memfd (closed by `BufferPool.close`)


def heap_block(nbytes: int, id: int) -> Block:
    return Block(np.empty(nbytes + ALIGN, np.uint8), nbytes, id)


def shm_block(nbytes: int, id: int) -> Block:
    """A block in anonymous shared memory (Linux `memfd_create`), mapped here."""
    fd = os.memfd_create(f"meshpipe-block-{id}", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, max(nbytes, 1))
        mm = mmap.mmap(fd, max(nbytes, 1))
    except BaseException:
        os.close(fd)
        raise
    return Block(mm, nbytes, id, fd)


def shm_supported() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "memfd_create")


def as_array(owner, shape, dtype) -> np.ndarray:
    """A new C-contiguous, 64-byte-aligned view of `shape`/`dtype` on the memory `owner` exports
    (a block's owner, or a peer's mapped shared-memory block)."""
    dtype = np.dtype(dtype)
    raw = np.frombuffer(owner, np.uint8)
    offset = (-raw.ctypes.data) % ALIGN
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return raw[offset:offset + n].view(dtype).reshape(shape)


class BufferPool:
    """Blocks by byte size, reused once unreferenced; at most `limit_bytes` pooled.

    `allocate(nbytes, id) -> Block` makes a block (default: on the heap). Past the
    limit, `take` still returns fresh unpooled memory and `take_block` returns None.

    Example:
        >>> pool = BufferPool(1 << 30)
        >>> a = pool.take((256, 64), np.float32)
        >>> a.ctypes.data % 64, a.shape
        (0, (256, 64))
        >>> b = pool.take((256, 64), np.float32)     # `a` is alive: another block
        >>> np.shares_memory(a, b)
        False
        >>> addr = a.ctypes.data
        >>> del a
        >>> pool.take((64, 256), np.float32).ctypes.data == addr   # freed: reused
        True
    """

    def __init__(self, limit_bytes: int = 1 << 30, allocate: Callable[[int, int], Block] = heap_block):
        self.limit_bytes = int(limit_bytes)
        self.allocate = allocate
        self.pooled_bytes = 0
        self.reused = 0
        self.blocks: dict[int, Block] = {}
        self._by_size: dict[int, list[Block]] = {}
        self._lock = threading.Lock()
        self._next = 0
        # refs a block's owner shows inside `_idle_block`'s loop when only the pool holds it
        # (measured, not assumed: CPython versions count loop variables and arguments differently)
        probe = allocate(ALIGN, -1)
        self._idle = self._refs(probe)
        if probe.fd is not None:
            os.close(probe.fd)

    @staticmethod
    def _refs(block: Block) -> int:
        for owner in [block.owner]:
            return sys.getrefcount(owner) - 1      # minus the list literal's reference

    def _idle_block(self, nbytes: int) -> Block | None:
        for block in self._by_size.get(nbytes, ()):
            for owner in [block.owner]:
                if sys.getrefcount(owner) - 1 <= self._idle:
                    return block
        return None

    def take_block(self, shape, dtype) -> tuple[np.ndarray, Block] | None:
        """A free pooled block as an array of `shape`/`dtype`, and the block; None past the limit."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        with self._lock:
            block = self._idle_block(nbytes)
            if block is not None:
                self.reused += 1
            else:
                if self.pooled_bytes + nbytes > self.limit_bytes:
                    return None
                block = self.allocate(nbytes, self._next)
                self._next += 1
                self._by_size.setdefault(nbytes, []).append(block)
                self.blocks[block.id] = block
                self.pooled_bytes += nbytes
            return as_array(block.owner, shape, dtype), block

    def take(self, shape, dtype) -> np.ndarray:
        """An uninitialised C-contiguous array of `shape` and `dtype`: 64-byte-aligned and pooled
        from SMALL_BYTES on; smaller ones come from numpy (cheaper to make than to recycle)."""
        if int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize < SMALL_BYTES:
            return np.empty(shape, dtype)
        got = self.take_block(shape, dtype)
        if got is None:
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            return as_array(heap_block(nbytes, -1).owner, shape, dtype)
        return got[0]

    def close(self) -> None:
        """Close shared-memory file descriptors (mappings stay valid while arrays use them)."""
        with self._lock:
            for block in self.blocks.values():
                if block.fd is not None:
                    os.close(block.fd)
                    block.fd = None
