"""A checkpoint directory that refuses writes stops the run at once (#35, item 6b): the policy
(pure: decided from the failure's cause and errno, never its words), the actor's classification
of a real OSError, and on Ray a real save into a directory blocked mid-run — no restart spent
with `failure.max_restarts: 3`, the stop naming the directory, the step, the errno and the
command that continues.
"""
from __future__ import annotations

import errno

import pytest

from tests.test_bad_input import has_all
from tests.test_recovery import _run, _summary, recovery_job


def test_storage_failures_are_never_restarted_and_others_still_are():
    from orchestrator.core.recovery import ERROR, STORAGE, Failure, RestartPolicy

    p = RestartPolicy(3)
    for code in (errno.ENOSPC, errno.EACCES, errno.EROFS, errno.ENOTDIR):
        d = p.decide(Failure(STORAGE, 0, 0, 4, "any words", errno=code, path="/ck/step_00000004"), committed=2)
        assert not d.restart and errno.errorcode[code] in d.reason and "same way" in d.reason
    assert p.restarts == 0
    # the same words as an ERROR restart: the decision reads the cause, not the text
    assert p.decide(Failure(ERROR, 0, 0, 4, "No space left on device"), committed=2).restart


def test_the_actor_types_a_refused_write_from_the_errno_field(tmp_path):
    """A real OSError from the file system (a file where the step directory must go), raised
    through the save's own wrapping: the errno is found on the chain; text alone is not."""
    from orchestrator.core.recovery import storage_error

    (tmp_path / "step_00000004").write_text("x")
    try:
        try:
            (tmp_path / "step_00000004" / "stage_0").mkdir(parents=True)
        except OSError as e:
            raise RuntimeError("checkpoint save of step 4 failed") from e
    except RuntimeError as outer:
        code, path = storage_error(outer)
    assert code == errno.ENOTDIR and path.endswith("stage_0")
    assert storage_error(RuntimeError("OSError: [Errno 28] No space left on device")) is None
    try:                                   # merely raised while handling one: not caused by it
        try:
            raise PermissionError(errno.EACCES, "denied")
        except OSError:
            raise KeyError("unrelated")
    except KeyError as e:
        assert storage_error(e) is None
    assert storage_error(OSError(errno.EIO, "I/O error")) is None      # not one a restart cannot help


def test_an_actor_already_aborted_by_a_peer_still_types_its_own_refused_write(tmp_path):
    """Every stage's save of one step fails; the peer that failed first has already aborted this
    actor (its mailbox closed with the peer's record) when this actor's own write fails. Its own
    error must still carry STORAGE (CI saw the driver take it for the cause untyped and restart);
    the "told to stop" error keeps the peer's record."""
    from types import SimpleNamespace

    from orchestrator.core.contract import StepFailure, failure_of
    from stages.mailbox import Mailbox, MailboxClosed
    from stages.worker import StageWorker

    (tmp_path / "step_00000006").write_text("x")
    me = SimpleNamespace(cfg=SimpleNamespace(stage=0, host=0, who="stage 0 host 0"), inbox=Mailbox("stage 0"),
                         actors=[])
    peer = StepFailure(1, 0, 5, "NotADirectoryError: ...", kind="storage", errno=errno.ENOTDIR, path="x")
    me.inbox.close("stage 1 host 0 failed in step 5", peer)
    try:
        (tmp_path / "step_00000006" / "stage_0").mkdir(parents=True)
    except OSError as e:
        own = e
    StageWorker._fail(me, 5, own)
    got = failure_of(own)
    assert got is not None and (got.kind, got.stage, got.step, got.errno) == ("storage", 0, 5, errno.ENOTDIR)
    with pytest.raises(MailboxClosed) as told:
        me.inbox.take("anything", timeout=0.1)
    StageWorker._fail(me, 5, told.value)
    assert failure_of(told.value) is peer


def test_a_refused_commit_marker_is_a_storage_failure_naming_its_path(tmp_path):
    """The driver's half: the commit marker of step 2 cannot be written (a file stands at
    step_00000002): `CommitWriteError` with the errno and the marker's path, which the attempt
    turns into a STORAGE failure (`Attempt._commit_failed`)."""
    from orchestrator.core.recovery import storage_error
    from orchestrator.driver.checkpoint import CommitWriteError, Committer
    from tests.test_checkpoint import checked_of, gpt_job

    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "step_00000002").write_text("in the way\n")
    committer = Committer(checked_of(gpt_job(tmp_path, "c", ck)), "1f1b", 1, losses=[3.0, 2.9])
    report = {"step": 2, "stage": 0, "host": 0, "path": "stage_0", "files": {}, "arrays": {}, "bytes": 0,
              "blocking_s": 0.0, "write_s": 0.0, "data": None}
    with pytest.raises(CommitWriteError) as ei:
        committer.add([report])
    assert storage_error(ei.value) == (errno.ENOTDIR, str(ck / "step_00000002" / "commit.json"))
    assert "commit marker of step 2" in str(ei.value)


@pytest.mark.ray
@pytest.mark.needs_checkpoint
def test_a_blocked_checkpoint_dir_stops_at_once_without_restarts(tmp_path, no_leaks):
    """Steps 2 and 4 commit (the first call's results); at step 5 a file is put where step 6's
    directory must go: its save fails with ENOTDIR on the stage hosts, and the run stops after 0
    of 3 restarts."""
    from orchestrator.driver.recovery import RecoveryStopped
    from tests.faults import BlockStepDir

    ck = tmp_path / "ck"
    job = recovery_job(tmp_path, "full", ck, max_restarts=3)
    with pytest.raises(RecoveryStopped) as ei:
        _run(job, hooks=[BlockStepDir(str(ck), step=5, blocked=6)], resume_command="meshpipe run j.yaml --resume")
    msg = str(ei.value)
    has_all(msg, f"checkpoint.dir = {ck} refused a checkpoint write in step 5", "ENOTDIR",
            str(ck / "step_00000006"), "not restarting: checkpoint.dir refused the write",
            "last committed checkpoint: step 4", "Continue with: meshpipe run j.yaml --resume")
    s = _summary(job)
    assert s["status"] == "failed" and s["restarts"] == 0 and s["recoveries"] == []
    f = s["failure"]
    assert (f["cause"], f["step"], f["errno"]) == ("checkpoint storage", 5, "ENOTDIR"), f
    assert f["path"] == str(ck / "step_00000006"), f
