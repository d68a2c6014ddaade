"""A missing optional dependency names the extra that installs it (issue #38).

The trial's step: a core-only install, a job naming the user's flax model, and the error was
`No module named 'flax'`, naming no extra. Here the absence is simulated in a subprocess by
`tests/without_packages.py` (a meta-path finder refusing the packages) running the real CLI.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from orchestrator.core import extras

ROOT = Path(__file__).resolve().parent.parent


def test_every_extra_of_pyproject_is_known_and_every_known_package_is_in_its_extra():
    import tomllib

    opt = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for module, extra in extras.EXTRAS.items():
        dist = "orbax-checkpoint" if module == "orbax" else module
        assert any(req.startswith(dist) for req in opt[extra]), (module, extra, opt[extra])


def test_with_hint_names_the_extra_and_keeps_the_type_and_name():
    e = extras.with_hint(ModuleNotFoundError("No module named 'flax'", name="flax"))
    assert isinstance(e, ModuleNotFoundError) and e.name == "flax"
    assert str(e) == "No module named 'flax' (flax comes with meshpipe's 'models' extra: pip install 'meshpipe[models]')"
    other = ModuleNotFoundError("No module named 'scipy'", name="scipy")
    assert extras.with_hint(other) is other                  # not an extra's package: unchanged


def test_extras_docstring_examples_run():
    import doctest

    result = doctest.testmod(extras, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def _cli(tmp_path: Path, absent: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)]), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "tests.without_packages", absent, *args], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path, env=env)


def _job(tmp_path: Path, factory: str, data: dict | None = None) -> Path:
    job = {"run": {"name": "x", "steps": 1, "output_dir": str(tmp_path / "runs")},
           "model": {"factory": factory},
           "data": data or {"source": "synthetic", "global_batch": 8},
           "optimizer": {"name": "sgd", "args": {"learning_rate": 0.1}},
           "pipeline": {"schedule": "1f1b", "microbatches": 2, "stages": [{"layers": [0, 1], "mesh": {"data": 2}},
                                                                          {"layers": [1, 2], "mesh": {"data": 2}}]}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


USER_MODULES = {
    # the user's model file imports flax at its top (the trial's case)
    "top": "from flax import nnx\n\ndef pipeline():\n    raise AssertionError('not reached')\n",
    # the user's factory imports only meshpipe's adapter; nnx_model imports flax
    "adapter": textwrap.dedent("""
        from orchestrator.core.model.adapters import nnx_model

        def pipeline():
            return nnx_model(lambda rngs: None, ["a"], loss=None, input=((4,), "float32"), label=((4,), "float32"))
        """),
    "eqx": textwrap.dedent("""
        from orchestrator.core.model.adapters import eqx_model

        def pipeline():
            return eqx_model(lambda key: None, ["a"], loss=None, input=((4,), "float32"), label=((4,), "float32"))
        """),
}


@pytest.mark.parametrize("case,absent,needles", [
    ("top", "flax", ["model.factory", "No module named 'flax'", "pip install 'meshpipe[models]'"]),
    ("adapter", "flax", ["model.factory", "nnx_model needs flax", "pip install 'meshpipe[models]'"]),
    ("eqx", "equinox", ["model.factory", "eqx_model needs equinox", "pip install 'meshpipe[models]'"]),
])
def test_a_model_factory_without_its_framework_names_the_models_extra(tmp_path, case, absent, needles):
    (tmp_path / f"user_{case}.py").write_text(USER_MODULES[case])
    r = _cli(tmp_path, absent, "plan", str(_job(tmp_path, f"user_{case}:pipeline")), "--allow-code")
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    missing = [n for n in needles if n not in r.stderr]
    assert not missing, f"{missing} not in:\n{r.stderr[-2000:]}"
    assert "Traceback" not in r.stderr


def test_a_data_factory_whose_module_imports_a_missing_package_names_the_data_extra(tmp_path):
    """grain is there; the user's grain source module imports `datasets`, which is not."""
    (tmp_path / "user_data.py").write_text("import datasets\n\ndef source():\n    return []\n")
    data = {"source": "grain", "factory": "user_data:source", "global_batch": 8, "seq_len": 8}
    job = _job(tmp_path, "gpt", data)
    raw = yaml.safe_load(job.read_text())
    raw["model"] = {"name": "gpt", "args": {"vocab": 64, "d_model": 16, "heads": 2, "blocks": 1}}
    job.write_text(yaml.safe_dump(raw))
    r = _cli(tmp_path, "datasets", "plan", str(job), "--allow-code")
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "data.factory" in r.stderr and "No module named 'datasets'" in r.stderr, r.stderr[-2000:]
    assert "pip install 'meshpipe[data]'" in r.stderr, r.stderr[-2000:]


def test_export_without_orbax_names_the_checkpoint_extra(tmp_path):
    (tmp_path / "step_1").mkdir()
    r = _cli(tmp_path, "orbax", "export", str(tmp_path / "step_1"), "--to", str(tmp_path / "out"))
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "meshpipe export needs orbax" in r.stderr and "pip install 'meshpipe[checkpoint]'" in r.stderr, r.stderr
