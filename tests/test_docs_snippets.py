"""The code on the docs' model, data and checkpoint pages runs as written: docs that cannot rot.

- Bring your own model (`docs/guides/models.md`): each framework's marked example is executed
  from the page, its factory called, and the PipelineModel it returns checked the way a job
  would (`describe`: shapes, part chaining, loss) and numerically: its parts, initialised from
  one key and applied in order, compute the whole model's own output from the model's own init
  (rtol 1e-5 / atol 1e-6, float32), so an adapter that splits the model wrongly fails here. A
  block marked `verbatim from PATH` must be PATH's text and runs among that file's definitions.
  The page's other Python blocks run as they are.
- Data (`docs/guides/data.md`): the Python blocks run in order in a scratch directory (they
  write a token shard and read it through a grain-style source), the `tokens` job the page shows
  for that shard passes `check_job` (every token id checked against the model's vocabulary), and
  the `meshpipe prepare` + `meshpipe run` block runs as written (`slow`).
- Checkpoints (`docs/guides/checkpoints.md`): the export block runs as written against a real
  run's export (`slow`), and every command of the command block parses with the CLI's own
  definitions.
- On all three pages every YAML block is a valid section of a job (`parse_job`), and the README's
  tour snippet runs.
"""
from __future__ import annotations

import contextlib
import io
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.docs_blocks import ROOT, blocks

MODELS, DATA, CHECKPOINTS = "docs/guides/models.md", "docs/guides/data.md", "docs/guides/checkpoints.md"


def snippets() -> dict:
    """name -> block, for each marked block of the models page."""
    return {b.name: b for b in blocks(MODELS, "python") if b.name}


