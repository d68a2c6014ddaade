"""Fault injection for the failure tests, through the workers' hook interface (`stages.hooks`).

The product has no test switches: a test passes these hooks to `run_job(checked,
hooks=[...])`; each stage actor gets them in its `WorkerConfig` and calls them at
setup and at every step's start. A hook raises only on the actor it names.

    run_job(checked, hooks=[FailSetup(stage=1, host=0)])
    run_job(checked, hooks=[FailStep(stage=1, host=0, step=2)])
"""
from __future__ import annotations

from dataclasses import dataclass

from stages.hooks import WorkerHook


@dataclass(frozen=True)
class FailSetup(WorkerHook):
    """`setup` of (stage, host) raises before anything else happens there."""

    stage: int
    host: int

    def on_setup(self, cfg) -> None:
        if (cfg.stage, cfg.host) == (self.stage, self.host):
            raise RuntimeError(f"{cfg.who}: injected setup failure")


@dataclass(frozen=True)
class FailStep(WorkerHook):
    """(stage, host) raises at the start of `step`, before the step's first action."""

    stage: int
    host: int
    step: int

    def on_step(self, cfg, step: int) -> None:
        if (cfg.stage, cfg.host, step) == (self.stage, self.host, self.step):
            raise RuntimeError(f"{cfg.who}: injected step failure at step {step}")


@dataclass(frozen=True)
class FailStepOnce(WorkerHook):
    """(stage, host) raises at the start of `step` the first time any attempt gets there (the file
    `flag` records that it did): a failure a restart gets past."""

    stage: int
    host: int
    step: int
    flag: str

    def on_step(self, cfg, step: int) -> None:
        import os

        if (cfg.stage, cfg.host, step) == (self.stage, self.host, self.step):
            try:
                os.close(os.open(self.flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            except FileExistsError:
                return
            raise RuntimeError(f"{cfg.who}: injected one-time failure at step {step}")


@dataclass(frozen=True)
class FailStepAtVisit(WorkerHook):
    """(stage, host) raises at the start of `step` the `visit`-th time any attempt gets there (one
    file per visit in the directory `counter`): a failure in a later attempt only."""

    stage: int
    host: int
    step: int
    visit: int
    counter: str

    def on_step(self, cfg, step: int) -> None:
        import os

        if (cfg.stage, cfg.host, step) != (self.stage, self.host, self.step):
            return
        n = 1
        while True:
            try:
                os.close(os.open(os.path.join(self.counter, str(n)), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
                break
            except FileExistsError:
                n += 1
        if n == self.visit:
            raise RuntimeError(f"{cfg.who}: injected failure at step {step}, visit {n}")


@dataclass(frozen=True)
class HoldAt(WorkerHook):
    """(stage, host) stops at the start of `step` — once `wait_for` exists (e.g. a commit marker;
    bounded by `timeout_s`) it creates `reached` and sleeps up to `timeout_s`, for a test to kill
    or stop it there. Only the first attempt holds: once `reached` exists, the hook does nothing."""

    stage: int
    host: int
    step: int
    wait_for: str
    reached: str
    timeout_s: float = 120.0

    def on_step(self, cfg, step: int) -> None:
        import os
        import time

        if (cfg.stage, cfg.host, step) != (self.stage, self.host, self.step) or os.path.exists(self.reached):
            return
        deadline = time.monotonic() + self.timeout_s
        while not os.path.exists(self.wait_for) and time.monotonic() < deadline:
            time.sleep(0.02)
        with open(self.reached, "w") as f:
            f.write(str(os.getpid()))
        while time.monotonic() < deadline:
            time.sleep(0.05)


@dataclass(frozen=True)
class HoldSetup(WorkerHook):
    """(stage, host) stops at the start of `setup` once `armed` exists (e.g. another hold's
    `reached`: a later attempt), creates `reached` and sleeps up to `timeout_s` — for a test to
    kill it while the run recovers. Only one attempt holds: once `reached` exists, nothing."""

    stage: int
    host: int
    armed: str
    reached: str
    timeout_s: float = 120.0

    def on_setup(self, cfg) -> None:
        import os
        import time

        if ((cfg.stage, cfg.host) != (self.stage, self.host) or not os.path.exists(self.armed)
                or os.path.exists(self.reached)):
            return
        with open(self.reached, "w") as f:
            f.write(str(os.getpid()))
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            time.sleep(0.05)


@dataclass(frozen=True)
class FillDiskAt(WorkerHook):
    """(stage, host) at the start of `step`, once `wait_for` exists (e.g. an earlier step's commit
    marker; bounded by `timeout_s`, then it raises), fills the filesystem holding `path` to its
    last block with the file `path`: another writer took the disk. Only the first attempt fills."""

    stage: int
    host: int
    step: int
    wait_for: str
    path: str
    timeout_s: float = 120.0

    def on_step(self, cfg, step: int) -> None:
        import os
        import time

        if (cfg.stage, cfg.host, step) != (self.stage, self.host, self.step) or os.path.exists(self.path):
            return
        deadline = time.monotonic() + self.timeout_s
        while not os.path.exists(self.wait_for):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{cfg.who}: {self.wait_for} did not appear within {self.timeout_s:g} s")
            time.sleep(0.02)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            for block in (1 << 16, 1 << 12):
                try:
                    while True:
                        os.write(fd, b"\0" * block)
                except OSError:
                    pass
        finally:
            os.close(fd)


@dataclass(frozen=True)
class BlockStepDir(WorkerHook):
    """At the start of `step`, stage 0 host 0 puts a file where checkpoint step `blocked`'s
    directory must go (`<root>/step_<blocked>`): that save then fails with a real OSError, as
    a read-only or full `checkpoint.dir` would (tests run as root here, so chmod blocks nothing)."""

    root: str
    step: int
    blocked: int

    def on_step(self, cfg, step: int) -> None:
        from orchestrator.core.checkpoint import step_dir

        if (cfg.stage, cfg.host, step) == (0, 0, self.step):
            step_dir(self.root, self.blocked).write_text("in the way\n")
