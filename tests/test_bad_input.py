"""Bad input, end to end: refused with `key = value: rule`, before any Ray actor or placement group.

Most per-key cases live in tests/test_config.py and tests/test_config_yaml.py;
this file adds what the "bad input" issue lists and those files did not cover,
proves at the CLI that refusals happen before `ray` is even imported, and
checks (marked `ray`) that a cluster which cannot hold the job is refused at
once, with required vs available, instead of hanging.

Audit (issue item → where it is tested):
  1. mesh ≠ devices, more stages than hosts, zero hosts — test_config CHECK_CASES /
     PARSE_CASES; here: the CLI batch.
  2. axis sizes 0 / negative / 2.0 / true / '2' — test_config PARSE_CASES; here: 1.5,
     null, a list, duplicate axis names in a job file, duplicate logical axes in
     Mesh-TF layout text.
  3. batch divisibility — test_config (first stage); here: the last stage only, and a
     2-axis batch rule.
  4. schedule rules — test_config (interleaved m % p, v > 1 needs interleaved); here:
     m < p accepted by every single-chunk schedule (the schedule layer allows it).
  5. layer ranges, layout names, divisibility naming the parameter — test_config
     CHECK_CASES (complete).
  6. unknown keys in every section (closest key suggested), wrong nesting (the section
     the key belongs to is named), wrong types, missing nested keys — here.
  7. `!!python/...` tags — test_config_yaml (loader, sentinel); here: cluster file,
     `--set` value and the CLI, each with a sentinel.
  8. alias bombs / size / depth — test_config_yaml (loader); here: through load_job,
     load_cluster and `--set`, each refused fast.
  9. resources the Ray cluster lacks — here (`ray`): pre-check and bounded wait.
 10. unwritable output dir, run name traversal — test_config (name rules); here:
     unwritable dirs, NUL in output_dir, and the CLI.
 11. `--set` unknown keys / unparsable values — test_config OVERRIDE_CASES; here: the CLI.
`tests/test_config.py::test_bad_input_suite_under_python_O` reruns this file under
`python -O` (the CLI batch then runs under -O as well).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from orchestrator.core.config import (ConfigError, check_job, check_output_dir, load_cluster, load_job,
                                 parse_cluster, parse_job)
from orchestrator.driver.placement import PlacementError, check_fits
from tests.conftest import ROOT

from tests.test_config import GPT, LOCAL, MLP, _repo_cwd, local  # noqa: F401 - shared paths and fixtures


def error_of(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as ei:
        fn(*args, **kwargs)
    return str(ei.value)


def has_all(msg: str, *needles: str) -> None:
    missing = [n for n in needles if n not in msg]
    assert not missing, f"{missing} not in message:\n{msg}"


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def tiny_job(stages: int = 2, devices: int = 1, hosts: int = 1, output_dir: str = "runs") -> dict:
    """An MLP job with `stages` stages of 1 layer-pair each, `hosts` × `devices` per stage."""
    per = 2
    return {"run": {"name": "bad-input", "steps": 1, "output_dir": output_dir},
            "model": {"name": "mlp", "args": {"blocks": stages * per - 2, "d_in": 4, "d_model": 8,
                                              "d_mlp": 8, "d_out": 2}},
            "data": {"global_batch": 4}, "optimizer": {"name": "sgd", "args": {"learning_rate": 0.1}},
            "pipeline": {"schedule": "gpipe", "microbatches": 2,
                         "stages": [{"layers": [i * per, (i + 1) * per], "mesh": {"data": hosts * devices},
                                     "hosts": hosts} for i in range(stages)]}}


def unwritable_dir(tmp_path: Path) -> Path:
    """A directory this process cannot create files in (root ignores mode bits: use /sys then)."""
    if os.geteuid() != 0:
        d = tmp_path / "read-only"
        d.mkdir()
        d.chmod(0o500)
        return d
    for cand in ("/sys", "/proc"):
        try:
            fd, p = tempfile.mkstemp(dir=cand)
        except OSError:
            return Path(cand)
        os.close(fd)
        os.unlink(p)
    pytest.skip("running as root and no read-only directory to test with")


# ----------------------------------------------------------------------------- 2. mesh axes

@pytest.mark.parametrize("value,rule", [("1.5", "must be an integer"), ("null", "must be an integer"),
                                        ("[2]", "must be an integer"), ("-0", ">= 1")])
def test_mesh_axis_size_kinds(value, rule):
    has_all(error_of(load_job, GPT, [f"pipeline.stages[1].mesh.model={value}"]),
            "pipeline.stages[1].mesh.model", rule)


def test_duplicate_mesh_axis_in_job_file(tmp_path):
    p = write(tmp_path, "job.yaml", GPT.read_text().replace("mesh: {data: 2}", "mesh: {data: 2, data: 1}"))
    has_all(error_of(load_job, p), str(p), "pipeline.stages[0].mesh.data", "duplicate key 'data'",
            "once per mapping")


def test_duplicate_logical_axis_in_layout_text():
    has_all(error_of(load_job, MLP, ["layout='batch:data;mlp:model;batch:model'"]),
            "layout", "'batch:data;mlp:model;batch:model'", "'batch' has more than one rule")
    has_all(error_of(load_job, GPT, ["pipeline.stages[0].layout='batch:data; batch:data'"]),
            "pipeline.stages[0].layout", "more than one rule")


# ----------------------------------------------------------------------------- 3. batch

def test_microbatch_not_divisible_by_last_stage_data_axis(local):
    job = load_job(MLP, ["pipeline.stages[0].mesh={model: 2}", "data.global_batch=12"])  # mb = 3
    msg = error_of(check_job, job, local)
    has_all(msg, "pipeline.microbatches", "= 4", "12 / 4 = 3", "'batch' on stage 2", "layout.batch")
    assert "stage 0" not in msg and "stage 1" not in msg  # only the stage that breaks the rule


def test_microbatch_not_divisible_by_two_axis_batch_rule(local):
    job = load_job(GPT, ["pipeline.stages[0].hosts=2", "pipeline.stages[0].mesh={data: 2, model: 2}",
                         "layout.batch=[data, model]", "data.global_batch=8", "pipeline.microbatches=4"])
    has_all(error_of(check_job, job, local), "pipeline.microbatches", "8 / 4 = 2", "not divisible by 4",
            "['data', 'model']")


# ----------------------------------------------------------------------------- 4. schedules

@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "eager-1f1b", "zb-h1"])
def test_fewer_microbatches_than_stages_is_allowed(local, schedule, monkeypatch):
    from orchestrator.core.config import check
    from orchestrator.core.plan import make_plan

    monkeypatch.setattr(check, "_jax_version", lambda: (0, 10))   # zb-h1's JAX floor is test_config's

    job = load_job(MLP, [f"pipeline.schedule={schedule}", "pipeline.microbatches=2", "data.global_batch=4"])
    checked = check_job(job, local)  # p = 3 > m = 2: the schedule layer's rule allows it
    plan = make_plan(checked)
    assert (plan.schedule.p, plan.schedule.m) == (3, 2)


def test_interleaved_needs_microbatches_divisible_by_stages(local):
    job = load_job(MLP, ["pipeline.schedule=interleaved-1f1b", "pipeline.virtual_stages=2",
                         "model.args.blocks=10",
                         "pipeline.stages[0].layers=[[0, 2], [6, 8]]", "pipeline.stages[1].layers=[[2, 4], [8, 10]]",
                         "pipeline.stages[2].layers=[[4, 6], [10, 12]]", "pipeline.microbatches=4"])
    has_all(error_of(check_job, job, local), "pipeline.microbatches", "= 4", "interleaved-1f1b",
            "m divisible by p", "m=4, p=3")


# ----------------------------------------------------------------------------- 6. keys and nesting

UNKNOWN_KEYS = [  # (section path in gpt.yaml, typo, the key it should suggest)
    ((), "pipelin", "pipeline"),
    (("run",), "stpes", "steps"),
    (("model",), "arg", "args"),
    (("data",), "seqlen", "seq_len"),
    (("optimizer",), "nmae", "name"),
    (("pipeline",), "virtual_stage", "virtual_stages"),
    (("pipeline", "stages", 1), "layer", "layers"),
]


@pytest.mark.parametrize("section,typo,valid", UNKNOWN_KEYS, ids=[u[1] for u in UNKNOWN_KEYS])
def test_unknown_key_in_every_section_suggests(section, typo, valid):
    raw = yaml.safe_load(GPT.read_text())
    node = raw
    for part in section:
        node = node[part]
    node[typo] = 1
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in (*section, typo)).lstrip(".")
    has_all(error_of(parse_job, raw, "job.yaml"), f"{path}: unknown key", f"did you mean '{valid}'",
            "(value 1)")


@pytest.mark.parametrize("typo,valid", [("hots", "hosts"), ("dashbord_host", "dashboard_host"),
                                        ("env_var", "env_vars"), ("timeouts.step", "step_s")])
def test_unknown_cluster_key_suggests(tmp_path, typo, valid):
    text = LOCAL.read_text() + (f"{typo}: 1\n" if "." not in typo else "")
    if "." in typo:
        text = text.replace("  step_s: 600", "  step: 600")
    has_all(error_of(load_cluster, write(tmp_path, "cluster.yaml", text)), typo, "unknown key",
            f"did you mean '{valid}'")


WRONG_NESTING = [  # a key written in the wrong section: the message names the right one
    (lambda r: r.update(steps=3), "steps: unknown key", "'steps' is a key of run", "run.steps"),
    (lambda r: r["run"].update(global_batch=8), "run.global_batch", "is a key of data", "data.global_batch"),
    (lambda r: r["pipeline"]["stages"][0].update(microbatches=2), "pipeline.stages[0].microbatches",
     "is a key of pipeline", "pipeline.microbatches"),
    (lambda r: r["data"].update(learning_rate=0.1), "data.learning_rate", "unknown key", "valid keys"),
    (lambda r: r["pipeline"].update(mesh={"data": 2}), "pipeline.mesh", "is a key of pipeline.stages[i]",
     "(value {'data': 2})"),
]


@pytest.mark.parametrize("mutate,where,hint,example", WRONG_NESTING, ids=[w[1] for w in WRONG_NESTING])
def test_wrong_nesting_names_the_right_section(mutate, where, hint, example):
    raw = yaml.safe_load(GPT.read_text())
    mutate(raw)
    has_all(error_of(parse_job, raw), where, hint, example)


def test_wrong_nesting_in_cluster_and_overrides():
    has_all(error_of(parse_cluster, {"hosts": 1, "devices_per_host": 1, "init_s": 5}),
            "init_s: unknown key", "'init_s' is a key of timeouts", "timeouts.init_s")
    has_all(error_of(load_job, GPT, ["seed=3"]), "override 'seed=3'", "'seed' is a key of run", "run.seed")
    has_all(error_of(load_cluster, LOCAL, ["step_s=5"]), "'step_s' is a key of timeouts")


WRONG_TYPES = [
    (lambda r: r.__setitem__("run", 3), "run = 3", "must be a mapping"),
    (lambda r: r.__setitem__("pipeline", ["stages"]), "pipeline = ['stages']", "must be a mapping"),
    (lambda r: r["pipeline"].__setitem__("stages", {"layers": [0, 4], "mesh": {"data": 2}}),
     "pipeline.stages = {'layers'", "must be a list, not a mapping"),
    (lambda r: r["pipeline"]["stages"][0].__setitem__("mesh", [2]), "pipeline.stages[0].mesh = [2]",
     "must be a mapping"),
    (lambda r: r["model"].__setitem__("args", "d_model=64"), "model.args = 'd_model=64'", "must be a mapping"),
    (lambda r: r["run"].__setitem__("name", 7), "run.name = 7", "must be a string"),
    (lambda r: r["data"].__setitem__("global_batch", "16"), "data.global_batch = '16'", "must be an integer"),
    (lambda r: r["pipeline"]["stages"][0].pop("mesh"), "pipeline.stages[0].mesh", "required key is missing"),
    (lambda r: r["pipeline"]["stages"][1].pop("layers"), "pipeline.stages[1].layers", "required key is missing"),
    (lambda r: r["run"].pop("steps"), "run.steps", "required key is missing"),
]


@pytest.mark.parametrize("mutate,where,rule", WRONG_TYPES, ids=[w[1][:30] for w in WRONG_TYPES])
def test_wrong_types_and_missing_keys(mutate, where, rule):
    raw = yaml.safe_load(GPT.read_text())
    mutate(raw)
    has_all(error_of(parse_job, raw), where, rule)


def test_missing_cluster_keys_all_listed():
    msg = error_of(parse_cluster, {"platform": "cpu"}, "cluster.yaml")
    has_all(msg, "2 configuration problems", "hosts: required key is missing",
            "devices_per_host: required key is missing")


# ----------------------------------------------------------------------------- 7, 8. unsafe YAML

def test_python_tag_in_cluster_file_and_override_never_runs(tmp_path):
    sentinel = tmp_path / "SENTINEL"
    bad = LOCAL.read_text().replace("hosts: 4 ", f"hosts: !!python/object/apply:os.system ['touch {sentinel}'] ")
    has_all(error_of(load_cluster, write(tmp_path, "cluster.yaml", bad)), "hosts", "not allowed",
            "python/object/apply")
    has_all(error_of(load_job, GPT, [f"model.args.vocab=!!python/object/apply:os.system ['touch {sentinel}']"]),
            "model.args.vocab", "not allowed")
    has_all(error_of(load_job, GPT, [f"run.name=!!python/object/new:subprocess.Popen [['touch', '{sentinel}']]"]),
            "run.name", "not allowed")
    assert not sentinel.exists()


def billion_laughs(levels: int = 9) -> str:
    lines = ["lol: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    return "\n".join(lines)


def test_alias_bomb_in_job_cluster_and_override_refused_fast(tmp_path):
    bomb = billion_laughs()
    t0 = time.perf_counter()
    has_all(error_of(load_job, write(tmp_path, "job.yaml", GPT.read_text() + bomb)), "alias bomb", "max_nodes")
    has_all(error_of(load_cluster, write(tmp_path, "cluster.yaml", LOCAL.read_text() + bomb)), "max_nodes")
    inline = "[" + ", ".join(["&a [1, 2, 3, 4, 5, 6, 7, 8, 9]"] + ["*a"] * 150) + "]"
    has_all(error_of(load_job, GPT, [f"model.args.x={inline}"]), "model.args.x", "max_aliases")
    assert time.perf_counter() - t0 < 5.0  # nothing was expanded


def test_oversized_and_deep_job_files_refused(tmp_path):
    has_all(error_of(load_job, write(tmp_path, "big.yaml", GPT.read_text() + "#" * 1_000_000)),
            "big.yaml", "over the limit of 1000000 bytes")
    deep = GPT.read_text() + "x: " + "[" * 200 + "]" * 200 + "\n"
    has_all(error_of(load_job, write(tmp_path, "deep.yaml", deep)), "deep.yaml", "max_depth=50")


# ----------------------------------------------------------------------------- 10. output directory

def test_unwritable_output_dir_refused(tmp_path):
    ro = unwritable_dir(tmp_path)
    has_all(error_of(check_output_dir, load_job(GPT, [f"run.output_dir={ro}"])),
            "run.output_dir", repr(str(ro)), "not writable")
    has_all(error_of(check_output_dir, load_job(GPT, [f"run.output_dir={ro / 'sub' / 'runs'}"])),
            "run.output_dir", str(ro / "sub" / "runs"), "cannot be created")


@pytest.mark.parametrize("name,rule", [("../../etc", "path separator"), ("..", "'..'"),
                                       ("/abs", "absolute"), ("C:x", "absolute"), ("a\\b", "path separator"),
                                       ("a\x00b", "NUL"), (".hidden", "must match")])
def test_run_name_traversal_in_job_file(tmp_path, name, rule):
    text = GPT.read_text().replace("name: gpt-tiny", f"name: {json.dumps(name)}")
    has_all(error_of(load_job, write(tmp_path, "job.yaml", text)), "run.name", rule)


def test_output_dir_with_nul_refused():
    has_all(error_of(load_job, GPT, ['run.output_dir="runs\\0x"']), "run.output_dir", "NUL")


# ----------------------------------------------------------------------------- 12. values that fail late

@pytest.mark.parametrize("sets,needles", [
    (["optimizer.args.learning_rate=.inf"], ["optimizer.args.learning_rate", "inf", "finite"]),
    (["optimizer.args.learning_rate=1e308"], ["optimizer.args.learning_rate", "1e+308", "at most 100"]),
    (["optimizer.args.b1=.nan"], ["optimizer.args.b1", "nan", "finite"]),
    (["optimizer.name=identity", "optimizer.args={}"], ["optimizer.name", "'identity'", "gradient ascent"]),
    (["optimizer.name=scale_by_adam", "optimizer.args={}"], ["optimizer.name", "'scale_by_adam'", "learning_rate"]),
    ([f"run.seed={2**64}"], ["run.seed", str(2**64), "less than or equal to 4294967295"]),
    ([f"run.steps={10**12}"], ["run.steps", str(10**12), "less than or equal to 1000000000"]),
    ([f"data.global_batch={2**40}"], ["data.global_batch", str(2**40), "cannot fit", "global batch"]),
    (["data.source=synthetic", "data.path=null", "data.seq_len=1048576", "data.global_batch=4096"],
     ["pipeline.stages[", "cannot fit", "each device needs at least"]),
    (["model.args.d_model=2097152", "model.args.d_mlp=2097152", "model.args.heads=4"],
     ["pipeline.stages[", "cannot fit", "parameters"]),
    (['run.name="a\\x07b"'], ["run.name", "U+0007", "printable"]),
    (['pipeline.stages[0].mesh={"da\\x1bta": 2}'], ["pipeline.stages[0].mesh", "control characters"]),
])
def test_values_that_would_fail_late_are_refused_at_plan_time(local, sets, needles):
    """Each passed the schema before and failed on the actors (or trained garbage); now
    `check_job` refuses it with key, value and rule (no Ray involved)."""
    def plan():
        return check_job(load_job(GPT, sets), local)
    has_all(error_of(plan), *needles)


def test_a_model_larger_than_any_device_is_refused_on_a_remote_cluster_too(local):
    """13 trillion parameters: without the machine's memory to compare (a running cluster),
    the bound is the largest accelerator memory there is."""
    cluster = parse_cluster({**local.to_dict(), "address": "auto", "num_cpus": None})
    job = load_job(GPT, ["model.args.d_model=1048576", "model.args.d_mlp=1048576", "model.args.blocks=2"])
    has_all(error_of(check_job, job, cluster), "cannot fit", "the most any device has")


def _text_job(path) -> list[str]:
    return [f"data.path={json.dumps(str(path))}"]


def test_data_path_must_be_a_long_enough_regular_file_inside_its_directory(tmp_path, local):
    short = write(tmp_path, "short.txt", "x" * 20)                  # seq_len 32: not one window
    has_all(error_of(check_job, load_job(GPT, _text_job(short)), local), "data.path", "holds 20 bytes")
    has_all(error_of(check_job, load_job(GPT, _text_job(tmp_path)), local), "data.path", "is a directory")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    has_all(error_of(check_job, load_job(GPT, _text_job(fifo)), local), "data.path", "FIFO")
    has_all(error_of(check_job, load_job(GPT, _text_job("/dev/zero")), local), "data.path", "character device")
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = write(outside, "secret.txt", "s" * 100)
    jobdir = tmp_path / "job"
    jobdir.mkdir()
    (jobdir / "data.txt").symlink_to(secret)
    has_all(error_of(check_job, load_job(GPT, _text_job(jobdir / "data.txt")), local), "data.path",
            "is a symlink to", str(secret), f"outside {jobdir}")
    (jobdir / "inside.txt").symlink_to(write(jobdir, "real.txt", "r" * 100))   # a link within is fine
    check_job(load_job(GPT, _text_job(jobdir / "inside.txt")), local)


def test_a_directory_symlink_inside_the_job_directory_does_not_bypass_the_data_path_rule(tmp_path, local,
                                                                                         monkeypatch):
    """The issue's input: `data.path: jobdir/etc/passwd` with `jobdir/etc -> /etc` read /etc/passwd and
    shipped it to every actor (the rule looked at the file's own directory after resolving links).
    Every component is now followed and held to the rule, relative paths (read from the current
    directory) and absolute ones alike, for text, token and eval paths."""
    outside = tmp_path / "outside"
    outside.mkdir()
    write(outside, "secret.txt", "s" * 100)
    jobdir = tmp_path / "job"
    jobdir.mkdir()
    (jobdir / "etc").symlink_to(outside)
    monkeypatch.chdir(tmp_path)
    for path in ("job/etc/secret.txt", str(jobdir / "etc" / "secret.txt"), "./job/./etc/secret.txt"):
        has_all(error_of(check_job, load_job(GPT, _text_job(path)), local), f"data.path = {path!r}",
                f"is a symlink to {outside}, outside {jobdir} (through the directory link {jobdir / 'etc'})")
    (jobdir / "hop").symlink_to(jobdir / "etc")          # a link inside whose target leads out: still out
    has_all(error_of(check_job, load_job(GPT, _text_job("job/hop/secret.txt")), local), f"outside {jobdir}")
    tokens = ["data.source=tokens", "data.path=job/etc", "data.dtype=uint16"]
    has_all(error_of(check_job, load_job(GPT, tokens), local), "data.path", f"is a symlink to {outside}")
    (jobdir / "sub").mkdir()
    write(jobdir / "sub", "data.txt", "d" * 100)
    (jobdir / "same").symlink_to("sub")                  # a directory link within the job directory: fine
    checked = check_job(load_job(GPT, _text_job("job/same/data.txt")), local)
    assert checked.data.files == (str(jobdir / "sub" / "data.txt"),)
    evald = ["run.eval_every=2", 'data.eval={"path": "job/etc/secret.txt"}']
    has_all(error_of(check_job, load_job(GPT, _text_job("job/sub/data.txt") + evald), local),
            "data.eval.path", f"outside {jobdir}")


@pytest.mark.parametrize("where", ["job", "cluster"])
@pytest.mark.parametrize("bad,needle", [(b"\x01", "control character U+0001"), (b"\xff", "invalid utf-8"),
                                        (b"\x1b[31m", "control character U+001B")])
def test_control_characters_and_invalid_utf8_in_yaml_give_file_line_column(tmp_path, where, bad, needle):
    src = GPT if where == "job" else LOCAL
    lines = src.read_bytes().split(b"\n")
    n = next(i for i, line in enumerate(lines) if line and not line.startswith(b"#"))
    lines[n] = lines[n] + b"  # " + bad
    path = tmp_path / f"{where}.yaml"
    path.write_bytes(b"\n".join(lines))
    col = len(lines[n]) - len(bad) + 1
    has_all(error_of(load_job if where == "job" else load_cluster, path), f"{path}:{n + 1}:{col}", needle)


def test_control_character_in_a_set_value_is_a_clear_error():
    has_all(error_of(load_job, GPT, ["run.name=a\x01b"]), "run.name", "U+0001", ":1:2")


# ----------------------------------------------------------------------------- the CLI: refused before ray

BATCH = """
import contextlib, io, json, sys
from orchestrator.driver.cli import main
results = []
for args in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(args)
        except SystemExit as e:
            code = e.code
        else:
            code = 0
    results.append({"code": code, "stderr": err.getvalue()})
print(json.dumps({"results": results, "ray_imported": "ray" in sys.modules}))
"""


def test_cli_refuses_bad_input_before_ray_is_imported(tmp_path):
    """`meshpipe run` on a representative bad input from each item: exit 2, key/value/rule, no ray."""
    sentinel = tmp_path / "SENTINEL"
    tag_job = write(tmp_path, "tag.yaml", GPT.read_text().replace(
        "name: gpt-tiny", f"name: !!python/object/apply:os.system ['touch {sentinel}']"))
    bomb_job = write(tmp_path, "bomb.yaml", GPT.read_text() + billion_laughs())
    typo_cluster = write(tmp_path, "cluster.yaml", LOCAL.read_text().replace("devices_per_host:", "device_per_host:"))
    ro = unwritable_dir(tmp_path)
    run = ["run", str(GPT), "--set", "run.steps=1"]
    cases = [  # (args, fragments the error must contain)
        (run + ["--set", "pipeline.stages[0].hosts=0"], ["pipeline.stages[0].hosts", "= 0", ">= 1"]),
        (run + ["--set", "pipeline.stages[1].hosts=2"], ["pipeline.stages[1].mesh", "{'model': 2}", "product"]),
        (run + ["--set", "pipeline.stages[0].hosts=3", "--set", "pipeline.stages[0].mesh.data=6",
                "--set", "pipeline.stages[1].hosts=2", "--set", "pipeline.stages[1].mesh.model=4"],
         ["pipeline.stages[*].hosts", "[3, 2]", "more stages than hosts"]),
        (run + ["--set", "pipeline.stages[0].mesh.data=true"], ["pipeline.stages[0].mesh.data", "True", "boolean"]),
        (run + ["--set", "data.global_batch=10"], ["data.global_batch", "= 10", "not divisible"]),
        (run + ["--set", "pipeline.schedule=interleaved-1f1b", "--set", "pipeline.microbatches=3",
                "--set", "data.global_batch=12"], ["pipeline.microbatches", "= 3", "interleaved-1f1b"]),
        (run + ["--set", "pipeline.stages.1.layers=[3, 4]"], ["pipeline.stages[1].layers", "[3, 4]", "gap"]),
        (run + ["--set", "layout.heads=modle"], ["layout.heads", "'modle'", "did you mean 'model'"]),
        (run + ["--set", "model.args.heads=3", "--set", "model.args.d_model=66"],
         ["layout.heads", "not divisible", "02.block1/wk"]),
        (run + ["--set", "steps=3"], ["steps", "unknown key", "'steps' is a key of run"]),
        (run + ["--set", "run.steps=[1,"], ["run.steps", "not valid safe YAML"]),
        (run + ["--set", "run.name=../escape"], ["run.name", "'../escape'", "path separator"]),
        (run + ["--set", f"run.output_dir={ro}"], ["run.output_dir", str(ro), "not writable"]),
        (run + ["--cluster", str(typo_cluster)], ["device_per_host", "unknown key", "did you mean 'devices_per_host'"]),
        (["run", str(tag_job)], ["run.name", "not allowed", "python/object/apply"]),
        (["run", str(bomb_job)], ["alias bomb", "max_nodes"]),
    ]
    py = [sys.executable] + (["-O"] if sys.flags.optimize else [])
    out = subprocess.run(py + ["-c", BATCH, json.dumps([c[0] for c in cases])], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    for (args, needles), res in zip(cases, report["results"]):
        assert res["code"] == 2, (args, res)
        assert "invalid configuration" in res["stderr"], (args, res)
        has_all(res["stderr"], *needles)
    assert report["ray_imported"] is False  # so no actor or placement group can exist
    assert not sentinel.exists()
    assert not list(ROOT.glob("runs/escape*")) and not (ROOT.parent / "escape").exists()


# ----------------------------------------------------------------------------- 9. the Ray cluster

FITS = [  # (bundle, count, strategy, nodes, fragments of the error or None when it fits)
    ({"CPU": 0.5}, 4, "PACK", [{"CPU": 2}], None),
    ({"CPU": 0.5, "GPU": 1}, 2, "PACK", [{"CPU": 8}], ["no 'GPU' resource at all", "required 2 × 1 = 2",
                                                        "available 0", "cluster.platform"]),
    ({"CPU": 0.5, "slice": 1}, 2, "PACK", [{"CPU": 8}], ["no 'slice'", "cluster.resources_per_host.slice"]),
    ({"CPU": 4}, 4, "PACK", [{"CPU": 8}], ["required CPU: 4 × 4 = 16", "has only CPU: 8", "cluster.cpus_per_host"]),
    ({"CPU": 1}, 2, "STRICT_SPREAD", [{"CPU": 8}], ["different node", "only 1 of the cluster's 1 alive node",
                                                    "cluster.placement_strategy"]),
    ({"CPU": 1}, 3, "STRICT_SPREAD", [{"CPU": 2}, {"CPU": 2}, {"CPU": 0.5}], ["only 2 of the cluster's 3"]),
    ({"CPU": 1}, 3, "STRICT_PACK", [{"CPU": 2}, {"CPU": 2}], ["one node", "largest node holds 2"]),
    ({"CPU": 3}, 3, "PACK", [{"CPU": 4}, {"CPU": 4}, {"CPU": 1}], ["hold [1, 1, 0]", "2 in all"]),
    ({"CPU": 9}, 1, "PACK", [{"CPU": 8}, {"CPU": 8}], ["no single node can hold one bundle"]),
    ({"CPU": 1}, 1, "PACK", [], ["no alive node"]),
    ({"CPU": 1, "GPU": 2}, 2, "STRICT_SPREAD", [{"CPU": 4, "GPU": 2}, {"CPU": 4, "GPU": 2}], None),
]


@pytest.mark.parametrize("bundle,count,strategy,nodes,needles", FITS, ids=[str(i) for i in range(len(FITS))])
def test_check_fits(bundle, count, strategy, nodes, needles):
    if needles is None:
        check_fits(bundle, count, strategy, nodes)
        return
    with pytest.raises(PlacementError) as ei:
        check_fits(bundle, count, strategy, nodes)
    has_all(str(ei.value), f"cannot place {count} host bundles", strategy, *needles)


def checked_for(cluster: dict, stages: int = 2, tmp_path: Path | None = None):
    raw = tiny_job(stages=stages, devices=cluster["devices_per_host"],
                   output_dir=str(tmp_path) if tmp_path else "runs")
    return check_job(parse_job(raw), parse_cluster({"address": "auto", **cluster}))


def my_groups(name: str) -> list:
    from tests.conftest import live_placement_groups

    return [pg for pg in live_placement_groups() if pg.name == name]


@pytest.mark.ray
@pytest.mark.parametrize("cluster,needles", [
    ({"platform": "gpu", "hosts": 2, "devices_per_host": 1, "cpus_per_host": 0.5},   # the GPU backend's check
     ["cluster.devices_per_host", "GPUs", "none"]),
    ({"hosts": 2, "devices_per_host": 1, "cpus_per_host": 0.5, "resources_per_host": {"tpu_slice_7": 1}},
     ["cannot place 2 host bundles", "'tpu_slice_7'", "at all", "available 0", "resources_per_host.tpu_slice_7"]),
    ({"hosts": 2, "devices_per_host": 1, "cpus_per_host": 0.5, "placement_strategy": "STRICT_SPREAD"},
     ["cannot place 2 host bundles", "STRICT_SPREAD", "different node", "1 alive node"]),
    ({"hosts": 2, "devices_per_host": 1, "cpus_per_host": 64.0},
     ["cannot place 2 host bundles", "required CPU: 2 × 64 = 128", "has only CPU", "cluster.cpus_per_host"]),
], ids=["gpu-on-cpu-cluster", "missing-custom-resource", "more-hosts-than-nodes", "too-many-cpus"])
def test_reserve_refuses_impossible_request_at_once(no_leaks, cluster, needles):
    from orchestrator.driver import placement

    checked = checked_for(cluster)
    t0 = time.perf_counter()
    with pytest.raises(PlacementError) as ei:
        placement.reserve(checked, "bad-input/pg", timeout=120)  # the pre-check must not wait for this
    assert time.perf_counter() - t0 < 10
    has_all(str(ei.value), *needles)
    assert not my_groups("bad-input/pg")  # refused before the group was created


@pytest.mark.ray
def test_run_job_on_a_cpu_cluster_asking_for_gpus_fails_fast(no_leaks, tmp_path):
    """The whole run path: a clear error, no actor, no placement group, no hang (init_s is 120)."""
    from orchestrator.driver.runner import run_job

    checked = checked_for({"platform": "gpu", "hosts": 2, "devices_per_host": 1, "cpus_per_host": 0.5},
                          tmp_path=tmp_path)
    t0 = time.perf_counter()
    with pytest.raises(PlacementError, match="GPU"):
        run_job(checked, echo=lambda s: None)
    assert time.perf_counter() - t0 < 30


@pytest.mark.ray
def test_reserve_times_out_when_satisfiable_but_busy(no_leaks):
    """A request the cluster could hold, but not now: bounded by timeouts.init_s, then a clear error."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from orchestrator.driver import placement

    free = ray.available_resources().get("CPU", 0.0)
    assert free >= 1.0
    blocker = placement_group([{"CPU": free}], name="bad-input/blocker")
    assert ray.wait([blocker.ready()], timeout=30)[0], "could not reserve the machine's CPUs"
    try:
        checked = checked_for({"hosts": 2, "devices_per_host": 1, "cpus_per_host": 0.5})
        t0 = time.perf_counter()
        with pytest.raises(PlacementError) as ei:
            placement.reserve(checked, "bad-input/busy", timeout=1.0)
        elapsed = time.perf_counter() - t0
        assert 1.0 <= elapsed < 15
        has_all(str(ei.value), "could not place 2 host bundles", "within 1 s", "cluster.timeouts.init_s",
                "required {'CPU': 1.0}", "available now")
        assert not my_groups("bad-input/busy")  # removed after the timeout
    finally:
        remove_placement_group(blocker)
