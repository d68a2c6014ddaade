"""Checkpoints: config and on-disk format (pure), resume bit-exact on Ray, bad input before training.

The Ray tests train a tiny GPT (2 stages: {data: 2} and {model: 2}) for 4 steps with a
checkpoint every 2; the resumed run starts from a copy holding only step 2 and must give
the uninterrupted run's per-step losses and final parameters exactly (same schedule and
layout: equality, no tolerance).
"""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from orchestrator.core import checkpoint as ck
from orchestrator.core.config import check_checkpoint_dir, check_job, parse_cluster, parse_job
from orchestrator.core.config import checkpoint_bytes as ck_bytes
from orchestrator.core.config.disk import CHECKPOINT_FIXED_BYTES
from orchestrator.driver.checkpoint import model_arrays, prepare
from tests import records
from tests.test_bad_input import error_of, has_all, unwritable_dir

pytestmark = [pytest.mark.needs_checkpoint]


CLUSTER = {"hosts": 2, "devices_per_host": 2}


def gpt_job(tmp_path: Path, name: str, ckpt_dir: Path, schedule: str = "1f1b", steps: int = 4,
            d_model: int = 16) -> dict:
    return {
        "run": {"name": name, "steps": steps, "seed": 0, "output_dir": str(tmp_path / "runs")},
        "model": {"name": "gpt", "args": {"vocab": 32, "d_model": d_model, "heads": 2, "d_mlp": 32, "blocks": 2}},
        "data": {"source": "synthetic", "global_batch": 8, "seq_len": 8},
        "optimizer": {"name": "adam", "args": {"learning_rate": 0.003}},
        "pipeline": {"schedule": schedule, "microbatches": 2,
                     "stages": [{"layers": [0, 2], "mesh": {"data": 2}}, {"layers": [2, 4], "mesh": {"model": 2}}]},
        "layout": {"batch": "data", "heads": "model", "mlp": "model", "vocab": "model"},
        "checkpoint": {"dir": str(ckpt_dir), "every_steps": 2, "keep": 3},
    }


def checked_of(job: dict, cluster: dict | None = None):
    return check_job(parse_job(job), parse_cluster(cluster or CLUSTER))


# ----------------------------------------------------------------------------- config (pure)

def test_checkpoint_config_keys_and_rules(tmp_path):
    job = parse_job(gpt_job(tmp_path, "c", tmp_path / "ck"))
    assert (job.checkpoint.every_steps, job.checkpoint.keep, job.checkpoint.async_) == (2, 3, True)
    assert parse_job(job.to_dict()) == job                     # `async` round-trips under its YAML name
    raw = gpt_job(tmp_path, "c", tmp_path / "ck")
    raw["checkpoint"]["async"] = False
    assert parse_job(raw).checkpoint.async_ is False
    for key, value, rule in [("every_steps", 0, "must be >= 1"), ("keep", -1, "must be >= 1"),
                             ("dir", " ", "must not be empty"), ("sometimes", 1, "")]:
        raw = gpt_job(tmp_path, "c", tmp_path / "ck")
        raw["checkpoint"][key] = value
        has_all(error_of(parse_job, raw), f"checkpoint.{key}", rule)


def test_unwritable_checkpoint_dir_refused(tmp_path):
    ro = unwritable_dir(tmp_path)
    job = parse_job(gpt_job(tmp_path, "c", ro))
    has_all(error_of(check_checkpoint_dir, job), "checkpoint.dir", repr(str(ro)), "not writable")
    f = tmp_path / "a-file"
    f.write_text("x")
    has_all(error_of(check_checkpoint_dir, parse_job(gpt_job(tmp_path, "c", f))),
            "checkpoint.dir", "not a directory")
    assert check_checkpoint_dir(parse_job(gpt_job(tmp_path, "c", tmp_path / "new" / "ck"))).is_dir()


