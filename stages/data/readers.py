"""Readers: rows of a step → (inputs, labels), read from a split of a data set on this host.

One reader per split (training, eval), opened lazily by the host that needs it from a
`orchestrator.core.data.DataPlan`. `read(step, rows)` returns the inputs and labels of
those global rows of step `step` (row r of step n is sample n·global_batch + r; which
window it reads is `orchestrator.core.data.WindowSampler`'s pure math), and counts the
bytes it copied out of the files (`bytes_read`), so a test can see that a host read
only its own rows.

  synthetic  the batch generated from (seed, step) — computed, not read (the whole
             batch is cheap to generate; the rows asked for are cut from it);
  text       the file's bytes, memory-mapped, as token ids;
  tokens     token shards (uint16/uint32), memory-mapped;
  hf         a `datasets` data set from local files (offline), its text column
             tokenized with a `tokenizers` file into one token stream on open
             (documents joined by the tokenizer's end-of-text token when it has one);
  grain      a user's grain random-access source / MapDataset: record i is window i.

Every window's ids are checked against the model's vocab as they are read (the plan checked
the files once, `orchestrator.core.data.plan`; this catches a file changed since, or what the
plan's bounded scan did not read): an id that does not fit stops the run naming the file and
the position. Nothing is ever clamped.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from orchestrator.core.data.plan import EXTRA_HINT, DataPlan, hf_format, load_factory
from orchestrator.core.data.sampler import WindowSampler

EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "[SEP]")


def open_reader(plan: DataPlan) -> "Reader":
    """A reader of `plan`'s split (see the module docstring), by its source's entry in `READERS`."""
    make = READERS.get(plan.source)
    if make is None:
        raise ValueError(f"unknown data source {plan.source!r}")
    return make(plan)


def _window_files(plan: DataPlan) -> "Reader":
    return WindowReader(plan, [np.memmap(f, dtype=plan.dtype, mode="r") for f in plan.files], plan.files)


def _hf_stream(plan: DataPlan) -> "Reader":
    return WindowReader(plan, [hf_tokens(plan)], [f"{plan.files[0]} (tokenized)"])


class Reader:
    bytes_read = 0
    windows_read = 0

    def read(self, step: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError


def _split(plan: DataPlan, counts: tuple[int, ...]) -> WindowSampler:
    n = sum(counts)
    kind = plan.split[0]
    if kind == "all":
        return WindowSampler(counts, plan.seed, plan.global_batch)
    tail = int(n * plan.split[1])
    if kind == "head":
        return WindowSampler(counts, plan.seed, plan.global_batch, 0, n - tail)
    return WindowSampler(counts, plan.seed, plan.global_batch, n - tail, None)


class WindowReader(Reader):
    """(seq_len + 1)-token windows of token arrays (memory maps, or one in-memory stream)."""

    def __init__(self, plan: DataPlan, arrays: list, names):
        self.plan, self.arrays, self.names = plan, arrays, list(names)
        seq = plan.seq_len
        counts = tuple(max(0, (len(a) - 1) // seq) for a in arrays)
        if plan.counts is not None and counts != tuple(plan.counts):
            raise ValueError(f"data changed since the plan: windows per file {counts}, planned {plan.counts}")
        self.sampler = _split(plan, counts)

    def read(self, step, rows):
        seq, vocab = self.plan.seq_len, self.plan.vocab
        shard, local = self.sampler.locate(self.sampler.windows(step, rows))
        out = np.empty((len(rows), seq + 1), dtype=np.int32)
        for i, (s, w) in enumerate(zip(shard.tolist(), local.tolist())):
            win = self.arrays[s][w * seq: w * seq + seq + 1]
            out[i] = win
            self.bytes_read += win.nbytes
        self.windows_read += len(rows)
        if vocab and len(rows) and out.max() >= vocab:
            bad = int(np.argmax(out.max(axis=1)))
            col = int(np.argmax(out[bad] >= vocab))
            what = "byte" if self.plan.source == "text" else "token id"
            raise ValueError(f"{what} {int(out[bad, col])} >= the model's vocab {vocab} in "
                             f"{self.names[shard[bad]]}, window {int(local[bad])}, at position "
                             f"{int(local[bad]) * seq + col} (never clamped: the data does not fit the model)")
        return out[:, :-1], out[:, 1:]


class SyntheticReader(Reader):
    """The generated batch of (seed, step) (as before the real sources existed), rows cut from it."""

    def __init__(self, plan: DataPlan):
        self.plan = plan

    def read(self, step, rows):
        x, y = synthetic_batch(self.plan, step)
        return x[rows], y[rows]


def synthetic_batch(plan: DataPlan, step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([plan.seed, step, 7])
    n = plan.global_batch
    if plan.input_shape and len(plan.label_shape) == 1 and plan.label_shape == plan.input_shape and plan.vocab:
        seq = plan.input_shape[0]
        start = rng.integers(0, plan.vocab, size=(n, 1))
        stride = rng.integers(1, 4, size=(n, 1))
        rows = ((start + stride * np.arange(seq + 1)[None, :]) % plan.vocab).astype(np.int32)
        return rows[:, :-1], rows[:, 1:]
    teacher = np.random.default_rng([plan.seed, 99991])
    d_in, d_out = plan.input_shape[0], plan.label_shape[0]
    t1 = teacher.normal(size=(d_in, 16)).astype(np.float32) / np.sqrt(d_in)
    t2 = teacher.normal(size=(16, d_out)).astype(np.float32) / 4.0
    x = rng.normal(size=(n, d_in)).astype(np.float32)
    return x, np.tanh(x @ t1) @ t2


class GrainReader(Reader):
    """Record i of the user's grain source is window i (its first seq_len + 1 ids)."""

    def __init__(self, plan: DataPlan):
        try:
            import grain
        except ImportError as e:
            raise ImportError(f"data.source 'grain' needs grain; {EXTRA_HINT}") from e
        self.plan = plan
        src = load_factory(plan.factory)(**dict(plan.args))
        self.ds = src if isinstance(src, grain.MapDataset) else grain.MapDataset.source(src)
        self.sampler = _split(plan, (len(self.ds),))

    def read(self, step, rows):
        seq, vocab = self.plan.seq_len, self.plan.vocab
        out = np.empty((len(rows), seq + 1), dtype=np.int32)
        for i, w in enumerate(self.sampler.windows(step, rows).tolist()):
            rec = np.asarray(self.ds[w])
            if rec.ndim != 1 or len(rec) < seq + 1:
                raise ValueError(f"grain record {w} has shape {rec.shape}; needs >= {seq + 1} token ids")
            out[i] = rec[:seq + 1]
            self.bytes_read += (seq + 1) * rec.itemsize
            if vocab and int(out[i].max()) >= vocab:
                raise ValueError(f"grain record {w} holds token id {int(out[i].max())} >= the model's vocab {vocab}")
        self.windows_read += len(rows)
        return out[:, :-1], out[:, 1:]


