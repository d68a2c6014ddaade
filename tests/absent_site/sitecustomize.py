"""Python's start-up hook for the processes of `tests/without_packages.py` (a test harness, never
product code): with `MESHPIPE_TEST_ABSENT=flax,equinox` in the environment and this directory on
PYTHONPATH, every Python process — the CLI and the children it starts, such as the job-code
check of `orchestrator.driver.usercode` — refuses those top-level packages (and their
submodules) with the ModuleNotFoundError Python raises for an absent package.
"""
import importlib.abc
import os
import sys

ENV = "MESHPIPE_TEST_ABSENT"


class Absent(importlib.abc.MetaPathFinder):
    """Refuses the named top-level packages, placed first on `sys.meta_path`."""

    def __init__(self, names):
        self.names = set(names)

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


def install(names) -> None:
    """Forget the named packages if imported, and refuse them from now on in this process."""
    names = set(names)
    for mod in [m for m in sys.modules if m.split(".")[0] in names]:
        del sys.modules[mod]
    if not any(isinstance(f, Absent) for f in sys.meta_path):
        sys.meta_path.insert(0, Absent(names))


if os.environ.get(ENV):
    install(os.environ[ENV].split(","))
