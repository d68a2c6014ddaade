"""Checkpoint layout on disk, commit markers, and the checks a resume makes (pure: no ray, no jax).

A job's `checkpoint.dir` holds one directory per saved step (the step = steps done, so a
resume continues at that step index)::

    <dir>/step_00000020/stage_0/      orbax checkpoint of stage 0 (written by its hosts)
    <dir>/step_00000020/stage_1/
    <dir>/step_00000020/commit.json   the commit marker, written last, by the driver

Invariants:
  - A step counts only when its `commit.json` exists and reads back valid; the driver
    writes it (atomically: temp file + rename) after every host of every stage reported
    its save finished (`orchestrator.driver.checkpoint`). Anything else under `<dir>` —
    an orbax temp directory, a stage directory without a marker — is never restored
    from, and is deleted once a newer step commits (or when a resumed run starts).
  - The marker is JSON only (never pickle) and lists every file of the step with its
    size and sha256, so a missing or corrupted shard is refused by name before restore.
    Resuming the newest step (`--resume` / `--resume auto`) falls back over damaged newer
    steps to the newest intact one (`newest_intact`); the damaged directories are renamed
    `step_<N>.damaged` (`set_aside`), kept, and no longer count.
  - Each stored array has a model-wide name (`param_name`, e.g. `03.block2/wq`; optimizer
    leaves `opt:<path in the optimizer state>|<param name>`; mutable model state such as
    BatchNorm's running statistics `state:<layer>/<leaf path>`, `state_name`), with its global
    (logical) shape and dtype in the marker: the model check names the first parameter that
    differs (optimizer and mutable-state leaves are checked when a stage restores them by name).
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

FORMAT = "meshpipe-checkpoint/1"
MARKER = "commit.json"
PROBE = ".meshpipe-shared-probe"     # written by the driver, read back by every stage host
_STEP_RE = re.compile(r"^step_(\d{8})$")
_MARKER_KEYS = {"format": str, "step": int, "time": float, "run": str, "model": str, "layout": list,
                "stages": list, "arrays": dict, "losses": list, "seed": int, "data": dict, "bytes": int}

__all__ = ["FORMAT", "MARKER", "CheckpointError", "step_dir", "stage_dir", "file_table", "write_marker",
           "read_marker", "committed", "scan", "newest_intact", "set_aside", "select", "verify_files", "check_model", "layout_of", "stale_dirs",
           "gc_dirs", "opt_name", "state_name", "is_param_name", "PROBE", "check_probe"]


class CheckpointError(ValueError):
    """A checkpoint cannot be used (missing, another model, a damaged file); the message says which."""


def step_dir(root: Path | str, step: int) -> Path:
    """`<root>/step_<step, 8 digits>`."""
    return Path(root) / f"step_{step:08d}"


def stage_dir(root: Path | str, step: int, stage: int) -> Path:
    return step_dir(root, step) / f"stage_{stage}"


def opt_name(prefix: str, param: Optional[str]) -> str:
    """Name of an optimizer-state leaf: its path in the state, then the parameter it follows
    (`opt:0/mu|03.block2/wq`), or `*` for a leaf shared by all parameters (adam's `count`)."""
    return f"opt:{prefix}|{param if param is not None else '*'}"


def state_name(param: str) -> str:
    """Name of a mutable model-state leaf (not trained, e.g. BatchNorm's running mean), after the
    parameter-style name of its leaf: `state:02.bn/bn/mean`."""
    return f"state:{param}"


def is_param_name(name: str) -> bool:
    """A parameter's name (not an optimizer-state `opt:` or mutable-state `state:` leaf)."""
    return not name.startswith(("opt:", "state:"))


def file_table(directory: Path | str) -> dict[str, list]:
    """Every file under `directory`: relative path -> [size, sha256 hex]."""
    directory = Path(directory)
    out = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        out[str(path.relative_to(directory))] = [path.stat().st_size, _sha256(path)]
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_marker(root: Path | str, marker: Mapping[str, Any]) -> Path:
    """Validate `marker` and write it as `<step dir>/commit.json`, atomically (temp + rename)."""
    from orchestrator.core.private_fs import write_private

    _validate(dict(marker), "the marker to write")
    path = step_dir(root, marker["step"]) / MARKER
    write_private(path, json.dumps(marker, indent=1, sort_keys=True))
    return path


def read_marker(path: Path | str) -> dict:
    """Read and validate one `commit.json` (its step must match its directory's name)."""
    path = Path(path)
    try:
        marker = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable commit marker: {e}") from None
    if not isinstance(marker, dict):
        raise CheckpointError(f"{path}: commit marker is not a JSON object")
    _validate(marker, str(path))
    m = _STEP_RE.match(path.parent.name)
    if not m or int(m.group(1)) != marker["step"]:
        raise CheckpointError(f"{path}: marker step {marker['step']} does not match directory {path.parent.name}")
    return marker


def _validate(marker: dict, where: str) -> None:
    for key, typ in _MARKER_KEYS.items():
        if key not in marker:
            raise CheckpointError(f"{where}: commit marker lacks {key!r}")
        value = marker[key]
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) if typ is float else \
            isinstance(value, typ) and not (typ is int and isinstance(value, bool))
        if not ok:
            raise CheckpointError(f"{where}: commit marker {key!r} = {value!r} is not a {typ.__name__}")
    if marker["format"] != FORMAT:
        raise CheckpointError(f"{where}: format {marker['format']!r}, this meshpipe reads {FORMAT!r}")
    if marker["step"] < 1:
        raise CheckpointError(f"{where}: step {marker['step']} must be at least 1")
    for rec in marker["stages"]:
        if not isinstance(rec, dict) or not isinstance(rec.get("files"), dict) or \
                not isinstance(rec.get("path"), str) or not isinstance(rec.get("stage"), int):
            raise CheckpointError(f"{where}: stage record {str(rec)[:200]} lacks stage/path/files")
        p = Path(rec["path"])
        if p.is_absolute() or ".." in p.parts:
            raise CheckpointError(f"{where}: stage path {rec['path']!r} must be relative, without '..'")


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out)


