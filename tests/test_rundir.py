"""Run directories (issue #38): running a job again starts a run of its own; nothing is replaced.

The trial's step: `meshpipe run examples/gpt.yaml` a second time exited 2 ("the run directory
exists"). Pure tests of `orchestrator.driver.rundir` on real files, and the CLI's refusals
that come before Ray; the README command run twice end to end is
tests/test_cli.py::test_cli_run_on_embedded_ray_writes_summary[gpt].
"""
from __future__ import annotations

import calendar
import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from orchestrator.driver import rundir
from tests.test_cli import meshpipe

T0 = calendar.timegm((2026, 12, 6, 12, 35, 3))


def job(tmp_path: Path, name: str = "gpt-tiny"):
    return SimpleNamespace(run=SimpleNamespace(output_dir=str(tmp_path / "runs"), name=name))


def test_each_run_gets_its_own_sortable_directory_and_latest_names_the_newest(tmp_path):
    j = job(tmp_path)
    a = rundir.open_run(j, now=T0)
    b = rundir.open_run(j, now=T0)                 # the same second: a suffix
    c = rundir.open_run(j, now=T0 + 61)
    assert [a.name, b.name, c.name] == ["20261206-123503", "20261206-123503-2", "20261206-123604"]
    base = tmp_path / "runs" / "gpt-tiny"
    assert rundir.run_ids(base) == [a.name, b.name, c.name]
    assert (base / "latest").is_symlink() and os.readlink(base / "latest") == c.name
    assert rundir.latest(base) == c
    for d in (a, b, c, base):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert not [p for p in base.iterdir() if p.name.startswith(".")]      # no temp link left


def test_resume_continues_the_latest_run_and_sets_the_earlier_record_aside(tmp_path):
    """The earlier invocation's documents go to previous/<k>/; its metrics.jsonl stays where it is,
    for the resumed invocation to append to (issue #35: a resumed run appends to its record, the
    earlier lines kept in the same file; `orchestrator.driver.record`)."""
    j = job(tmp_path)
    first = rundir.open_run(j, now=T0)
    (first / "summary.json").write_text('{"status": "failed"}')
    (first / "metrics.jsonl").write_text('{"step": 0}\n')
    (first / "error.txt").write_text("boom")
    (first / "error.1.txt").write_text("boom again")
    (first / "compile_notes").write_text("not a record file")        # left where it is
    again = rundir.open_run(j, resume=True)
    assert again == first
    assert sorted(p.name for p in first.iterdir()) == ["compile_notes", "metrics.jsonl", "previous"]
    assert (first / "previous" / "1" / "summary.json").read_text() == '{"status": "failed"}'
    assert sorted(p.name for p in (first / "previous" / "1").iterdir()) == ["error.1.txt", "error.txt", "summary.json"]
    assert (first / "metrics.jsonl").read_text() == '{"step": 0}\n'
    assert rundir.previous_of(first) == ["previous/1"]
    (first / "summary.json").write_text('{"status": "interrupted"}')
    rundir.open_run(j, resume=True)
    assert (first / "previous" / "2" / "summary.json").read_text() == '{"status": "interrupted"}'
    assert (first / "previous" / "1" / "summary.json").read_text() == '{"status": "failed"}'    # kept


def test_resume_by_run_id_and_the_errors(tmp_path):
    j = job(tmp_path)
    old = rundir.open_run(j, now=T0)
    new = rundir.open_run(j, now=T0 + 5)
    assert rundir.open_run(j, resume=True, run_id=old.name) == old
    assert rundir.latest(old.parent) == old                     # latest follows the run continued
    with pytest.raises(rundir.RunDirError, match=r"--run-id 20990101-000000: no run .*the newest: "
                                                 rf"{old.name}, {new.name}"):
        rundir.open_run(j, resume=True, run_id="20990101-000000")
    with pytest.raises(rundir.RunDirError, match=r"--run-id \.\./x"):
        rundir.open_run(j, resume=True, run_id="../x")
    fresh = rundir.open_run(job(tmp_path, "other"), resume=True, now=T0)   # nothing to continue: a new run
    assert fresh.name == "20261206-123503"


def test_latest_falls_back_to_a_file_and_to_the_newest_id(tmp_path, monkeypatch):
    j = job(tmp_path)

    def no_symlinks(*a, **k):
        raise OSError("symlinks not supported here")

    monkeypatch.setattr(os, "symlink", no_symlinks)
    a = rundir.open_run(j, now=T0)
    base = a.parent
    assert (base / "latest").is_file() and (base / "latest").read_text() == f"{a.name}\n"
    b = rundir.open_run(j, now=T0 + 1)
    assert rundir.latest(base) == b
    (base / "latest").unlink()
    assert rundir.latest(base) == b                             # no pointer: the newest id


def test_cli_refuses_run_id_without_resume_and_says_overwrite_is_not_needed(tmp_path):
    out = meshpipe("run", "examples/mlp.yaml", "--run-id", "20261206-123503")
    assert out.returncode == 2 and "--run-id 20261206-123503: only with --resume" in out.stderr, out.stderr
    assert "RAY_IMPORTED=False" in out.stderr
    out = meshpipe("run", "examples/mlp.yaml", "--reference", "--overwrite", "--set", "run.steps=1",
                   "--set", f"run.output_dir={tmp_path}")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--overwrite is no longer needed" in out.stderr
    (run,) = rundir.run_ids(tmp_path / "mlp-tiny")
    assert f"run directory {tmp_path / 'mlp-tiny' / run}" in out.stdout
    assert (tmp_path / "mlp-tiny" / run / "summary.reference.json").is_file()
