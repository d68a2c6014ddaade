"""Config layer: good configs round-trip; every bad input names its key path, value and rule.

Pure tests (no Ray, no jax arrays). Each bad-input case asserts that the
ConfigError message contains the key path, the offending value and a keyword of
the rule broken. `test_bad_input_suite_under_python_O` reruns this file, the
YAML loader tests and tests/test_bad_input.py under `python -O` to prove no
check relies on `assert`.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.core.config import (Checked, ClusterConfig, ConfigError, StagePlan,
                                 apply_overrides, check_job, check_output_dir, load_cluster,
                                 load_job, parse_cluster, parse_job)
from orchestrator.core.config import check as check_mod

REPO = Path(__file__).resolve().parents[1]
GPT = REPO / "examples" / "gpt.yaml"
MLP = REPO / "examples" / "mlp.yaml"
LOCAL = REPO / "cluster_configs" / "local.yaml"
SIM = REPO / "cluster_configs" / "sim-multinode.yaml"


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)  # example data paths are relative to the repo root


@pytest.fixture(scope="module")
def local() -> ClusterConfig:
    return load_cluster(LOCAL)


def raw(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def error_of(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as ei:
        fn(*args, **kwargs)
    msg = str(ei.value)
    assert "\n" not in msg or "configuration problems" in msg  # one line per problem
    return msg


def has_all(msg: str, *needles: str) -> None:
    missing = [n for n in needles if n not in msg]
    assert not missing, f"{missing} not in message:\n{msg}"


# ----------------------------------------------------------------------------- good configs

def test_examples_load_and_check(local):
    for path, n_stages, mb in ((GPT, 2, 4), (MLP, 3, 8)):
        job = load_job(path)
        checked = check_job(job, local)
        assert isinstance(checked, Checked)
        assert len(checked.stages) == n_stages and checked.microbatch_size == mb
        assert all(isinstance(s, StagePlan) for s in checked.stages)
        assert parse_job(job.to_dict()) == job
        assert checked.to_dict()["stages"][0]["hosts"] == [0]


def test_gpt_example_plan(local):
    checked = check_job(load_job(GPT), local)
    s0, s1 = checked.stages
    assert (s0.layers, s0.hosts, s0.mesh, s0.devices_per_host) == ((0, 2), (0,), {"data": 2}, 2)
    assert (s1.layers, s1.hosts, s1.mesh) == ((2, 4), (1,), {"model": 2})
    assert s0.layout == {"batch": "data"}  # rules naming axes a mesh lacks are dropped
    assert s1.layout == {"heads": "model", "mlp": "model", "vocab": "model"}
    assert checked.model.num_layers == 4 and checked.model.name == "gpt"
    assert checked.data_path == str((REPO / "examples/data/tiny_shakespeare_like.txt").resolve())
    assert checked.to_json().startswith("{")


def test_mlp_example_plan(local):
    checked = check_job(load_job(MLP), local)
    assert [s.layers for s in checked.stages] == [(0, 2), (2, 4), (4, 6)]
    assert [s.hosts for s in checked.stages] == [(0,), (1,), (2,)]
    assert checked.job.layout == {"batch": "data", "mlp": "model"}  # parsed from Mesh-TF text
    assert checked.job.data.seq_len is None


def test_cluster_configs_load():
    local, sim = load_cluster(LOCAL), load_cluster(SIM)
    assert (local.address, local.hosts, local.devices_per_host, local.cpus_per_host) == (None, 4, 2, 0.5)
    assert (sim.address, sim.placement_strategy) == ("auto", "STRICT_SPREAD")
    assert parse_cluster(local.to_dict()) == local and local.timeouts.init_s == 120.0


def test_multi_host_stage_takes_consecutive_hosts(local):
    job = load_job(GPT, ["pipeline.stages[0].hosts=2", "pipeline.stages[0].mesh.data=4",
                         "pipeline.stages[1].hosts=2", "pipeline.stages[1].mesh={data: 2, model: 2}"])
    stages = check_job(job, local).stages
    assert [s.hosts for s in stages] == [(0, 1), (2, 3)]
    assert list(stages[1].mesh) == ["data", "model"]  # ordered as written
    assert stages[1].num_devices == 4


def test_interleaved_virtual_stages(local):
    job = load_job(GPT, ["pipeline.schedule=interleaved-1f1b", "pipeline.virtual_stages=2",
                         "pipeline.stages.0.layers=[[0, 1], [2, 3]]",
                         "pipeline.stages.1.layers=[[1, 2], [3, 4]]"])
    s0, s1 = check_job(job, local).stages
    assert s0.chunks == ((0, 1), (2, 3)) and s1.layer_indices() == (1, 3)


def test_overrides_and_free_form_keys():
    out = apply_overrides(raw(GPT), ["run.steps=3", "pipeline.schedule=gpipe", "model.args.blocks=4",
                                     "pipeline.stages[1].mesh.model=2", "pipeline.stages.0.layers=[0, 3]",
                                     "data.seq_len=null", "optimizer.args.b1=0.8"])
    assert out["run"]["steps"] == 3 and out["pipeline"]["schedule"] == "gpipe"
    assert out["model"]["args"]["blocks"] == 4 and out["pipeline"]["stages"][0]["layers"] == [0, 3]
    assert out["data"]["seq_len"] is None and out["optimizer"]["args"]["b1"] == 0.8
    mlp = apply_overrides(raw(MLP), ["layout.embed=data"])  # Mesh-TF text becomes a mapping
    assert mlp["layout"] == {"batch": "data", "mlp": "model", "embed": "data"}
    assert raw(GPT)["run"]["steps"] == 50  # input untouched
    assert load_job(GPT, ["run.steps=3"]).run.steps == 3


def test_cluster_overrides():
    c = load_cluster(LOCAL, ["timeouts.step_s=5", "resources_per_host.slice_a=1", "hosts=8"])
    assert (c.timeouts.step_s, c.resources_per_host, c.hosts) == (5.0, {"slice_a": 1.0}, 8)
    has_all(error_of(load_cluster, LOCAL, ["timeouts.stepp_s=5"]), "timeouts.stepp_s", "unknown key",
            "did you mean 'step_s'")


def test_optimizer_learning_rate_exponent_form(tmp_path):
    text = GPT.read_text().replace("learning_rate: 0.003", "learning_rate: 3e-3")
    p = tmp_path / "job.yaml"
    p.write_text(text)
    assert load_job(p).optimizer.args["learning_rate"] == 0.003


def test_check_output_dir(tmp_path):
    job = load_job(GPT, [f"run.output_dir={tmp_path / 'a' / 'b'}"])
    assert check_output_dir(job) == tmp_path / "a" / "b" / "gpt-tiny"
    (tmp_path / "file").write_text("")
    msg = error_of(check_output_dir, load_job(GPT, [f"run.output_dir={tmp_path / 'file' / 'x'}"]))
    has_all(msg, "run.output_dir", str(tmp_path / "file" / "x"), "cannot be created")
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "gpt-tiny").write_text("")
    msg = error_of(check_output_dir, load_job(GPT, [f"run.output_dir={tmp_path / 'o'}"]))
    has_all(msg, "run.name", "'gpt-tiny'", "not a directory")


def test_schedule_check_params_is_called(local, monkeypatch):
    calls = []

    class FakeScheduleError(ValueError):
        pass

    def check_params(name, p, m, v=1):
        calls.append((name, p, m, v))
        if m < 2 * p:
            raise FakeScheduleError(f"m={m} must be >= 2p for this test")

    from orchestrator.core.config import check as check_mod

    monkeypatch.setattr(check_mod, "check_params", check_params)
    monkeypatch.setattr(check_mod, "ScheduleError", FakeScheduleError)
    monkeypatch.setattr(check_mod, "SCHEDULES", {"gpipe": None, "1f1b": None})
    check_job(load_job(GPT), local)
    assert calls == [("1f1b", 2, 4, 1)]
    msg = error_of(check_job, load_job(GPT, ["pipeline.microbatches=2", "data.global_batch=8"]), local)
    has_all(msg, "pipeline.microbatches", "= 2", "m=2 must be >= 2p", "rejects")
    msg = error_of(check_job, load_job(GPT, ["pipeline.schedule=zb-h1"]), local)
    has_all(msg, "pipeline.schedule", "'zb-h1'", "unknown schedule", "1f1b, gpipe")


# ----------------------------------------------------------------------------- bad inputs
# (overrides on examples/gpt.yaml, expected fragments: key path, value, rule keyword)

PARSE_CASES = [
    (["run.steps=0"], ["run.steps", "= 0", ">= 1"]),
    (["run.steps='3'"], ["run.steps", "'3'", "must be an integer"]),
    (["run.seed=-1"], ["run.seed", "-1", ">= 0"]),
    (["run.name=../evil"], ["run.name", "'../evil'", "path separator"]),
    (["run.name=a..b"], ["run.name", "'a..b'", "'..'"]),
    (["run.name=/etc"], ["run.name", "'/etc'", "absolute"]),
    (['run.name="a\\0b"'], ["run.name", "'a\\x00b'", "NUL"]),
    (["run.name=-x"], ["run.name", "'-x'", "must match"]),
    (["run.name=" + "a" * 65], ["run.name", "a" * 65, "at most 64"]),
    (["run.output_dir=''"], ["run.output_dir", "''", "must not be empty"]),
    (["model.name=gtp"], ["model.name", "'gtp'", "unknown model", "did you mean 'gpt'"]),
    (["data.source=txt"], ["data.source", "'txt'", "must be one of", "did you mean 'text'"]),
    (["data.source=synthetic"], ["data.path", "tiny_shakespeare_like.txt", "only used when"]),
    (["data.path=null"], ["data.path", "None", "required when data.source is 'text'"]),
    (["data.global_batch=0"], ["data.global_batch", "= 0", ">= 1"]),
    (["data.seq_len=1.5"], ["data.seq_len", "1.5", "must be an integer"]),
    (["optimizer.name=optax.adam"], ["optimizer.name", "'optax.adam'", "optax optimizer"]),
    (["pipeline.microbatches=0"], ["pipeline.microbatches", "= 0", ">= 1"]),
    (["pipeline.virtual_stages=true"], ["pipeline.virtual_stages", "True", "not a boolean"]),
    (["pipeline.stages=[]"], ["pipeline.stages", "[]", "at least one stage"]),
    (["pipeline.stages[1].mesh.model=0"], ["pipeline.stages[1].mesh.model", "= 0", ">= 1"]),
    (["pipeline.stages[1].mesh.model=-2"], ["pipeline.stages[1].mesh.model", "-2", ">= 1"]),
    (["pipeline.stages[1].mesh.model=true"], ["pipeline.stages[1].mesh.model", "True", "not a boolean"]),
    (["pipeline.stages[1].mesh.model='2'"], ["pipeline.stages[1].mesh.model", "'2'", "must be an integer"]),
    (["pipeline.stages[1].mesh.model=2.0"], ["pipeline.stages[1].mesh.model", "2.0", "must be an integer"]),
    (["pipeline.stages[1].mesh={}"], ["pipeline.stages[1].mesh", "{}", "at least 1"]),
    (["pipeline.stages[1].mesh={'2d': 2}"], ["pipeline.stages[1].mesh.2d", "'2d'", "identifier"]),
    (["pipeline.stages[0].hosts=0"], ["pipeline.stages[0].hosts", "= 0", ">= 1"]),
    (["pipeline.stages[1].layers=[3, 2]"], ["pipeline.stages[1].layers", "[3, 2]", "start must be < stop"]),
    (["pipeline.stages[1].layers=[-1, 4]"], ["pipeline.stages[1].layers", "[-1, 4]", ">= 0"]),
    (["pipeline.stages[1].layers=[2]"], ["pipeline.stages[1].layers", "[2]", "half-open range"]),
    (["pipeline.stages[1].layers=[2, true]"], ["pipeline.stages[1].layers", "[2, True]", "two integers"]),
    (["layout='batch=data'"], ["layout", "'batch=data'", "Mesh-TF"]),
    (["layout.vocab=[model, model]"], ["layout.vocab", "['model', 'model']", "only once"]),
    (["layout.vocab=3"], ["layout.vocab", "3", "mesh axis name"]),
    (["pipeline.stages[0].layout='x'"], ["pipeline.stages[0].layout", "'x'", "Mesh-TF"]),
]


@pytest.mark.parametrize("overrides,needles", PARSE_CASES, ids=[c[0][0][:40] for c in PARSE_CASES])
def test_parse_errors(overrides, needles):
    has_all(error_of(load_job, GPT, overrides), *needles)


CHECK_CASES = [
    # 1. layer ranges
    (["pipeline.stages.1.layers=[3, 4]"], ["pipeline.stages[1].layers", "[3, 4]", "gap", "4 layers",
                                           "0:embed 1:block0 2:block1 3:head"]),
    (["pipeline.stages.1.layers=[1, 4]"], ["pipeline.stages[1].layers", "[1, 4]", "overlap", "stage 0"]),
    (["pipeline.stages.1.layers=[2, 3]"], ["pipeline.stages[1].layers", "[2, 3]", "cover", "[0, 4)"]),
    (["pipeline.stages.1.layers=[2, 6]"], ["pipeline.stages[1].layers", "[2, 6]", "past the model's last layer"]),
    (["pipeline.stages.0.layers=[1, 2]"], ["pipeline.stages[0].layers", "[1, 2]", "gap", "start at 0"]),
    (["pipeline.virtual_stages=2", "pipeline.schedule=interleaved-1f1b"],
     ["pipeline.stages[0].layers", "[0, 2]", "list of 2"]),
    (["pipeline.virtual_stages=2", "pipeline.schedule=interleaved-1f1b",
      "pipeline.stages.0.layers=[[0, 1], [1, 2]]", "pipeline.stages.1.layers=[[2, 3], [3, 4]]"],
     ["pipeline.stages[1].layers[0]", "[2, 3]", "gap", "virtual stage"]),
    # 2. mesh product
    (["pipeline.stages[1].mesh.model=4"], ["pipeline.stages[1].mesh", "{'model': 4}", "product", "1 × 2"]),
    (["pipeline.stages[0].hosts=2"], ["pipeline.stages[0].mesh", "{'data': 2}", "product", "2 × 2"]),
    # 3. hosts
    (["pipeline.stages[0].hosts=3", "pipeline.stages[0].mesh.data=6", "pipeline.stages[1].hosts=2",
      "pipeline.stages[1].mesh.model=4"],
     ["pipeline.stages[*].hosts", "[3, 2]", "more stages than hosts can hold", "cluster.hosts = 4"]),
    # 4. batch
    (["data.global_batch=10"], ["data.global_batch", "= 10", "not divisible", "microbatches = 4"]),
    (["pipeline.microbatches=8"] + ["data.global_batch=8"],
     ["pipeline.microbatches", "= 8", "microbatch size", "'batch'", "stage 0"]),
    # 5. schedule
    (["pipeline.schedule=1f1bb"], ["pipeline.schedule", "'1f1bb'", "unknown schedule", "did you mean '1f1b'"]),
    (["pipeline.virtual_stages=2", "pipeline.stages.0.layers=[[0, 1], [2, 3]]",
      "pipeline.stages.1.layers=[[1, 2], [3, 4]]"], ["pipeline.virtual_stages", "= 2", "'1f1b'", "rejects"]),
    (["pipeline.schedule=interleaved-1f1b", "pipeline.microbatches=3", "data.global_batch=12"],
     ["pipeline.microbatches", "= 3", "'interleaved-1f1b'", "m=3"]),
    # 6. layout
    (["layout.batchh=data"], ["layout.batchh", "'data'", "unknown logical axis", "did you mean 'batch'"]),
    (["layout.batch=dta"], ["layout.batch", "'dta'", "in no stage's mesh", "did you mean 'data'"]),
    (["pipeline.stages.0.layout.batch=model"], ["pipeline.stages[0].layout.batch", "'model'",
                                                "not in stage 0's mesh"]),
    (["pipeline.stages.0.layout.bach=data"], ["pipeline.stages[0].layout.bach", "'data'",
                                              "unknown logical axis", "did you mean 'batch'"]),
    (["model.args.heads=3", "model.args.d_model=66"],
     ["layout.heads", "'model'", "not divisible", "02.block1/wk", "(66, 3, 22)", "'heads'", "model"]),
    (["model.args.d_mlp=255"], ["layout.mlp", "'model'", "not divisible", "02.block1/w1", "255"]),
    (["pipeline.stages.1.layout.mlp=null", "pipeline.stages.1.layout.embed=model", "model.args.d_model=63",
      "model.args.heads=3"], ["pipeline.stages[1].layout.embed", "'model'", "not divisible", "'embed'", "63"]),
    (["layout.seq=model", "data.seq_len=33"], ["layout.seq", "'model'", "not divisible", "activation", "33"]),
    # 7. model, data, optimizer
    (["model.args.dmodel=8"], ["model.args.dmodel", "= 8", "unknown argument", "did you mean 'd_model'"]),
    (["model.args.d_model='64'"], ["model.args.d_model", "'64'", "integer >= 1"]),
    (["model.args.blocks=-1"], ["model.args.blocks", "= -1", "integer >= 0"]),
    (["model.args.heads=0"], ["model.args.heads", "= 0", "integer >= 1"]),
    (["model.name=nosuchpkg.mod:make"], ["model.name", "'nosuchpkg.mod:make'", "cannot import"]),
    (["data.seq_len=null"], ["data.seq_len", "None", "required"]),
    (["data.path=examples/data/nope.txt"], ["data.path", "'examples/data/nope.txt'", "file not found"]),
    (["optimizer.name=adamm"], ["optimizer.name", "'adamm'", "not an optax optimizer", "did you mean 'adam'"]),
    (["optimizer.args.lr=0.1"], ["optimizer.args", "'lr': 0.1", "rejects", "lr"]),
    (["optimizer.args.learning_rate='3e-3'"], ["optimizer.args.learning_rate", "'3e-3'", "number > 0"]),
    (["optimizer.args.learning_rate=-1"], ["optimizer.args.learning_rate", "-1", "> 0"]),
    (["optimizer.name=GradientTransformation"], ["optimizer.name", "'GradientTransformation'",
                                                 "not an optax optimizer"]),
]


@pytest.mark.parametrize("overrides,needles", CHECK_CASES, ids=[" ".join(c[0])[:50] for c in CHECK_CASES])
def test_check_errors(overrides, needles, local):
    job = load_job(GPT, overrides)  # parses fine: these are cross-checks
    has_all(error_of(check_job, job, local), *needles)


def test_mlp_seq_len_rejected(local):
    msg = error_of(check_job, load_job(MLP, ["data.seq_len=32"]), local)
    has_all(msg, "data.seq_len", "= 32", "no 'seq' axis")
    msg = error_of(check_job, load_job(MLP, ["data.source=text", "data.path=examples/mlp.yaml"]), local)
    has_all(msg, "data.source", "'text'", "token ids", "float32")


def test_all_problems_listed_one_per_line():
    r = raw(GPT)
    r["pipeline"]["microbatchs"] = 3
    r["run"]["steps"] = "3"
    r["pipeline"]["stages"][0]["mesh"] = {"data": True}
    del r["model"]
    msg = error_of(parse_job, r, "job.yaml")
    lines = msg.splitlines()
    assert lines[0] == "job.yaml: 4 configuration problems:" and len(lines) == 5
    has_all(msg, "pipeline.microbatchs: unknown key; did you mean 'microbatches'?", "(value 3)",
            "run.steps = '3': must be an integer", "pipeline.stages[0].mesh.data = True",
            "model: required key is missing")
    assert "pydantic" not in msg and "Input should" not in msg


def test_unknown_keys_in_yaml_suggest(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text(GPT.read_text().replace("global_batch:", "global_bacth:"))
    has_all(error_of(load_job, p), "data.global_bacth", "unknown key", "did you mean 'global_batch'", "16")
    has_all(error_of(parse_cluster, {"hosts": 1, "devices_per_host": 1, "timeouts": {"init": 3}}),
            "timeouts.init", "unknown key", "did you mean 'init_s'")


OVERRIDE_CASES = [
    (["pipeline.microbatchs=8"], ["pipeline.microbatchs: unknown key; did you mean 'microbatches'?"]),
    (["pipeline.stages.5.mesh.model=2"], ["pipeline.stages[5]", "out of range", "2 item"]),
    (["pipeline.stages[x].mesh=1"], ["pipeline.stages[x].mesh=1", "malformed"]),
    (["pipeline.stages.one.mesh.x=1"], ["pipeline.stages.one", "'one'", "list index"]),
    (["run.name.x=1"], ["run.name", "single value"]),
    (["nosuch=1"], ["nosuch", "unknown key", "valid keys: run, model"]),
    (["run.steps"], ["'run.steps'", "malformed", "key.path=value"]),
    (["=3"], ["'=3'", "malformed"]),
    (["run..steps=3"], ["run..steps", "malformed"]),
    (["run.steps=[1, 2"], ["run.steps", "not valid safe YAML"]),
    (["run.steps=!!python/object/apply:os.system ['true']"], ["run.steps", "not allowed", "python/object"]),
]


@pytest.mark.parametrize("overrides,needles", OVERRIDE_CASES, ids=[c[0][0] for c in OVERRIDE_CASES])
def test_override_errors(overrides, needles):
    has_all(error_of(load_job, GPT, overrides), *needles)


CLUSTER_CASES = [
    ({"hosts": 0}, ["hosts", "= 0", ">= 1"]),
    ({"devices_per_host": True}, ["devices_per_host", "True", "not a boolean"]),
    ({"cpus_per_host": 0}, ["cpus_per_host", "= 0", "> 0"]),
    ({"platform": "gpus"}, ["platform", "'gpus'", "must be one of", "did you mean 'gpu'"]),
    ({"placement_strategy": "spread"}, ["placement_strategy", "'spread'", "must be one of"]),
    ({"address": "ray://head"}, ["address", "'ray://head'", "host:port"]),
    ({"address": "head:70000"}, ["address", "'head:70000'", "port 1-65535"]),
    ({"num_cpus": 1}, ["num_cpus", "= 1", "too few CPUs", "4 × 0.5"]),
    ({"address": "auto", "num_cpus": 8}, ["num_cpus", "= 8", "only for an embedded cluster"]),
    ({"resources_per_host": {"CPU": 1}}, ["resources_per_host.CPU", "1", "reserved"]),
    ({"resources_per_host": {"tpu_slice": -1}}, ["resources_per_host.tpu_slice", "-1", ">= 0"]),
    ({"timeouts": {"step_s": 0}}, ["timeouts.step_s", "= 0", "> 0"]),
    ({"timeouts": {"step_s": float("inf")}}, ["timeouts.step_s", "inf", "finite"]),
    ({"dashboard_host": "a b"}, ["dashboard_host", "'a b'", "no spaces"]),
    ({"executor": "compiled"}, ["executor", "'compiled'", "must be one of", "compiled_graph"]),
    ({"steps_per_call": 0}, ["steps_per_call", "= 0", ">= 1"]),
    ({"executor": "action_calls", "steps_per_call": 4},
     ["steps_per_call", "= 4", "must be 1", "one Ray call per action"]),
]


@pytest.mark.parametrize("change,needles", CLUSTER_CASES, ids=[str(c[0])[:40] for c in CLUSTER_CASES])
def test_cluster_errors(change, needles):
    r = {**raw(LOCAL), **change}
    has_all(error_of(parse_cluster, r, "local.yaml"), "local.yaml: ", *needles)


def test_embedded_cluster_cpu_shortage(local, monkeypatch):
    monkeypatch.setattr(check_mod.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    msg = error_of(check_job, load_job(MLP), local)  # 3 hosts × 0.5 CPUs > 1 CPU
    has_all(msg, "cluster.cpus_per_host", "0.5", "too few CPUs", "wait forever")


def test_python_tag_in_job_file_never_runs(tmp_path):
    sentinel = tmp_path / "SENTINEL"
    p = tmp_path / "job.yaml"
    p.write_text(GPT.read_text().replace(
        "name: gpt-tiny", f"name: !!python/object/apply:os.system ['touch {sentinel}']"))
    has_all(error_of(load_job, p), str(p), "run.name", "not allowed", "python/object/apply")
    assert not sentinel.exists()


@pytest.mark.slow         # the bad-input suite again in a child under -O (~35 s): the slow step
@pytest.mark.skipif(sys.flags.optimize > 0, reason="already running under python -O")
def test_bad_input_suite_under_python_O():
    r = subprocess.run([sys.executable, "-O", "-m", "pytest", "tests/test_config.py",
                        "tests/test_config_yaml.py", "tests/test_bad_input.py", "-q", "-p", "no:cacheprovider", "-n", "0"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    summary = r.stdout.strip().splitlines()[-1]     # pytest's last line, e.g. "206 passed, 1 skipped in 5s"
    assert " passed" in summary and " failed" not in summary and " error" not in summary, out


def test_zb_h1_on_a_jax_without_the_split_internals_is_refused(monkeypatch):
    """ZB-H1's I/W split needs JAX >= 0.10 (measured: JAX 0.8.3 fails inside it); refused at plan time."""
    from orchestrator.core.config import ConfigError, check, check_job, parse_cluster, parse_job

    raw = yaml.safe_load((Path(__file__).resolve().parent.parent / "examples/gpt.yaml").read_text())
    raw["pipeline"]["schedule"] = "zb-h1"
    cluster = parse_cluster({"hosts": 2, "devices_per_host": 2})
    monkeypatch.setattr(check, "_jax_version", lambda: (0, 10))
    check_job(parse_job(raw), cluster)                        # JAX 0.10: fine
    monkeypatch.setattr(check, "_jax_version", lambda: (0, 8))
    with pytest.raises(ConfigError, match=r"pipeline.schedule = 'zb-h1': needs JAX >= 0.10 .*this is JAX 0.8"):
        check_job(parse_job(raw), cluster)
    raw["pipeline"]["schedule"] = "1f1b"
    check_job(parse_job(raw), cluster)                        # other schedules do not need it
