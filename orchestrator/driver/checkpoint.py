"""The driver half of checkpoints: resume checks, the commit protocol, garbage collection, listing.

Basic flow (`orchestrator.driver.runner` calls it):
  1. `prepare(checked, resume)` — before any actor starts: with `--resume` pick the committed
     step (`orchestrator.core.checkpoint.select`), check it is this model (the first parameter
     whose shape/dtype differs is named), this seed, and that every file the marker lists is
     there with its size and sha256 (a missing or corrupted shard is refused by name); without
     it, refuse a `checkpoint.dir` that already holds committed steps. `--resume auto` is
     `--resume` when a step is committed and a fresh start when none is (what `meshpipe submit`
     runs, so that submitting the same job again continues it: Ray Jobs leaves retries to the
     submitter). Resuming the newest step falls back over damaged newer ones (a marker that
     does not read back, a file missing or not matching its sha256) to the newest intact one,
     saying so; the damaged directories are kept as `step_<N>.damaged`. `checkpoint.dir` is made
     absolute here, once (relative: from the current directory). Uncommitted step
     directories (an interrupted save) are deleted here. Returns what the workers get
     (`orchestrator.core.contract.CheckpointSpec`: where, how often, and the restore plan) and the
     step to start at.
  2. `Committer.add(reports)` with every step's results: each stage host reports its save
     finished (`stages.checkpoint`); when all hosts of all stages reported a step, the driver
     writes that step's one commit marker (atomic), and only then deletes what `keep` no
     longer covers (`gc_dirs`). A run killed before the marker leaves a directory that never
     counts.
  3. `listing(root)` for `meshpipe checkpoints` (step, time, size, layout).
  4. `export(step_dir, to)` for `meshpipe export`: one consolidated checkpoint of the whole
     model's parameters (no optimizer state) that a plain single-process JAX program restores
     without meshpipe: `<to>/params` (orbax PyTree {"params": [one nested dict per part]},
     numpy arrays, no shardings) and `<to>/meshpipe.json` (step, model, names, losses).
"""
from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import json
import logging
import os
import secrets
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from orchestrator.core.checkpoint import (FORMAT, MARKER, PROBE, CheckpointError, check_model, committed, gc_dirs,
                                          layout_of, newest_intact, scan, select, set_aside, stale_dirs, step_dir,
                                          verify_files, write_marker)
from orchestrator.core.contract import CheckpointSpec, RestorePlan
from orchestrator.core.model.spec import param_name

log = logging.getLogger("meshpipe")


def model_arrays(spec) -> dict[str, dict]:
    """Every parameter of the model: name -> {"shape", "dtype"} (model order)."""
    return {param_name(i, layer, path): {"shape": list(p.shape), "dtype": p.dtype}
            for i, layer in enumerate(spec.layers) for path, p in layer.params.items()}


@dataclass
class Prepared:
    spec: CheckpointSpec         # what the stages get (WorkerConfig.checkpoint)
    start: int                   # first step index to run
    losses: list = field(default_factory=list)    # per-step losses before `start` (from the marker)
    marker: Optional[dict] = None                  # the marker resumed from


