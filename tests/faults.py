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
