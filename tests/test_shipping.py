"""`meshpipe submit` ships only what the job needs, and finds the cluster's dashboard (issue #38).

The trial's steps: submit shipped the whole job directory (20 MB of earlier runs and
checkpoints) and defaulted to the dashboard port an embedded Ray takes. Here: a job directory
as a user's looks after a few runs (runs/, a checkpoint, a venv, caches beside the job), real
files, real module scanning; the submission against a real Ray head is
tests/test_jobs.py::test_submit_succeeds_prints_how_to_follow_and_exits_with_the_outcome
(dashboard found from RAY_ADDRESS, one file shipped).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.core.config import check_job, load_cluster, load_job
from orchestrator.driver import jobs, ray_internals, shipping
from tests.conftest import ROOT

USER_MODEL = '''
import numpy as np                    # installed: not shipped
import helpers                        # beside it: shipped
from mypkg.layers import scale        # a local package: shipped with its __init__
from orchestrator.core.model.adapters import plain     # meshpipe itself: the cluster has it

from stages.models.mlp_impl import model as builtin_mlp


def spec(**args):
    helpers.touch()
    return builtin_mlp(**args)
'''


def user_tree(tmp_path: Path, data: bool = True) -> Path:
    """A job directory after a few runs: what must ship and what must not."""
    d = tmp_path / "proj"
    (d / "mypkg").mkdir(parents=True)
    (d / "mymodel.py").write_text(USER_MODEL)
    (d / "helpers.py").write_text("import mypkg\n\ndef touch():\n    return 1\n")
    (d / "mypkg" / "__init__.py").write_text("")
    (d / "mypkg" / "layers.py").write_text("def scale(x):\n    return x\n")
    (d / "unused.py").write_text("raise SystemExit('never imported')\n")
    for junk in ("runs/mine/20261206-121503/summary.json", "ck/step_00000002/commit.json",
                 ".venv/lib/python3.11/site-packages/big.so", "__pycache__/mymodel.cpython-311.pyc",
                 ".git/objects/ab/cdef"):
        (d / junk).parent.mkdir(parents=True, exist_ok=True)
        (d / junk).write_bytes(b"\0" * 100_000)
    job = yaml.safe_load((ROOT / "examples/mlp.yaml").read_text())
    job["model"]["name"] = "mymodel:spec"
    job["run"].update(steps=1, name="mine", output_dir=str(d / "runs"))
    (d / "job.yaml").write_text(yaml.safe_dump(job))
    return d


def checked_of(job: Path):
    from orchestrator.driver.cli import job_import_dir

    job_import_dir(str(job))
    return check_job(load_job(job), load_cluster(ROOT / "cluster_configs/local.yaml", overrides=["address=auto"]))


@pytest.fixture
def tree(tmp_path, monkeypatch):
    d = user_tree(tmp_path)
    monkeypatch.chdir(d)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("mymodel", "helpers", "mypkg", "mypkg.layers"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return d


def test_only_the_job_its_code_and_the_local_modules_it_imports_ship(tree):
    p = jobs.package(checked_of(tree / "job.yaml"), "job.yaml", None, (), "http://127.0.0.1:8265")
    assert [f for f, _ in p.shipment.files] == ["helpers.py", "job.yaml", "mymodel.py", "mypkg/__init__.py",
                                                 "mypkg/layers.py"]
    why = dict(p.shipment.files)
    assert why["mymodel.py"] == "model.name (code the job names)" and "imported by mymodel.py" in why["helpers.py"]
    assert p.shipment.nbytes == sum((tree / f).stat().st_size for f in why) < 5_000
    staged = shipping.stage(p.shipment)
    try:
        got = sorted(str(f.relative_to(staged)) for f in staged.rglob("*") if f.is_file())
        assert got == sorted(why) and all((staged / f).read_bytes() == (tree / f).read_bytes() for f in got)
    finally:
        import shutil

        shutil.rmtree(staged)


def test_data_files_ship_and_a_big_upload_is_refused_before_anything_is_sent(tree):
    (tree / "data").mkdir()
    (tree / "data" / "corpus.txt").write_text("hello world, " * 2000)
    job = yaml.safe_load((tree / "job.yaml").read_text())
    job["model"] = {"name": "gpt", "args": {"vocab": 128, "d_model": 16, "heads": 2, "d_mlp": 32, "blocks": 2}}
    job["data"] = {"source": "text", "path": "data/corpus.txt", "global_batch": 8, "seq_len": 8}
    job["pipeline"]["stages"] = [{"layers": [0, 2], "mesh": {"data": 2}}, {"layers": [2, 4], "mesh": {"data": 2}}]
    job["layout"] = {"batch": "data"}
    (tree / "job.yaml").write_text(yaml.safe_dump(job))
    checked = checked_of(tree / "job.yaml")
    p = jobs.package(checked, "job.yaml", None, (), "http://127.0.0.1:8265", include=("unused.py",))
    assert [f for f, _ in p.shipment.files] == ["data/corpus.txt", "job.yaml", "unused.py"]
    assert "--set data.path=data/corpus.txt" in p.entrypoint and not p.warnings
    with pytest.raises(jobs.JobsError, match=r"come to 25\.\d KiB, over the 10\.0 KiB limit.*biggest: "
                                             r"data/corpus.txt \(25\.\d KiB\).*absolute path") as e:
        jobs.package(checked, "job.yaml", None, (), "http://127.0.0.1:8265", limit_bytes=10 << 10)
    assert e.value.code == jobs.EXIT_CONFIG


@pytest.mark.needs_models          # the Llama factory imports flax before the import check is reached
def test_a_factory_the_cluster_could_not_import_is_refused_naming_the_working_dir(monkeypatch):
    """examples/llama.yaml names `examples.llama_model:pipeline`: shipped from examples/ (the job's
    directory) the module would not import on the cluster; the refusal names --working-dir."""
    monkeypatch.chdir(ROOT)
    checked = checked_of(ROOT / "examples/llama.yaml")
    with pytest.raises(jobs.JobsError, match=rf"imported from {ROOT}, which is not on the cluster's import path.*"
                                             rf"--working-dir {ROOT}"):
        jobs.package(checked, "examples/llama.yaml", None, (), "http://127.0.0.1:8265")
    p = jobs.package(checked, "examples/llama.yaml", None, (), "http://127.0.0.1:8265", working_dir=str(ROOT))
    files = [f for f, _ in p.shipment.files]
    assert "examples/llama_model.py" in files and "examples/llama.yaml" in files
    assert not [f for f in files if f.startswith(("orchestrator/", "stages/", "tests/", "runs/"))], files


def test_the_dashboard_is_found_not_assumed(monkeypatch):
    """The order `find_dashboard` asks in (its Ray lookups replaced by what a cluster would answer:
    the real ones run against a real head in tests/test_jobs.py)."""
    asked = []
    monkeypatch.setattr(ray_internals, "current_cluster", lambda: "10.0.0.9:6379")
    monkeypatch.setattr(ray_internals, "dashboard_of_gcs", lambda gcs: (asked.append(gcs) or f"http://{gcs[:-5]}:8265", ""))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert jobs.find_dashboard("10.0.0.5:8265") == ("http://10.0.0.5:8265", "--address / RAY_API_SERVER_ADDRESS")
    assert jobs.find_dashboard(None)[0] == "http://10.0.0.9:8265" and asked == ["10.0.0.9:6379"]
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.7:6379")
    url, how = jobs.find_dashboard(None)
    assert url == "http://10.0.0.7:8265" and how == "RAY_ADDRESS (GCS 10.0.0.7:6379)"
    monkeypatch.setenv("RAY_ADDRESS", "http://head:8265")
    assert jobs.find_dashboard(None) == ("http://head:8265", "RAY_ADDRESS")
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    with pytest.raises(jobs.JobsError, match="Ray Client address"):
        jobs.find_dashboard(None)
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setattr(ray_internals, "current_cluster", lambda: None)
    with pytest.raises(jobs.JobsError, match=r"no Ray cluster given or found: pass --address") as e:
        jobs.find_dashboard(None)
    assert e.value.code == jobs.EXIT_CONNECT
    monkeypatch.setattr(ray_internals, "current_cluster", lambda: "10.0.0.9:6379")
    monkeypatch.setattr(ray_internals, "dashboard_of_gcs", lambda gcs: (None, "no answer within 20 s"))
    with pytest.raises(jobs.JobsError, match=r"GCS 10\.0\.0\.9:6379, did not say where its dashboard is "
                                             r"\(no answer within 20 s\)"):
        jobs.find_dashboard(None)


def test_the_gcs_query_of_a_cluster_that_is_not_there_ends_within_its_deadline():
    import time

    t0 = time.monotonic()
    url, why = ray_internals.dashboard_of_gcs("127.0.0.1:1", timeout=20)
    assert url is None and why and time.monotonic() - t0 < 25
