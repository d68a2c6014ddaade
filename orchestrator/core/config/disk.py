"""Checks of a job that touch the disk: the run's output directory and the checkpoint directory.

Basic flow: after `check_job` (`orchestrator.core.config.check`) passed and just before
anything starts, the runner calls `check_output_dir(job)` and, for a job with a
`checkpoint:` section, `check_checkpoint_dir(job, checkpoint_bytes(checked))`. Each creates
its directory if needed (components it creates are owner-only, `orchestrator.core.private_fs`),
writes and syncs WRITE_PROBE_BYTES there (`write_probe`), and compares the free space with
what the run will write there: `run_output_bytes`, or up to `checkpoint.keep + 1`
checkpoints of `checkpoint_bytes` each, less the step directories already there.

Invariants:
  - Pure layer: no Ray, no jax arrays; these functions and `write_probe` are the ones in
    `orchestrator.core.config` that touch the disk.
  - A problem raises `ConfigError` naming the key (`run.output_dir`, `run.name`,
    `checkpoint.dir`), the value and the rule; the first one ends the check, since the
    later checks depend on it.
"""
from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from orchestrator.core.config.errors import ConfigError, problem
from orchestrator.core.config.schema import JobConfig
from orchestrator.core.private_fs import free_bytes, private_dir

if TYPE_CHECKING:
    from orchestrator.core.config.check import Checked

__all__ = ["check_output_dir", "check_checkpoint_dir", "checkpoint_bytes"]

def write_probe(directory: Path) -> None:
    """Write and sync WRITE_PROBE_BYTES in `directory`, then remove them; OSError if it cannot.
    Real bytes: an empty file can be created on a full disk, a block cannot."""
    fd, tmp = tempfile.mkstemp(prefix=".meshpipe-write-test-", dir=directory)
    try:
        os.write(fd, b"\0" * WRITE_PROBE_BYTES)
        os.fsync(fd)
    finally:
        os.close(fd)
        os.unlink(tmp)


def free_or_none(directory: Path) -> Optional[int]:
    """Free bytes on `directory`'s file system, or None where the platform cannot say."""
    try:
        return free_bytes(directory)
    except OSError:
        return None


def check_output_dir(job: JobConfig) -> Path:
    """Make sure `<run.output_dir>` exists (created if needed, owner-only) and is writable.

    Returns the run directory `<output_dir>/<run.name>` (not created here).
    Touches the disk, so the runner calls it just before starting anything.

    Raises:
      ConfigError: the directory cannot be created or written, or the run path is a file.
    """
    out = Path(job.run.output_dir)
    run_dir = out / job.run.name
    try:
        private_dir(out, tighten=False)  # components it creates are 0o700; existing ones untouched
    except OSError as e:
        raise ConfigError(problem("run.output_dir", job.run.output_dir,
                                  f"cannot be created: {e.strerror or e}")) from None
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(problem("run.name", job.run.name, f"{run_dir} exists and is not a directory"))
    target = run_dir if run_dir.is_dir() else out
    key, value = ("run.name", job.run.name) if target == run_dir else ("run.output_dir", job.run.output_dir)
    try:
        write_probe(target)
    except OSError as e:
        raise ConfigError(problem(key, value, f"not writable: cannot write {WRITE_PROBE_BYTES} bytes in "
                                  f"{target}: {e.strerror or e}")) from None
    need = run_output_bytes(job)
    free = free_or_none(target)
    if free is not None and free < need:
        raise ConfigError(problem(key, value, f"not enough free space in {target}: {free:,} bytes free, "
                                  f"the run writes about {need:,} (summary, trace, timeline and a record "
                                  f"per step for {job.run.steps:,} steps)"))
    return run_dir


RUN_FIXED_BYTES = 8 << 20      # summary.json, trace.json (first + last steps), timeline.png
RUN_STEP_BYTES = 512           # per step: its loss and time in summary.json, a metrics record
WRITE_PROBE_BYTES = 64 << 10


