"""Owner-only directories and files for runs and checkpoints, whatever the umask.

`mkdir(mode=0o700)` alone is not enough: the mode is masked by the umask, and
`parents=True` creates the parents with default permissions. `private_dir`
creates each missing component itself and `chmod`s it to 0o700 (directories
that already existed are left alone, so pointing `run.output_dir` at `/tmp`
never changes `/tmp`); `write_private` writes a file atomically with 0o600.

Example:
    >>> import tempfile, pathlib
    >>> d = private_dir(pathlib.Path(tempfile.mkdtemp()) / "runs" / "demo")
    >>> oct(d.stat().st_mode & 0o777), oct(d.parent.stat().st_mode & 0o777)
    ('0o700', '0o700')
    >>> oct(write_private(d / "summary.json", "{}").stat().st_mode & 0o777)
    '0o600'
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

__all__ = ["DIR_MODE", "FILE_MODE", "DiskFullError", "private_dir", "write_private", "append_private", "append_fd",
           "free_bytes"]

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(path: str | os.PathLike, *, tighten: bool = True) -> Path:
    """Create `path` (and missing parents) with mode 0o700; return it.

    Args:
      path: the directory.
      tighten: also set 0o700 on `path` itself if it already existed and this
        user owns it (a run directory from an earlier run); parents that
        already existed are never changed.

    Raises:
      OSError: a component cannot be created (or exists and is not a directory).
    """
    path = Path(path)
    missing = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=DIR_MODE)
        except FileExistsError:
            if not d.is_dir():
                raise
            continue  # created concurrently by someone else: not ours to chmod
        os.chmod(d, DIR_MODE)
    if not path.is_dir():
        raise NotADirectoryError(f"{path} exists and is not a directory")
    if tighten and not missing:
        st = path.stat()
        if st.st_uid == os.geteuid() and st.st_mode & 0o777 != DIR_MODE:
            os.chmod(path, DIR_MODE)
    return path


class DiskFullError(OSError):
    """A write ran out of space (ENOSPC / EDQUOT); the message names the file, the bytes it
    needed and what is free, and no partial or temporary file is left behind."""

    def __str__(self) -> str:   # the message alone, without OSError's "[Errno 28]" prefix
        return self.strerror or super().__str__()


def _full(e: OSError) -> bool:
    return e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes an unprivileged write may still use on the file system holding `path`."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def disk_full(path: Path, nbytes: int, e: OSError) -> DiskFullError:
    """The clear error for a write of `nbytes` to `path` that hit a full disk."""
    try:
        free = f"{free_bytes(path.parent)} bytes free"
    except OSError:
        free = "free space unknown"
    return DiskFullError(e.errno, f"no space left on the device writing {path} ({nbytes} bytes; {free}): "
                         f"{e.strerror}; free some space or point run.output_dir at another disk")


def write_private(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write `data` to `path` atomically (temp file + fsync + rename) with mode 0o600.

    Raises:
      DiskFullError: the disk (or quota) is full; neither the temporary file nor a partial
        `path` is left, and an existing `path` keeps its old content.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    raw = data.encode() if isinstance(data, str) else data
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), FILE_MODE)
    try:
        try:
            os.fchmod(fd, FILE_MODE)  # the mode passed to open() is masked by the umask; this is not
            with os.fdopen(fd, "wb") as f:
                fd = -1
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())  # a full disk shows here at the latest, not after the rename
        finally:
            if fd >= 0:
                os.close(fd)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError) and _full(e):
            raise disk_full(path, len(raw), e) from None
        raise
    return path


def append_private(path: str | os.PathLike, data: str | bytes) -> None:
    """Append `data` (e.g. one JSON line) to `path`, created 0o600; a full disk raises
    `DiskFullError` and truncates the file back to its length before the append."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0), FILE_MODE)
    try:
        append_fd(fd, path, data)
    finally:
        os.close(fd)


def append_fd(fd: int, path: str | os.PathLike, data: str | bytes) -> None:
    """Append `data` whole to the O_APPEND descriptor `fd` of file `path` (looping only on a
    short write); a full disk raises `DiskFullError` naming `path` and truncates the file back
    to its length before the append, so it never ends in a partial record."""
    raw = data.encode() if isinstance(data, str) else data
    start = os.fstat(fd).st_size
    try:
        view = memoryview(raw)
        while view:
            view = view[os.write(fd, view):]
    except OSError as e:
        if _full(e):
            os.ftruncate(fd, start)
            raise disk_full(Path(path), len(raw), e) from None
        raise
