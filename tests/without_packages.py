"""Run the meshpipe CLI as if some packages were not installed (a test harness, never product code).

    python -m tests.without_packages flax,equinox plan job.yaml --allow-code

A `sys.meta_path` finder placed first refuses the named top-level packages (and their
submodules) with the ModuleNotFoundError Python raises for an absent package, so a core-only
install is simulated in a venv that has every extra. The CLI's own child processes (the job's
code checked in a child, `orchestrator.driver.usercode`) get the same finder through
`tests/absent_site/sitecustomize.py`, put on their PYTHONPATH here.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

SITE = Path(__file__).resolve().parent / "absent_site"


def main() -> None:
    names = sys.argv[1]
    os.environ["MESHPIPE_TEST_ABSENT"] = names          # inherited by every child process
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE), os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, str(SITE))
    import sitecustomize                                 # this directory's: the finder

    sitecustomize.install(names.split(","))
    from orchestrator.driver.cli import main as cli

    sys.argv = ["meshpipe", *sys.argv[2:]]
    cli()


if __name__ == "__main__":
    main()