@contextlib.contextmanager
def scratch_dir(tmp_path: Path):
    """A working directory with a copy of the repository's `examples/` (pages use paths from the repo
    root; a copy, not a link: a data path through a directory link that leads out is refused)."""
    shutil.copytree(ROOT / "examples", tmp_path / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        yield tmp_path
    finally:
        os.chdir(old)


def run_block(code: str, namespace: dict, where: str) -> str:
    """Execute a page's block; returns what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, where, "exec"), namespace)
    return out.getvalue()


# -- bring your own model ------------------------------------------------------------------------
def test_the_models_page_marks_an_example_for_each_framework():
    assert sorted(snippets()) == ["equinox", "linen", "nnx", "plain"]


def test_a_verbatim_snippet_is_its_files_text():
    for name, b in snippets().items():
        if b.verbatim_from is not None:
            assert b.code in (ROOT / b.verbatim_from).read_text(), f"{b} is not verbatim in {b.verbatim_from}"


def test_the_pages_import_only_the_public_api():
    """The docs show what users write against: `meshpipe`, never the internal packages."""
    pages = ["README.md", *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").rglob("*.md")))]
    for page in pages:
        for b in blocks(page, "python"):
            assert "orchestrator" not in b.code and "stages." not in b.code, f"{b} imports an internal path"


def chained(model, key, x):
    """The parts of a PipelineModel, each initialised from `key`, applied in order."""
    for part in model.parts:
        x = part.apply(part.init(key), x, rng=None, train=True)
    return x


def whole_linen(ns, key, x):
    from flax import linen as nn

    module = ns["Model"]()
    return module.apply(nn.unbox(module.init(key, x)), x)


def whole_plain(ns, key, x):
    p = ns["init"](key)
    h = x @ p["in"]["w"]
    for i in range(2):
        h = ns["block"](p[f"block{i}"], h)
    return h @ p["out"]["w"]


def whole_equinox(ns, key, x):
    import jax

    return jax.vmap(ns["Decoder"](64, 32, 4, 64, 2, key))(x)


def whole_nnx(ns, key, x):
    from flax import nnx

    with nnx.use_eager_sharding(False):     # axis names only: no mesh here
        return ns["Llama"](64, 32, 4, 2, 64, 2, nnx.Rngs(key))(x)     # pipeline()'s defaults


CASES = {"linen": ("linen_pipeline", whole_linen), "plain": ("plain_pipeline", whole_plain),
         "equinox": ("pipeline", whole_equinox), "nnx": ("pipeline", whole_nnx)}


# equinox: its attention compiles slowly (24-52 s on 2 loaded cores); its text is checked verbatim
# above and its adapter planned in tests/test_byo_eqx_example.py in the default suite
@pytest.mark.parametrize("name", [pytest.param("linen", marks=pytest.mark.needs_models),
                                  pytest.param("nnx", marks=pytest.mark.needs_models), "plain",
                                  pytest.param("equinox", marks=pytest.mark.slow)])
def test_snippet_runs_and_its_parts_compute_the_whole_model(name):
    import importlib

    import jax
    import jax.numpy as jnp

    import meshpipe

    b = snippets()[name]
    namespace: dict = {}
    if b.verbatim_from is not None:   # a verbatim snippet runs among its file's definitions (its imports, its model)
        namespace.update(vars(importlib.import_module(b.verbatim_from[:-len(".py")].replace("/", "."))))
    run_block(b.code, namespace, str(b))
    factory, whole = CASES[name]
    model = namespace[factory]()
    spec = meshpipe.describe(model, name=name)
    assert len(spec.layers) == 4
    key = jax.random.key(7)
    if model.input.dtype == "int32":
        x = jax.random.randint(jax.random.key(1), (3, *model.input.shape), 0, 64, jnp.int32)
    else:
        x = jax.random.normal(jax.random.key(1), (3, *model.input.shape))
    got = jax.jit(lambda k, x: chained(model, k, x))(key, x)
    want = jax.jit(lambda k, x: whole(namespace, k, x))(key, x)
    assert got.shape == want.shape == (3, *spec.layers[-1].outputs[0].shape)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    labels = jnp.zeros((3, *model.label.shape), model.label.dtype)
    assert np.isfinite(float(model.loss(got, labels)))


@pytest.mark.needs_models
def test_the_models_pages_other_python_blocks_run_as_written():
    rest = [b for b in blocks(MODELS, "python") if not b.name]
    assert rest, "the models page shows how to check a model with meshpipe.describe"
    for b in rest:
        printed = run_block(b.code, {"__name__": "docs"}, str(b))
        if "describe" in b.code:     # the block says what it prints
            assert printed.strip() == "['embed', 'blocks.0', 'blocks.1', 'head']", printed


# -- YAML on the three pages -----------------------------------------------------------------------
def base_job() -> dict:
    from orchestrator.core.safe_yaml import safe_load_file

    return safe_load_file(ROOT / "examples" / "gpt.yaml")


@pytest.mark.parametrize("page", [MODELS, DATA, CHECKPOINTS])
def test_every_yaml_block_is_a_valid_job_section(page):
    """Each YAML block's sections, put into `examples/gpt.yaml`'s job, pass the job's own checks."""
    import yaml

    from meshpipe import ConfigError
    from orchestrator.core.config import parse_job

    found = blocks(page, "yaml")
    assert found, f"{page} has no YAML block"
    for b in found:
        fragment = yaml.safe_load(b.code)
        job = base_job()
        for section, value in fragment.items():
            job[section] = {**job.get(section, {}), **value} if section == "run" else value
        try:
            parse_job(job)
        except ConfigError as e:
            pytest.fail(f"{b}: {e}")


# -- data ------------------------------------------------------------------------------------------
def test_the_data_pages_python_blocks_run_and_the_shard_they_write_is_a_valid_job(tmp_path):
    """The blocks write a uint16 token shard under runs/data and read it back as a grain source; the page's `tokens`
    job over that shard passes `check_job` (which reads the shard and checks every id's range)."""
    import yaml

    from meshpipe import check_job, load_cluster
    from orchestrator.core.config import parse_job

    found = blocks(DATA, "python")
    assert len(found) == 2
    with scratch_dir(tmp_path):
        namespace: dict = {"__name__": "docs"}
        for b in found:
            run_block(b.code, namespace, str(b))
        assert len(namespace["source"]) > 0
        shard = [yaml.safe_load(b.code)["data"] for b in blocks(DATA, "yaml") if "bytes.bin" in b.code]
        assert len(shard) == 1
        job = base_job()
        job["data"] = shard[0]
        checked = check_job(parse_job(job), load_cluster(ROOT / "cluster_configs" / "local.yaml"))
        assert checked.data.source == "tokens"


@pytest.mark.slow
def test_the_data_pages_commands_run_as_written(tmp_path):
    """`meshpipe prepare` of Debian's licence texts, then the tokens job on them, word for word."""
    commands = [line for b in blocks(DATA, "bash") for line in b.code.splitlines() if line.strip()]
    assert [c.split()[:2] for c in commands] == [["meshpipe", "prepare"], ["meshpipe", "run"]]
    meshpipe = Path(sys.executable).with_name("meshpipe")
    with scratch_dir(tmp_path):
        for cmd in commands:
            words = shlex.split(cmd)
            r = subprocess.run([str(meshpipe), *words[1:]], capture_output=True, text=True, timeout=900)
            assert r.returncode == 0, f"{cmd}\n{r.stderr[-3000:]}"
    import json

    summary = json.loads((tmp_path / "runs" / "gpt-tokens" / "latest" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["eval_losses"]


# -- checkpoints -----------------------------------------------------------------------------------
def test_every_command_on_the_checkpoint_page_parses_with_the_cli(tmp_path):
    """The command block's lines are real `meshpipe` commands: the CLI's own click definitions
    accept each (arguments, options, and the paths they require to exist)."""
    import click

    from orchestrator.driver.cli import main

    commands = [line.split("#")[0].strip() for b in blocks(CHECKPOINTS, "bash") for line in b.code.splitlines()]
    commands = [c for c in commands if c]
    assert len(commands) >= 5
    with scratch_dir(tmp_path):
        Path("JOB.yaml").write_text((ROOT / "examples" / "gpt.yaml").read_text())
        Path("ckpt/gpt-tiny/step_00000040").mkdir(parents=True)
        for cmd in commands:
            words = shlex.split(cmd)
            assert words[0] == "meshpipe", cmd
            sub = main.commands.get(words[1])
            assert sub is not None, f"{cmd}: no such meshpipe command"
            # parses every argument and option, and checks the paths they require; raises click's
            # UsageError/BadParameter on a bad line (the command itself is not invoked)
            sub.make_context(sub.name, words[2:], parent=click.Context(main, info_name="meshpipe"))


@pytest.mark.slow
def test_the_export_block_runs_as_written_after_a_real_run(tmp_path):
    """Train the Llama of examples/llama.yaml with checkpoints, export the last step to ./exported,
    then run the page's block as written: it restores the export with orbax alone and prints a
    finite loss of the model's own functions (that an export restores the pipeline's exact loss is
    `tests/test_checkpoint.py`'s test)."""
    (export_block,) = blocks(CHECKPOINTS, "python")
    meshpipe = str(Path(sys.executable).with_name("meshpipe"))
    with scratch_dir(tmp_path):
        ckpt = tmp_path / "ckpt"
        r = subprocess.run([meshpipe, "run", "examples/llama.yaml", "--set", "run.steps=2",
                            "--set", f"checkpoint={{dir: {ckpt}, every_steps: 2}}"],
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        step = sorted(ckpt.glob("step_*"))[-1]
        r = subprocess.run([meshpipe, "export", str(step), "--to", "exported"], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        printed = run_block(export_block.code, {"__name__": "docs"}, str(export_block))
    loss = float(printed.strip())
    assert np.isfinite(loss) and 0 < loss < 10


# -- the README ------------------------------------------------------------------------------------
def test_the_readme_tour_snippet_runs():
    (tour,) = [b for b in blocks("README.md", "python") if b.name == "tour"]
    printed = run_block(tour.code, {"__name__": "docs"}, str(tour))
    assert "1f1b" in printed and "stage" in printed


def test_the_readme_results_table_is_the_published_runs():
    """The README's small results table holds the figures of `benchmarks/results/pipeline.md`
    (its section 1, `large`, m = 8), so a new run cannot leave the README quoting an old one."""
    import re

    readme = (ROOT / "README.md").read_text()
    header = re.search(r"^\| \| (1F1B.*)\|$", readme, re.M).group(1)
    row = re.search(r"^\| efficiency \| (.*)\|$", readme, re.M).group(1)
    quoted = dict(zip([h.strip().lower() for h in header.split("|")], [float(v) for v in row.split("|")]))
    text = (ROOT / "benchmarks" / "results" / "pipeline.md").read_text()
    section = re.search(r"^## 1\. Pipeline efficiency$(.*?)^## ", text, re.M | re.S).group(1)
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    columns = [c.strip() for c in re.split(r"(?<!\\)\|", lines[0].strip("|"))]
    published = {}
    for line in lines[2:]:
        row = dict(zip(columns, [c.strip() for c in re.split(r"(?<!\\)\|", line.strip("|"))]))
        if (row["size"], row["m"]) == ("large", "8"):
            published[row["schedule"]] = float(row["efficiency"].strip("*"))
    assert set(quoted) <= set(published), f"{set(quoted) - set(published)} not in pipeline.md's table"
    assert {k: published[k] for k in quoted} == quoted
