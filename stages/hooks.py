"""Worker hooks: an extension point for code that runs inside every stage worker.

Basic flow: the driver is given hook objects (`run_job(checked, hooks=[...])`,
or `PipelineExecutor(..., hooks=[...])`); they travel to each stage actor inside
its `WorkerConfig` (pickled with it, so a hook's class must be importable on the
actors, as any module on the driver's path is with a local Ray) and the worker
calls them at fixed points:

  on_setup(cfg)        at the start of `StageWorker.setup`, before jax loads;
  on_step(cfg, step)   at the start of every step, before its first action.

A hook that raises fails that call like any other error there: the run stops,
naming the stage and host, and every actor is torn down. Uses: start or stop a
profiler at a given step, log or check something per host, or (the test suite's
`tests/faults.py`) inject a failure at a chosen stage, host and step. The
default is no hooks; the per-step cost is then one loop over an empty tuple.

Example:

    >>> class EveryStep(WorkerHook):
    ...     def on_step(self, cfg, step):
    ...         print(f"stage {cfg.stage} host {cfg.host} step {step}")
"""
from __future__ import annotations


class WorkerHook:
    """Base of a worker hook: override what you need; the defaults do nothing.

    Instances must be picklable (they travel with the worker's config) and
    should be small, frozen values: every actor gets its own copy.
    """

    def on_setup(self, cfg) -> None:
        """Called at the start of `StageWorker.setup`; `cfg` is the actor's `WorkerConfig`."""

    def on_step(self, cfg, step: int) -> None:
        """Called at the start of step `step` (after the abort check, before any action)."""
