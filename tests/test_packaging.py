"""What a newcomer meets: the README's set-up commands, CI running exactly them, the
packaged default cluster, tested dependency ranges, and a non-editable install.

The install test (`-m install`) builds the package into a fresh venv and trains from
a directory outside the source tree; it is its own CI step (.ci/run).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.conftest import ROOT

SETUP_COMMANDS = [
    'pip install -e . && meshpipe run examples/gpt.yaml',
    'pip install -e ".[test]" && pytest',
]


def readme_setup_commands() -> list[str]:
    """The lines of the README's first fenced bash block (its set-up commands)."""
    text = (ROOT / "README.md").read_text()
    m = re.search(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)
    assert m, "README.md has no ```bash block"
    return [line for line in m.group(1).splitlines() if line.strip()]


def pins(path: Path) -> dict[str, Version]:
    """`name==version` lines of a constraints file, by normalised name."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"{path.name}: {line!r} is not name==version"
            out[_norm(name)] = Version(version)
    return out


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in project.get("optional-dependencies", {}).values():
        reqs += [Requirement(r) for r in extra]
    return reqs


def bounds(req: Requirement) -> tuple[Version, Version]:
    """(floor, upper) of a `>=floor,<upper` requirement."""
    ops = {s.operator: Version(s.version) for s in req.specifier}
    assert set(ops) == {">=", "<"}, f"{req}: wants exactly a >= floor and a < upper bound"
    return ops[">="], ops["<"]


# -- the README's commands and CI -------------------------------------------------
def test_readme_starts_with_the_two_setup_commands():
    assert readme_setup_commands() == SETUP_COMMANDS


def test_ci_runs_the_readme_commands_verbatim():
    """.ci/run has each README set-up command as a line of its own, word for word (so CI fails
    whenever the README would), and the multinode step is not allowed to select nothing."""
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    for cmd in readme_setup_commands():
        assert cmd in lines, f".ci/run does not run the README's command {cmd!r} verbatim"
    assert "pytest -m multinode" in lines
    assert not [ln for ln in lines if re.search(r"\brc\b.*\b5\b", ln)], ".ci/run must not excuse pytest's exit 5"


# -- the default cluster ships with the package -------------------------------------
def test_packaged_default_cluster_is_the_documented_one():
    from orchestrator.core.config import load_cluster
    from orchestrator.driver.cli import DEFAULT_CLUSTER

    documented = ROOT / "cluster_configs" / "local.yaml"
    assert DEFAULT_CLUSTER.parent == ROOT / "orchestrator" / "driver"
    assert DEFAULT_CLUSTER.read_bytes() == documented.read_bytes(), (
        f"{DEFAULT_CLUSTER} (what `meshpipe` uses without --cluster) and {documented} (its documented "
        "copy) differ: edit one, copy it over the other")
    assert load_cluster(str(DEFAULT_CLUSTER)) == load_cluster(str(documented))
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert DEFAULT_CLUSTER.name in data["orchestrator.driver"]


# -- dependency ranges ---------------------------------------------------------------
def test_every_dependency_has_a_tested_floor_and_an_upper_bound():
    """Floors are versions CI ran: the oldest pair's pins (constraints/oldest.txt, its own CI step)
    or, for a dependency not pinned there, the version in constraints/ci.txt. Every version CI ran
    lies inside the range."""
    ci = pins(ROOT / "constraints" / "ci.txt")
    oldest = pins(ROOT / "constraints" / "oldest.txt")
    for req in requirements():
        name = _norm(req.name)
        floor, upper = bounds(req)
        assert name in ci, f"{req.name}: not in constraints/ci.txt"
        assert ci[name] in req.specifier, f"{req}: CI ran {ci[name]}, outside the range"
        assert floor == oldest.get(name, ci[name]), (
            f"{req}: the floor must be a version CI ran ({oldest.get(name, ci[name])})")
        assert oldest.get(name, floor) in req.specifier
        assert upper.release[:2] > ci[name].release[:2], f"{req}: upper bound {upper} excludes CI's minor"
    for name in oldest:
        assert any(_norm(r.name) == name for r in requirements()), f"oldest.txt pins {name}, not a dependency"


# -- a non-editable install ------------------------------------------------------------
def _copy_source(dst: Path) -> Path:
    """The source tree without venvs, caches, runs and build leftovers (a stale build/ would leak
    into the wheel)."""
    skip = shutil.ignore_patterns(".git", ".*venv*", ".v", "__pycache__", "*.egg-info", "build", "dist",
                                  "runs", ".pytest_cache", ".hypothesis", "site")
    return Path(shutil.copytree(ROOT, dst, ignore=skip))


@pytest.mark.install
def test_non_editable_install_trains_from_another_directory(tmp_path):
    """`pip install .` into a fresh venv; from a directory outside the source tree, `meshpipe run`
    without --cluster finds the packaged local cluster and trains the README's GPT, whose data
    path is relative to the directory it runs from."""
    src = _copy_source(tmp_path / "src")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py, meshpipe = venv / "bin" / "python", venv / "bin" / "meshpipe"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "-c", str(src / "constraints" / "ci.txt"), str(src)],
                       capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    shutil.rmtree(src)                               # nothing may still read the source tree

    work = tmp_path / "elsewhere"
    shutil.copytree(ROOT / "examples", work / "examples")
    where = subprocess.run([str(py), "-c", "import orchestrator.driver.cli as c; print(c.__file__); "
                            "print(c.DEFAULT_CLUSTER); import meshpipe; print(meshpipe.__file__)"],
                           cwd=work, capture_output=True, text=True, timeout=120, env=env)
    assert where.returncode == 0, where.stderr
    module, cluster, api = where.stdout.split()
    site = str(venv / "lib")
    assert module.startswith(site) and cluster.startswith(site) and Path(cluster).is_file()
    assert api.startswith(site), "the public API package `meshpipe` is not in the wheel"

    out = subprocess.run([str(meshpipe), "run", "examples/gpt.yaml", "--set", "run.steps=2",
                          "--set", "run.output_dir=out"], cwd=work, capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((work / "out" / "gpt-tiny" / "latest" / "summary.json").read_text())
    assert summary["status"] == "completed" and len(summary["losses"]) == 2
    assert len((work / "out" / "gpt-tiny" / "latest" / "metrics.jsonl").read_text().splitlines()) == 2