def committed(root: Path | str) -> list[dict]:
    """Every committed checkpoint under `root`, oldest first (a step directory whose marker is
    missing does not count; one whose marker is unreadable raises, naming it)."""
    out = []
    for _, p in _step_dirs(Path(root)):
        if (p / MARKER).is_file():
            out.append(read_marker(p / MARKER))
    return out


def scan(root: Path | str) -> list[tuple[int, Optional[dict], Optional[str]]]:
    """Every step directory under `root` that holds a marker, oldest first: (step, the marker, None)
    when it reads back valid, (step, None, why) when it does not — unlike `committed`, which raises."""
    out = []
    for step, p in _step_dirs(Path(root)):
        if (p / MARKER).is_file():
            try:
                out.append((step, read_marker(p / MARKER), None))
            except CheckpointError as e:
                out.append((step, None, str(e)))
    return out


def newest_intact(root: Path | str) -> tuple[dict, list[tuple[int, str]]]:
    """The marker of the newest committed step that is intact — its marker reads back valid and every
    file it lists is there with its size and sha256 (`verify_files`) — and the newer steps that are
    not, newest first, each with why (what `--resume latest|auto` falls back over).

    Raises:
      CheckpointError: nothing is committed, or no committed step is intact (each one's damage named).
    """
    damaged: list[tuple[int, str]] = []
    for step, marker, why in reversed(scan(root)):
        if marker is not None:
            try:
                verify_files(root, marker)
                return marker, damaged
            except CheckpointError as e:
                why = str(e)
        damaged.append((step, why or "unreadable"))
    if not damaged:
        raise CheckpointError(f"--resume: no committed checkpoint in checkpoint.dir = {root}")
    raise CheckpointError(f"--resume: no intact committed checkpoint in checkpoint.dir = {root}: "
                          + "; ".join(f"step {s}: {why}" for s, why in damaged))


def set_aside(root: Path | str, step: int) -> Path:
    """Rename a damaged step directory to `step_<N>.damaged[.<k>]` (kept, never deleted: it no longer
    counts as a step, so a resumed run can commit step N again). Returns the new path."""
    src = step_dir(root, step)
    dst, k = src.with_name(src.name + ".damaged"), 1
    while dst.exists():
        k += 1
        dst = src.with_name(f"{src.name}.damaged.{k}")
    src.rename(dst)
    return dst


def select(root: Path | str, step: Optional[int] = None) -> dict:
    """The marker to resume from: the newest committed step, or `step` (which must be committed)."""
    found = committed(root)
    if not found:
        raise CheckpointError(f"--resume: no committed checkpoint in checkpoint.dir = {root}")
    if step is None:
        return found[-1]
    for marker in found:
        if marker["step"] == step:
            return marker
    steps = ", ".join(str(m["step"]) for m in found)
    raise CheckpointError(f"--resume {step}: no committed checkpoint of step {step} in {root} (committed: {steps})")