def hf_tokens(plan: DataPlan) -> np.ndarray:
    """The hf split's documents tokenized into one uint32 stream (offline; nothing downloaded)."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"   # this host's loader never reaches the Hub
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import datasets
        from tokenizers import Tokenizer
    except ImportError as e:
        raise ImportError(f"data.source 'hf' needs datasets and tokenizers; {EXTRA_HINT}") from e
    import tempfile

    tok = Tokenizer.from_file(plan.tokenizer)
    eos = next((tok.token_to_id(t) for t in EOS_NAMES if tok.token_to_id(t) is not None), None)
    with tempfile.TemporaryDirectory(prefix="meshpipe-hf-") as cache:
        ds = datasets.load_dataset(hf_format(plan.files, plan.fmt), data_files=list(plan.files), split="train",
                                   cache_dir=cache, keep_in_memory=True)
        texts = ds[plan.column]
    parts: list[Any] = []
    for i in range(0, len(texts), 1024):
        for enc in tok.encode_batch([t or "" for t in texts[i:i + 1024]]):
            parts.append(np.asarray(enc.ids, dtype=np.uint32))
            if eos is not None:
                parts.append(np.array([eos], dtype=np.uint32))
    stream = np.concatenate(parts) if parts else np.zeros(0, np.uint32)
    if len(stream) < plan.seq_len + 1:
        raise ValueError(f"data.path {plan.files}: column {plan.column!r} tokenizes to {len(stream)} tokens, "
                         f"fewer than data.seq_len + 1 = {plan.seq_len + 1}")
    return stream


# `data.source` -> its reader: the one place the runtime tells the sources apart (the planner's
# table is `orchestrator.core.data.plan.SOURCES`; tests/test_data_sources.py keeps both complete).
READERS = {"synthetic": SyntheticReader, "text": _window_files, "tokens": _window_files, "hf": _hf_stream,
           "grain": GrainReader}
