"""Host-side data loading: readers of each source and the prefetching host loader.

Deterministic: row r of step n is sample n·global_batch + r of the split, whatever the
pipeline layout (`orchestrator.core.data.sampler`). The first stage's hosts load inputs,
the last stage's labels, each only the rows its devices hold (`HostLoader`).
"""
from stages.data.loader import HostBatch, HostLoader, rows_array, rows_of
from stages.data.readers import open_reader, synthetic_batch

__all__ = ["HostBatch", "HostLoader", "rows_array", "rows_of", "open_reader", "synthetic_batch",
           "global_batch", "microbatch"]


def global_batch(reader, plan, step: int):
    """(inputs, labels) of the whole global batch of `step` (the single-process reference)."""
    import numpy as np

    return reader.read(step, np.arange(plan.global_batch))


def microbatch(arr, index: int, count: int):
    size = arr.shape[0] // count
    return arr[index * size: (index + 1) * size]
