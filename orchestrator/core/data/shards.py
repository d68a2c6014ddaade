"""Token shards on disk: the format, and the checks made on it before anything starts.

Format (written by `meshpipe prepare`, readable by nanoGPT/levanter-style code):
  - each shard is a flat, header-less little-endian array of token ids, `uint16`
    (vocabularies up to 65 536) or `uint32`, named `*.bin`;
  - a directory of shards holds `index.json`::

        {"format": "meshpipe.tokens", "version": 1, "dtype": "uint16",
         "vocab": 512, "eos": 0, "tokenizer": "tokenizer.json",
         "shards": [{"file": "train-00000.bin", "tokens": 1048576, "max_token": 511}, ...]}

    `tokens` must equal the file size / itemsize, `max_token` is the largest id
    written (checked against the model's vocab at plan time).

`data.path` of `source: tokens` names such a directory, a single `.bin` file, or
a list of them; a bare `.bin` without an `index.json` next to it takes its dtype
from `data.dtype`.

Every path must be a regular file (a directory only where an index is expected):
FIFOs, devices and sockets are refused, since reading one could block forever
or never end. Paths are resolved once (`resolve_strict`): relative ones against the
current directory, every symlink among the components followed and held to the rule
that it points inside the directory that holds it.

Token ids must be below the model's vocabulary; nothing is ever clamped. At plan time
(`orchestrator.core.data.plan`) a shard's `max_token` from its index (recorded by
`meshpipe prepare`) is compared with the vocabulary; a shard without one is read in full
while the data set's unread bytes stay within `SCAN_BUDGET`, else its first and last
`SCAN_BYTES`. A shard found to hold an id that does not fit is scanned for the first one
(`first_at_least`), so the refusal names the file, the position and the id. The loader
checks every window it reads again (a file changed after the plan, or beyond the budget).
"""
from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

__all__ = ["TokenSet", "ShardError", "INDEX", "FORMAT", "DTYPES", "SCAN_BYTES", "SCAN_BUDGET",
           "resolve_tokens", "regular_file", "resolve_strict", "scan_max", "first_at_least", "index_dict"]

INDEX = "index.json"
FORMAT = "meshpipe.tokens"
DTYPES = ("uint16", "uint32")
SCAN_BYTES = 4 << 20
SCAN_BUDGET = 1 << 30       # bytes of a data set read in full at plan time to find ids >= vocab


class ShardError(ValueError):
    """A token data set breaks a rule: `value` is the offending path or value, `rule` the rule."""

    def __init__(self, value, rule: str):
        super().__init__(f"{value}: {rule}")
        self.value, self.rule = value, rule


@dataclass(frozen=True)
class TokenSet:
    """Resolved token shards: absolute file paths, their dtype and token counts.

    Attributes:
      files: absolute paths of the shards, in order.
      dtype: "uint16" or "uint32".
      tokens: token count of each shard.
      max_token: largest token id an index declares (None when no index said).
      vocab: the vocabulary size an index declares (None when unknown).
      max_tokens: each shard's `max_token` from its index (None where none is recorded).
    """

    files: tuple[str, ...]
    dtype: str
    tokens: tuple[int, ...]
    max_token: int | None = None
    vocab: int | None = None
    max_tokens: tuple[int | None, ...] = ()


def resolve_strict(path: str | Path, what: str = "path") -> Path:
    """`path` made absolute (a relative path against the current directory) with every symlink among
    its components followed, one component at a time, each held to the rule: a symlink must point
    inside the directory that holds it. A link out of its own directory is refused wherever it sits:
    `jobdir/data.txt -> /etc/shadow` and `jobdir/etc -> /etc` (named as `jobdir/etc/shadow`) alike.
    A top-level system link (`/lib -> usr/lib`) points inside `/` and passes; the current directory
    is the kernel's resolved one and has no links to judge. Nothing but `lstat`/`readlink` is done.

    Example:
        >>> resolve_strict("/usr/../usr/bin").as_posix()
        '/usr/bin'
    """
    p = Path(os.fspath(path))
    queue = list(p.parts[1:] if p.is_absolute() else p.parts)
    cur = Path(p.anchor or "/") if p.is_absolute() else Path(os.getcwd())
    while queue:
        part = queue.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            cur = cur.parent          # `cur` is physical (no links in it), so its parent is the real one
            continue
        nxt = cur / part
        if nxt.is_symlink():
            real = Path(os.path.realpath(nxt))
            if real != cur and cur not in real.parents:   # e.g. data/train.txt -> /etc/shadow: read and shipped
                raise ShardError(str(path), f"is a symlink to {real}, outside {cur}"
                                 + (f" (through the directory link {nxt})" if queue else "")
                                 + f"; a {what} must not lead out of the directory that holds a link: copy the "
                                 "data there or name its real path")
            cur = real
        else:
            cur = nxt
    return cur


def regular_file(path: str | Path, what: str = "path") -> Path:
    """`path` resolved by `resolve_strict` (no symlink out of the directory that holds it, in any
    component), if it is a regular, non-empty file; else `ShardError`.

    Example:
        >>> regular_file("/dev/null")
        Traceback (most recent call last):
        ...
        orchestrator.core.data.shards.ShardError: /dev/null: is a character device, not a regular file
    """
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise ShardError(str(path), f"{what} not found (relative paths are read from {os.getcwd()})") from None
    except OSError as e:
        raise ShardError(str(path), f"cannot stat {what}: {e.strerror or e}") from None
    mode = st.st_mode
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            raise ShardError(str(path), f"is {name}, not a regular file")
    if st.st_size == 0:
        raise ShardError(str(path), "is empty")
    return resolve_strict(path, what)


