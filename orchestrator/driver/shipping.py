"""What `meshpipe submit` ships to the cluster: the files the job needs, nothing else.

A Ray Job's `working_dir` is zipped and uploaded whole. Shipping the job file's directory
sent earlier runs, checkpoints, virtual environments and caches with it (20 MB in a trial
where the job needed 20 kB). `needed_files` lists instead what the job reads:

  - the job file and the `--cluster` file;
  - each module of code the job names (`model.factory` / a `module:function` model name,
    `data.factory`), with the package `__init__.py` files above it and, recursively, the
    modules it imports that live in the same tree (`modulefinder`, the standard library's
    static import scan) — not meshpipe's own packages nor installed ones, which the
    cluster has;
  - the data: `data.path` (a file or a directory of token shards), `data.eval.path`,
    `data.tokenizer`;
  - `--include` paths (a file the code opens itself, which no scan can see).

Every path must lie inside the working dir (the job file's directory or `--working-dir`),
keeping its place relative to it: the entrypoint runs there. `stage` copies the files into
a fresh temporary directory, which is what is uploaded (and removed after). The total is
printed; above `WARN_BYTES` a warning says what is big, above the limit (`--max-upload-mb`,
default `LIMIT_BYTES`) the submission is refused before anything is sent: large data
belongs on storage the cluster reads, named by an absolute `data.path`.
"""
from __future__ import annotations

import modulefinder
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

__all__ = ["Shipment", "ShippingError", "check_size", "needed_files", "stage", "size_text", "LIMIT_BYTES",
           "WARN_BYTES"]

LIMIT_BYTES = 100 << 20
WARN_BYTES = 10 << 20
OWN_PACKAGES = frozenset({"orchestrator", "stages", "meshpipe"})   # the cluster's installed meshpipe


class ShippingError(ValueError):
    """A file the job needs cannot be shipped (outside the working dir, missing, too big)."""


@dataclass(frozen=True)
class Shipment:
    """The files of a submission: `files` relative to `root` (posix), each with why it goes."""

    root: Path
    files: tuple[tuple[str, str], ...]       # (relative path, why)
    nbytes: int

    def listing(self, most: int = 8) -> str:
        names = [f for f, _ in self.files]
        return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def size_text(n: int) -> str:
    """`1536` -> '1.5 KiB'.

    >>> size_text(512), size_text(1536), size_text(3 << 20)
    ('512 B', '1.5 KiB', '3.0 MiB')
    """
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def _code_files(module: str, root: Path, import_roots: Iterable[Path]) -> list[tuple[Path, str]]:
    """The file of `module` (dotted), its packages' __init__ files and the modules it imports from the
    same import root, recursively; ShippingError when it does not come from one of `import_roots`."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError) as e:
        raise ShippingError(f"cannot find module {module!r}: {e}") from None
    if spec is None or not spec.origin or not spec.has_location:
        raise ShippingError(f"cannot find the file of module {module!r}")
    origin = Path(spec.origin).resolve()
    depth = module.count(".") + (2 if origin.name == "__init__.py" else 1)
    base = origin.parents[depth - 1]
    roots = [r.resolve() for r in import_roots]
    if base not in roots:
        raise ShippingError(f"module {module!r} is imported from {base}, which is not on the cluster's import path "
                            f"(the working dir {root} or the job file's directory): pass --working-dir {base}")
    finder = modulefinder.ModuleFinder(path=[str(base)])
    finder.run_script(str(origin))
    out = [(origin, "code the job names")]
    for name, mod in finder.modules.items():
        f = getattr(mod, "__file__", None)
        if not f or name == "__main__" or name.split(".")[0] in OWN_PACKAGES:
            continue
        out.append((Path(f).resolve(), f"imported by {origin.name}"))
    parts = module.split(".")
    for i in range(1, len(parts)):            # the packages above the module
        init = base.joinpath(*parts[:i], "__init__.py")
        if init.is_file():
            out.append((init.resolve(), f"package of {module}"))
    return out


def needed_files(checked, job_path: str, cluster_path: Optional[str], working_dir: Path,
                 include: Iterable[str] = ()) -> Shipment:
    """The files the job needs, relative to `working_dir` (module docstring).

    Raises:
      ShippingError: a needed file is outside `working_dir` or missing.
    """
    from orchestrator.core.config.check import job_code

    root = Path(working_dir).resolve()
    job = checked.job
    found: dict[Path, str] = {}

    def add(path: Path, why: str) -> None:
        path = Path(path).resolve()
        if not path.exists():
            raise ShippingError(f"{why}: {path} does not exist")
        if path.is_dir():
            for sub in sorted(p for p in path.rglob("*") if p.is_file()):
                add(sub, why)
            return
        try:
            path.relative_to(root)
        except ValueError:
            raise ShippingError(f"{why}: {path} is outside the working dir {root} that the job ships to the "
                                "cluster; pass --working-dir with a directory that holds both (e.g. "
                                "--working-dir .)") from None
        found.setdefault(path, why)

    add(Path(job_path), "the job file")
    if cluster_path:
        add(Path(cluster_path), "the cluster file")
    job_dir = Path(job_path).resolve().parent
    for key, ref in job_code(job):
        module = str(ref).partition(":")[0]
        for path, why in _code_files(module, root, [root, job_dir]):
            if not any(part in ("site-packages", "dist-packages") for part in path.parts):
                add(path, f"{key} ({why})")
    d = job.data
    paths = [] if d.path is None else ([d.path] if isinstance(d.path, str) else list(d.path))
    for p in paths:
        add(Path(p), "data.path")
    if d.eval is not None and d.eval.path is not None:
        for p in [d.eval.path] if isinstance(d.eval.path, str) else list(d.eval.path):
            add(Path(p), "data.eval.path")
    if d.tokenizer:
        add(Path(d.tokenizer), "data.tokenizer")
    for p in include:
        add(Path(p), "--include")
    files = tuple(sorted((path.relative_to(root).as_posix(), why) for path, why in found.items()))
    return Shipment(root, files, sum((root / f).stat().st_size for f, _ in files))


def stage(shipment: Shipment, prefix: str = "meshpipe-submit-") -> Path:
    """Copy the shipment's files into a new temporary directory (same relative layout); the caller
    removes it (`shutil.rmtree`) once the submission uploaded it."""
    dest = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        for rel, _ in shipment.files:
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(shipment.root / rel, target)
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    return dest


def check_size(shipment: Shipment, limit: int = LIMIT_BYTES) -> list[str]:
    """Warnings for a big shipment; ShippingError above `limit` (naming the biggest files)."""
    sizes = sorted(((os.path.getsize(shipment.root / f), f) for f, _ in shipment.files), reverse=True)
    biggest = ", ".join(f"{f} ({size_text(n)})" for n, f in sizes[:3])
    if shipment.nbytes > limit:
        raise ShippingError(f"the job's files come to {size_text(shipment.nbytes)}, over the {size_text(limit)} "
                            f"limit of an upload (--max-upload-mb); biggest: {biggest}. Put large data where the "
                            "cluster reads it (shared storage) and point data.path at it with an absolute path")
    if shipment.nbytes > WARN_BYTES:
        return [f"the job's files come to {size_text(shipment.nbytes)} (biggest: {biggest}); every submission "
                "uploads them: data the cluster can read in place need not travel (an absolute data.path)"]
    return []

