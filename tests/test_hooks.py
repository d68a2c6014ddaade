"""The worker hook interface (stages/hooks.py) and the tests' faults built on it, pure.

That the hooks run inside real stage actors (setup and step, every executor) is
shown by tests/test_cli.py's and tests/test_multinode.py's failure tests.
"""
from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest

from stages.hooks import WorkerHook
from tests.faults import FailSetup, FailStep


def cfg(stage: int, host: int):
    return SimpleNamespace(stage=stage, host=host, who=f"run stage {stage} host {host}")


def test_the_base_hook_does_nothing():
    h = WorkerHook()
    assert h.on_setup(cfg(0, 0)) is None and h.on_step(cfg(0, 0), 3) is None


def test_faults_travel_pickled_unchanged():
    for hook in (FailSetup(stage=1, host=0), FailStep(stage=1, host=0, step=2)):
        assert pickle.loads(pickle.dumps(hook)) == hook


def test_fail_setup_raises_only_on_its_actor():
    hook = FailSetup(stage=1, host=0)
    hook.on_setup(cfg(0, 0))
    hook.on_setup(cfg(1, 1))
    hook.on_step(cfg(1, 0), 0)
    with pytest.raises(RuntimeError, match="^run stage 1 host 0: injected setup failure$"):
        hook.on_setup(cfg(1, 0))


def test_fail_step_raises_only_at_its_step_on_its_actor():
    hook = FailStep(stage=1, host=0, step=2)
    hook.on_setup(cfg(1, 0))
    for c, step in ((cfg(1, 0), 1), (cfg(1, 0), 3), (cfg(0, 0), 2), (cfg(1, 1), 2)):
        hook.on_step(c, step)
    with pytest.raises(RuntimeError, match="^run stage 1 host 0: injected step failure at step 2$"):
        hook.on_step(cfg(1, 0), 2)
