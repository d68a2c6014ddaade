"""The examples in the schedule layer's docstrings run and hold."""
import doctest
import importlib

import pytest

MODULES = ["ir", "generators", "lowering", "validate", "simulate", "stash", "render"]


@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples(module):
    mod = importlib.import_module(f"orchestrator.core.schedule.{module}")
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