def _read_index(directory: Path) -> dict:
    path = directory / INDEX
    regular_file(path, "index.json")
    if path.stat().st_size > 64 << 20:
        raise ShardError(str(path), "index.json is larger than 64 MiB")
    try:
        doc = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ShardError(str(path), f"is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ShardError(str(path), f"is not a token index (needs \"format\": {FORMAT!r})")
    if doc.get("dtype") not in DTYPES:
        raise ShardError(str(path), f"dtype {doc.get('dtype')!r} must be one of {', '.join(DTYPES)}")
    shards = doc.get("shards")
    if not isinstance(shards, list) or not shards:
        raise ShardError(str(path), "lists no shards")
    for s in shards:
        if not isinstance(s, dict) or not isinstance(s.get("file"), str) or "/" in s["file"] or s["file"] in (".", ".."):
            raise ShardError(str(path), f"shard entry {s!r} needs a plain file name in 'file'")
    return doc


def resolve_tokens(paths: str | Sequence[str], dtype: str | None = None) -> TokenSet:
    """Resolve `data.path` (a directory with index.json, a .bin file, or a list of them).

    Raises:
      ShardError: a missing, empty, irregular or mis-sized shard, mixed dtypes, a bad index.
    """
    entries = [paths] if isinstance(paths, str) else list(paths)
    if not entries:
        raise ShardError([], "lists no shard")
    files, counts, dtypes, maxes, vocabs = [], [], set(), [], []
    for entry in entries:
        p = Path(entry)
        if p.is_dir():
            p = resolve_strict(entry, "data directory")
            doc = _read_index(p)
            for s in doc["shards"]:
                f = regular_file(p / s["file"], "shard")
                n = _count(f, doc["dtype"])
                if s.get("tokens") is not None and s["tokens"] != n:
                    raise ShardError(str(f), f"holds {n} tokens but {p / INDEX} says {s['tokens']}")
                files.append(str(f))
                counts.append(n)
                maxes.append(_max_token(s))
            dtypes.add(doc["dtype"])
            if isinstance(doc.get("vocab"), int):
                vocabs.append(doc["vocab"])
            continue
        f = regular_file(p, "shard")
        beside = f.parent / INDEX
        dt, top = dtype, None
        if beside.is_file():
            doc = _read_index(f.parent)
            dt = doc["dtype"]
            if isinstance(doc.get("vocab"), int):
                vocabs.append(doc["vocab"])
            top = next((_max_token(s) for s in doc["shards"] if s["file"] == f.name), None)
        if dt is None:
            raise ShardError(str(f), f"no {INDEX} beside it: set data.dtype (one of {', '.join(DTYPES)})")
        if dt not in DTYPES:
            raise ShardError(dt, f"dtype must be one of {', '.join(DTYPES)}")
        files.append(str(f))
        counts.append(_count(f, dt))
        maxes.append(top)
        dtypes.add(dt)
    if len(dtypes) > 1:
        raise ShardError(sorted(dtypes), "all shards of a data set must share one dtype")
    known = [m for m in maxes if m is not None]
    return TokenSet(tuple(files), dtypes.pop(), tuple(counts), max(known) if known else None,
                    max(vocabs) if vocabs else None, tuple(maxes))


def _max_token(shard: dict) -> int | None:
    top = shard.get("max_token")
    return top if isinstance(top, int) and not isinstance(top, bool) else None


def _count(path: Path, dtype: str) -> int:
    size, item = path.stat().st_size, np.dtype(dtype).itemsize
    if size % item:
        raise ShardError(str(path), f"size {size} bytes is not a multiple of {item} ({dtype} tokens)")
    return size // item


def scan_max(path: str, dtype: str, limit: int = SCAN_BYTES) -> int:
    """Largest token id in the first and last `limit` bytes of a shard (a bounded scan)."""
    arr = np.memmap(path, dtype=dtype, mode="r")
    n = max(1, limit // arr.itemsize)
    head, tail = arr[:n], arr[max(0, len(arr) - n):]
    return int(max(head.max(), tail.max()))


def first_at_least(path: str, dtype: str, limit: int, chunk: int = 1 << 24) -> tuple[int, int] | None:
    """(position, value) of the first element >= `limit` in a flat array file of `dtype`, read in
    chunks of `chunk` elements (memory-mapped: only the pages read are loaded); None if there is none.

    Example:
        >>> import os, tempfile
        >>> f = os.path.join(tempfile.mkdtemp(), "a.bin")
        >>> np.array([1, 2, 300, 7, 400], dtype=np.uint16).tofile(f)
        >>> first_at_least(f, "uint16", 256)
        (2, 300)
    """
    arr = np.memmap(path, dtype=dtype, mode="r")
    for start in range(0, len(arr), chunk):
        part = arr[start:start + chunk]
        if int(part.max()) >= limit:
            i = int(np.argmax(part >= limit))
            return start + i, int(part[i])
    return None


def index_dict(dtype: str, shards: list[dict], *, vocab: int | None = None, eos: int | None = None,
               tokenizer: str | None = None) -> dict:
    """The index.json document for a directory of shards.

    Example:
        >>> index_dict("uint16", [{"file": "a.bin", "tokens": 3, "max_token": 2}])["format"]
        'meshpipe.tokens'
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} must be one of {DTYPES}")
    return {"format": FORMAT, "version": 1, "dtype": dtype, "vocab": vocab, "eos": eos,
            "tokenizer": tokenizer, "shards": shards}
