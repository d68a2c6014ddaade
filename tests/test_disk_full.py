"""A full disk, for real: a small tmpfs mounted in a private mount namespace (`unshare`).

The output-directory check compares free space with what the run will write and writes
real bytes (an empty file can be created on a full disk); `write_private` and
`append_private` turn ENOSPC into a `DiskFullError` that names the file and leave no
temporary or partial file behind. A disk that fills up mid-run (the per-step records of
`metrics.jsonl`) stops `meshpipe run` with that message and exit code 1, no traceback.
The checkpoint-directory check compares free space with what `keep + 1` checkpoints
(parameters and optimizer state) take. A disk that fills up during a checkpoint save (`slow`:
a Ray run) stops the run naming the step and the directory, keeps the last commit, and the
partial step is never taken for a checkpoint.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT

SCRIPT = r"""
import json, os, sys
from pathlib import Path
from orchestrator.core.config import ConfigError, check_output_dir, load_job
from orchestrator.core.private_fs import DiskFullError, append_private, write_private

d = Path(sys.argv[1])
out = {}
def refusal(steps):
    try:
        check_output_dir(load_job("examples/mlp.yaml", [f"run.output_dir={d}", f"run.steps={steps}"]))
        return None
    except ConfigError as e:
        return str(e)
def ckpt_refusal(optimizer):     # a ~0.5M-parameter MLP: 3.1 MB per checkpoint with sgd, 7.3 MB with adam
    from orchestrator.core.config import check_checkpoint_dir, check_job, checkpoint_bytes, load_cluster
    job = load_job("examples/mlp.yaml", [f"checkpoint.dir={d}/ck", "checkpoint.every_steps=5", "checkpoint.keep=2",
                                         "model.args.d_mlp=1024", f"optimizer.name={optimizer}"])
    checked = check_job(job, load_cluster("cluster_configs/local.yaml"))
    try:
        check_checkpoint_dir(checked.job, checkpoint_bytes(checked))
        return None
    except ConfigError as e:
        return str(e)
out["ckpt_sgd"] = ckpt_refusal("sgd")               # 3 x 3.1 MB fit in 16 MiB
out["ckpt_adam"] = ckpt_refusal("adam")             # 3 x 7.3 MB do not
os.rmdir(d / "ck")
out["small_run"] = refusal(10)
out["long_run"] = refusal(100_000)                   # 8 MiB + 51 MB > a 16 MiB disk
write_private(d / "summary.json", "old")
try:
    write_private(d / "summary.json", "x" * (32 << 20))
    out["big_write"] = None
except DiskFullError as e:
    out["big_write"] = str(e)
out["kept"] = (d / "summary.json").read_text()
append_private(d / "metrics.jsonl", "{}\n")
fd = os.open(d / "filler", os.O_WRONLY | os.O_CREAT)   # fill the disk to the last block
try:
    while True:
        os.write(fd, b"\0" * 4096)
except OSError:
    pass
os.close(fd)
try:
    append_private(d / "metrics.jsonl", "y" * (1 << 20))
    out["append"] = None
except DiskFullError as e:
    out["append"] = str(e)
