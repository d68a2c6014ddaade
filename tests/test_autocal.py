"""`meshpipe plan --auto` on an uncalibrated cluster (issue #38).

The trial's step: `plan --auto` on the default (uncalibrated) cluster predicted 6.8 ms per step
against 243–433 ms measured, nothing said to calibrate, and the written plan kept the job's
run.name. Now it calibrates first (cached per cluster file and machine), or with
--no-calibrate says its figures are nominal; the plan it writes has its own run.name and
runs as written.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from orchestrator.core.config import load_cluster
from orchestrator.driver import autocal
from orchestrator.driver.cli import DEFAULT_CLUSTER
from tests import records
from tests.test_cli import meshpipe

# a search small enough to compile in seconds
SEARCH = ("--max-model", "2", "--microbatches", "4", "--top", "2")
FIGURES = {"device": {"tflops": 0.02, "memory_bandwidth_gbps": 5.0, "action_overhead_us": 900.0,
                      "transfer_overhead_us": 700.0},
           "links": {"host": {"bandwidth_gbps": 5.0, "latency_us": 50.0},
                     "dcn": {"bandwidth_gbps": 1.0, "latency_us": 200.0}}}


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture
def user_cache(tmp_path, monkeypatch):
    """The user cache dir of the CLI processes the test starts (never the real ~/.cache)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "meshpipe" / "calibrated"


def test_nominal_names_what_calibrate_measures_and_the_file_lacks(tmp_path):
    local = load_cluster(DEFAULT_CLUSTER)
    assert autocal.nominal(local) == ("device.tflops", "device.memory_bandwidth_gbps", "device.action_overhead_us",
                                      "links.host", "device.transfer_overhead_us", "links.dcn")
    full = tmp_path / "c.yaml"
    full.write_text(yaml.safe_dump({"hosts": 2, "devices_per_host": 2, **FIGURES}))
    assert autocal.nominal(load_cluster(full)) == ()
    one = tmp_path / "one.yaml"
    one.write_text(yaml.safe_dump({"hosts": 1, "devices_per_host": 2, "device": {"tflops": 1.0}}))
    assert autocal.nominal(load_cluster(one)) == ("device.memory_bandwidth_gbps", "device.action_overhead_us",
                                                  "links.host")


def test_the_cache_key_follows_the_file_and_the_machine():
    facts = autocal.host_facts()
    assert {"host", "cpu", "cpus", "jax", "meshpipe"} <= set(facts)
    base = autocal.cache_key(b"hosts: 2\n", facts)
    assert base == autocal.cache_key(b"hosts: 2\n", dict(facts))
    assert base != autocal.cache_key(b"hosts: 4\n", facts)
    assert base != autocal.cache_key(b"hosts: 2\n", {**facts, "jax": "0.0.0"})


@pytest.mark.slow          # plan --auto compiles layer programs (as tests/test_planner_compile.py)
def test_no_calibrate_says_the_figures_are_nominal_and_names_the_command(tmp_path, user_cache, profiles):
    out = tmp_path / "p.yaml"
    r = meshpipe("plan", "examples/mlp.yaml", "--auto", "--no-calibrate", "--out", str(out), "--cache-dir",
                 str(profiles), *SEARCH, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RAY_IMPORTED=False" in r.stderr                               # nothing measured, no Ray
    text = r.stdout + r.stderr
    assert "planning from NOMINAL figures" in text and "figures: NOMINAL platform defaults" in text
    assert f"meshpipe calibrate --cluster {DEFAULT_CLUSTER}" in text
    head = out.read_text().split("\nrun:")[0]
    assert "predicted from NOMINAL figures" in head and "NOMINAL platform defaults" in head
    assert yaml.safe_load(out.read_text())["run"]["name"] == "mlp-tiny-auto"
    assert not user_cache.exists() or not list(user_cache.iterdir())     # nothing cached
    rep = json.loads(meshpipe("plan", "examples/mlp.yaml", "--auto", "--no-calibrate", "--json", "--out",
                              str(tmp_path / "q.yaml"), "--cache-dir", str(profiles), *SEARCH, timeout=600).stdout)
    assert rep["calibration"]["source"] == "nominal" and "device.tflops" in rep["calibration"]["missing"]


@pytest.mark.ray
@pytest.mark.slow
def test_a_cached_calibration_is_used_and_the_written_plan_runs_as_written(tmp_path, user_cache, profiles):
    """A calibration of the default cluster on this machine in the cache (as `plan --auto` leaves
    one): planned from it without measuring; then `meshpipe run` of the written plan as it is."""
    user_cache.mkdir(parents=True)
    key = autocal.cache_key(Path(DEFAULT_CLUSTER).read_bytes(), autocal.host_facts())
    raw = yaml.safe_load(Path(DEFAULT_CLUSTER).read_text())
    (user_cache / f"{key}.yaml").write_text(yaml.safe_dump({**raw, **FIGURES}))
    out = tmp_path / "p.yaml"
    r = meshpipe("plan", "examples/mlp.yaml", "--auto", "--out", str(out), "--cache-dir", str(profiles), *SEARCH,
                 timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RAY_IMPORTED=False" in r.stderr                               # the cached figures: nothing measured
    assert f"cached at {user_cache / (key + '.yaml')}" in r.stdout + r.stderr
    assert "figures: measured by meshpipe calibrate" in r.stdout and "NOMINAL" not in r.stdout
    assert yaml.safe_load(out.read_text())["run"]["name"] == "mlp-tiny-auto"
    run = meshpipe("run", str(out), "--set", "run.steps=2", "--set", f"run.output_dir={tmp_path / 'runs'}",
                   timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = records.summary(tmp_path / "runs", "mlp-tiny-auto")
    assert summary["status"] == "completed" and len(summary["losses"]) == 2


@pytest.mark.ray
@pytest.mark.slow
def test_an_uncalibrated_cluster_is_calibrated_once_then_the_cache_is_used(tmp_path, user_cache, profiles):
    """A 2-host cluster file with no figures: the first `plan --auto` calibrates it (Ray), writes
    the cache and plans from it; the second plans from the cache without starting Ray; editing the
    file measures again (a new key)."""
    cluster = tmp_path / "c.yaml"
    cluster.write_text("hosts: 2\ndevices_per_host: 2\ncpus_per_host: 0.5\n")
    args = ("plan", "examples/mlp.yaml", "--auto", "--cluster", str(cluster), "--cache-dir", str(profiles), *SEARCH)
    first = meshpipe(*args, "--out", str(tmp_path / "a.yaml"), timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "calibrating it first" in first.stdout and "RAY_IMPORTED=True" in first.stderr
    (cached,) = user_cache.iterdir()
    assert autocal.nominal(load_cluster(cached)) == ()
    assert "figures: measured by meshpipe calibrate" in first.stdout
    second = meshpipe(*args, "--out", str(tmp_path / "b.yaml"), timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"cached at {cached}" in second.stdout and "RAY_IMPORTED=False" in second.stderr
    assert list(user_cache.iterdir()) == [cached]
    assert autocal.cache_key(cluster.read_bytes(), autocal.host_facts()) == cached.stem
    assert autocal.cache_key((cluster.read_text() + "pin_cpus: false\n").encode(), autocal.host_facts()) != cached.stem
