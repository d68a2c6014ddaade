"""`data:` checked against the model and the files: a `DataPlan`, the small description every
host opens its own reader from (no data travels in the actors' start-up config).

`plan_data(job_data, model, seed)` resolves paths (absolute, every symlink followed and held to
the rule: `orchestrator.core.data.shards.resolve_strict`), checks every rule that can be
checked without reading a whole data set — regular, non-empty files, token ids (and a text
file's bytes) below the model's vocabulary (the index's `max_token`, else a scan bounded by
`SCAN_BUDGET`; the refusal names the file, the first offending position and the id), seq_len
against every shard, the hf column and the tokenizer's vocabulary (every id it can produce),
the grain factory's first records — and returns the plan, or raises `DataProblems` (one
(key, value, rule) per problem). Reading happens in `stages.data`, which checks every window
it reads again and never clamps an id.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from orchestrator.core.data.sampler import windows_per_shard
from orchestrator.core.data.shards import (SCAN_BUDGET, SCAN_BYTES, ShardError, first_at_least, regular_file,
                                           resolve_tokens, scan_max)

__all__ = ["DataPlan", "DataProblems", "SOURCES", "plan_data", "synthetic_plan", "EXTRA_HINT", "hf_format", "load_factory"]

EXTRA_HINT = "install the data extra: pip install 'meshpipe[data]'"
_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".arrow": "arrow", ".csv": "csv"}
GRAIN_PROBE = 4            # records of a grain source checked at plan time


class DataProblems(ValueError):
    """Problems with `data:`: `problems` is a list of (key, value, rule)."""

    def __init__(self, problems: list[tuple[str, Any, str]]):
        super().__init__("; ".join(f"{k} = {v!r}: {r}" for k, v, r in problems))
        self.problems = problems


@dataclass(frozen=True)
class DataPlan:
    """Where a split's examples come from (frozen, small, picklable).

    Attributes:
      source: synthetic | text | tokens | hf | grain.
      model: the model name ("mlp"/"gpt" choose the synthetic generator).
      global_batch, seq_len, seed, vocab: as in the job (vocab 0: the model has none).
      input_shape, label_shape: per-row shapes the model takes.
      files: absolute paths read (text: one file; tokens: shards; hf: data files).
      dtype: token dtype of the files (tokens: uint16/uint32; text: uint8).
      counts: windows per file (tokens/text), None where only the loader can count (hf, grain).
      fmt, column, tokenizer: hf's file format, text column, tokenizer JSON path.
      factory, args: grain's 'package.module:function' and its keyword arguments.
      split: ("all",) whole data set, ("head", f) all but the last fraction f, ("tail", f) that tail.
      prefetch: batches the loader thread keeps ready.
      eval: the held-out split's plan (None without data.eval); eval_batches: how many.
    """

    source: str
    model: str
    global_batch: int
    seed: int
    input_shape: tuple[int, ...]
    label_shape: tuple[int, ...]
    vocab: int = 0
    seq_len: int | None = None
    files: tuple[str, ...] = ()
    dtype: str = "uint8"
    counts: Optional[tuple[int, ...]] = None
    fmt: str | None = None
    column: str = "text"
    tokenizer: str | None = None
    factory: str | None = None
    args: tuple = ()
    split: tuple = ("all",)
    prefetch: int = 2
    eval: Optional["DataPlan"] = field(default=None, repr=False)
    eval_batches: int = 0

    @property
    def windowed(self) -> bool:
        return self.source != "synthetic"


def synthetic_plan(model, global_batch: int, seed: int) -> DataPlan:
    """The synthetic data plan of `model` (benchmarks and tests that need no files)."""
    return DataPlan(source="synthetic", model=model.name, global_batch=global_batch, seed=seed,
                    input_shape=tuple(model.input_shape), label_shape=tuple(model.label_shape),
                    vocab=int(model.vocab))


def hf_format(files: tuple[str, ...], fmt: str | None) -> str:
    """The datasets builder name for these files (data.format, else from the first extension)."""
    if fmt:
        return fmt
    ext = Path(files[0]).suffix.lower()
    if ext not in _FORMATS:
        raise ValueError(f"cannot tell the format from {ext!r} ({', '.join(sorted(_FORMATS))}); set data.format")
    return _FORMATS[ext]


def load_factory(path: str):
    """The callable named by 'package.module:function'."""
    import importlib

    from orchestrator.core.extras import hinting

    mod, _, fn = path.partition(":")
    with hinting():        # the user's module may import grain/datasets/... at its top: name the extra
        return getattr(importlib.import_module(mod), fn)


def plan_data(d, model, seed: int) -> DataPlan:
    """Check `d` (a `DataConfig`) against `model` (a `ModelSpec`); see the module docstring."""
    probs: list[tuple[str, Any, str]] = []
    vocab = int(model.vocab)
    base = DataPlan(source=d.source, model=model.name, global_batch=d.global_batch, seed=seed,
                    input_shape=tuple(model.input_shape), label_shape=tuple(model.label_shape), vocab=vocab,
                    seq_len=d.seq_len, prefetch=d.prefetch)
    if d.source == "synthetic":
        return base
    if not model.input_dtype.startswith(("int", "uint")):
        probs.append(("data.source", d.source, f"{d.source} data gives token ids, but model {model.name!r} "
                      f"takes {model.input_dtype} inputs; use 'synthetic'"))
        raise DataProblems(probs)
    seq = d.seq_len or (model.input_shape[0] if model.input_shape else None)
    if seq is None or tuple(model.label_shape) != tuple(model.input_shape) or len(model.input_shape) != 1:
        probs.append(("data.source", d.source, f"token windows need a model whose inputs and labels are "
                      f"(seq_len,) token ids; model {model.name!r} takes {tuple(model.input_shape)} -> "
                      f"{tuple(model.label_shape)}"))
        raise DataProblems(probs)
    base = replace(base, seq_len=seq)
    plan = _one(d, d.path, base, "data.path", probs, vocab, seq)
    if d.eval is not None and plan is not None:
        if d.eval.holdout is not None:
            ev = replace(plan, split=("tail", d.eval.holdout))
            plan = replace(plan, split=("head", d.eval.holdout))
            _check_split(plan, ev, probs)
        else:
            ev = _one(d, d.eval.path, base, "data.eval.path", probs, vocab, seq)
        if ev is not None:
            plan = replace(plan, eval=replace(ev, prefetch=0), eval_batches=d.eval.batches)
    if probs:
        raise DataProblems(probs)
    return plan


def _check_split(train: DataPlan, ev: DataPlan, probs) -> None:
    if train.counts is None:
        return
    n = sum(train.counts)
    tail = int(n * ev.split[1])
    if tail < 1 or n - tail < 1:
        probs.append(("data.eval.holdout", ev.split[1], f"the data set has {n} windows of seq_len+1 "
                      f"tokens; holding out this fraction leaves {tail} for eval and {n - tail} for "
                      "training (each needs at least 1)"))


def _one(d, path, base: DataPlan, key: str, probs, vocab: int, seq: int) -> Optional[DataPlan]:
    """The plan of one split at `path` (`key`: the job key naming it), by its source's entry in
    `SOURCES`; None with its problems added to `probs`."""
    try:
        return SOURCES[d.source](d, path, base, key, probs, vocab, seq)
    except ShardError as e:
        probs.append((key, e.value, e.rule))
    except ImportError as e:
        probs.append(("data.source", d.source, f"needs a package that is not installed ({e.name}); {EXTRA_HINT}"))
    return None


def _text(d, path, base: DataPlan, key: str, probs, vocab: int, seq: int) -> Optional[DataPlan]:
    f = str(regular_file(path, "text file"))
    n = windows_per_shard(os.path.getsize(f), seq)
    if n < 1:
        probs.append((key, path, f"holds {os.path.getsize(f)} bytes, fewer than data.seq_len + 1 = {seq + 1}"))
        return None
    if vocab and vocab < 256:
        _fit_bytes(key, f, vocab, probs)
    return replace(base, files=(f,), dtype="uint8", counts=(n,))


def _tokens(d, path, base: DataPlan, key: str, probs, vocab: int, seq: int) -> Optional[DataPlan]:
    ts = resolve_tokens(path, d.dtype)
    counts = []
    for f, t in zip(ts.files, ts.tokens):
        n = windows_per_shard(t, seq)
        if n < 1:
            probs.append((key, f, f"shard holds {t} tokens, fewer than data.seq_len + 1 = {seq + 1}"))
        counts.append(n)
    if vocab:
        _fit_tokens(key, ts, vocab, probs)
    if ts.vocab is not None and vocab and ts.vocab > vocab:
        probs.append((key, path, f"the shards were tokenized with a vocabulary of {ts.vocab}, larger "
                      f"than the model's vocab {vocab}"))
    return replace(base, files=ts.files, dtype=ts.dtype, counts=tuple(counts))


def _hf(d, path, base: DataPlan, key: str, probs, vocab: int, seq: int) -> Optional[DataPlan]:
    files = tuple(str(regular_file(p, "data file")) for p in ((path,) if isinstance(path, str) else path))
    try:
        fmt = hf_format(files, d.format)
    except ValueError as e:
        probs.append(("data.format", d.format, str(e)))
        return None
    column = d.column or "text"
    for f in files:
        cols = _columns(f, fmt)
        if column not in cols:
            probs.append(("data.column", column, f"not a column of {f} (columns: {', '.join(cols)})"))
            break
    tok = str(regular_file(d.tokenizer, "tokenizer file"))
    size = _tokenizer_vocab(tok)
    if vocab and size > vocab:
        probs.append(("data.tokenizer", d.tokenizer, f"the tokenizer's vocabulary has {size} tokens, "
                      f"more than the model's vocab {vocab}"))
    return replace(base, files=files, dtype="uint32", fmt=fmt, column=column, tokenizer=tok)


def _grain(d, path, base: DataPlan, key: str, probs, vocab: int, seq: int) -> Optional[DataPlan]:
    args = dict(d.args or {})
    _probe_grain(d.factory, args, seq, vocab, probs)
    return replace(base, factory=d.factory, args=tuple(sorted(args.items())))


# `data.source` -> how one split of it is planned: the one place the planner tells the sources apart
# (`synthetic` needs no plan of its own; the readers' table is `stages.data.readers.READERS`).
SOURCES = {"text": _text, "tokens": _tokens, "hf": _hf, "grain": _grain}


def _fit_bytes(key: str, f: str, vocab: int, probs) -> None:
    """Text is fed byte by byte as token ids: every byte must be below the model's vocab. The file is
    read once, in full, up to SCAN_BUDGET (beyond it, its first and last SCAN_BYTES; the reader
    checks each window it reads)."""
    size = os.path.getsize(f)
    if size <= SCAN_BUDGET:
        hit, how = first_at_least(f, "uint8", vocab), "the whole file read"
    else:
        top = scan_max(f, "uint8")
        hit = first_at_least(f, "uint8", vocab) if top >= vocab else None
        how = f"its first and last {SCAN_BYTES >> 20} MiB read: larger than {SCAN_BUDGET >> 30} GiB"
    if hit is not None:
        pos, value = hit
        probs.append((key, f, f"byte {value} at offset {pos} does not fit the model's vocab {vocab} ({how}): "
                      "data.source text feeds each byte as a token id, so the model needs vocab >= "
                      f"{value + 1} (256 for any byte, 128 for ASCII); bytes are never clamped"))


def _fit_tokens(key: str, ts, vocab: int, probs) -> None:
    """Every shard's token ids below the model's vocab: the index's max_token where `meshpipe
    prepare` recorded it, else the shard read in full within SCAN_BUDGET, else its ends; a shard
    that holds an id too large is scanned for the first one (module `shards`)."""
    budget = SCAN_BUDGET
    item = 4 if ts.dtype == "uint32" else 2
    tops = ts.max_tokens or (None,) * len(ts.files)
    for f, count, top in zip(ts.files, ts.tokens, tops):
        if top is not None:
            how = f"index.json records max_token {top}"
            if top < vocab:
                continue
        elif count * item <= budget:
            budget -= count * item
            how = "the whole shard read"
        else:
            how = f"its first and last {SCAN_BYTES >> 20} MiB read (beyond the plan's {SCAN_BUDGET >> 30} GiB scan)"
            if scan_max(f, ts.dtype) < vocab:
                continue
        hit = first_at_least(f, ts.dtype, vocab)
        if hit is None and top is None:
            continue
        if hit is None:           # the index claims an id the file does not hold
            probs.append((key, f, f"{how}, >= the model's vocab {vocab}, but no token id in the file is: "
                          "index.json is stale; run meshpipe prepare again"))
            continue
        pos, value = hit
        probs.append((key, f, f"token id {value} at position {pos} (of {count} tokens) does not fit the model's "
                      f"vocab {vocab} ({how}); token ids are never clamped: use a model with vocab >= "
                      f"{max(value, top or 0) + 1}, or tokenize with a smaller vocabulary"))


def _columns(path: str, fmt: str) -> list[str]:
    if fmt == "json":
        with open(path, "rb") as fh:
            for line in fh:
                if line.strip():
                    try:
                        doc = json.loads(line)
                    except ValueError:
                        raise ShardError(path, "first record is not one JSON object per line (JSONL)") from None
                    return sorted(doc) if isinstance(doc, dict) else []
        raise ShardError(path, "holds no JSON record")
    if fmt == "csv":
        import csv

        with open(path, newline="") as fh:
            return next(csv.reader(fh), [])
    import pyarrow as pa  # datasets' own dependency

    if fmt == "parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(path).names)
    try:
        with pa.memory_map(path) as src:
            return list(pa.ipc.open_stream(src).schema.names)
    except pa.ArrowInvalid:
        with pa.memory_map(path) as src:
            return list(pa.ipc.open_file(src).schema.names)


def _tokenizer_vocab(path: str) -> int:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path).get_vocab_size(with_added_tokens=True)
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own exception types
        raise ShardError(path, f"not a tokenizers JSON file: {e}") from None


def _probe_grain(factory: str, args: dict, seq: int, vocab: int, probs) -> None:
    import numpy as np

    import grain  # noqa: F401 - the source is the user's grain object

    try:
        src = load_factory(factory)(**args)
    except (ImportError, AttributeError) as e:
        probs.append(("data.factory", factory, f"cannot import: {e}"))
        return
    except Exception as e:  # noqa: BLE001 - the user's code
        probs.append(("data.factory", factory, f"the factory failed: {type(e).__name__}: {e}"))
        return
    if not (hasattr(src, "__len__") and hasattr(src, "__getitem__")):
        probs.append(("data.factory", factory, f"returned {type(src).__name__}; needs a random-access source "
                      "(__len__ and __getitem__), e.g. a grain MapDataset"))
        return
    if len(src) < 1:
        probs.append(("data.factory", factory, "returned an empty source"))
        return
    for i in range(min(GRAIN_PROBE, len(src))):
        rec = np.asarray(src[i])
        if rec.ndim != 1 or rec.dtype.kind not in "iu" or len(rec) < seq + 1:
            probs.append(("data.factory", factory, f"record {i} is {rec.dtype}{list(rec.shape)}; each record "
                          f"must be a 1-D integer array of at least data.seq_len + 1 = {seq + 1} token ids"))
            return
        if vocab and int(rec.max()) >= vocab:
            probs.append(("data.factory", factory, f"record {i} holds token id {int(rec.max())} >= the model's "
                          f"vocab {vocab}"))
            return
