"""A run's record in its run directory: what `meshpipe run` leaves behind, whatever happens.

    <run.output_dir>/<run.name>/<run id>/      (`orchestrator.driver.rundir`: one per run)
      metrics.jsonl      a line per step as it completes; a `restart` line at each restart; a
                         `resume` line where a resumed invocation (`--resume`) starts appending
      summary.json       written on every exit: status completed | failed | interrupted, the
                         losses, step times and evals so far, restarts and recoveries, ...
      error.txt          a failure's full (redacted) stage traceback; the next ones error.1.txt,
                         error.2.txt, ... (every attempt's, recovered or not: `error_files`)
      workers.json, trace.json, timeline.png
      previous/<k>/      what the k-th earlier invocation of this run wrote besides metrics.jsonl
                         (its summary, error files, pictures), set aside by `rundir.open_run`
                         when `--resume` continued the run (`previous` in the summary)

Basic flow (`orchestrator.driver.runner.run_job`): `rundir.open_run` gives the directory (a new
one, or with `--resume` the one continued, its earlier documents set aside), then
`RunRecord(...)` opens the record: metrics.jsonl is always appended to, after a `resume` line
when there was a record to continue. Then `step(rec)` per step result, `health(event)` per
training-health event (`orchestrator.core.health`), `rollback(step, restart)` when a restart drops
the steps after the commit it resumes from, `error_file(e)` for each failure's traceback, and
`completed(norms)` or `stopped(e)` at the end. `close()` in every case.

Invariants:
  - No record is erased or replaced: a run's directory is its own, a resumed invocation appends
    to the run's metrics.jsonl and finds the earlier documents under previous/<k>/. The losses,
    step times and evals of summary.json are this invocation's view (a resumed run's losses
    start with the committed steps'); metrics.jsonl is everything that happened.
  - Each file is written owner-only; summary.json atomically (`private_fs.write_private`).
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Callable

from orchestrator.core.private_fs import write_private
from orchestrator.core.redact import redact, redact_text
from orchestrator.driver.rundir import previous_of

log = logging.getLogger("meshpipe")


def numbered(path: Path) -> Path:
    """`path` itself if free, else the first free `<stem>.<n><suffix>` (n = 1, 2, ...)."""
    if not path.exists():
        return path
    n = 1
    while (found := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
        n += 1
    return found


class RunRecord:
    """See the module docstring.

    Args:
      checked: the job.
      out: the run directory (`rundir.open_run`: exists, owner-only).
      plan_json: the plan as summary.json records it.
      reference: the single-process reference run (`summary.reference.json`, `metrics.reference.jsonl`).
      resume: a resumed invocation (`--resume`): continue the run's metrics.jsonl.
      losses: the committed steps' losses a resumed run starts from.
      progress: what shows each step (`telemetry.Progress`), or None.
    """

    def __init__(self, checked, out: Path, plan_json: dict, *, reference: bool = False, resume: bool = False,
                 losses=(), progress=None):
        from orchestrator.driver.telemetry import StepLog

        self.checked, self.out, self.plan_json = checked, Path(out), plan_json
        suffix = ".reference" if reference else ""
        self.summary_path = self.out / f"summary{suffix}.json"
        self.resumed_from = len(losses) if resume else None
        log_path = self.out / f"metrics{suffix}.jsonl"
        continued = resume and log_path.exists()          # an earlier invocation's lines to continue
        self.previous = previous_of(self.out)             # the earlier invocations' documents, oldest first
        self.metrics = StepLog(log_path)                  # appended to, never truncated
        self.progress = progress
        self.samples = checked.job.data.global_batch
        self.losses: list[float] = list(losses)
        self.times: list[float] = []
        self.evals: list[list] = []          # [step, mean eval loss] (data.eval)
        self.errors: list[str] = []          # this invocation's error files, in order
        self.extra: dict = {"mode": "reference" if reference else "pipeline", "run_dir": str(self.out)}
        if continued:
            self.metrics.append({"resume": self.resumed_from, "previous": self.previous, "time": time.time()})

    # -- as the run goes ---------------------------------------------------
    def step(self, rec: dict) -> None:
        """One step's result: into summary.json's lists, a line of metrics.jsonl, the progress display."""
        rec = {**rec, "samples_per_s": self.samples / rec["step_time_s"] if rec["step_time_s"] else 0.0}
        if rec.get("loss_scale") is not None:      # precision.loss_scale: the scale used, whether skipped
            scaled = self.extra.setdefault("loss_scale", {"scales": [], "skipped_steps": []})
            scaled["scales"].append(rec["loss_scale"])
            if rec["skipped"]:
                scaled["skipped_steps"].append(rec["step"])
        self.losses.append(rec["loss"])
        self.times.append(rec["step_time_s"])
        if rec.get("eval_loss") is not None:
            self.evals.append([rec["step"], rec["eval_loss"]])
        self.metrics.append({**rec, "time": time.time()})
        if self.progress is not None:
            self.progress.update(rec)

    def health(self, event: dict) -> None:
        """A training-health event (`orchestrator.core.health.Event.as_record`) into summary.json's
        `health` (opened by the run: `Session`): every event is kept, a skip's step is listed."""
        health = self.extra["health"]
        health["events"].append(event)
        if event["action"] == "skip":
            health["skipped_steps"].append(event["step"])

    def rollback(self, step: int, restart: int, grow: bool = False) -> None:
        """A restart from checkpoint `step` (`grow`: an elastic grow-back, no failure): the later steps
        leave summary.json's lists (they run again); metrics.jsonl keeps them and gets a `restart`
        (or `grow`) line."""
        lost = len(self.losses) - step
        del self.losses[step:]
        if lost > 0:
            del self.times[max(0, len(self.times) - lost):]
            scaled = self.extra.get("loss_scale")
            if scaled:                      # precision.loss_scale's per-step record goes the same way
                del scaled["scales"][max(0, len(scaled["scales"]) - lost):]
                scaled["skipped_steps"] = [s for s in scaled["skipped_steps"] if s < step]
        self.evals[:] = [e for e in self.evals if e[0] < step]
        if "health" in self.extra:          # the skips from the commit on run again (the events stay)
            self.extra["health"]["skipped_steps"] = [s for s in self.extra["health"]["skipped_steps"] if s < step]
        what = {"grow": True} if grow else {"restart": restart}
        self.metrics.append({**what, "resumed_from": step, "time": time.time()})

    def error_file(self, message: str, where: str, detail: str) -> Path:
        """A failure's full traceback in the next free `error[.N].txt`; returns its path."""
        path = numbered(self.out / "error.txt")
        write_private(path, f"{message}\nwhere: {where}\n\n{detail}\n")
        self.errors.append(path.name)
        return path

    # -- at the end ----------------------------------------------------------
    def summary(self, status: str, param_norms: dict, error: str | None = None) -> dict:
        return {
            "run": self.checked.job.run.name,
            "status": status,               # completed | failed | interrupted
            **({"error": error} if error is not None else {}),
            "steps_done": len(self.losses),
            "losses": self.losses,
            "step_times_s": self.times,
            "param_norms": param_norms,
            "eval_losses": self.evals,
            "plan": self.plan_json,
            "config": json.dumps(redact(self.checked.to_dict()), indent=2),  # secrets never reach disk
            **({"error_files": list(self.errors)} if self.errors else {}),
            **({"previous": list(self.previous)} if self.previous else {}),
            **self.extra,
        }

    def completed(self, norms: dict, echo: Callable[[str], None]) -> dict:
        done = self.summary("completed", norms)
        write_private(self.summary_path, json.dumps(done, indent=1))  # 0o600, atomic
        echo(f"wrote {self.summary_path}")
        return done

    def stopped(self, e: BaseException, echo: Callable[[str], None]) -> None:
        """The record of a run that stopped early: summary.json with status "failed" or "interrupted",
        a stage's full traceback in the next error file; the record's path and the steps done go
        onto `e` for the CLI (`interrupt.stopped_message`, the stage-failure report)."""
        from orchestrator.driver.waiting import StageFailure

        status = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
        total = self.checked.job.run.steps
        try:
            if isinstance(e, StageFailure) and e.detail:
                e.error_file = str(self.error_file(e.message, e.where, e.detail))
            rec = self.summary(status, {}, redact_text(f"{type(e).__name__}: {getattr(e, 'message', None) or e}"))
            write_private(self.summary_path, json.dumps(rec, indent=1))
            echo(f"wrote {self.summary_path} ({status} after {rec['steps_done']} of {total} steps)")
        except Exception as w:  # noqa: BLE001 - the record must not hide the run's own error
            log.warning("could not write %s: %s", self.summary_path, w)
            return
        if isinstance(e, KeyboardInterrupt):
            e.steps_done, e.total_steps, e.record = rec["steps_done"], total, str(self.summary_path)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()   # end the bar's line before anything else is printed
        self.metrics.close()
