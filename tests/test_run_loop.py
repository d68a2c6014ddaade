"""The driver's run loop in parts: attempts and recovery with fake attempts (pure), the run's record
(files only), and on Ray a failed run resumed: its record continues, nothing of it erased.

`run_attempts` (`orchestrator.driver.attempts`) knows an attempt by `run` and `close` and the run
by `Recovery` (`committed`, `restart`, `stop`), so each recovery decision is tested here without
Ray; the Ray tests of tests/test_recovery.py drive the same loop with real attempts.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.core.recovery import DIED, ERROR, Failure, RestartPolicy
from orchestrator.driver.attempts import AttemptFailed, run_attempts


class FakeAttempt:
    def __init__(self, outcome):
        self.outcome, self.closed = outcome, None

    def run(self):
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome

    def close(self, after_failure: bool, hung=()):
        self.closed = after_failure
        return {"graceful_s": 0.0, "stuck": []}


class FakeRun:
    """The run between attempts: a commit at `committed`, restarts recorded, a stop as an error."""

    def __init__(self, committed=4):
        self.commit, self.restarts, self.stops = committed, [], []

    def committed(self):
        return self.commit

    def restart(self, failed, attempt, restarts):
        attempt.close(after_failure=True)
        self.restarts.append((failed.failure.cause, failed.failure.step, restarts))
        return self.commit, {"steps_lost": failed.failure.step - self.commit}

    def stop(self, failed, decision):
        self.stops.append(decision.reason)
        return RuntimeError(f"stopped: {decision.reason}")

    def placement_lost(self, e):
        from orchestrator.core.recovery import Decision

        return Decision(False, f"the placement could not be reserved again within 9 s: {e}")

    def replan(self, failed, recovering):
        return self.placement_lost(failed.error)


class ElasticRun(FakeRun):
    """failure.elastic: each failed placement re-plans onto `hosts.pop(0)` hosts while that is at least
    `min_hosts` (fewer than the last plan), else stops; a grow switches back and counts nothing."""

    def __init__(self, hosts, min_hosts=1, committed=4):
        super().__init__(committed)
        self.hosts, self.min_hosts, self.plans, self.grows = list(hosts), min_hosts, [3], []

    def replan(self, failed, recovering):
        from orchestrator.core.recovery import Decision

        left = self.hosts.pop(0)
        if left < self.min_hosts or left >= self.plans[-1]:
            return Decision(False, f"{self.placement_lost(failed.error).reason}; failure.elastic: {left} host(s)")
        self.plans.append(left)
        return self.commit, recovering

    def grow(self, grow, attempt):
        attempt.close(after_failure=False)
        self.plans.append(3)
        self.grows.append(grow.step)
        return grow.step, {"detected_at": 0.0, "steps_lost": 0, "restart": 1}


def loop(outcomes, max_restarts=2, committed=4, run=None):
    made, run = [], run or FakeRun(committed)

    def start(first, recovering):
        made.append((first, recovering, FakeAttempt(outcomes[len(made)])))
        return made[-1][2]

    return made, run, lambda: run_attempts(start, 0, RestartPolicy(max_restarts), run)


def failed(cause, step, text="x", stage=1):
    return AttemptFailed(Failure(cause, stage, 0, step, text), {}, RuntimeError(text), steps_done=step)


def test_a_death_restarts_from_the_commit_and_the_next_attempt_finishes():
    made, run, go = loop([failed(DIED, 5), ("norms", None)])
    assert go() == ("norms", None)
    assert run.restarts == [(DIED, 5, 1)] and run.stops == []
    assert [(first, rec) for first, rec, _ in made] == [(0, None), (4, {"steps_lost": 1})]
    assert made[0][2].closed is True                # the failed attempt torn down before the next starts


def test_the_same_error_at_the_same_step_stops_as_deterministic():
    made, run, go = loop([failed(ERROR, 5, "NaN"), failed(ERROR, 5, "NaN")])
    with pytest.raises(RuntimeError, match="stopped: the same failure .* deterministic"):
        go()
    assert len(made) == 2 and len(run.restarts) == 1


def test_restarts_used_up_or_nothing_committed_stop_with_the_reason():
    _, run, go = loop([failed(DIED, 5), failed(DIED, 6), failed(DIED, 7)], max_restarts=2)
    with pytest.raises(RuntimeError, match="max_restarts = 2 restarts are used up"):
        go()
    assert [r[2] for r in run.restarts] == [1, 2]
    _, run, go = loop([failed(DIED, 1)], committed=None)
    with pytest.raises(RuntimeError, match="no checkpoint is committed yet"):
        go()


def test_without_restarts_the_error_is_raised_as_it_was():
    f = failed(ERROR, 3, "boom")
    _, run, go = loop([f], max_restarts=0)
    with pytest.raises(RuntimeError) as ei:
        go()
    assert ei.value is f.error and run.stops == [] and run.restarts == []


def test_a_placement_that_fails_after_a_restart_stops_but_the_first_is_raised_as_is():
    from orchestrator.core.backends import PlacementError

    first = PlacementError("the cluster has 1 node, the job needs 2")
    _, run, go = loop([first])
    with pytest.raises(PlacementError) as ei:
        go()
    assert ei.value is first
    _, run, go = loop([failed(DIED, 5), PlacementError("no room")])
    with pytest.raises(RuntimeError, match="placement could not be reserved again within 9 s: no room"):
        go()
    assert run.restarts == [(DIED, 5, 1)]


def test_elastic_a_failed_placement_replans_and_a_second_loss_replans_again_then_min_hosts_stops():
    """A restart's placement fails → the run re-plans (3 → 2 hosts) and goes on without counting a
    restart; that plan's placement fails too (a second loss while re-planning) → 1 host; with
    min_hosts 2 the second re-plan stops with both reasons."""
    from orchestrator.core.backends import PlacementError

    run = ElasticRun([2, 1])
    made, run, go = loop([failed(DIED, 5), PlacementError("no room"), PlacementError("lost again"),
                          ("norms", None)], max_restarts=1, run=run)
    assert go() == ("norms", None)
    assert run.plans == [3, 2, 1] and run.restarts == [(DIED, 5, 1)] and run.stops == []
    assert [first for first, _, _ in made] == [0, 4, 4, 4]
    run = ElasticRun([2, 1], min_hosts=2)
    made, run, go = loop([failed(DIED, 5), PlacementError("no room"), PlacementError("lost again")],
                         max_restarts=1, run=run)
    with pytest.raises(RuntimeError, match="within 9 s: lost again; failure.elastic: 1 host"):
        go()
    assert run.plans == [3, 2] and len(made) == 3


def test_elastic_a_grow_back_starts_the_next_attempt_at_its_commit_and_counts_no_restart():
    from orchestrator.core.backends import PlacementError
    from orchestrator.driver.elastic import GrowBack

    grow = GrowBack(type("G", (), {"reason": "3 hosts available"})(), step=8, at=0.0, planning_s=0.01)
    made, run, go = loop([failed(DIED, 5), PlacementError("no room"), grow, ("norms", None)],
                         max_restarts=1, run=ElasticRun([2]))
    assert go() == ("norms", None)
    assert run.plans == [3, 2, 3] and run.grows == [8] and len(run.restarts) == 1
    assert [first for first, _, _ in made] == [0, 4, 4, 8] and made[2][2].closed is False


# ----------------------------------------------------------------------------- the record (files)

def _checked(tmp_path):
    from tests.test_checkpoint import checked_of, gpt_job

    return checked_of(gpt_job(tmp_path, "rec", tmp_path / "ck"))


def _record(checked, out, **kw):
    from orchestrator.driver.record import RunRecord

    return RunRecord(checked, out, {"plan": 1}, **kw)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _job(tmp_path):
    from types import SimpleNamespace

    return SimpleNamespace(run=SimpleNamespace(output_dir=str(tmp_path / "runs"), name="rec"))


def test_a_resumed_record_keeps_every_earlier_line_error_and_summary(tmp_path):
    """One run, two invocations: the second (`--resume`) appends to the run's metrics.jsonl after a
    `resume` line, the first's summary and error file are under previous/1/, nothing is replaced."""
    from orchestrator.driver.rundir import open_run
    from orchestrator.driver.waiting import StageFailure

    checked = _checked(tmp_path)
    out = open_run(_job(tmp_path))
    first = _record(checked, out)
    for step in range(3):
        first.step({"step": step, "loss": 1.0 - step / 10, "step_time_s": 0.5})
    first.rollback(2, 1)
    first.step({"step": 2, "loss": 0.8, "step_time_s": 0.5})
    first.close()
    err = StageFailure("steps 2-3 failed on stage 1 host 0: boom", detail="Traceback ...\nboom", where="stage 1 host 0")
    first.stopped(err, echo=lambda s: None)
    assert err.error_file == str(out / "error.txt")
    assert open_run(_job(tmp_path), resume=True) == out
    second = _record(checked, out, resume=True, losses=[1.0, 0.9])
    second.error_file("a recovered failure", "stage 0 host 0", "Traceback ...\nother")
    second.step({"step": 2, "loss": 0.8, "step_time_s": 0.4})
    second.close()
    done = second.completed({"w": 1.0}, echo=lambda s: None)
    lines = _lines(out / "metrics.jsonl")
    assert [ln.get("step", ln.get("restart", ln.get("resume"))) for ln in lines] == [0, 1, 2, 1, 2, 2, 2]
    assert lines[3]["restart"] == 1 and lines[5] == {**lines[5], "resume": 2, "previous": ["previous/1"]}
    earlier = json.loads((out / "previous" / "1" / "summary.json").read_text())      # the first's, kept
    assert earlier["status"] == "failed" and earlier["error_files"] == ["error.txt"]
    assert (out / "previous" / "1" / "error.txt").read_text().startswith("steps 2-3 failed")
    assert (out / "error.txt").read_text().startswith("a recovered failure")          # the second's own
    assert done["error_files"] == ["error.txt"] and done["previous"] == ["previous/1"]
    assert done["losses"] == [1.0, 0.9, 0.8] and done["status"] == "completed" and done["run_dir"] == str(out)
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"


