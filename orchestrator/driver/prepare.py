"""`meshpipe prepare`: text files → token shards (`orchestrator.core.data.shards` format).

Basic flow: list the inputs (files, or directories walked recursively; only regular
files are read) → optionally train a byte-level BPE tokenizer on them, locally with
`tokenizers` (saved as OUT/tokenizer.json) → encode each file as one document followed
by the tokenizer's end-of-text token → write flat uint16 (vocab ≤ 65 536) or uint32
shards of at most `shard_tokens` tokens, a progress bar over the input bytes → write
OUT/index.json last (a directory without it is not a data set). Nothing is downloaded.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from orchestrator.core.data.plan import EXTRA_HINT
from orchestrator.core.data.shards import INDEX, index_dict

EOS = "<|endoftext|>"


def _tokenizers():
    try:
        import tokenizers
    except ImportError as e:
        raise ImportError(f"meshpipe prepare needs the tokenizers package; {EXTRA_HINT}") from e
    return tokenizers


def list_inputs(inputs: Iterable[str]) -> list[Path]:
    """Regular files named, or found under named directories (sorted); others are skipped."""
    out: list[Path] = []
    for name in inputs:
        p = Path(name)
        if p.is_dir():
            for root, dirs, files in os.walk(p):
                dirs.sort()
                for f in sorted(files):
                    q = Path(root) / f
                    if stat.S_ISREG(q.lstat().st_mode) and q.stat().st_size > 0:
                        out.append(q)
        elif p.exists() and stat.S_ISREG(p.stat().st_mode):
            out.append(p)
        else:
            raise ValueError(f"{name}: not a regular file or directory")
    if not out:
        raise ValueError(f"no non-empty regular files in {list(inputs)}")
    return out


def _read(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def train_tokenizer(files: list[Path], vocab_size: int, out: Path) -> Path:
    """A byte-level BPE tokenizer of `vocab_size` tokens (incl. <|endoftext|>) trained on `files`."""
    tk = _tokenizers()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((_read(f) for f in files), trainer=trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return out


def prepare(inputs: Iterable[str], out_dir: str, *, tokenizer: str | None = None, train_vocab: int | None = None,
            shard_tokens: int = 1 << 24, progress: Callable | None = None) -> dict:
    """Write token shards of `inputs` into `out_dir`; returns the index.json document.

    Args:
      tokenizer: a tokenizers JSON file; or `train_vocab`: train one of that size first.
      shard_tokens: the largest shard, in tokens.
      progress: a context manager factory `progress(length=total_bytes)` whose value has
        `update(n)` (click.progressbar); None for no bar.
    """
    tk = _tokenizers()
    files = list_inputs(inputs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if (tokenizer is None) == (train_vocab is None):
        raise ValueError("give exactly one of a tokenizer file or a vocabulary size to train one")
    if train_vocab is not None:
        tok_path = train_tokenizer(files, train_vocab, out / "tokenizer.json")
    else:
        tok_path = Path(tokenizer)
    tok = tk.Tokenizer.from_file(str(tok_path))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eos = tok.token_to_id(EOS)
    dtype = "uint16" if vocab <= 1 << 16 else "uint32"
    shards: list[dict] = []
    buf: list[np.ndarray] = []
    held = 0

    def flush():
        nonlocal buf, held
        if not held:
            return
        arr = np.concatenate(buf).astype(dtype)
        name = f"train-{len(shards):05d}.bin"
        arr.tofile(out / name)
        shards.append({"file": name, "tokens": int(len(arr)), "max_token": int(arr.max())})
        buf, held = [], 0

    total = sum(f.stat().st_size for f in files)
    bar = progress(length=total, label="tokenizing") if progress else _NoBar()
    with bar as b:
        for f in files:
            ids = np.asarray(tok.encode(_read(f)).ids, dtype=np.int64)
            if eos is not None:
                ids = np.append(ids, eos)
            while len(ids):
                take = ids[:shard_tokens - held]
                buf.append(take)
                held += len(take)
                ids = ids[len(take):]
                if held >= shard_tokens:
                    flush()
            b.update(f.stat().st_size)
    flush()
    try:
        tok_ref = os.path.relpath(tok_path.resolve(), out.resolve())
    except ValueError:
        tok_ref = str(tok_path.resolve())
    doc = index_dict(dtype, shards, vocab=vocab, eos=eos, tokenizer=tok_ref)
    (out / INDEX).write_text(json.dumps(doc, indent=1))
    return doc


class _NoBar:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n):
        pass