def prepare(checked, resume) -> Optional[Prepared]:
    """Checks and plan for a run's checkpoints; `resume`: None, "latest", "auto" (the newest commit
    if there is one, else a fresh start) or a step number.

    Raises:
      CheckpointError: --resume without `checkpoint:`, nothing (or not that step) committed, another
        model or seed, a missing/corrupted file, a step at or past `run.steps`, or committed steps in
        the way (a fresh run over an old directory, or later steps than the one resumed).
    """
    job = checked.job
    ck = job.checkpoint
    if ck is None:
        if resume is not None:
            raise CheckpointError("--resume: the job has no `checkpoint:` section (checkpoint.dir, every_steps)")
        return None
    if importlib.util.find_spec("orbax") is None or importlib.util.find_spec("orbax.checkpoint") is None:
        raise CheckpointError(f"checkpoint.dir = {ck.dir}: checkpoints need orbax-checkpoint, which is not "
                              "installed: pip install 'meshpipe[checkpoint]' (or -e \".[checkpoint]\")")
    root = checkpoint_root(job)
    spec = CheckpointSpec(str(root), ck.every_steps, job.run.steps, ck.async_, secrets.token_hex(16))
    entries = scan(root)
    if resume == "auto":
        resume = "latest" if entries else None
    if resume is None:
        found = committed(root)
        if found:
            steps = ", ".join(str(m["step"]) for m in found)
            raise CheckpointError(f"checkpoint.dir = {ck.dir} holds committed checkpoints (steps {steps}): "
                                  "pass --resume to continue from one, or use another checkpoint.dir")
        _remove(stale_dirs(root, ()))
        return Prepared(spec, 0)
    damaged: list[tuple[int, str]] = []
    if resume == "latest":
        marker, damaged = newest_intact(root)       # every file verified; damaged newer steps listed
    else:
        marker = select(root, int(resume))
    step = marker["step"]
    later = [s for s, _, _ in entries if s > step and s not in dict(damaged)]
    if later:
        raise CheckpointError(f"--resume {step}: checkpoint.dir = {ck.dir} holds later committed steps "
                              f"({', '.join(map(str, later))}) this run would overwrite: resume the latest, "
                              "or move them away")
    if step >= job.run.steps:
        raise CheckpointError(f"--resume: checkpoint step {step} is not before run.steps = {job.run.steps}: "
                              "nothing left to train (raise run.steps)")
    if marker["seed"] != job.run.seed:
        raise CheckpointError(f"--resume: checkpoint step {step} was trained with run.seed = {marker['seed']}, "
                              f"this job has {job.run.seed} (the data and init would differ)")
    source = marker["data"].get("source")
    if source is not None and source != job.data.source:
        raise CheckpointError(f"--resume: checkpoint step {step} was trained on data.source = {source!r}, "
                              f"this job has {job.data.source!r} (the batches would differ)")
    check_model(marker, model_arrays(checked.model))
    if resume != "latest":            # (the newest is verified by newest_intact)
        verify_files(root, marker)
    for bad, why in damaged:       # kept under another name: a resumed run commits that step again
        aside = set_aside(root, bad)
        log.warning("--resume: checkpoint step %d is damaged (%s); it is kept as %s and the run resumes "
                    "from the newest intact one, step %d", bad, why, aside, step)
    _remove(stale_dirs(root, ()))
    spec = dataclasses.replace(spec, restore=RestorePlan.of_marker(str(root), marker))
    return Prepared(spec, step, list(marker["losses"]), marker)


def checkpoint_root(job) -> Path:
    """`checkpoint.dir` made absolute once, before anything starts: a relative one is read from the
    current directory, as every relative path of a job is (orbax needs absolute paths, and the stage
    actors may run elsewhere). Symlinks in it are kept: shared storage may be mounted differently on
    the hosts than on the driver."""
    return Path(os.path.abspath(job.checkpoint.dir))