def test_a_resumed_record_with_nothing_before_it_is_a_plain_one(tmp_path):
    """`--resume auto` with nothing to continue (what `meshpipe submit` runs the first time): no
    resume line, nothing set aside."""
    from orchestrator.driver.rundir import open_run

    checked = _checked(tmp_path)
    out = open_run(_job(tmp_path), resume=True)
    rec = _record(checked, out, resume=True)
    rec.step({"step": 0, "loss": 1.0, "step_time_s": 0.5})
    rec.close()
    assert [ln["step"] for ln in _lines(out / "metrics.jsonl")] == [0]
    assert "previous" not in rec.completed({}, echo=lambda s: None)
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "summary.json"]


def test_a_second_run_of_the_job_replaces_nothing(tmp_path):
    """Running the job again (no --resume) is a run of its own in a new directory: the first run's
    files stay as they were, whatever they were (the code before run directories deleted them
    after --overwrite)."""
    from orchestrator.driver.rundir import open_run, run_ids

    checked = _checked(tmp_path)
    first = open_run(_job(tmp_path), now=0)
    for name in ("summary.json", "error.txt", "error.1.txt", "metrics.jsonl", "trace.json"):
        (first / name).write_text("{}\n")
    second = open_run(_job(tmp_path), now=1)
    rec = _record(checked, second)
    rec.close()
    assert second != first and run_ids(first.parent) == [first.name, second.name]
    assert sorted(p.name for p in first.iterdir()) == ["error.1.txt", "error.txt", "metrics.jsonl", "summary.json",
                                                       "trace.json"]
    assert all(p.read_text() == "{}\n" for p in first.iterdir())
    assert sorted(p.name for p in second.iterdir()) == ["metrics.jsonl"]


