"""Run the meshpipe CLI as if some packages were not installed (a test harness, never product code).

    python -m tests.without_packages flax,equinox plan job.yaml --allow-code

A `sys.meta_path` finder placed first refuses the named top-level packages (and their
submodules) with the ModuleNotFoundError Python raises for an absent package, so a core-only
install is simulated in a venv that has every extra.
"""
from __future__ import annotations

import importlib.abc
import sys


class Absent(importlib.abc.MetaPathFinder):
    def __init__(self, names: set[str]):
        self.names = names

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


def main() -> None:
    names = set(sys.argv[1].split(","))
    for mod in [m for m in sys.modules if m.split(".")[0] in names]:
        del sys.modules[mod]
    sys.meta_path.insert(0, Absent(names))
    from orchestrator.driver.cli import main as cli

    sys.argv = ["meshpipe", *sys.argv[2:]]
    cli()


if __name__ == "__main__":
    main()
