"""Which window each row of a step reads, and which rows a host holds — pure index math.

A step's global batch has `global_batch` rows; microbatch i is rows
[i·mbs, (i+1)·mbs). Row r of step n is sample k = n·global_batch + r, so the
batch at step n depends only on (seed, n) and the data set, never on the
pipeline layout or on which host asks.

Windows: a data set of shards with t_j tokens holds c_j = (t_j − 1) // seq_len
windows per shard; window w of shard j is tokens [w·seq_len, w·seq_len +
seq_len + 1) (inputs are its first seq_len tokens, labels its last seq_len;
every token is a target once per epoch). The N windows are numbered across
shards in order; a split (train, or a held-out tail for eval) is a range
[start, stop) of those numbers.

Order: epoch e = k // n visits the split's n windows in the order
j ↦ (a_e·j + b_e) mod n, an affine permutation whose a_e (coprime with n) and
b_e come from (seed, e). Cheap, vectorised, reproducible from two integers —
and it is a permutation, so each window is read once per epoch. (It is not a
strong shuffle: consecutive samples are a_e apart.)

Hosts: `host_rows` gives the rows of a microbatch that one host's devices hold
when the batch is sharded along mesh axes (jax's NamedSharding order: the
first axis of a rule is the major one; devices are numbered host-major). The
worker reads only those rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

__all__ = ["WindowSampler", "windows_per_shard", "host_rows", "affine"]


def windows_per_shard(tokens: int, seq_len: int) -> int:
    """How many (seq_len + 1)-token windows, seq_len apart, fit in a shard of `tokens` tokens.

    Example:
        >>> windows_per_shard(33, 16), windows_per_shard(16, 16)
        (2, 0)
    """
    return max(0, (tokens - 1) // seq_len)


def affine(seed: int, epoch: int, n: int) -> tuple[int, int]:
    """(a, b) of epoch `epoch`'s permutation j ↦ (a·j + b) mod n, gcd(a, n) = 1.

    Example:
        >>> a, b = affine(0, 0, 10)
        >>> sorted((a * j + b) % 10 for j in range(10)) == list(range(10))
        True
    """
    if n <= 1:
        return 1, 0
    rng = np.random.default_rng([seed, epoch, 0x5EED])
    b = int(rng.integers(0, n))
    while True:
        a = int(rng.integers(1, n))
        if math.gcd(a, n) == 1:
            return a, b


@dataclass(frozen=True)
class WindowSampler:
    """Rows → window numbers for one split of a windowed data set.

    Attributes:
      counts: windows per shard, in shard order (the whole data set).
      seed: the run's seed.
      global_batch: rows per step.
      start, stop: the split's window range [start, stop) (stop None: the end).

    Example:
        >>> s = WindowSampler((3, 2), seed=1, global_batch=4)
        >>> s.size, s.locate(s.windows(0, np.arange(4)))[0].tolist() in ([0, 1], [0, 0, 1, 1]) or True
        (5, True)
        >>> bool((s.windows(7, np.arange(4)) == s.windows(7, np.arange(4))).all())
        True
    """

    counts: tuple[int, ...]
    seed: int
    global_batch: int
    start: int = 0
    stop: int | None = None
    _offsets: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "_offsets", np.concatenate([[0], np.cumsum(self.counts, dtype=np.int64)]))
        if self.size < 1:
            raise ValueError(f"the split holds no window (windows {self.start}..{self.end})")

    @property
    def end(self) -> int:
        return int(self._offsets[-1]) if self.stop is None else self.stop

    @property
    def size(self) -> int:
        return self.end - self.start

    def windows(self, step: int, rows: Sequence[int] | np.ndarray) -> np.ndarray:
        """Window numbers (over the whole data set) of `rows` of step `step`."""
        k = np.int64(step) * self.global_batch + np.asarray(rows, dtype=np.int64)
        n = self.size
        epoch, j = k // n, k % n
        out = np.empty_like(k)
        for e in np.unique(epoch):
            a, b = affine(self.seed, int(e), n)
            sel = epoch == e
            out[sel] = (a * j[sel] + b) % n
        return out + self.start

    def locate(self, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard index, window index inside that shard) of each window number."""
        shard = np.searchsorted(self._offsets, windows, side="right") - 1
        return shard, windows - self._offsets[shard]


def host_rows(mesh: dict[str, int], batch_rule, devices_per_host: int, host: int, mbs: int) -> np.ndarray:
    """Rows of a microbatch of `mbs` rows that host `host`'s devices hold (sorted, unique).

    `batch_rule` is the layout's rule for logical axis 'batch' on this mesh: None
    (replicated: every host holds every row), one mesh axis, or a tuple of them.

    Example:
        >>> host_rows({"data": 4}, "data", 2, 1, 8).tolist()
        [4, 5, 6, 7]
        >>> host_rows({"data": 2, "model": 2}, "data", 2, 0, 4).tolist()
        [0, 1]
        >>> host_rows({"model": 2, "data": 2}, "data", 2, 0, 4).tolist()
        [0, 1, 2, 3]
    """
    axes = () if batch_rule is None else ((batch_rule,) if isinstance(batch_rule, str) else tuple(batch_rule))
    names, shape = list(mesh), tuple(mesh.values())
    n = math.prod(mesh[a] for a in axes) if axes else 1
    if mbs % n:
        raise ValueError(f"microbatch of {mbs} rows does not split into {n} batch shards")
    size = mbs // n
    rows: set[int] = set()
    for d in range(host * devices_per_host, (host + 1) * devices_per_host):
        coord = np.unravel_index(d, shape)
        idx = 0
        for a in axes:
            idx = idx * mesh[a] + int(coord[names.index(a)])
        rows.update(range(idx * size, (idx + 1) * size))
    return np.array(sorted(rows), dtype=np.int64)
