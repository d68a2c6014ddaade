"""Where a run writes its record: a directory of its own under the run's name.

Layout (`<run.output_dir>/<run.name>/` is the NAME directory, shared by every run of the name):

    runs/gpt-tiny/
        20261206-121503/        one `meshpipe run`: summary.json, metrics.jsonl, workers.json,
                                trace.json, timeline.png (error.txt after a stage error),
                                previous/<k>/ after --resume
        20261206-121503-2/      a second run started in the same second
        20261206-130044/
        latest -> 20261206-130044   the newest run (a symlink; a one-line file where the file
                                    system has none)
        compile_cache/          what runs of the name share (failure.compile_cache: auto)

Basic flow of `open_run` (the one place that decides):
  - a new run (no `--resume`) gets a new directory, named by its start time in UTC
    (`%Y%m%d-%H%M%S`, sortable), with `-2`, `-3`, ... when that name is taken (created with
    an exclusive mkdir, so two runs starting at once never share one), and `latest` is
    pointed at it;
  - `--resume` continues the latest run's directory (or the run id given, `run_id`): the
    earlier invocation's documents (`DOCUMENTS`: its summary, error files, workers.json,
    pictures) are first moved, unchanged, into `previous/<k>/` inside it (k = 1, 2, ... in
    order), and its `metrics.jsonl` stays where it is: the resumed invocation appends to it
    after a `resume` line (`orchestrator.driver.record.RunRecord`). So the run directory holds
    the whole run — metrics.jsonl every step of every invocation, summary.json the newest
    invocation's (with the committed steps' losses), previous/ the earlier ones' — and nothing
    is replaced. `--resume` on a name with no run yet starts a new directory.

Invariants: a record file is never overwritten or removed by a later run; directories are
owner-only (`private_fs`); `latest` is replaced atomically (a new link renamed over it).
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Optional

from orchestrator.core.private_fs import private_dir

__all__ = ["DOCUMENTS", "LOGS", "RECORD_FILES", "RunDirError", "latest", "name_dir", "open_run", "previous_of", "run_ids",
           "LATEST", "PREVIOUS"]

# What an invocation writes as whole documents: set aside in previous/<k>/ when --resume continues the
# run (with the numbered error files, error.1.txt, ...). The logs (metrics*.jsonl) are appended to.
DOCUMENTS = ("summary.json", "trace.json", "timeline.png", "error.txt", "workers.json", "summary.reference.json")
LOGS = ("metrics.jsonl", "metrics.reference.jsonl")
RECORD_FILES = DOCUMENTS + LOGS
ERROR_FILE_RE = re.compile(r"^error\.\d+\.txt$")
LATEST = "latest"
PREVIOUS = "previous"
ID_RE = re.compile(r"^(\d{8}-\d{6})(?:-(\d+))?$")


class RunDirError(ValueError):
    """A run directory that cannot be used (an unknown run id to resume)."""


def name_dir(job) -> Path:
    """`<run.output_dir>/<run.name>`: the directory every run of the name shares."""
    return Path(job.run.output_dir) / job.run.name


def run_ids(directory: Path) -> list[str]:
    """The run ids under a name directory, oldest first (by start time, then suffix).

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> for n in ("20261206-121503-10", "20261206-121503", "compile_cache", "20261206-121503-2"):
    ...     (d / n).mkdir()
    >>> run_ids(d)
    ['20261206-121503', '20261206-121503-2', '20261206-121503-10']
    """
    def key(name: str):
        m = ID_RE.match(name)
        return (m.group(1), int(m.group(2) or 1))

    try:
        names = [p.name for p in directory.iterdir() if p.is_dir() and not p.is_symlink() and ID_RE.match(p.name)]
    except FileNotFoundError:
        return []
    return sorted(names, key=key)


def latest(directory: Path) -> Optional[Path]:
    """The newest run's directory under a name directory: what `latest` names, else the last run id."""
    link = directory / LATEST
    target = None
    if link.is_symlink():
        target = os.readlink(link)
    elif link.is_file():
        target = link.read_text().strip()
    if target and ID_RE.match(Path(target).name) and (directory / Path(target).name).is_dir():
        return directory / Path(target).name
    ids = run_ids(directory)
    return directory / ids[-1] if ids else None


def open_run(job, resume: bool = False, run_id: Optional[str] = None, now: Optional[float] = None) -> Path:
    """The directory this run writes its record into, created (see the module docstring).

    Args:
      job: the JobConfig (`run.output_dir`, `run.name`).
      resume: continue the latest run's directory (or `run_id`'s) instead of starting one.
      run_id: with `resume`, the run to continue (a directory name under the name directory).
      now: the start time (seconds since the epoch; default: now), for the new directory's name.

    Raises:
      RunDirError: `run_id` names no run of this name.
    """
    base = private_dir(name_dir(job))
    if resume:
        if run_id is not None:
            if not ID_RE.match(run_id) or not (base / run_id).is_dir():
                have = ", ".join(run_ids(base)[-5:]) or "none"
                raise RunDirError(f"--run-id {run_id}: no run {run_id!r} in {base} (the newest: {have})")
            found: Optional[Path] = base / run_id
        else:
            found = latest(base)
        if found is not None:
            _set_aside(found)
            _point_latest(base, found.name)
            return private_dir(found)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    for k in range(1, 10_000):
        candidate = base / (stamp if k == 1 else f"{stamp}-{k}")
        try:
            candidate.mkdir(mode=0o700)
        except FileExistsError:
            continue
        break
    else:   # pragma: no cover - 10,000 runs of one name in one second
        raise RunDirError(f"{base}: no free run directory name for {stamp}")
    private_dir(candidate)
    _point_latest(base, candidate.name)
    return candidate


def previous_of(run: Path) -> list[str]:
    """The earlier invocations' set-aside records of a run directory, oldest first (`previous/<k>`).

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> for k in ("10", "2", "1"):
    ...     (d / PREVIOUS / k).mkdir(parents=True)
    >>> previous_of(d)
    ['previous/1', 'previous/2', 'previous/10']
    """
    prev = run / PREVIOUS
    if not prev.is_dir():
        return []
    return [f"{PREVIOUS}/{k}" for k in sorted((int(p.name) for p in prev.iterdir() if p.name.isdigit()))]


def _set_aside(run: Path) -> None:
    """Move the documents of the run's earlier invocation into `previous/<k>/`, unchanged (its
    metrics.jsonl stays: the resumed invocation appends to it)."""
    present = [run / f for f in DOCUMENTS if (run / f).exists()]
    present += sorted(p for p in run.iterdir() if ERROR_FILE_RE.match(p.name))
    if not present:
        return
    prev = private_dir(run / PREVIOUS)
    k = 1 + max((int(p.name) for p in prev.iterdir() if p.name.isdigit()), default=0)
    dest = private_dir(prev / str(k))
    for f in present:
        os.replace(f, dest / f.name)


def _point_latest(base: Path, name: str) -> None:
    """`latest` -> name, replaced atomically; a one-line file where symlinks are not available."""
    tmp = base / f".{LATEST}.{os.getpid()}"
    try:
        tmp.unlink(missing_ok=True)
        os.symlink(name, tmp)
    except OSError:          # no symlinks here (some Windows set-ups, some network file systems)
        tmp.unlink(missing_ok=True)
        tmp.write_text(name + "\n")
    os.replace(tmp, base / LATEST)
