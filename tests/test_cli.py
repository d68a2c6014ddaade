"""The `meshpipe` command line: plan without Ray, bad input before anything starts, a real run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.core.config import check_job, load_cluster, load_job, parse_cluster, parse_job
from orchestrator.core.plan import make_plan, plan_json
from orchestrator.driver.runner import run_job
from orchestrator.driver.waiting import StageFailure
from tests.conftest import ROOT
from tests.faults import FailSetup, FailStep
from tests import records

CALL = ("import sys; from orchestrator.driver.cli import main\n"
        "try:\n    main(sys.argv[1:])\n"
        "except SystemExit as e:\n    code = e.code\n"
        "else:\n    code = 0\n"
        "print('RAY_IMPORTED=%s' % ('ray' in sys.modules), file=sys.stderr)\n"
        "sys.exit(code)\n")


def meshpipe(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the CLI in a fresh interpreter and report whether it imported ray."""
    return subprocess.run([sys.executable, "-c", CALL, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_plan_json_needs_no_ray_and_describes_the_job():
    out = meshpipe("plan", "examples/gpt.yaml", "--json")
    assert out.returncode == 0, out.stderr
    assert "RAY_IMPORTED=False" in out.stderr
    plan = json.loads(out.stdout)
    assert [s["mesh"] for s in plan["stages"]] == [{"data": 2}, {"model": 2}]
    assert [s["layers"] for s in plan["stages"]] == [[0, 2], [2, 4]]
    assert plan["stages"][0]["layout"] == {"batch": "data"}
    assert plan["schedule"]["name"] == "1f1b" and plan["schedule"]["microbatches"] == 4
    assert len(plan["schedule"]["grid"]) == 2
    assert 0 < plan["simulated"]["bubble_fraction"] < 1
    assert plan["simulated"]["peak_inflight"] == [2, 1]
    edge = plan["edges"][0]
    assert edge["forward"]["cross_host_bytes"] == edge["forward"]["lower_bound_bytes"] > 0
    # the same plan as computed in-process (what summary.json embeds)
    checked = check_job(load_job(str(ROOT / "examples/gpt.yaml")),
                        load_cluster(str(ROOT / "cluster_configs/local.yaml")))
    assert plan == json.loads(json.dumps(plan_json(make_plan(checked))))


def test_plan_text_shows_placement_grid_and_bubble():
    out = meshpipe("plan", "examples/mlp.yaml")
    assert out.returncode == 0, out.stderr
    for text in ("stage 0", "stage 2", "mesh model=2", "0F0", "2OPT", "bubble", "peak in-flight"):
        assert text in out.stdout


def test_bad_config_exits_2_before_ray(tmp_path):
    out = meshpipe("run", "examples/gpt.yaml", "--set", "pipeline.microbatchs=8")
    assert out.returncode == 2
    assert "pipeline.microbatchs" in out.stderr and "microbatches" in out.stderr
    assert "RAY_IMPORTED=False" in out.stderr


def test_mesh_not_matching_devices_rejected_before_ray():
    out = meshpipe("run", "examples/gpt.yaml", "--set", "pipeline.stages[1].mesh.model=4")
    assert out.returncode == 2
    assert "pipeline.stages[1].mesh" in out.stderr and "RAY_IMPORTED=False" in out.stderr


@pytest.mark.ray
@pytest.mark.parametrize("example, run_name", [
    ("examples/mlp.yaml", "mlp-tiny"),
    # the README's example (~50 s): CI's first step runs it as the README says; here in the slow step
    pytest.param("examples/gpt.yaml", "gpt-tiny", marks=pytest.mark.slow)])
def test_cli_run_on_embedded_ray_writes_summary(tmp_path, example, run_name):
    """The README's main command (and the MLP example), end to end through the CLI."""
    out = meshpipe("run", example, "--set", "run.steps=2", "--set", f"run.output_dir={tmp_path}", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("loss") >= 2
    summary = records.summary(tmp_path, run_name)
    assert f"run directory {summary['run_dir']}" in out.stdout       # where the record is, said up front
    assert len(summary["losses"]) == 2 and summary["mode"] == "pipeline"
    assert summary["status"] == "completed" and summary["steps_done"] == 2 and "error" not in summary
    recs = records.metrics(tmp_path, run_name)
    assert [r["step"] for r in recs] == [0, 1]
    assert [r["loss"] for r in recs] == summary["losses"]
    assert [r["step_time_s"] for r in recs] == summary["step_times_s"]
    # every stage actor's CPU affinity and thread count, as read back on the actor
    hosts = {(st["index"], h) for st in summary["plan"]["stages"] for h in range(len(st["hosts"]))}
    assert {(c["stage"], c["host"]) for c in summary["conditions"]} == hosts
    assert all(c["affinity"] and set(c["affinity"]) <= set(range(os.cpu_count())) and c["os_threads"] > 1
               for c in summary["conditions"]), summary["conditions"]
    if run_name != "gpt-tiny":
        return
    # the README's first command again: a run of its own beside the first, which stays as it was
    first = (Path(summary["run_dir"]) / "summary.json").read_text()
    again = meshpipe("run", example, "--set", "run.steps=2", "--set", f"run.output_dir={tmp_path}", timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    second = records.summary(tmp_path, run_name)
    assert records.run_ids_of(tmp_path, run_name) == [Path(summary["run_dir"]).name, Path(second["run_dir"]).name]
    assert (tmp_path / run_name / "latest").resolve() == Path(second["run_dir"]).resolve()
    assert (Path(summary["run_dir"]) / "summary.json").read_text() == first
    assert second["losses"] == summary["losses"]             # same job, same seed


@pytest.mark.ray
def test_failed_setup_names_stage_and_leaves_nothing(tmp_path, no_leaks):
    checked = check_job(parse_job(_mlp_job(tmp_path, "fails", 1, data=2)),
                        parse_cluster({"hosts": 4, "devices_per_host": 2}))
    with pytest.raises(StageFailure, match="stage 1 host 0.*injected setup failure"):
        run_job(checked, echo=lambda s: None, hooks=[FailSetup(stage=1, host=0)])


@pytest.mark.ray
@pytest.mark.parametrize("executor", ["step_calls", "compiled_graph", "action_calls"])
def test_failed_step_fails_fast_everywhere_and_leaves_nothing(tmp_path, no_leaks, executor):
    """Stage 1 raises at the start of step 2; stage 0, waiting for its tensors, is told at once
    (`abort_step`), so the run ends long before the 120 s step deadline, naming the cause. The
    run's record survives: metrics.jsonl has the steps the driver learnt of — 0 and 1 (step calls
    at 2 steps per call: the failing call is the second; one call per action), none with the
    compiled graph at its default 4 steps per call (steps 0-1 ran inside the failing call) —
    and summary.json says failed, why, and the losses so far."""
    import time

    checked = check_job(parse_job(_mlp_job(tmp_path, f"fails-{executor}", 6, data=1)), parse_cluster(
        {"hosts": 2, "devices_per_host": 1, "executor": executor, "timeouts": {"step_s": 120},
         **({"steps_per_call": 2} if executor == "step_calls" else {})}))
    t0 = time.monotonic()
    with pytest.raises(StageFailure, match="stage 1 host 0: injected step failure at step 2"):
        run_job(checked, echo=lambda s: None, hooks=[FailStep(stage=1, host=0, step=2)])
    assert time.monotonic() - t0 < 60
    run_dir = records.run_dir(tmp_path, f"fails-{executor}")
    recs = records.metrics(tmp_path, f"fails-{executor}")
    done = [] if executor == "compiled_graph" else [0, 1]
    assert [r["step"] for r in recs] == done
    summary = records.summary(tmp_path, f"fails-{executor}")
    assert summary["status"] == "failed" and summary["steps_done"] == len(done)
    assert "StageFailure" in summary["error"] and "injected step failure" in summary["error"]
    assert summary["losses"] == [r["loss"] for r in recs] and len(summary["losses"]) == len(done)
    assert summary["param_norms"] == {} and summary["mode"] == "pipeline"
    assert summary["telemetry"].get("measured_bubble_per_step", []) == [r["measured_bubble"] for r in recs]
    assert not [p.name for p in run_dir.iterdir() if "tmp" in p.name]   # no temp file left behind


def _mlp_job(tmp_path, name: str, steps: int, data: int) -> dict:
    """A 2-stage MLP job (1F1B, 2 microbatches), each stage mesh {data: data}."""
    return {
        "run": {"name": name, "steps": steps, "output_dir": str(tmp_path)},
        "model": {"name": "mlp", "args": {"blocks": 2}},
        "data": {"source": "synthetic", "global_batch": 8},
        "optimizer": {"name": "sgd", "args": {"learning_rate": 0.1}},
        "pipeline": {"schedule": "1f1b", "microbatches": 2,
                     "stages": [{"layers": [a, a + 2], "mesh": {"data": data}} for a in (0, 2)]},
        "layout": {"batch": "data"},
    }


@pytest.mark.ray
def test_json_stdout_keeps_forwarded_actor_lines_off_stdout(ray_local, capsys):
    """`calibrate --json` and `plan --auto --measure --json` print while Ray forwards the actors'
    output to this process's stdout: with --json those lines must land on stderr (a stray probe line
    once made the calibrate JSON unparseable), and without it they stay on stdout."""
    import ray

    from orchestrator.driver.cli import json_stdout
    from tests.conftest import wait_until

    @ray.remote(num_cpus=0)
    def speak(word: str) -> None:
        print(word, flush=True)

    capsys.readouterr()
    for as_json, word in ((False, "plain-mode-actor-line"), (True, "json-mode-actor-line")):
        seen = {"out": "", "err": ""}

        def arrived() -> bool:
            got = capsys.readouterr()
            seen["out"] += got.out
            seen["err"] += got.err
            return word in seen["out"] + seen["err"]

        with json_stdout(as_json) as echo:
            ray.get(speak.remote(word), timeout=60)
            wait_until(arrived, 30, f"Ray to forward {word!r}")
            echo('{"ok": 1}')
        arrived()
        if as_json:
            assert seen["out"] == '{"ok": 1}\n' and word in seen["err"], seen
        else:
            assert word in seen["out"] and '{"ok": 1}' in seen["out"], seen