def write_probe(prepared: Prepared) -> Path:
    """The file each stage host reads back at set-up (`core.checkpoint.check_probe`): proof that
    the hosts see the driver's checkpoint.dir. Removed by `remove_probe` once they all did."""
    root = Path(prepared.spec.root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / PROBE
    path.write_text(prepared.spec.probe)
    return path


def remove_probe(prepared: Optional[Prepared]) -> None:
    if prepared is not None:
        (Path(prepared.spec.root) / PROBE).unlink(missing_ok=True)


def _remove(paths) -> None:
    for p in paths:
        log.info("removing uncommitted checkpoint directory %s", p)
        shutil.rmtree(p, ignore_errors=True)


class CommitWriteError(OSError):
    """The driver could not write a commit marker into checkpoint.dir (errno, message, the marker's path)."""


class Committer:
    """Collects the hosts' save reports and commits each step once all `expected` hosts reported.

    Args:
      checked: the job (for the marker's run, model, layout, seed).
      schedule: the schedule's name (recorded in the layout).
      expected: stage hosts in the run (each reports every save).
      losses: the run's per-step losses so far; the marker of step N records losses[:N].
    """

    def __init__(self, checked, schedule: str, expected: int, losses: list):
        job = checked.job
        self.root, self.keep = checkpoint_root(job), job.checkpoint.keep
        self.base = {"format": FORMAT, "run": job.run.name, "model": checked.model.name, "seed": job.run.seed,
                     "layout": layout_of(checked.stages, schedule)}
        self.expected, self.losses = expected, losses
        self.pending: dict[int, list[dict]] = {}
        self.commits: list[dict] = []       # {step, blocking_s (max over hosts), bytes, commit_s}

    def add(self, reports: list[dict]) -> list[int]:
        """Take reports; write the marker of every step now complete. Returns the steps committed."""
        done = []
        for rec in reports:
            self.pending.setdefault(rec["step"], []).append(rec)
        for step in sorted(self.pending):
            recs = self.pending[step]
            if len(recs) < self.expected:
                continue
            if len(self.losses) < step:
                continue           # the step's own result has not arrived yet (cannot happen in order)
            del self.pending[step]
            self._commit(step, recs)
            done.append(step)
        return done

    def _commit(self, step: int, recs: list[dict]) -> None:
        t0 = time.perf_counter()
        primaries = sorted((r for r in recs if r["host"] == 0), key=lambda r: r["stage"])
        arrays: dict = {}
        for r in primaries:
            for name, meta in r["arrays"].items():
                arrays.setdefault(name, {"shape": meta["shape"], "dtype": meta["dtype"], "stage": r["stage"]})
        stages = [{"stage": r["stage"], "path": r["path"], "files": r["files"], "arrays": r["arrays"],
                   "array_bytes": r["bytes"]} for r in primaries]
        size = sum(f[0] for r in primaries for f in r["files"].values())
        marker = {**self.base, "step": step, "time": time.time(), "stages": stages, "arrays": arrays,
                  "losses": [float(x) for x in self.losses[:step]], "data": _data_state(step, recs),
                  "bytes": int(size), "array_bytes": int(sum(r["bytes"] for r in primaries))}
        try:
            write_marker(self.root, marker)
        except OSError as e:         # checkpoint.dir refused the marker: the run's STORAGE failure
            raise CommitWriteError(e.errno, f"writing the commit marker of step {step}: {e}",
                                   str(step_dir(self.root, step) / MARKER)) from e
        flying = list(self.pending)
        _remove(gc_dirs(self.root, self.keep, flying))
        self.commits.append({"step": step, "bytes": int(size), "array_bytes": marker["array_bytes"],
                             "blocking_s": max(r["blocking_s"] for r in recs),
                             "write_s": max(r["write_s"] for r in recs), "commit_s": time.perf_counter() - t0})

    def incomplete(self) -> list[int]:
        return sorted(self.pending)


def _data_state(step: int, recs: list[dict]) -> dict:
    """The data position a marker records: the loading hosts' loader state (source, seed,
    next_step, samples), which every loading host must agree on, and which is step N's."""
    states = [r["data"] for r in recs if r.get("data") is not None]
    if any(s != states[0] for s in states[1:]):
        raise CheckpointError(f"step {step}: the loading hosts disagree on the data position: {states}")
    state = {"next_step": step, **(states[0] if states else {})}
    if state["next_step"] != step:
        raise CheckpointError(f"step {step}: the loaders were at step {state['next_step']} when it was saved")
    return state


def describe_layout(layout: list[dict]) -> str:
    """`2 stages: [0,2) data=2 | [2,4) model=2` (chunks joined by '+')."""
    parts = []
    for s in layout:
        chunks = "+".join(f"[{a},{b})" for a, b in s["chunks"])
        mesh = ",".join(f"{k}={v}" for k, v in s["mesh"].items())
        parts.append(f"{chunks} {mesh}" + (f" x{s['hosts']} hosts" if s.get("hosts", 1) > 1 else ""))
    return f"{len(layout)} stages ({layout[0].get('schedule', '?') if layout else '?'}): " + " | ".join(parts)


def listing(root: Path | str) -> list[str]:
    """One line per committed checkpoint: step, UTC time, size, layout."""
    lines = []
    for m in committed(root):
        when = datetime.datetime.fromtimestamp(m["time"], datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        lines.append(f"step {m['step']:>7d}  {when}  {m['bytes'] / 1e6:10.3f} MB  {describe_layout(m['layout'])}")
    return lines


def export(ckpt: Path | str, to: Path | str) -> dict:
    """Consolidate committed checkpoint `ckpt` (a `step_<N>` directory) into `to` (must not exist).

    Every file is verified first (size, sha256). Each parameter is read whole on this host
    (orbax, as numpy) and saved as part `i`'s nested dict under its path (`03.head/unembed` →
    params[3]["unembed"]; list indices become string keys). Returns the description written
    to `<to>/meshpipe.json`.
    """
    import numpy as np
    from orchestrator.core.extras import MissingExtra, require

    try:
        ocp = require("orbax.checkpoint", "meshpipe export")
    except MissingExtra as e:
        raise CheckpointError(str(e)) from None

    from orchestrator.core.checkpoint import MARKER, is_param_name, read_marker
    from orchestrator.core.private_fs import private_dir, write_private

    ckpt, to = Path(os.path.abspath(ckpt)), Path(os.path.abspath(to))   # relative: from the current directory
    if not (ckpt / MARKER).is_file():
        raise CheckpointError(f"{ckpt}: not a committed checkpoint (no {MARKER}; pass a step_<N> directory)")
    if to.exists():
        raise CheckpointError(f"--to {to}: exists already (export writes a new directory)")
    marker = read_marker(ckpt / MARKER)
    verify_files(ckpt.parent, marker)
    names = sorted(n for n in marker["arrays"] if is_param_name(n))
    parts: dict[int, dict] = {}
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
        for rec in marker["stages"]:
            mine = {n: m for n, m in rec["arrays"].items() if is_param_name(n)}
            if not mine:
                continue
            item = {"arrays": {m["key"]: np.zeros(m["shape"], m["dtype"]) for m in mine.values()}}
            args = {"arrays": {m["key"]: ocp.RestoreArgs(restore_type=np.ndarray) for m in mine.values()}}
            got = ckptr.restore(ckpt / rec["path"], args=ocp.args.PyTreeRestore(item, restore_args=args,
                                                                                 partial_restore=True))
            for name, m in mine.items():
                layer, path = name.split("/", 1)
                node = parts.setdefault(int(layer.split(".", 1)[0]), {})
                *up, last = path.split("/")
                for k in up:
                    node = node.setdefault(k, {})
                node[last] = np.asarray(got["arrays"][m["key"]])
    if sorted(parts) != list(range(len(parts))):
        raise CheckpointError(f"{ckpt}: parts {sorted(parts)} are not 0..{len(parts) - 1}")
    private_dir(to)
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
        ckptr.save(to / "params", args=ocp.args.PyTreeSave({"params": [parts[i] for i in range(len(parts))]}))
    info = {"format": "meshpipe-export/1", "step": marker["step"], "model": marker["model"], "run": marker["run"],
            "names": names, "losses": marker["losses"], "layout": marker["layout"]}
    write_private(to / "meshpipe.json", json.dumps(info, indent=1))
    return info


__all__ = ["CheckpointError", "Committer", "export", "Prepared", "describe_layout", "listing", "model_arrays", "prepare"]
