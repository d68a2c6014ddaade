"""`import meshpipe`: the public API — cheap to import, documented, and doing what the CLI does.

- Importing it loads neither Ray nor JAX nor a model framework (a fresh process checks sys.modules).
- Every exported name resolves, has a docstring, and the docstring examples run (doctest).
- `meshpipe.run` gives each run its own directory as `meshpipe run` does (an earlier record
  is kept, `latest` names the newest), and trains a pipeline on Ray (`slow`) as the CLI does.
"""
from __future__ import annotations

import doctest
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs_blocks import ROOT

HEAVY = ("ray", "jax", "jaxlib", "flax", "equinox", "optax", "orbax", "orchestrator.driver", "stages.worker",
         "stages.program", "stages.transport")


def test_importing_meshpipe_loads_no_ray_jax_or_framework():
    code = ("import sys, json, meshpipe\n"
            f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == []


def test_the_check_would_see_a_heavy_import():
    code = "import sys, json, meshpipe, jax\nprint(json.dumps(sorted(m for m in ('jax',) if m in sys.modules)))\n"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert json.loads(r.stdout.strip().splitlines()[-1]) == ["jax"]


def test_every_public_name_resolves_and_is_documented():
    import meshpipe

    assert len(set(meshpipe.__all__)) == len(meshpipe.__all__)
    for name in meshpipe.__all__:
        obj = getattr(meshpipe, name)
        assert (obj.__doc__ or "").strip(), f"meshpipe.{name} has no docstring"


@pytest.mark.parametrize("module", ["meshpipe", "meshpipe._api"])
def test_the_docstring_examples_run(module, monkeypatch, tmp_path):
    import importlib

    monkeypatch.chdir(ROOT)
    mod = importlib.import_module(module)
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_run_again_gets_its_own_directory_and_replaces_nothing(tmp_path, monkeypatch):
    import meshpipe

    monkeypatch.chdir(ROOT)
    sets = ["run.steps=2", f"run.output_dir={tmp_path}"]
    first = meshpipe.run("examples/mlp.yaml", reference=True, overrides=sets, echo=lambda s: None)
    assert first["status"] == "completed" and len(first["losses"]) == 2
    first_record = (Path(first["run_dir"]) / "summary.reference.json").read_bytes()
    again = meshpipe.run("examples/mlp.yaml", reference=True, overrides=sets, overwrite=True, echo=lambda s: None)
    assert again["losses"] == first["losses"]       # same seed, same data: the same run
    assert again["run_dir"] != first["run_dir"] and Path(again["run_dir"]).parent == tmp_path / "mlp-tiny"
    assert (Path(first["run_dir"]) / "summary.reference.json").read_bytes() == first_record
    assert (tmp_path / "mlp-tiny" / "latest").resolve() == Path(again["run_dir"]).resolve()
    with pytest.raises(ValueError, match="run_id"):
        meshpipe.run("examples/mlp.yaml", reference=True, overrides=sets, run_id="x", echo=lambda s: None)


def test_run_and_plan_take_a_dict_and_report_bad_keys():
    import meshpipe
    from orchestrator.core.safe_yaml import safe_load_file

    job = safe_load_file(ROOT / "examples" / "gpt.yaml")
    job["data"]["path"] = str(ROOT / job["data"]["path"])
    p = meshpipe.plan(job, overrides=["pipeline.schedule=gpipe"])
    assert p.schedule.name == "gpipe" and "gpipe" in meshpipe.plan_text(p)
    job["pipeline"]["microbatches"] = 3          # 16 sequences do not split into 3 microbatches
    with pytest.raises(meshpipe.ConfigError, match="microbatches"):
        meshpipe.plan(job)


@pytest.mark.slow
def test_run_trains_a_pipeline_on_ray(tmp_path, monkeypatch):
    import meshpipe

    monkeypatch.chdir(ROOT)
    summary = meshpipe.run("examples/gpt.yaml", overrides=["run.steps=2", f"run.output_dir={tmp_path}"],
                           echo=lambda s: None)
    assert summary["status"] == "completed" and len(summary["losses"]) == 2
    assert json.loads((tmp_path / "gpt-tiny" / "latest" / "summary.json").read_text())["losses"] == summary["losses"]


def test_batches_are_windows_of_the_jobs_data_in_a_fixed_order(monkeypatch):
    """`meshpipe.batches`: each row a window of the text file's bytes, labels the next token,
    the same batch for the same step on every call, another batch at another step."""
    import meshpipe

    monkeypatch.chdir(ROOT)
    text = (ROOT / "examples/data/tiny_shakespeare_like.txt").read_bytes()
    first = list(meshpipe.batches("examples/gpt.yaml", steps=[0, 1]))
    again = list(meshpipe.batches("examples/gpt.yaml", steps=[1, 0]))
    assert len(first) == 2 and all(x.shape == (16, 32) == y.shape for x, y in first)
    for x, y in first:
        for row_x, row_y in zip(x, y):
            assert bytes(row_x.astype("uint8").tolist()) + bytes([int(row_y[-1])]) in text
            assert (row_x[1:] == row_y[:-1]).all()
    assert (first[0][0] == again[1][0]).all() and (first[1][1] == again[0][1]).all()
    assert not (first[0][0] == first[1][0]).all()