def run_output_bytes(job: JobConfig) -> int:
    """About how many bytes a run writes into its run directory (an upper estimate)."""
    return RUN_FIXED_BYTES + RUN_STEP_BYTES * job.run.steps


CHECKPOINT_FIXED_BYTES = 1 << 20    # per checkpoint: commit marker, orbax metadata, data-loader state, RNG


def checkpoint_bytes(checked: "Checked") -> int:
    """About how many bytes one checkpoint of the run writes (an upper estimate): every
    parameter in its dtype, as much again per optimizer slot (adam: 2), the mutable model
    state, and `CHECKPOINT_FIXED_BYTES`.

    Example:
        >>> from orchestrator.core.config import check_job, load_job, load_cluster
        >>> ck = check_job(load_job("examples/mlp.yaml", ["checkpoint.dir=/tmp/x", "checkpoint.every_steps=5"]),
        ...                load_cluster("cluster_configs/local.yaml"))
        >>> checkpoint_bytes(ck) - CHECKPOINT_FIXED_BYTES == 4 * ck.model.param_count()   # sgd: no slots
        True
    """
    from orchestrator.core.edges import leaf_dtype
    from orchestrator.core.memory import optimizer_slots

    opt = checked.job.optimizer
    slots = (max(optimizer_slots(e.name, e.args) for e in opt.chain) if opt.chain is not None
             else optimizer_slots(opt.name, opt.args))
    params = state = 0
    for layer in checked.model.layers:
        params += sum(math.prod(d.shape) * leaf_dtype(d.dtype).itemsize for d in layer.params.values())
        state += sum(math.prod(d.shape) * leaf_dtype(d.dtype).itemsize for d in layer.state.values())
    return params * (1 + slots) + state + CHECKPOINT_FIXED_BYTES


def _steps_bytes(root: Path) -> int:
    """Bytes already in `root`'s step directories (they are deleted as newer steps commit)."""
    total = 0
    for step in root.glob("step_*"):
        for dirpath, _, files in os.walk(step):
            for name in files:
                try:
                    total += os.lstat(os.path.join(dirpath, name)).st_size
                except OSError:
                    pass
    return total


def check_checkpoint_dir(job: JobConfig, per_checkpoint: int = 0) -> Optional[Path]:
    """Make sure `checkpoint.dir` exists (created owner-only if needed), is writable and has
    room for the checkpoints the run keeps.

    `per_checkpoint`: the bytes one checkpoint writes (`checkpoint_bytes`). The older steps
    go only after a newer one commits, so up to `keep + 1` checkpoints are on the disk at
    once; the step directories already there count towards them. Returns the directory, or
    None when the job has no `checkpoint:` section. Touches the disk, so the runner calls it
    beside `check_output_dir`, before anything starts.

    Raises:
      ConfigError: the directory cannot be created, is a file, is not writable, or its disk
        has less free space than the checkpoints need.
    """
    if job.checkpoint is None:
        return None
    root = Path(job.checkpoint.dir)
    if root.exists() and not root.is_dir():
        raise ConfigError(problem("checkpoint.dir", job.checkpoint.dir, "exists and is not a directory"))
    try:
        private_dir(root, tighten=False)
        write_probe(root)
    except OSError as e:
        raise ConfigError(problem("checkpoint.dir", job.checkpoint.dir,
                                  f"not writable: cannot write {WRITE_PROBE_BYTES} bytes in {root}: "
                                  f"{e.strerror or e}")) from None
    keep = job.checkpoint.keep
    need = max(per_checkpoint, (keep + 1) * per_checkpoint - _steps_bytes(root))
    free = free_or_none(root)
    if free is not None and free < need:
        raise ConfigError(problem("checkpoint.dir", job.checkpoint.dir,
                                  f"not enough free space in {root}: {free:,} bytes free, the checkpoints need "
                                  f"about {need:,} more (checkpoint.keep {keep} + 1 being written, "
                                  f"{per_checkpoint:,} bytes each: parameters and optimizer state)"))
    return root
