"""What a user sees (issue #23): the plan of interleaved schedules, stage errors with their
cause, the progress bar's width, stopping with Ctrl-C/SIGTERM, runs never overwritten
silently, a model factory beside the job file, and the everyday commands."""
from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from orchestrator.core.config import check_job, load_cluster, load_job
from orchestrator.core.plan import make_plan, plan_json, plan_text
from tests import records
from tests.conftest import ROOT

GPT, LOCAL = str(ROOT / "examples/gpt.yaml"), str(ROOT / "cluster_configs/local.yaml")
INTERLEAVED = ["pipeline.schedule=interleaved-1f1b", "pipeline.virtual_stages=2",
               "pipeline.stages.0.layers=[[0, 1], [2, 3]]", "pipeline.stages.1.layers=[[1, 2], [3, 4]]"]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}


def cli(*args, cwd=ROOT, timeout=180, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.driver.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=env or ENV)


# -- plan: interleaved ------------------------------------------------------------------------
def test_plan_of_an_interleaved_schedule_lists_every_chunk_and_every_edge():
    checked = check_job(load_job(GPT, INTERLEAVED), load_cluster(LOCAL))
    plan = make_plan(checked)
    js = plan_json(plan)
    m = checked.model
    s0, s1 = js["stages"]
    assert [c["layers"] for c in s0["chunks"]] == [[0, 1], [2, 3]]
    assert [c["layers"] for c in s1["chunks"]] == [[1, 2], [3, 4]]
    assert [c["virtual_stage"] for c in s0["chunks"] + s1["chunks"]] == [0, 2, 1, 3]
    assert s0["params"] == m.param_count(0, 1) + m.param_count(2, 3)       # every chunk counted
    assert s1["chunks"][1]["layer_names"] == [m.layers[3].name]
    # virtual stages 0→1→2→3: edges 0→1, 1→0 (last stage back to the first: chunk boundary), 0→1
    edges = js["edges"]
    assert [(e["edge"], e["virtual"], e["boundary"], e["wraps"]) for e in edges] == [
        ([0, 1], [0, 1], 1, False), ([1, 0], [1, 2], 2, True), ([0, 1], [2, 3], 3, False)]
    assert all(e["dtype"] == "float32" for e in edges)
    assert all(e["forward"]["cross_host_bytes"] == e["forward"]["lower_bound_bytes"] > 0 for e in edges)
    # costs ∝ the mean chunk of each stage, so stage 1's small head chunk lowers its cost
    per_stage = [(m.param_count(0, 1) + m.param_count(2, 3)) / 2, (m.param_count(1, 2) + m.param_count(3, 4)) / 2]
    assert [c["F"] for c in js["simulated"]["costs"]] == pytest.approx([x / max(per_stage) for x in per_stage])
    text = plan_text(plan)
    assert "chunk 1 (virtual stage 3) layers [3, 4)" in text
    assert "1→0 (virtual 1→2, layer 2, chunk boundary: last stage back to the first) float32" in text
    assert text.count("float32 (") == 3


@pytest.mark.parametrize("sets", [INTERLEAVED, []], ids=["interleaved", "1f1b"])
def test_plan_shows_the_edges_the_stage_workers_plan(sets):
    """The same edges as the workers' own rule (`stages.stage_io.plan_edges`, run on the configs the
    executor would hand them, no Ray): each cross-actor output edge of each chunk, and its input twin."""
    from types import SimpleNamespace

    from orchestrator.core.edges import planned_edges
    from orchestrator.driver.executor import PipelineExecutor
    from stages.stage_io import plan_edges

    checked = check_job(load_job(GPT, sets), load_cluster(LOCAL))
    plan = make_plan(checked)
    ex = PipelineExecutor(checked, plan.schedule, checked.data, "t", plan.eval_schedule)
    outs, ins = set(), set()
    for stage in checked.stages:
        cfg = ex.worker_config(stage, 0)
        expected = []      # what the worker tells its transport to expect: (edge, shape, dtype)
        edge_in, edge_out = plan_edges(cfg, SimpleNamespace(expect=lambda *a: expected.append(a)))
        assert expected and {str(d) for _, _, d in expected} == {"float32"}
        for c, (start, stop) in enumerate(cfg.layer_chunks):
            out_edge = edge_out[c][0][0] if edge_out[c] else None     # (Edge, shape, dtype) per leaf
            in_edge = edge_in[c][0][0] if edge_in[c] else None
            if out_edge is not None and out_edge.stage != stage.index:
                outs.add((stage.index, out_edge.stage, stop))
            if in_edge is not None and in_edge.stage != stage.index:
                ins.add((in_edge.stage, stage.index, start))
    planned = {(e.src, e.dst, e.boundary) for e in planned_edges(checked)}
    assert planned == outs == ins and len(planned) == len(planned_edges(checked))
    assert [(e["edge"][0], e["edge"][1], e["boundary"]) for e in plan_json(plan)["edges"]] == \
        [(e.src, e.dst, e.boundary) for e in planned_edges(checked)]


