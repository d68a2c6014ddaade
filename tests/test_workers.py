"""Which process is which (issue #38): the run's live workers.json, the metrics endpoint printed,
each restart printed once.

The trial's steps: while a run was live nothing said which `ray::StageWorker` process was
which stage and host; the metrics endpoint was not printed; the restart line printed twice
(the runner both echoed it and logged it as a warning, which Python's last-resort handler
prints to stderr: the terminal showed both).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrator.driver.workers import worker_lines, workers_record
from stages.hooks import WorkerHook
from tests.conftest import ROOT


def test_workers_record_joins_the_actors_with_the_node_table():
    info = [{"stage": 1, "host": 0, "pid": 12, "node_id": "n2", "devices": 2, "bundle": 1},
            {"stage": 0, "host": 0, "pid": 11, "node_id": "n1", "devices": 2, "bundle": 0}]
    nodes = [{"NodeID": "n1", "NodeManagerAddress": "10.0.0.5", "NodeManagerHostname": "a", "MetricsExportPort": 9},
             {"NodeID": "n2", "NodeManagerAddress": "10.0.0.6", "NodeManagerHostname": "b"}]
    doc = workers_record("r", info, nodes, 2)
    assert doc["restart"] == 2 and doc["namespace"] == "meshpipe-r"
    assert [(w["stage"], w["pid"], w["node_ip"], w["hostname"], w["metrics"]) for w in doc["workers"]] == [
        (0, 11, "10.0.0.5", "a", "http://10.0.0.5:9/metrics"), (1, 12, "10.0.0.6", "b", None)]
    assert worker_lines(doc) == ["stage 0 host 0: pid 11 on 10.0.0.5 (a)", "stage 1 host 0: pid 12 on 10.0.0.6 (b)"]
    many = workers_record("r", [{**info[0], "host": h} for h in range(10)], nodes, 0)
    assert len(worker_lines(many)) == 9 and worker_lines(many)[-1] == "... and 2 more"


def test_workers_docstring_examples_run():
    import doctest

    from orchestrator.driver import workers

    result = doctest.testmod(workers)
    assert result.attempted > 0 and result.failed == 0


@dataclass(frozen=True)
class SeeWorkers(WorkerHook):
    """At each step's start, each actor reads the run's workers.json (`<name dir>/latest/`) and
    writes `<out>/<pid>.json`: its own entry there and the file's `restart`."""

    name_dir: str
    out: str

    def on_step(self, cfg, step: int) -> None:
        doc = json.loads((Path(self.name_dir) / "latest" / "workers.json").read_text())
        mine = [w for w in doc["workers"] if (w["stage"], w["host"]) == (cfg.stage, cfg.host)]
        os.makedirs(self.out, exist_ok=True)
        Path(self.out, f"{os.getpid()}.json").write_text(json.dumps({"entry": mine, "restart": doc["restart"],
                                                                      "stage": cfg.stage, "host": cfg.host}))


SCRIPT = r"""
import json, sys
from orchestrator.driver import runner
from orchestrator.driver.cli import main
from tests.faults import FailStepOnce
from tests.test_workers import SeeWorkers

job, name_dir, seen, flag = sys.argv[1:5]
original = runner.run_job

def with_hooks(checked, **kw):        # `meshpipe run` as a user runs it, plus the test's hooks
    return original(checked, hooks=[FailStepOnce(1, 0, 5, flag), SeeWorkers(name_dir, seen)], **kw)

runner.run_job = with_hooks
main(["run", job])
"""


@pytest.mark.ray
@pytest.mark.slow
def test_workers_json_names_each_live_process_and_a_restart_prints_once(tmp_path):
    """`meshpipe run` (embedded Ray, 2 stages, a checkpoint every 2 steps, one restart allowed);
    stage 1 fails once at step 5, the run restarts from step 4 and completes. Each actor of each
    attempt finds itself in workers.json (its pid, its node's IP) while it runs, the file saying
    which attempt it describes; the restart line appears once in all the output; the metrics
    endpoint is printed."""
    import ray  # noqa: F401 - the marker's dependency

    from tests.test_checkpoint import gpt_job

    job = gpt_job(tmp_path, "who", tmp_path / "ck", steps=8)
    job["checkpoint"]["async"] = False
    job["failure"] = {"max_restarts": 1}
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job))
    name_dir, seen = tmp_path / "runs" / "who", tmp_path / "seen"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(path), str(name_dir), str(seen), str(tmp_path / "flag")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    both = r.stdout + r.stderr
    restarts = [ln for ln in both.splitlines() if "restart 1 of 1:" in ln]
    assert len(restarts) == 1, restarts
    assert "metrics (Prometheus text format) http://" in r.stdout
    doc = json.loads((name_dir / "latest" / "workers.json").read_text())
    assert doc["restart"] == 1 and len(doc["workers"]) == 2
    assert f"workers {name_dir / 'latest'}" not in r.stdout          # the real directory is printed
    assert f"workers {Path(os.path.realpath(name_dir / 'latest')) / 'workers.json'}" in r.stdout
    records = [json.loads(p.read_text()) for p in seen.glob("*.json")]
    assert {rec["restart"] for rec in records} == {0, 1}             # both attempts saw their own file
    for p in seen.glob("*.json"):
        rec = json.loads(p.read_text())
        (entry,) = rec["entry"]
        assert entry["pid"] == int(p.stem), rec                       # the process the file names is this one
        assert entry["actor"] == f"who/stage{rec['stage']}/host{rec['host']}" and entry["node_ip"] and entry["node_id"]
        assert entry["metrics"] and entry["metrics"].startswith(f"http://{entry['node_ip']}:")
    last = {(w["stage"], w["host"]): w["pid"] for w in doc["workers"]}
    assert all(json.loads((seen / f"{pid}.json").read_text())["restart"] == 1 for pid in last.values())
