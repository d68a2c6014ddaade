"""The README's checkpoint example as written — `checkpoint: {dir: ckpt/gpt-tiny, every_steps: 20,
keep: 2, async: true}`, a directory relative to where `meshpipe` runs — trains, commits, resumes
and exports through the CLI (it crashed at the first save with orbax's "Checkpoint path should be
absolute"; `meshpipe export` with relative paths printed a raw traceback). With its newest commit
damaged, `--resume auto` falls back to the older intact one that `keep: 2` kept, says so, keeps the
damaged directory aside, and continues bit-exactly (the resumed steps' losses equal the first run's).
"""
from __future__ import annotations

import json
import logging

import pytest
import yaml

from orchestrator.core import checkpoint as ck
from tests.conftest import ROOT

README_CHECKPOINT = {"dir": "ckpt/gpt-tiny", "every_steps": 20, "keep": 2, "async": True}
CLUSTER = {"hosts": 2, "devices_per_host": 2}


@pytest.mark.ray
@pytest.mark.slow
def test_readme_checkpoint_example_relative_dir_resume_fallback_and_export(tmp_path, monkeypatch, caplog, no_leaks):
    from click.testing import CliRunner

    from orchestrator.driver.cli import main

    job = yaml.safe_load((ROOT / "examples" / "gpt.yaml").read_text())
    job["checkpoint"] = dict(README_CHECKPOINT)
    job["run"]["steps"] = 40
    job["data"]["path"] = str(ROOT / job["data"]["path"])          # the example's text, from the repo
    monkeypatch.chdir(tmp_path)                                      # relative paths: from here
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    (tmp_path / "cluster.json").write_text(json.dumps(CLUSTER))
    caplog.set_level(logging.WARNING, logger="meshpipe")    # the CLI shows it on stderr (logging's last resort)

    def meshpipe(*args: str) -> str:
        r = CliRunner().invoke(main, list(args))
        assert r.exit_code == 0, r.output
        return r.output

    meshpipe("run", "job.yaml", "--cluster", "cluster.json")
    root = tmp_path / "ckpt" / "gpt-tiny"
    assert [m["step"] for m in ck.committed(root)] == [20, 40]
    first = json.loads((tmp_path / "runs" / "gpt-tiny" / "latest" / "summary.json").read_text())
    assert first["status"] == "completed" and len(first["losses"]) == 40

    shard = next(p for p in sorted(ck.stage_dir(root, 40, 1).rglob("*")) if p.is_file() and p.parent.name == "d")
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF                                       # the newest commit is damaged
    shard.write_bytes(bytes(raw))
    out = meshpipe("run", "job.yaml", "--cluster", "cluster.json", "--resume", "auto", "--set", "run.steps=60")
    said = caplog.text
    assert "checkpoint step 40 is damaged" in said and str(shard) in said and "step_00000040.damaged" in said, said
    assert "resuming from checkpoint step 20" in out, out
    resumed = json.loads((tmp_path / "runs" / "gpt-tiny" / "latest" / "summary.json").read_text())
    kept = json.loads((tmp_path / "runs" / "gpt-tiny" / "latest" / "previous" / "1" / "summary.json").read_text())
    assert kept == first                                             # the resumed run set it aside, unchanged
    assert resumed["status"] == "completed" and resumed["checkpoint"]["resumed_from"] == 20
    assert resumed["losses"][:40] == first["losses"]               # steps 20..39 again, bit-exact
    assert [m["step"] for m in ck.committed(root)] == [40, 60]      # 40 committed again; keep: 2
    assert (root / "step_00000040.damaged").is_dir()                # kept aside, never deleted

    out = meshpipe("export", "ckpt/gpt-tiny/step_00000060", "--to", "exported")
    assert "exported step 60" in out and (tmp_path / "exported" / "params").is_dir()
    assert json.loads((tmp_path / "exported" / "meshpipe.json").read_text())["step"] == 60


@pytest.mark.needs_checkpoint          # `meshpipe export` asks for orbax before it reads its paths
@pytest.mark.parametrize("case", ["not-a-checkpoint", "to-exists"])
def test_export_with_relative_paths_refuses_in_one_line_naming_the_absolute_path(tmp_path, monkeypatch, case):
    """The trial's step: `meshpipe export` with relative paths. What it cannot do is one line on
    stderr (exit 2) naming the path as resolved from the current directory, never a traceback."""
    from click.testing import CliRunner

    from orchestrator.driver.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt" / "step_00000002").mkdir(parents=True)
    (tmp_path / "exported").mkdir()
    if case == "to-exists":
        (tmp_path / "ckpt" / "step_00000002" / ck.MARKER).write_text("{}")
    r = CliRunner().invoke(main, ["export", "ckpt/step_00000002", "--to", "exported"])
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), (r.exit_code, r.output, r.exception)
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1, r.output
    want = (f"{tmp_path / 'ckpt' / 'step_00000002'}: not a committed checkpoint" if case == "not-a-checkpoint"
            else f"--to {tmp_path / 'exported'}: exists already")
    assert r.output.startswith("meshpipe: checkpoint: ") and want in r.output, r.output