# ----------------------------------------------------------------------------- on Ray

@pytest.mark.ray
@pytest.mark.needs_checkpoint
def test_a_failed_run_resumed_continues_its_record(tmp_path, no_leaks):
    """A run that fails at step 5 (the driver learns steps 4 at a time: it has 0-3, a commit at 2 or 4)
    and is then resumed: its run directory's metrics.jsonl holds both invocations' steps with a
    resume line between, the failed invocation's error.txt and summary are kept in previous/1/
    (the code before this erased all three at the resumed run's start)."""
    from orchestrator.core import checkpoint as ck
    from orchestrator.driver.runner import run_job
    from tests.faults import FailStep
    from tests.records import run_dir
    from tests.test_checkpoint import checked_of, gpt_job

    job = gpt_job(tmp_path, "again", tmp_path / "ck", steps=6)
    with pytest.raises(Exception, match="injected step failure at step 5"):
        run_job(checked_of(job), echo=lambda s: None, hooks=[FailStep(stage=1, host=0, step=5)])
    out = run_dir(job["run"]["output_dir"], "again")
    assert (out / "error.txt").exists() and json.loads((out / "summary.json").read_text())["status"] == "failed"
    steps_before = [ln["step"] for ln in _lines(out / "metrics.jsonl") if "step" in ln]
    assert steps_before == [0, 1, 2, 3]
    committed = ck.select(tmp_path / "ck")["step"]
    done = run_job(checked_of(job), echo=lambda s: None, resume="latest")
    assert done["run_dir"] == str(out)                                     # the same run, continued
    lines = _lines(out / "metrics.jsonl")
    resume_at = next(i for i, ln in enumerate(lines) if "resume" in ln)
    assert [ln["step"] for ln in lines[:resume_at]] == steps_before          # the failed run's lines kept
    assert lines[resume_at]["resume"] == committed and lines[resume_at]["previous"] == ["previous/1"]
    assert [ln["step"] for ln in lines[resume_at + 1:]] == list(range(committed, 6))
    assert "injected step failure at step 5" in (out / "previous" / "1" / "error.txt").read_text()
    assert json.loads((out / "previous" / "1" / "summary.json").read_text())["error_files"] == ["error.txt"]
    assert done["status"] == "completed" and done["previous"] == ["previous/1"]
    assert done["steps_done"] == 6 and len(done["losses"]) == 6