out["metrics"] = (d / "metrics.jsonl").read_text()
out["full_dir"] = refusal(1)
out["files"] = sorted(p.name for p in d.iterdir())
print(json.dumps(out))
"""


def _in_tiny_tmpfs(tmp_path, size: str = "16m", script: str = SCRIPT, timeout: float = 120) -> dict:
    mnt = tmp_path / "disk"
    mnt.mkdir()
    probe = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {mnt}"]
    if shutil.which("unshare") is None or subprocess.run(probe, capture_output=True, timeout=30).returncode != 0:
        pytest.skip("cannot mount a private tmpfs here (unshare --user --mount refused)")
    cmd = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
           f'mount -t tmpfs -o size={size} tmpfs "$1" && exec "$2" -c "$3" "$1"', "sh", str(mnt), sys.executable,
           script]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_a_full_disk_is_found_before_training_and_writes_fail_cleanly(tmp_path):
    out = _in_tiny_tmpfs(tmp_path)
    assert out["small_run"] is None
    assert "run.output_dir" in out["long_run"] and "not enough free space" in out["long_run"]
    assert "100,000 steps" in out["long_run"]
    assert "no space left on the device writing" in out["big_write"] and "summary.json" in out["big_write"]
    assert out["kept"] == "old"                          # the old summary survives, no partial file
    assert "metrics.jsonl" in out["append"] and out["metrics"] == "{}\n"   # truncated back
    assert "run.output_dir" in out["full_dir"] and ("not enough free space" in out["full_dir"]
                                                     or "cannot write" in out["full_dir"])
    assert out["files"] == ["filler", "metrics.jsonl", "summary.json"]   # no .tmp, no write-test file
    assert out["ckpt_sgd"] is None
    assert "checkpoint.dir" in out["ckpt_adam"] and "not enough free space" in out["ckpt_adam"]
    assert "checkpoint.keep 2 + 1" in out["ckpt_adam"]


RUN_SCRIPT = r"""
import io, json, os, sys
from pathlib import Path
from orchestrator.driver import telemetry
from orchestrator.driver.cli import main

d = Path(sys.argv[1])
original = telemetry.StepLog.append