def verify_files(root: Path | str, marker: Mapping[str, Any]) -> None:
    """Every file the marker lists exists with its size and sha256, and no stage directory holds
    an unlisted file; raises CheckpointError naming the first file that is not so."""
    base = step_dir(root, marker["step"])
    for rec in marker["stages"]:
        directory = base / rec["path"]
        if not directory.is_dir():
            raise CheckpointError(f"checkpoint step {marker['step']}: stage directory {directory} is missing")
        for rel, (size, digest) in sorted(rec["files"].items()):
            path = directory / rel
            if not path.is_file():
                raise CheckpointError(f"checkpoint step {marker['step']}: file {path} is missing")
            if path.stat().st_size != size:
                raise CheckpointError(f"checkpoint step {marker['step']}: file {path} has "
                                      f"{path.stat().st_size} bytes, the marker says {size} (corrupted)")
            if _sha256(path) != digest:
                raise CheckpointError(f"checkpoint step {marker['step']}: file {path} does not match its "
                                      f"sha256 in the marker (corrupted)")
        extra = sorted(set(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())
                       - set(rec["files"]))
        if extra:
            raise CheckpointError(f"checkpoint step {marker['step']}: {directory / extra[0]} is not in the marker")


def check_model(marker: Mapping[str, Any], arrays: Mapping[str, Mapping[str, Any]]) -> None:
    """The checkpoint holds exactly these parameters with these shapes and dtypes (`arrays`:
    name -> {"shape", "dtype"}, as `orchestrator.driver.checkpoint.model_arrays` gives them);
    raises naming the first parameter (in model order) that is missing, extra or different."""
    saved = {k: v for k, v in marker["arrays"].items() if is_param_name(k)}
    for name, want in arrays.items():
        have = saved.get(name)
        if have is None:
            raise CheckpointError(f"checkpoint step {marker['step']} (model {marker['model']!r}) has no "
                                  f"parameter {name!r} of this model")
        if list(have["shape"]) != list(want["shape"]) or have["dtype"] != want["dtype"]:
            raise CheckpointError(f"checkpoint step {marker['step']} (model {marker['model']!r}): parameter "
                                  f"{name!r} is {have['dtype']}{list(have['shape'])}, this model's is "
                                  f"{want['dtype']}{list(want['shape'])}")
    extra = [n for n in saved if n not in arrays]
    if extra:
        raise CheckpointError(f"checkpoint step {marker['step']} (model {marker['model']!r}) has parameter "
                              f"{extra[0]!r}, which this model does not")


def layout_of(stages: Iterable[Any], schedule: str) -> list[dict]:
    """The layout a checkpoint records: per stage its layer chunks, mesh, layout and hosts."""
    return [{"stage": s.index, "chunks": [list(c) for c in s.chunks], "mesh": dict(s.mesh),
             "layout": {k: (list(v) if isinstance(v, tuple) else v) for k, v in dict(s.layout).items()},
             "hosts": len(s.hosts), "schedule": schedule} for s in stages]


def stale_dirs(root: Path | str, keep_steps: Iterable[int]) -> list[Path]:
    """Step directories under `root` that are not committed, except those in `keep_steps`
    (a save still being written)."""
    keep = set(keep_steps)
    return [p for step, p in _step_dirs(Path(root)) if step not in keep and not (p / MARKER).is_file()]


def gc_dirs(root: Path | str, keep: int, in_flight: Iterable[int] = ()) -> list[Path]:
    """What to delete after a commit: committed steps older than the newest `keep`, and uncommitted
    step directories older than the newest committed step (never one in `in_flight`)."""
    steps = [step for step, p in _step_dirs(Path(root)) if (p / MARKER).is_file()]
    if not steps:
        return []
    newest, flying = steps[-1], set(in_flight)
    old = [step_dir(root, s) for s in steps[:-keep]] if len(steps) > keep else []
    partial = [p for p in stale_dirs(root, flying) if int(p.name[5:]) < newest]
    return old + partial



def check_probe(root: Path | str, expected: str, who: str) -> None:
    """A stage host's check that it sees `checkpoint.dir` as the driver does: the probe file
    the driver wrote before the actors started must be here with the driver's random content.
    The driver verifies every stage's files and writes every commit, so the directory must be
    storage every host and the driver share (NFS, a FUSE-mounted bucket, ...).

    Raises:
      CheckpointError: the probe is missing or holds another run's content.
    """
    path = Path(root) / PROBE
    try:
        found = path.read_text()
    except OSError as e:
        raise CheckpointError(f"checkpoint.dir = {root}: {who} cannot read the driver's probe file {path} "
                              f"({type(e).__name__}): checkpoint.dir must be storage that the driver and "
                              "every host share (e.g. NFS or a mounted bucket), not a local disk") from None
    if found != expected:
        raise CheckpointError(f"checkpoint.dir = {root}: {who} sees another probe in {path} than the driver "
                              "wrote (another run, or a different disk at the same path): checkpoint.dir "
                              "must be storage that the driver and every host share")
