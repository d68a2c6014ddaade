"""Every wait before Ray is up has a deadline (issue #35, item 8).

  - The job's own code (a model or grain data factory) is imported and called first in a child
    process within `cluster.timeouts.factory_s` (`orchestrator.driver.usercode`): one that blocks
    is killed and refused naming the key; one that ends its process early (`os._exit(0)`, in the
    factory or at import) is refused naming the key and the exit code — it made `meshpipe run`
    exit 0 in 4 s with no record before.
  - Connecting to a running Ray (`--address`) is bounded by `cluster.timeouts.connect_s`
    (`orchestrator.driver.connect`): `--address 127.0.0.1:1` retried for more than 5 minutes
    against the address Ray rewrote it to; now it fails in seconds naming both.
The CLI cases run `meshpipe` in a fresh interpreter (tests/test_cli.py's helper).
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import pytest

from orchestrator.core.config import ConfigError, load_job
from orchestrator.driver.usercode import STARTUP_S, guard
from tests.conftest import ROOT
from tests.test_cli import meshpipe

LLAMA = ROOT / "examples" / "llama.yaml"


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(ROOT)   # the child imports tests.bad_factories from here, as `meshpipe run` would


def _job(factory: str) -> list[str]:
    return [f"model.factory={factory}", "model.args={}"]


def _refused(job, timeout: float) -> tuple[str, float]:
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        guard(job, timeout)
    return str(e.value), time.monotonic() - t0


def test_a_model_factory_that_blocks_is_refused_at_the_deadline():
    factory = "tests.bad_factories:blocks"
    msg, took = _refused(load_job(LLAMA, _job(factory)), 6)
    assert f"model.factory = '{factory}': importing and calling it did not return within 6 s" in msg, msg
    assert "cluster.timeouts.factory_s" in msg
    assert took < 6 + STARTUP_S, took      # killed 6 s into the factory (the child's own start is not the job's)


@pytest.mark.parametrize("factory,where", [("tests.bad_factories:exits", "factory"),
                                           ("tests.bad_factory_module:pipeline", "import")])
def test_a_factory_that_ends_its_process_is_refused_naming_the_exit_code(factory, where):
    msg, _ = _refused(load_job(LLAMA, _job(factory)), 120)
    assert f"model.factory = '{factory}': the process importing and calling it ended with exit code 0 " \
           "before it returned" in msg, (where, msg)


def test_a_grain_data_factory_that_blocks_is_refused_naming_data_factory(tmp_path):
    pytest.importorskip("grain")
    sets = ["model.name=gpt", 'model.args={"vocab": 128, "d_model": 64, "heads": 4, "d_mlp": 256, "blocks": 2}',
            'data={"source": "grain", "factory": "tests.bad_factories:grain_blocks", "global_batch": 16, '
            '"seq_len": 32}']
    msg, _ = _refused(load_job(ROOT / "examples" / "gpt.yaml", sets), 8)
    assert "data.factory = 'tests.bad_factories:grain_blocks': importing and calling it did not return within 8 s" \
        in msg, msg


@pytest.mark.needs_models          # the Llama factory of examples/llama.yaml imports flax
def test_the_childs_problems_are_the_config_errors_check_job_gives():
    msg, _ = _refused(load_job(LLAMA, ["model.args.nope=1"]), 120)
    assert "model.factory = 'examples.llama_model:pipeline': the model factory failed: TypeError" in msg, msg


def _write_job(tmp_path, factory: str, name: str) -> str:
    import yaml

    job = yaml.safe_load(LLAMA.read_text())
    job["model"] = {"factory": factory, "args": {}}
    job["run"].update(output_dir=str(tmp_path / "runs"), name=name)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


def test_cli_run_with_a_factory_that_exits_or_blocks_exits_2_naming_it_before_ray(tmp_path):
    r = meshpipe("run", _write_job(tmp_path, "tests.bad_factories:exits", "exits"), timeout=300)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "model.factory = 'tests.bad_factories:exits'" in r.stderr and "exit code 0" in r.stderr, r.stderr
    assert "RAY_IMPORTED=False" in r.stderr
    t0 = time.monotonic()
    r = meshpipe("run", _write_job(tmp_path, "tests.bad_factories:blocks", "blocks"), "--set",
                 "cluster.timeouts.factory_s=5", timeout=300)
    assert r.returncode == 2 and "did not return within 5 s" in r.stderr, (r.returncode, r.stderr)
    assert "RAY_IMPORTED=False" in r.stderr and time.monotonic() - t0 < 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_address_where_nothing_listens_fails_in_seconds_naming_the_address_ray_tried(tmp_path):
    port = _free_port()        # bound and released: nothing listens there
    # asked in a fresh process as the CLI's is: in this one an earlier test's Ray may have
    # fixed the node address Ray rewrites 127.0.0.1 to
    tried = subprocess.run([sys.executable, "-c", "import sys; from orchestrator.driver.ray_internals "
                            f"import bootstrap_address; print(bootstrap_address('127.0.0.1:{port}'))"],
                           capture_output=True, text=True, timeout=120, cwd=ROOT, check=True).stdout.strip()
    t0 = time.monotonic()
    r = meshpipe("run", "examples/gpt.yaml", "--address", f"127.0.0.1:{port}", "--set",
                 f"run.output_dir={tmp_path}", "--set", "cluster.timeouts.connect_s=2", timeout=300)
    took = time.monotonic() - t0
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert f"cannot reach a Ray cluster at cluster.address = '127.0.0.1:{port}'" in r.stderr, r.stderr
    assert f"(Ray connects to {tried}" in r.stderr and "for 2 s (cluster.timeouts.connect_s)" in r.stderr
    assert took < 120, took
    summary = json.loads((tmp_path / "gpt-tiny" / "latest" / "summary.json").read_text())
    assert summary["status"] == "failed" and "cannot reach a Ray cluster" in summary["error"]


def test_cli_address_that_accepts_but_is_no_ray_gcs_fails_at_the_deadline(tmp_path):
    srv = socket.socket()
    srv.bind(("0.0.0.0", 0))      # Ray dials this machine's routable address, not loopback
    srv.listen(16)
    port, held, stop = srv.getsockname()[1], [], threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])         # accept and never answer
            except OSError:
                pass

    th = threading.Thread(target=accept, daemon=True)
    th.start()
    try:
        r = meshpipe("run", "examples/gpt.yaml", "--address", f"127.0.0.1:{port}", "--set",
                     f"run.output_dir={tmp_path}", "--set", "cluster.timeouts.connect_s=4", timeout=300)
    finally:
        stop.set()
        th.join(5)
        for c in held:
            c.close()
        srv.close()
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert f"connecting to Ray at cluster.address = '127.0.0.1:{port}'" in r.stderr, r.stderr
    assert "did not finish within 4 s" in r.stderr and "does not answer as a Ray GCS" in r.stderr
    assert "SIGTERM handler is not set" not in r.stderr