def test_plan_of_a_plain_schedule_is_unchanged_in_shape():
    js = plan_json(make_plan(check_job(load_job(GPT), load_cluster(LOCAL))))
    assert [e["edge"] for e in js["edges"]] == [[0, 1]] and not js["edges"][0]["wraps"]
    assert [len(s["chunks"]) for s in js["stages"]] == [1, 1]


def test_plan_png_prints_the_path_it_wrote(tmp_path):
    out = cli("plan", "examples/mlp.yaml", "--png", str(tmp_path / "t.png"), "--json")
    assert out.returncode == 0, out.stderr
    assert f"wrote {tmp_path / 't.png'}" in out.stderr and (tmp_path / "t.png").stat().st_size > 0
    json.loads(out.stdout)           # stdout stays JSON


# -- a stage's error as the driver shows it (a real RayTaskError, no cluster needed) ------------------
def test_stage_failure_names_where_and_keeps_the_stage_traceback_redacted():
    from ray.exceptions import RayTaskError

    from orchestrator.driver.waiting import stage_failure

    frames = "".join(f'  File "/srv/stages/worker.py", line {100 + i}, in f{i}\n    x = g{i}()\n' for i in range(30))
    tb = f"Traceback (most recent call last):\n{frames}IndexError: tuple index out of range (password=hunter2)\n"
    err = RayTaskError("StageWorker.run_steps", tb, IndexError("tuple index out of range (password=hunter2)"),
                       proctitle="ray::StageWorker.run_steps", pid=4242, ip="10.1.2.3").as_instanceof_cause()
    f = stage_failure("steps 0-3", "stage 1 host 0", err)
    short = str(f)
    assert short.splitlines()[0] == ("steps 0-3 failed on stage 1 host 0: "
                                     "IndexError: tuple index out of range (password=<redacted>)")
    assert "where: stage 1 host 0 (pid 4242, node 10.1.2.3, in StageWorker.run_steps)" in short
    assert 'line 129, in f29' in short and 'line 100, in f0' not in short      # nearest frames only
    assert len(short.splitlines()) <= 25 and "hunter2" not in short
    assert 'line 100, in f0' in f.detail and 'line 129, in f29' in f.detail and "hunter2" not in f.detail


# -- everyday commands (no Ray) ---------------------------------------------------------------
def test_version():
    out = cli("--version")
    assert out.returncode == 0 and re.fullmatch(r"meshpipe \S+\n", out.stdout), out.stdout + out.stderr


def test_cluster_keys_are_overridable_with_set():
    out = cli("plan", "examples/mlp.yaml", "--json", "--set", "cluster.hosts=3", "--set", "run.steps=2")
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["placement"]) == 3
    bad = cli("plan", "examples/mlp.yaml", "--set", "cluster.hosts=2")   # 3 stages need 3 hosts
    assert bad.returncode == 2 and "hosts" in bad.stderr


