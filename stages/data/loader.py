"""The host's loader: this host's rows of each step, prepared ahead on a background thread.

Basic flow (one `HostLoader` per split on a stage host that needs data):
  - `rows_in` / `rows_lab`: the rows of a microbatch this host's devices hold of the
    inputs (first stage) and of the labels (last stage); None where the host needs
    none. Each step reads only the union of those rows of every microbatch — never
    the global batch when the batch is sharded across hosts.
  - `get(step, timeout)` returns the step's `HostBatch`; with `prefetch > 0` a
    daemon thread has already read steps step+1 … step+prefetch into a bounded
    queue. `wait_s` sums the time `get` waited (the loader's share of the step's
    critical path), `bytes_read` what the reader copied out of the files.
  - Asking for a step other than the next one (a resume, a restore) restarts the
    thread there. `state()` / `load_state()` is the loader's whole position — a
    small dict a checkpoint saves — since the batch of step n depends only on
    (seed, n) and the data set. `offset` (the stage's `StageState.data_offset`: a
    training-health rollback's skipped batches): step n reads batch n + offset.
  - `close()` stops the thread (bounded join). Every wait has a deadline.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import numpy as np

from orchestrator.core.data.plan import DataPlan
from stages.data.readers import open_reader


@dataclass
class HostBatch:
    """One step's rows on this host: xs[i] / ys[i] are microbatch i's inputs / labels of
    rows_in / rows_lab (None where the host needs none)."""

    step: int
    xs: list | None
    ys: list | None


class HostLoader:
    """See the module docstring. `plan` is one split's `DataPlan`; `microbatches` m."""

    def __init__(self, plan: DataPlan, rows_in, rows_lab, microbatches: int, who: str = "loader"):
        self.plan, self.m, self.who = plan, microbatches, who
        self.mbs = plan.global_batch // microbatches
        self.rows_in = None if rows_in is None else np.asarray(rows_in, dtype=np.int64)
        self.rows_lab = None if rows_lab is None else np.asarray(rows_lab, dtype=np.int64)
        parts = [r for r in (self.rows_in, self.rows_lab) if r is not None]
        self.rows = np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
        self._global = (np.arange(self.m)[:, None] * self.mbs + self.rows[None, :]).ravel()
        self._reader = None
        self.wait_s = 0.0
        self._next = 0                 # the step get() expects next
        self.offset = 0                # batches skipped ahead of the step number (a health rollback)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._q: queue.Queue | None = None
        self._lock = threading.Lock()

    @property
    def reader(self):
        with self._lock:
            if self._reader is None:
                self._reader = open_reader(self.plan)
            return self._reader

    @property
    def bytes_read(self) -> int:
        """Bytes the reader copied out of the files (prefetched steps included)."""
        return 0 if self._reader is None else self._reader.bytes_read

    @property
    def windows_read(self) -> int:
        return 0 if self._reader is None else self._reader.windows_read

    def load(self, step: int) -> HostBatch:
        """Read step `step`'s rows now, on the calling thread."""
        if not len(self.rows):
            return HostBatch(step, None, None)
        x, y = self.reader.read(step + self.offset, self._global)
        n = len(self.rows)
        x = x.reshape(self.m, n, *x.shape[1:])
        y = y.reshape(self.m, n, *y.shape[1:])

        def pick(arr, rows):
            if rows is None:
                return None
            pos = np.searchsorted(self.rows, rows)
            return [arr[i] if len(rows) == n else np.ascontiguousarray(arr[i][pos]) for i in range(self.m)]

        return HostBatch(step, pick(x, self.rows_in), pick(y, self.rows_lab))

    def get(self, step: int, timeout: float) -> HostBatch:
        """Step `step`'s batch: from the prefetch queue, or read now (prefetch 0)."""
        t0 = time.perf_counter()
        try:
            if self.plan.prefetch == 0:
                return self.load(step)
            if self._thread is None or step != self._next:
                self._restart(step)
            try:
                item = self._q.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"{self.who}: no batch for step {step} within {timeout:g} s") from None
            got, batch = item
            if isinstance(batch, BaseException):
                raise RuntimeError(f"{self.who}: loading step {got} failed: {batch}") from batch
            self._next = step + 1
            return batch
        finally:
            self.wait_s += time.perf_counter() - t0

    def _restart(self, step: int) -> None:
        self.close()
        self._stop = threading.Event()
        self._q = queue.Queue(maxsize=self.plan.prefetch)
        self._next = step
        self._thread = threading.Thread(target=self._produce, args=(step, self._q, self._stop),
                                        name=f"{self.who} prefetch", daemon=True)
        self._thread.start()

    def _produce(self, step: int, q: queue.Queue, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                item = (step, self.load(step))
            except BaseException as e:  # noqa: BLE001 - handed to get(), which raises it on the step
                item = (step, e)
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item[1], BaseException):
                return
            step += 1

    def state(self) -> dict:
        """The loader's position: all a checkpoint needs to resume the data exactly (with the
        stage's `data_offset`, which the checkpoint saves in the stage's state)."""
        return {"source": self.plan.source, "seed": self.plan.seed, "next_step": self._next,
                "samples": self._next * self.plan.global_batch}

    def load_state(self, state: dict) -> None:
        """Resume at `state['next_step']` (the seed must be the plan's)."""
        if state.get("seed") != self.plan.seed or state.get("source") != self.plan.source:
            raise ValueError(f"{self.who}: loader state {state} is not of this data set "
                             f"(source {self.plan.source!r}, seed {self.plan.seed})")
        self.close()
        self._next = int(state["next_step"])

    def close(self, timeout: float = 5.0) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout)
            self._thread = None


def rows_of(sharding, shape) -> np.ndarray:
    """Rows (dim 0) of a global array of `shape` that this process's devices hold under `sharding`."""
    rows: set[int] = set()
    for idx in sharding.addressable_devices_indices_map(tuple(shape)).values():
        rows.update(range(shape[0])[idx[0]] if idx else range(shape[0]))
    return np.array(sorted(rows), dtype=np.int64)


def rows_array(local: np.ndarray, rows: np.ndarray, shape, sharding):
    """A jax.Array of global `shape` from this host's `rows` of it (`local[i]` is row rows[i])."""
    import jax

    def cb(idx):
        want = np.arange(shape[0])[idx[0]]
        pos = np.searchsorted(rows, want)
        if (pos >= len(rows)).any() or (rows[np.minimum(pos, len(rows) - 1)] != want).any():
            raise RuntimeError(f"rows {want.tolist()} asked of a host that read {rows.tolist()}")
        sel = local[pos] if not (len(pos) == len(rows) and (pos == np.arange(len(rows))).all()) else local
        return sel[(slice(None),) + tuple(idx[1:])]

    return jax.make_array_from_callback(tuple(shape), sharding, cb)