def append(self, record):          # the disk fills up (another writer) after the second record
    if self.count == 2:
        fd = os.open(d / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError:
            pass
        os.close(fd)
    original(self, record)
telemetry.StepLog.append = append

err, real = io.StringIO(), sys.stderr
sys.stderr = err
try:
    main(["run", "examples/mlp.yaml", "--reference", "--set", f"run.output_dir={d}", "--set", "run.steps=400"])
    code = "returned"
except SystemExit as e:
    code = e.code
except BaseException as e:
    code = f"{type(e).__name__}: {e}"
sys.stderr = real
from tests.records import run_dir as latest_run
run_dir = latest_run(d, "mlp-tiny")
lines = (run_dir / "metrics.reference.jsonl").read_text().splitlines()
print(json.dumps({"code": code, "stderr": err.getvalue(), "records": [json.loads(ln).get("step") for ln in lines],
                  "files": sorted(p.name for p in run_dir.iterdir())}))
"""


def test_a_disk_that_fills_up_mid_run_stops_it_cleanly(tmp_path):
    """`meshpipe run --reference` (no Ray) on a 16 MiB disk that another writer fills after the
    second step: the step record that no longer fits ends the run with the clear message and
    exit code 1; metrics.jsonl keeps whole records only; nothing temporary is left."""
    out = _in_tiny_tmpfs(tmp_path, script=RUN_SCRIPT)
    assert out["code"] == 1, out
    assert "meshpipe: run failed: no space left on the device writing" in out["stderr"], out["stderr"]
    assert "metrics.reference.jsonl" in out["stderr"] and "Traceback" not in out["stderr"]
    steps = out["records"]
    assert 2 <= len(steps) < 400 and steps == list(range(len(steps)))     # whole records, in order, none cut
    assert not [f for f in out["files"] if "tmp" in f or f.startswith(".")], out["files"]


CKPT_SCRIPT = r"""
import io, json, os, sys
from pathlib import Path
from orchestrator.core import checkpoint as ck
from orchestrator.driver import runner
from orchestrator.driver.cli import main
from tests.faults import FillDiskAt
from tests.test_checkpoint import gpt_job

disk = Path(sys.argv[1])
work, root, filler = disk.parent, disk / "ck", disk / "filler"
job_file = work / "job.json"
job = gpt_job(work, "diskfull", root, steps=8)          # a save every 2 steps, keep 3
job["checkpoint"]["async"] = False    # step 2 is reported with step 2's own result (async: any later step)
job_file.write_text(json.dumps(job))
original = runner.run_job

def with_fill(checked, **kw):   # stage 0 host 0, at step 3's start, once step 2 is committed: the disk fills
    hook = FillDiskAt(stage=0, host=0, step=3, wait_for=str(ck.step_dir(root, 2) / ck.MARKER), path=str(filler))
    return original(checked, hooks=[hook], **kw)

def cli(*args):
    err, real = io.StringIO(), sys.stderr
    sys.stderr = err
    try:
        main(["run", str(job_file), "--set", "cluster.steps_per_call=1", *args])
        code = "returned"
    except SystemExit as e:
        code = e.code
    except BaseException as e:
        code = f"{type(e).__name__}: {e}"
    finally:
        sys.stderr = real
    return code, err.getvalue()

def losses(part="all"):      # [step, loss] of the run's metrics.jsonl: all, or before / after its resume line
    from tests.records import run_dir
    lines = [json.loads(ln) for ln in (run_dir(work / "runs", "diskfull") / "metrics.jsonl").read_text().splitlines()]
    cut = next((i for i, ln in enumerate(lines) if "resume" in ln), len(lines))
    lines = {"all": lines, "before": lines[:cut], "after": lines[cut + 1:]}[part]
    return [[ln["step"], ln["loss"]] for ln in lines if "step" in ln]

out = {}
runner.run_job = with_fill
out["code"], out["stderr"] = cli()
runner.run_job = original
out["losses"] = losses()
out["left"] = sorted(str(p.relative_to(root)) for p in root.rglob("*") if "step_00000002/" not in str(p))
out["committed"] = [m["step"] for m in ck.committed(root)]
ck.verify_files(root, ck.select(root))          # the last commit: every file there, sizes and sha256 as marked
os.remove(filler)                               # the disk has room again: resume from the last commit
out["resume_code"], out["resume_stderr"] = cli("--resume")
out["resumed_losses"] = losses("after")
out["set_aside_losses"] = losses("before")     # the failed invocation's lines, kept in the run's metrics.jsonl
out["committed_after"] = [m["step"] for m in ck.committed(root)]
out["steps_after"] = sorted(p.name for p in root.iterdir())
print(json.dumps(out))
"""


@pytest.mark.slow
def test_a_disk_that_fills_up_during_a_checkpoint_save(tmp_path):
    """`meshpipe run` (embedded Ray, 2 stages, a save every 2 steps) with `checkpoint.dir` on an
    8 MiB disk that another writer fills once step 2 is committed (stage 0's hook, at step 3's
    start; one step per call, so the fill lands between the two saves). Step 4's save hits
    ENOSPC: the run stops with exit code 1 and a message naming it; step 2 stays committed,
    every file as its marker says; step 4's partial directory has no marker, so it is not a
    checkpoint, and `--resume` (with room again) removes it, restores step 2 and gives the
    failed run's losses exactly."""
    out = _in_tiny_tmpfs(tmp_path, size="8m", script=CKPT_SCRIPT, timeout=600)
    root = tmp_path / "disk" / "ck"
    assert out["code"] == 1, out
    failed = out["stderr"][out["stderr"].index("meshpipe: run failed:"):]
    assert "checkpoint save of step 4 failed on stage" in failed, failed[:3000]
    assert f"checkpoint.dir = {root} refused a checkpoint write in step 3: ENOSPC" in failed, failed[:3000]
    assert "not restarting: checkpoint.dir refused the write" in failed, failed[:3000]
    assert "No space left on device" in failed                    # the file system's own words, with the file
    assert [s for s, _ in out["losses"]] == [0, 1, 2]             # step 3 ended in step 4's save
    assert out["committed"] == [2]
    assert "step_00000004" in out["left"] and "step_00000004/commit.json" not in out["left"], out["left"]
    assert out["resume_code"] == 0, out["resume_stderr"][-3000:]
    assert [s for s, _ in out["resumed_losses"]] == list(range(2, 8))     # the resumed record: steps 2-7
    assert out["resumed_losses"][0] == out["losses"][2]                    # step 2's loss, exactly
    assert out["set_aside_losses"] == out["losses"]                        # the first record, kept whole
    assert out["committed_after"] == [4, 6, 8]
    assert out["steps_after"] == ["step_00000004", "step_00000006", "step_00000008"]   # the partial one removed