# -- bring your own model --------------------------------------------------------------------
FACTORY = '''
"""Models a user writes beside the job file (the driver and every actor import this module)."""
import dataclasses

import jax.numpy as jnp

from orchestrator.core.model.adapters import plain
from stages.models.mlp_impl import model as builtin_mlp


def spec(**args):
    """The built-in MLP, built by this module's factory (the actors must import it)."""
    return builtin_mlp(**args)


def broken(**args):
    """The built-in MLP with a bug inside stage 1's model code (block2), as a user would write one."""
    m = builtin_mlp(**args)
    part = next(p for p in m.parts if p.name == "block2")

    def apply(p, x, *, rng=None, train=True):
        if x.shape[0] > 2:     # plan time evaluates shapes at batch 2: only the actors reach this
            return x.shape[5]
        return part.apply(p, x, rng=rng, train=train)
    return dataclasses.replace(m, parts=tuple(dataclasses.replace(q, apply=apply) if q is part else q
                                              for q in m.parts))


def empty(**args):
    """Two identity parts: nothing to train."""
    def ident(p, x):
        return x
    return plain(lambda key: {"id0": {}, "id1": {}}, [("id0", ident), ("id1", ident)],
                 loss=lambda y, t: jnp.mean(jnp.square(y - t)), input=((8,), "float32"), label=((8,), "float32"))
'''


def _own_model_job(tmp_path, factory="mymodel:spec", steps=1, name="mine") -> Path:
    d = tmp_path / "job"
    d.mkdir(exist_ok=True)
    (d / "mymodel.py").write_text(FACTORY)
    job = yaml.safe_load((ROOT / "examples/mlp.yaml").read_text())
    job["model"]["name"] = factory
    job["run"].update(steps=steps, name=name, output_dir=str(tmp_path / "runs"))
    (d / "job.yaml").write_text(yaml.safe_dump(job))
    return d / "job.yaml"


def test_a_model_with_no_parameters_is_refused_at_plan_time(tmp_path):
    job = _own_model_job(tmp_path, "mymodel:empty")
    out = cli("plan", str(job), "--allow-code")     # also: mymodel imports without PYTHONPATH
    assert out.returncode == 2, out.stdout + out.stderr
    assert "model.name = 'mymodel:empty'" in out.stderr and "no parameters" in out.stderr