def test_checkpoint_dir_needs_room_for_keep_plus_one_checkpoints(tmp_path):
    """Free space against (checkpoint.keep + 1) x one checkpoint's bytes, less what the step
    directories already there hold (a sparse file stands in for an earlier checkpoint)."""
    from orchestrator.core.private_fs import free_bytes

    root = tmp_path / "ck"
    job = parse_job(gpt_job(tmp_path, "c", root))               # keep 3: up to 4 on the disk at once
    free = free_bytes(tmp_path)
    each = free // 3
    has_all(error_of(check_checkpoint_dir, job, each), "checkpoint.dir", "not enough free space",
            "checkpoint.keep 3 + 1", f"{each:,} bytes each")
    assert check_checkpoint_dir(job, free // 5) == root
    shard = root / "step_00000002" / "stage_0" / "shard"
    shard.parent.mkdir(parents=True)
    with open(shard, "wb") as f:
        f.truncate(4 * each - free // 2)                      # sparse: counts as written, takes no space
    assert check_checkpoint_dir(job, each) == root
    checked = checked_of(gpt_job(tmp_path, "c", root))
    params = checked.model.param_count()
    assert ck_bytes(checked) == 3 * 4 * params + CHECKPOINT_FIXED_BYTES   # adam: 2 slots, float32


def test_resume_without_checkpoint_section_or_commit_refused(tmp_path):
    raw = gpt_job(tmp_path, "c", tmp_path / "ck")
    del raw["checkpoint"]
    with pytest.raises(ck.CheckpointError, match="no `checkpoint:` section"):
        prepare(checked_of(raw), "latest")
    (tmp_path / "ck" / "step_00000002").mkdir(parents=True)       # a save that never committed
    with pytest.raises(ck.CheckpointError, match="no committed checkpoint in checkpoint.dir"):
        prepare(checked_of(gpt_job(tmp_path, "c", tmp_path / "ck")), "latest")


def test_cli_resume_with_no_checkpoint_exits_2_before_ray(tmp_path):
    from tests.test_cli import meshpipe

    path = tmp_path / "job.json"      # JSON is YAML
    path.write_text(json.dumps(gpt_job(tmp_path, "c", tmp_path / "empty")))
    r = meshpipe("run", str(path), "--resume", timeout=300)
    assert r.returncode == 2, r.stderr
    has_all(r.stderr, "--resume", "no committed checkpoint", str(tmp_path / "empty"), "RAY_IMPORTED=False")
    r = meshpipe("run", str(path), "--resume=abc", timeout=300)
    assert r.returncode == 2 and "must be a step number" in r.stderr, r.stderr


# ----------------------------------------------------------------------------- markers and layout (pure)

def _marker(step: int, files: dict | None = None) -> dict:
    return {"format": ck.FORMAT, "step": step, "time": 1.0, "run": "r", "model": "gpt", "layout": [],
            "stages": [{"stage": 0, "path": "stage_0", "files": files or {}, "arrays": {}}],
            "arrays": {"00.embed/tok": {"shape": [32, 16], "dtype": "float32", "stage": 0}},
            "losses": [1.0] * step, "seed": 0, "data": {"next_step": step}, "bytes": 0}


def _commit(root: Path, step: int, payload: bytes = b"abc") -> dict:
    d = ck.stage_dir(root, step, 0)
    d.mkdir(parents=True)
    (d / "data").write_bytes(payload)
    marker = _marker(step, ck.file_table(d))
    ck.write_marker(root, marker)
    return marker


def test_marker_round_trip_and_damage_named(tmp_path):
    m = _commit(tmp_path, 2)
    assert ck.read_marker(tmp_path / "step_00000002" / ck.MARKER) == m
    ck.verify_files(tmp_path, m)
    bad = tmp_path / "step_00000002" / ck.MARKER
    bad.write_text("{not json")
    with pytest.raises(ck.CheckpointError, match=f"{bad}: unreadable commit marker"):
        ck.committed(tmp_path)
    bad.write_text(json.dumps({**m, "step": 3}))
    with pytest.raises(ck.CheckpointError, match="does not match directory step_00000002"):
        ck.read_marker(bad)
    with pytest.raises(ck.CheckpointError, match="'losses'"):
        ck.write_marker(tmp_path, {k: v for k, v in m.items() if k != "losses"})
    with pytest.raises(ck.CheckpointError, match="must be relative"):
        ck.write_marker(tmp_path, {**m, "stages": [{**m["stages"][0], "path": "../x"}]})


@pytest.mark.parametrize("damage,rule", [("missing", "is missing"), ("size", "has 4 bytes"),
                                         ("flip", "sha256"), ("extra", "not in the marker")])
def test_damaged_shard_refused_naming_the_file(tmp_path, damage, rule):
    m = _commit(tmp_path, 2)
    f = ck.stage_dir(tmp_path, 2, 0) / "data"
    if damage == "missing":
        f.unlink()
    elif damage == "size":
        f.write_bytes(b"abcd")
    elif damage == "flip":
        f.write_bytes(b"abd")
    else:
        f = f.with_name("stray")
        f.write_bytes(b"")
    with pytest.raises(ck.CheckpointError, match=rule) as ei:
        ck.verify_files(tmp_path, m)
    assert str(f) in str(ei.value)


def test_newest_intact_falls_back_over_damaged_commits_and_sets_them_aside(tmp_path):
    """`--resume` / `--resume auto` with a damaged newest commit: the newest intact one (every file
    verified) is chosen and the damage named; the damaged directories are renamed, never deleted."""
    for step in (2, 4, 6):
        _commit(tmp_path, step)
    (ck.stage_dir(tmp_path, 6, 0) / "data").write_bytes(b"abd")            # a flipped byte
    (ck.step_dir(tmp_path, 4) / ck.MARKER).write_text("{not json")          # a torn marker
    marker, damaged = ck.newest_intact(tmp_path)
    assert marker["step"] == 2
    assert [s for s, _ in damaged] == [6, 4]
    assert "sha256" in damaged[0][1] and str(ck.stage_dir(tmp_path, 6, 0) / "data") in damaged[0][1]
    assert "unreadable commit marker" in damaged[1][1]
    assert ck.set_aside(tmp_path, 6).name == "step_00000006.damaged"
    _commit(tmp_path, 6)                                   # the resumed run commits step 6 again
    (ck.stage_dir(tmp_path, 6, 0) / "data").write_bytes(b"xyz")
    assert ck.set_aside(tmp_path, 6).name == "step_00000006.damaged.2"          # nothing overwritten
    assert [s for s, _, _ in ck.scan(tmp_path)] == [2, 4]
    (ck.stage_dir(tmp_path, 2, 0) / "data").unlink()
    with pytest.raises(ck.CheckpointError, match=r"no intact committed checkpoint .*step 4: .*step 2: .*is missing"):
        ck.newest_intact(tmp_path)


def test_select_gc_and_partial_dirs(tmp_path):
    for step in (2, 4, 6):
        _commit(tmp_path, step)
    (tmp_path / "step_00000003").mkdir()                # interrupted save before the newest commit
    (tmp_path / "step_00000008").mkdir()                # a save in flight
    assert ck.select(tmp_path)["step"] == 6
    assert ck.select(tmp_path, 4)["step"] == 4
    with pytest.raises(ck.CheckpointError, match=r"no committed checkpoint of step 5 .*committed: 2, 4, 6"):
        ck.select(tmp_path, 5)
    gone = ck.gc_dirs(tmp_path, keep=2, in_flight=[8])
    assert sorted(p.name for p in gone) == ["step_00000002", "step_00000003"]
    assert [p.name for p in ck.stale_dirs(tmp_path, ())] == ["step_00000003", "step_00000008"]


def test_model_check_names_first_mismatching_parameter(tmp_path):
    spec = checked_of(gpt_job(tmp_path, "c", tmp_path / "ck")).model
    arrays = model_arrays(spec)
    m = {**_marker(2), "arrays": {**arrays, "opt:0/count|*": {"shape": [], "dtype": "int32"}}}
    ck.check_model(m, arrays)
    other = model_arrays(checked_of(gpt_job(tmp_path, "c", tmp_path / "ck", d_model=24)).model)
    with pytest.raises(ck.CheckpointError, match=r"parameter '00.embed/pos' is float32\[8, 16\], this "
                                                 r"model's is float32\[8, 24\]"):
        ck.check_model(m, other)
    fewer = {k: v for k, v in arrays.items() if k != "03.head/unembed"}
    with pytest.raises(ck.CheckpointError, match="'03.head/unembed', which this model does not"):
        ck.check_model(m, fewer)


def test_a_host_that_does_not_share_the_checkpoint_dir_is_refused(tmp_path):
    """What each stage host checks at set-up: the driver's probe, with the driver's content."""
    (tmp_path / ck.PROBE).write_text("x")
    ck.check_probe(tmp_path, "x", "stage 0 host 0")                              # shared: passes
    with pytest.raises(ck.CheckpointError, match=r"stage 1 host 0 on n2 cannot read the driver's probe .*"
                                                 r"must be storage that the driver and every host share"):
        ck.check_probe(tmp_path / "elsewhere", "x", "stage 1 host 0 on n2")     # a local disk: no probe
    with pytest.raises(ck.CheckpointError, match="sees another probe"):
        ck.check_probe(tmp_path, "y", "stage 1 host 0 on n2")                  # another run's probe


def test_committer_commits_only_when_every_host_reported_and_gcs_after(tmp_path):
    from orchestrator.driver.checkpoint import Committer

    raw = gpt_job(tmp_path, "c", tmp_path / "ck")
    raw["checkpoint"]["keep"] = 1
    checked = checked_of(raw)
    root, losses = tmp_path / "ck", [3.0, 2.0, 1.0, 0.5]
    committer = Committer(checked, "1f1b", expected=2, losses=losses)

    def reports(step):
        out = []
        for stage in (0, 1):
            d = ck.stage_dir(root, step, stage)
            d.mkdir(parents=True)
            (d / "x").write_bytes(b"12345")
            out.append({"step": step, "stage": stage, "host": 0, "path": d.name, "files": ck.file_table(d),
                        "arrays": {f"a{stage}": {"shape": [1], "dtype": "float32", "key": "a00000"}},
                        "bytes": 4, "blocking_s": 0.1, "write_s": 0.2})
        return out

    first = reports(2)
    assert committer.add(first[:1]) == [] and not (ck.step_dir(root, 2) / ck.MARKER).exists()
    assert committer.add(first[1:]) == [2]
    m = ck.select(root)
    assert (m["step"], m["losses"], m["bytes"], m["array_bytes"]) == (2, [3.0, 2.0], 10, 8)
    ck.verify_files(root, m)
    (root / "step_00000003").mkdir()                      # an interrupted save
    second = reports(4)
    committer.add(second[:1])
    assert (ck.step_dir(root, 2) / ck.MARKER).exists()    # kept until step 4 commits
    assert committer.add(second[1:]) == [4]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000004"]
    assert [c["step"] for c in committer.commits] == [2, 4]
    # the loading hosts' loader states go into the marker; hosts that disagree are refused
    third = reports(6)
    third[0]["data"] = {"next_step": 6, "source": "synthetic", "seed": 0, "samples": 48}
    third[1]["data"] = None                               # a stage that loads nothing
    committer.losses.extend([0.4, 0.3])
    assert committer.add(third) == [6] and ck.select(root)["data"]["samples"] == 48
    fourth = reports(8)
    fourth[0]["data"], fourth[1]["data"] = ({"next_step": 8, "seed": 0}, {"next_step": 7, "seed": 0})
    committer.losses.extend([0.2, 0.1])
    with pytest.raises(ck.CheckpointError, match="step 8: the loading hosts disagree"):
        committer.add(fourth)


# ----------------------------------------------------------------------------- on Ray

def plain_jax_loss(checked, exported: Path, step: int) -> float:
    """What the checkpoints page's export snippet does: orbax restore of the export, the model's own functions, no
    meshpipe runtime; the mean microbatch loss on step `step`'s batch."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    from orchestrator.core.model.registry import build_model
    from stages.data import global_batch, open_reader

    params = ocp.PyTreeCheckpointer().restore(exported.resolve() / "params")["params"]
    spec, m = checked.model, checked.job.pipeline.microbatches
    model = build_model(spec.factory, spec.args)
    x, y = global_batch(open_reader(checked.data), checked.data, step)
    losses = []
    for i in range(m):
        h = jnp.asarray(np.split(x, m)[i])
        for part, p in zip(model.parts, params):
            h = part.apply(p, h, rng=None, train=True)
        losses.append(float(model.loss(h, jnp.asarray(np.split(y, m)[i]))))
    return float(np.mean(losses))


def _run(job: dict, resume=None, cluster: dict | None = None) -> dict:
    from orchestrator.driver.runner import run_job

    return run_job(checked_of(job, cluster), echo=lambda s: None, keep_params=True, resume=resume)


def _resume_equals_uninterrupted(tmp_path: Path, schedule: str, make_job=gpt_job,
                                 cluster: dict | None = None) -> tuple[Path, dict]:
    """Uninterrupted 4 steps (commits 2 and 4) vs a copy of step 2 resumed: losses and params equal."""
    full_dir, part_dir = tmp_path / "ck-full", tmp_path / "ck-part"
    full = _run(make_job(tmp_path, f"full-{schedule}", full_dir, schedule), cluster=cluster)
    assert [m["step"] for m in ck.committed(full_dir)] == [2, 4]
    part_dir.mkdir()
    shutil.copytree(ck.step_dir(full_dir, 2), ck.step_dir(part_dir, 2))     # as if stopped after step 2
    resumed = _run(make_job(tmp_path, f"resumed-{schedule}", part_dir, schedule), resume=2, cluster=cluster)
    assert resumed["checkpoint"]["resumed_from"] == 2
    assert resumed["losses"] == full["losses"]                          # exact: floats equal
    assert len(resumed["step_times_s"]) == 2                            # it ran steps 2 and 3 only
    assert resumed["params"].keys() == full["params"].keys()
    for name, arr in full["params"].items():
        np.testing.assert_array_equal(resumed["params"][name], arr, err_msg=name)
    assert full["losses"][-1] < full["losses"][0]
    # the resumed run committed step 4 itself: same arrays as the uninterrupted run's step 4
    m_full, m_res = ck.select(full_dir), ck.select(part_dir)
    assert m_res["step"] == 4 and m_res["losses"] == m_full["losses"] == full["losses"]
    assert m_res["arrays"] == m_full["arrays"]
    assert not (full_dir / ck.PROBE).exists() and not (part_dir / ck.PROBE).exists()   # read back, removed
    # the loaders' own position, as the loading hosts reported it with their saves
    batch = make_job(tmp_path, "x", full_dir, schedule)["data"]["global_batch"]
    assert m_full["data"] == {"next_step": 4, "source": "synthetic", "seed": 0, "samples": 4 * batch}
    assert ck.select(full_dir, 2)["data"]["next_step"] == 2
    return full_dir, full


@pytest.mark.ray
def test_resume_is_bit_exact_1f1b_and_bad_checkpoints_refused(tmp_path, no_leaks):
    full_dir, full = _resume_equals_uninterrupted(tmp_path, "1f1b")
    commits = full["checkpoint"]["commits"]
    assert [c["step"] for c in commits] == [2, 4]
    params = sum(a.nbytes for a in full["params"].values())
    assert commits[0]["array_bytes"] == 3 * params + 4 * 2   # params + adam mu, nu + one int32 count per stage

    # `meshpipe checkpoints` lists both; `meshpipe export` → plain JAX restores step 2 and gets the
    # pipeline's step-2 loss (computed there with the parameters after 2 steps) on the same batch
    from tests.test_cli import meshpipe

    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(gpt_job(tmp_path, "full-1f1b", full_dir)))
    r = meshpipe("checkpoints", str(job_file), timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert [ln.split()[:2] for ln in lines] == [["step", "2"], ["step", "4"]], r.stdout
    assert "2 stages (1f1b): [0,2) data=2 | [2,4) model=2" in lines[0] and " MB " in lines[0]
    r = meshpipe("export", str(ck.step_dir(full_dir, 2)), "--to", str(tmp_path / "exported"), timeout=300)
    assert r.returncode == 0, r.stderr
    checked = checked_of(gpt_job(tmp_path, "full-1f1b", full_dir))
    loss = plain_jax_loss(checked, tmp_path / "exported", step=2)
    np.testing.assert_allclose(loss, full["losses"][2], rtol=2e-5)      # f32: other reduction order
    r = meshpipe("export", str(ck.step_dir(full_dir, 2)), "--to", str(tmp_path / "exported"), timeout=300)
    assert r.returncode == 2 and "exists already" in r.stderr

    # `--resume auto` (what `meshpipe submit` runs), through the CLI on this session's Ray: the first
    # run finds no commit and starts at step 0 (2 steps, commits step 2); the same command again, told
    # to train 4 steps, continues its own record from step 2 (a plain `run` exits 2 on that record)
    # and ends with the uninterrupted run's losses and step-4 arrays; a third finds nothing to train
    from click.testing import CliRunner

    from orchestrator.driver.cli import main

    auto_dir, job_file, cluster_file = tmp_path / "ck-auto", tmp_path / "auto.json", tmp_path / "cluster.json"
    job_file.write_text(json.dumps(gpt_job(tmp_path, "auto", auto_dir)))
    cluster_file.write_text(json.dumps(CLUSTER))

    def auto(steps: int, code: int = 0) -> str:
        r = CliRunner().invoke(main, ["run", str(job_file), "--cluster", str(cluster_file), "--set",
                                      f"run.steps={steps}", "--resume", "auto"])
        assert r.exit_code == code, r.output
        return r.output

    has_all(auto(2), "--resume auto: no committed checkpoint in", str(auto_dir), "starting at step 0")
    assert [m["step"] for m in ck.committed(auto_dir)] == [2]
    has_all(auto(4), "resuming from checkpoint step 2")
    summary = records.summary(tmp_path / "runs", "auto")      # --resume: the same run directory, continued
    assert summary["status"] == "completed" and summary["checkpoint"]["resumed_from"] == 2
    assert records.run_ids_of(tmp_path / "runs", "auto") == [Path(summary["run_dir"]).name]
    assert summary["losses"] == full["losses"] and len(summary["step_times_s"]) == 2     # ran steps 2, 3
    assert ck.select(auto_dir)["step"] == 4 and ck.select(auto_dir)["arrays"] == ck.select(full_dir)["arrays"]
    has_all(auto(4, code=2), "checkpoint step 4 is not before run.steps = 4", "nothing left to train")

    # bad input against this real checkpoint, each refused before anything starts
    fresh = gpt_job(tmp_path, "again", full_dir)
    with pytest.raises(ck.CheckpointError, match="holds committed checkpoints .*pass --resume"):
        prepare(checked_of(fresh), None)
    with pytest.raises(ck.CheckpointError, match="later committed steps"):
        prepare(checked_of(fresh), 2)
    with pytest.raises(ck.CheckpointError, match="nothing left to train"):
        prepare(checked_of(fresh), "latest")
    more = copy.deepcopy(fresh)
    more["run"]["steps"] = 6
    with pytest.raises(ck.CheckpointError, match=r"parameter '00.embed/pos' is float32\[8, 16\]"):
        prepare(checked_of(gpt_job(tmp_path, "other", full_dir, steps=6, d_model=24)), "latest")
    marker = ck.select(full_dir)
    shard = next(p for p in sorted(ck.stage_dir(full_dir, 4, 1).rglob("*")) if p.is_file() and p.parent.name == "d")
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(ck.CheckpointError, match="sha256") as ei:       # that step, asked for by number
        prepare(checked_of(more), 4)
    assert str(shard) in str(ei.value)
    shard.unlink()
    with pytest.raises(ck.CheckpointError, match="is missing") as ei:
        prepare(checked_of(more), 4)
    assert str(shard) in str(ei.value)
    assert ck.select(full_dir) == marker          # checks never touch a committed checkpoint
    path = ck.step_dir(full_dir, 4) / ck.MARKER             # as if step 4 had been trained on tokens
    saved = path.read_text()
    path.write_text(json.dumps({**marker, "data": {**marker["data"], "source": "tokens"}}))
    with pytest.raises(ck.CheckpointError, match="data.source = 'tokens', this job has 'synthetic'"):
        prepare(checked_of(more), 4)
    path.write_text(saved)
    # the newest step (--resume / --resume auto) falls back over the damaged step 4 to step 2, keeping it aside
    got = prepare(checked_of(more), "latest")
    assert got.start == 2 and got.marker == ck.select(full_dir, 2)
    assert [m["step"] for m in ck.committed(full_dir)] == [2] and (full_dir / "step_00000004.damaged").is_dir()


def bf16_job(tmp_path, name, ckpt_dir, schedule="1f1b"):
    job = gpt_job(tmp_path, name, ckpt_dir, schedule)
    job["precision"] = {"compute": "bfloat16"}
    return job


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("schedule,make_job", [("zb-h1", gpt_job), ("1f1b", bf16_job)], ids=["zb-h1", "1f1b-bf16"])
def test_resume_is_bit_exact_zb_h1_and_bf16(tmp_path, no_leaks, schedule, make_job):
    _resume_equals_uninterrupted(tmp_path, schedule, make_job)


@pytest.mark.ray
@pytest.mark.slow
def test_driver_killed_during_a_save_leaves_the_last_commit(tmp_path, no_leaks):
    """SIGKILL the driver (a real `meshpipe run` process) while step 4's save is on disk but not
    committed: step 2 is what counts, the partial step 4 is never taken, and --resume continues."""
    import os
    import signal
    import subprocess
    import sys

    from tests.conftest import ROOT, wait_until

    root = tmp_path / "ck"
    job = gpt_job(tmp_path, "killed", root, steps=6)
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(job))
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.driver.cli", "run", str(job_file)], cwd=ROOT,
                            env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        # step 2's commit lags its save by up to one batched call (the reports come back with step
        # results); step 4's save starts in that call, so both hold from then until step 4 commits
        wait_until(lambda: ((ck.step_dir(root, 2) / ck.MARKER).exists() and ck.step_dir(root, 4).exists())
                   or proc.poll() is not None, 900, "step 2 committed and step 4's save started", every=0.01)
        tree = _descendants(proc.pid)              # taken before the kill: orphans lose their parent
        os.kill(proc.pid, signal.SIGKILL)          # the driver, mid-save
        proc.wait(60)
    finally:
        _kill_all(proc.pid, locals().get("tree", []))
    assert proc.returncode == -signal.SIGKILL
    assert not (ck.step_dir(root, 4) / ck.MARKER).exists(), "killed too late: step 4 had committed"
    assert [m["step"] for m in ck.committed(root)] == [2]
    assert ck.select(root)["step"] == 2
    resumed = _run(job, resume="latest")
    assert resumed["checkpoint"]["resumed_from"] == 2
    assert [m["step"] for m in ck.committed(root)] == [2, 4, 6]
    assert resumed["losses"][:2] == ck.select(root, 2)["losses"] and len(resumed["losses"]) == 6
    # and the run that lost its driver ends exactly as one that did not: every loss, every array
    full = _run(gpt_job(tmp_path, "uninterrupted", tmp_path / "ck-full", steps=6))
    assert resumed["losses"] == full["losses"]
    assert resumed["params"].keys() == full["params"].keys()
    for name, arr in full["params"].items():
        np.testing.assert_array_equal(resumed["params"][name], arr, err_msg=name)


def _descendants(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _kill_all(pid: int, tree: list) -> None:
    """SIGKILL what the killed driver started (its embedded Ray: GCS, raylet, agents, the stage
    workers) and wait until every one is gone, so no writer of the dead run is left when the
    resumed run saves into the same directory. Ray starts some of them in sessions of their own,
    so the process group alone does not reach them all."""
    import os
    import signal

    import psutil

    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    procs = tree + [p for p in _descendants(pid) if p not in tree]
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=60)
    assert not alive, f"processes of the killed run still alive: {[p.pid for p in alive]}"


@pytest.mark.ray
@pytest.mark.slow
def test_resume_onto_another_layout_matches_within_f32(tmp_path, no_leaks):
    """Saved by 2 stages ({data: 2} | {model: 2}), resumed by 3 stages with the meshes swapped
    ({model: 2} | {data: 2} | {data: 2}): every array found by name in whichever old stage held it,
    restored into the new sharding; then the losses and parameters equal the uninterrupted run's
    within float32 tolerance (reduction order changes with the layout)."""
    full_dir, part_dir = tmp_path / "ck-full", tmp_path / "ck-part"
    full = _run(gpt_job(tmp_path, "full-2", full_dir))
    part_dir.mkdir()
    shutil.copytree(ck.step_dir(full_dir, 2), ck.step_dir(part_dir, 2))
    job = gpt_job(tmp_path, "resumed-3", part_dir)
    job["pipeline"]["stages"] = [{"layers": [0, 1], "mesh": {"model": 2}}, {"layers": [1, 3], "mesh": {"data": 2}},
                                 {"layers": [3, 4], "mesh": {"data": 2}}]
    resumed = _run(job, resume="latest", cluster={"hosts": 3, "devices_per_host": 2, "cpus_per_host": 0.5})
    assert resumed["checkpoint"]["resumed_from"] == 2
    assert resumed["losses"][:2] == full["losses"][:2]          # from the marker
    np.testing.assert_allclose(resumed["losses"][2:], full["losses"][2:], rtol=1e-5)
    for name, arr in full["params"].items():
        np.testing.assert_allclose(resumed["params"][name], arr, rtol=1e-5, atol=1e-6, err_msg=name)
    assert len(ck.select(part_dir)["layout"]) == 3              # step 4 saved in the new layout