def test_a_factory_beside_the_job_file_plans_without_pythonpath(tmp_path):
    out = cli("plan", str(_own_model_job(tmp_path)), "--json", "--allow-code", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["model"] == "mymodel:spec"


def test_plan_refuses_a_job_that_names_code_unless_allowed(tmp_path):
    """`meshpipe plan` inspects job files: without --allow-code it never imports a factory they name."""
    marker = tmp_path / "ran"
    d = tmp_path / "evil"
    d.mkdir()
    (d / "evilmod.py").write_text(f"open({str(marker)!r}, 'w').write('x')\ndef spec(**kw):\n    raise SystemExit(0)\n")
    job = yaml.safe_load((ROOT / "examples" / "mlp.yaml").read_text())
    job["model"] = {"name": "evilmod:spec"}
    (d / "job.yaml").write_text(yaml.safe_dump(job))
    for extra in ([], ["--auto"]):
        out = cli("plan", str(d / "job.yaml"), *extra, cwd=d)
        assert out.returncode == 2, out.stdout + out.stderr
        assert "model.name = 'evilmod:spec'" in out.stderr and "--allow-code" in out.stderr, out.stderr
        assert not marker.exists(), f"plan {extra} imported the job's module"
    out = cli("plan", str(d / "job.yaml"), "--allow-code", cwd=d)
    assert marker.exists(), out.stderr                 # with the flag it does import (and the module exits 0)


# -- progress bar in a terminal of 80 columns --------------------------------------------------
def _in_pty(args: list[str], columns: int, timeout: float, env: dict | None = None) -> tuple[int, str]:
    """Run the CLI on a pseudo-terminal `columns` wide; (exit code, everything it printed)."""
    import fcntl
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.driver.cli", *args], cwd=ROOT,
                            stdin=slave, stdout=slave, stderr=slave, env=env or ENV, close_fds=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        r, _, _ = select.select([master], [], [], 0.5)
        if r:
            try:
                data = os.read(master, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    if proc.poll() is None:
        proc.kill()
    rc = proc.wait(timeout=30)
    os.close(master)
    return rc, b"".join(chunks).decode("utf-8", "replace")


def _screen_lines(text: str) -> list[str]:
    """What the terminal shows per redraw: split on newlines and carriage returns."""
    return [seg for line in text.split("\n") for seg in line.split("\r")]


@pytest.mark.ray
@pytest.mark.slow         # a whole CLI run (~23 s) for the line's width: the slow step
def test_progress_bar_fits_an_80_column_terminal(tmp_path):
    rc, text = _in_pty(["run", "examples/mlp.yaml", "--set", "run.steps=3", "--set",
                        f"run.output_dir={tmp_path}"], 80, 300,
                       env={**ENV, "RAY_AUTH_MODE": "token"})    # Ray 2.60's default; 2.52 needs it asked for
    assert rc == 0, text[-3000:]
    bars = [ln for ln in _screen_lines(text) if "3/3" in ln or "1/3" in ln]
    assert bars, text[-3000:]
    assert all(len(ln) <= 79 for ln in bars), [ln for ln in bars if len(ln) > 79]
    assert "loss" in bars[-1]
    # the run's first lines: the dashboard URL and how to get in with token auth
    url = re.search(r"Ray dashboard (http://127\.0\.0\.1:\d+)", text)
    assert url, text[:3000]
    assert "paste the output of `ray get-auth-token`" in text
    assert re.search(r"RAY_AUTH_MODE=token ray status --address 127\.0\.0\.1:\d+", text)
    assert f"RAY_AUTH_MODE=token ray list actors --address {url.group(1)}" in text


# -- a stage error, through the CLI: cause, traceback, error.txt in the run's directory -----------
@pytest.mark.ray
def test_a_stage_error_shows_where_and_its_traceback_and_leaves_its_record(tmp_path):
    """A bug in the user's model code on stage 1 (IndexError in block2's apply)."""
    job = _own_model_job(tmp_path, "mymodel:broken", steps=3, name="fails")
    out = cli("run", str(job), cwd=tmp_path, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    err = out.stderr
    assert "run failed:" in err and "IndexError: tuple index out of range" in err
    assert re.search(r"where: stage 1 host 0 \(pid \d+, node [\d.]+, in StageWorker\.\w+\)", err), err
    assert "stage traceback" in err and 'mymodel.py", line' in err and "x.shape[5]" in err  # the actor's frames
    assert "Traceback (most recent call last)" not in err                       # no driver traceback
    assert len(err.splitlines()) <= 40, err                                     # one screen
    run_dir = records.run_dir(tmp_path / "runs", "fails")
    full = (run_dir / "error.txt").read_text()
    assert "IndexError: tuple index out of range" in full and 'mymodel.py", line' in full
    assert len(full.splitlines()) > len(err.splitlines()) - 10                  # the whole traceback
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps_done"] == 0 and "IndexError" in summary["error"]
    assert f"run directory {run_dir}" in out.stdout                             # said before it started


@pytest.mark.ray
def test_a_factory_beside_the_job_file_trains_on_the_actors_without_pythonpath(tmp_path):
    job = _own_model_job(tmp_path, steps=1)
    out = cli("run", str(job), cwd=tmp_path, timeout=300)      # PYTHONPATH holds only the repository
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    summary = records.summary(tmp_path / "runs", "mine")
    assert summary["status"] == "completed" and len(summary["losses"]) == 1


# -- stopping ------------------------------------------------------------------------------
def _marked(mark: str) -> list[int]:
    """Pids of live processes whose environment carries MESHPIPE_TEST_MARK=mark (the run's Ray too)."""
    needle = f"MESHPIPE_TEST_MARK={mark}".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                zombie = (d / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
                if not zombie and needle in (d / "environ").read_bytes().split(b"\0"):
                    pids.append(int(d.name))
            except (OSError, IndexError):
                continue
    return pids


@pytest.mark.ray
@pytest.mark.parametrize("sig, executor", [
    (signal.SIGINT, "step_calls"),
    # ~25 s each: in the slow step, so the default suite stays near 15 min on 2 cores
    pytest.param(signal.SIGTERM, "step_calls", marks=pytest.mark.slow),
    pytest.param(signal.SIGINT, "compiled_graph", marks=pytest.mark.slow)])
def test_a_signal_stops_the_run_within_seconds_with_its_record(tmp_path, sig, executor):
    """Ctrl-C reaches the whole foreground process group (the driver and the Ray it started);
    SIGTERM is what `ray job stop` sends to the driver. Either: exit 130 within seconds, the step
    reached and the record's path printed, summary.json written, nothing left running — under a
    compiled graph too (its teardown waits for the actors' steps: they are told to abort first)."""
    from tests.conftest import wait_until

    mark = f"{os.getpid()}-{sig.name}-{executor}"
    env = {**ENV, "MESHPIPE_TEST_MARK": mark, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.driver.cli", "run", "examples/mlp.yaml",
                             "--set", "run.steps=100000", "--set", f"run.output_dir={tmp_path}",
                             "--set", f"cluster.executor={executor}",
                             "--set", "run.name=stopped"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        for line in proc.stdout:                       # wait for the first step line
            if line.startswith("step ") or time.monotonic() > deadline:
                break
        t0 = time.monotonic()
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)                   # what a terminal's Ctrl-C does
            time.sleep(0.5)
            os.killpg(proc.pid, sig)                   # a second, impatient Ctrl-C
        else:
            proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == 130, err[-3000:]
    assert took < 30, took
    what = "Ctrl-C (SIGINT)" if sig == signal.SIGINT else "SIGTERM"
    m = re.search(rf"meshpipe: stopped by {re.escape(what)} after (\d+) of 100000 steps; record: (\S+)", err)
    assert m, err[-3000:]
    record = records.run_dir(tmp_path, "stopped") / "summary.json"
    assert m.group(2) == str(record)
    summary = json.loads(record.read_text())
    assert summary["status"] == "interrupted" and summary["steps_done"] == int(m.group(1)) >= 1
    assert "Traceback" not in err, err[-3000:]           # neither the driver's nor a worker's
    assert "*** SIG" not in err and "PC: @" not in err    # no absl stack dump
    wait_until(lambda: not _marked(mark), 30, "the run's Ray processes to exit")


# -- noise -------------------------------------------------------------------------------------
FORK = ("import jax, os\njax.devices()\npid = os.fork()\nif pid == 0:\n    os._exit(0)\nos.waitpid(pid, 0)\n")


@pytest.mark.parametrize("how", ["loud", "driver", "actor"])
def test_jax_fork_warning_is_quiet_unless_asked(how):
    from orchestrator.driver.quiet import actor_env

    code, env = FORK, {**ENV}
    env.pop("PYTHONWARNINGS", None)
    env.pop("MESHPIPE_QUIET", None)
    if how == "driver":
        code = "from orchestrator.driver.quiet import quiet\nquiet()\n" + FORK
    elif how == "actor":     # what a stage actor gets in its runtime_env when the driver is quiet
        os.environ["MESHPIPE_QUIET"] = "1"
        try:
            env.update(actor_env())
        finally:
            del os.environ["MESHPIPE_QUIET"]
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert ("os.fork() was called" in out.stderr) == (how == "loud"), out.stderr


def test_gloo_and_fork_lines_forwarded_by_ray_are_dropped_unless_asked(monkeypatch):
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    from orchestrator.driver import quiet

    seen = []
    monkeypatch.setattr(dispatcher, "handlers", [("ray_print_logs", lambda data: seen.append(data["lines"]))])
    lines = ["\x1b[0m[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1",
             "/x/jax/_src/xla_bridge.py:164: RuntimeWarning: os.fork() was called. os.fork() is incompatible",
             "  self.pid = os.fork()", "stage 1: my own print"]
    monkeypatch.delenv("MESHPIPE_QUIET", raising=False)
    assert not quiet.filter_worker_logs()                      # -v: everything through
    dispatcher.emit({"lines": lines, "pid": 1, "is_err": True})
    monkeypatch.setenv("MESHPIPE_QUIET", "1")
    assert quiet.filter_worker_logs()
    dispatcher.emit({"lines": lines, "pid": 1, "is_err": True})
    assert seen == [lines, ["stage 1: my own print"]]


def test_a_compiled_graph_teardown_error_about_a_dead_actor_is_dropped_when_quiet(monkeypatch):
    """Ray logs "Error cancelling worker task" (two tracebacks) for each dead actor of a graph torn
    down; the driver names the death itself. Other errors of that logger still show."""
    import logging

    from ray.exceptions import ActorDiedError

    from orchestrator.driver import quiet

    import warnings

    monkeypatch.setenv("MESHPIPE_QUIET", "1")
    monkeypatch.setenv("RAY_IGNORE_UNHANDLED_ERRORS", "1")      # (quiet() sets both)
    graph_log = logging.getLogger(quiet.GRAPH_LOGGER)
    monkeypatch.setattr(graph_log, "filters", [])
    with warnings.catch_warnings():
        quiet.quiet()
        quiet.quiet()                                            # installed once
    assert len(graph_log.filters) == 1
    seen: list = []
    handler = logging.Handler()
    handler.emit = seen.append
    monkeypatch.setattr(graph_log, "handlers", [handler])     # (Ray's loggers do not propagate)
    monkeypatch.setattr(graph_log, "level", logging.INFO)
    for error in (ActorDiedError(), ValueError("not a death")):
        try:
            raise error
        except Exception:
            graph_log.exception("Error cancelling worker task")
    graph_log.info("Tearing down compiled DAG")
    assert [(r.getMessage(), r.exc_info and type(r.exc_info[1])) for r in seen] == [
        ("Error cancelling worker task", ValueError), ("Tearing down compiled DAG", None)]


@pytest.mark.needs_checkpoint      # the checkpoint step asks for orbax before it looks for commits
def test_a_refused_resume_makes_and_moves_nothing(tmp_path):
    """--resume with nothing committed: exit 2 naming checkpoint.dir before Ray starts, and the
    latest run directory is neither changed nor its record set aside (the checks come first)."""
    from tests.test_checkpoint import gpt_job

    path = tmp_path / "job.json"      # JSON is YAML
    path.write_text(json.dumps(gpt_job(tmp_path, "again", tmp_path / "ck")))
    run_dir = tmp_path / "runs" / "again" / "20261206-121503"
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text('{"status": "interrupted"}')
    resumed = cli("run", str(path), "--resume")
    assert resumed.returncode == 2, resumed.stderr
    assert "no committed checkpoint" in resumed.stderr and str(tmp_path / "ck") in resumed.stderr, resumed.stderr
    assert (run_dir / "summary.json").read_text() == '{"status": "interrupted"}'    # untouched
    assert sorted(p.name for p in (tmp_path / "runs" / "again").iterdir()) == ["20261206-121503"]


def test_quick_option_leaves_out_every_test_that_starts_ray():
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "--quick", "--co",
                          "tests/test_surface.py"], cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert out.returncode == 0, out.stdout + out.stderr
    ids = [ln for ln in out.stdout.splitlines() if ln.startswith("tests/")]
    assert "tests/test_surface.py::test_version" in ids
    assert not [i for i in ids if "signal_stops" in i or "progress_bar" in i or "trains_on_the_actors" in i]


def test_the_installed_command_imports_a_package_factory_from_the_working_directory(tmp_path):
    """`meshpipe plan jobs/job.yaml` naming `pkg.mymodel:spec`, run in the directory that holds
    the package (as `examples/llama.yaml` names `examples.llama_model:pipeline` from the repo root),
    through the console script (whose sys.path, unlike `python -m`'s, lacks the working
    directory) with no PYTHONPATH: it imports, as the CLI puts the working directory on the
    import path after the job's own directory."""
    import shutil

    exe = shutil.which("meshpipe", path=str(Path(sys.executable).parent))
    assert exe, "the meshpipe console script is not installed beside this interpreter"
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "mymodel.py").write_text(FACTORY)
    (tmp_path / "jobs").mkdir()
    job = yaml.safe_load((ROOT / "examples/mlp.yaml").read_text())
    job["model"]["name"] = "pkg.mymodel:spec"
    (tmp_path / "jobs" / "job.yaml").write_text(yaml.safe_dump(job))
    env = {k: v for k, v in ENV.items() if k != "PYTHONPATH"}
    out = subprocess.run([exe, "plan", "jobs/job.yaml", "--json", "--allow-code"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["model"] == "pkg.mymodel:spec"
