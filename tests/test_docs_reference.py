"""The generated references cover what the code defines (pure: no mkdocs needed).

- Every key of the job and cluster files — found here by walking the pydantic models, not by
  the generator's own walk — is a documented row of the generated reference, in a section
  reached at its key path, and the reference documents no key the models lack.
- A model that gains a key without a description cannot build a reference.
- The CLI reference's directive names the CLI's real click group; the API reference shows every
  name `meshpipe` exports.
"""
from __future__ import annotations

import importlib
import re
import sys
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel, Field

from tests.docs_blocks import ROOT

sys.path.insert(0, str(ROOT / "docs" / "hooks"))
import config_reference  # noqa: E402

sys.path.remove(str(ROOT / "docs" / "hooks"))


def model_keys(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every key path of a config file, from the models (nested models through Optional, unions and lists)."""
    out = set()
    for name, info in model.model_fields.items():
        key = f"{prefix}{info.alias or name}"
        out.add(key)
        for sub, suffix in nested(info.annotation):
            out |= model_keys(sub, f"{key}{suffix}.")
    return out


def nested(tp) -> list[tuple[type[BaseModel], str]]:
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [(tp, "")]
    args = typing.get_args(tp)
    if typing.get_origin(tp) is tuple and len(args) == 2 and args[1] is Ellipsis:
        return [(m, "[]" + s) for m, s in nested(args[0])]
    return [found for a in args for found in nested(a)]


def documented_keys(markdown: str) -> set[str]:
    """(section key paths × row keys) of a generated reference page."""
    out = set()
    for sec in re.split(r"^## ", markdown, flags=re.M)[1:]:
        heading = sec.splitlines()[0].split(" {#")[0]
        reached = re.search(r"^Reached at: (.*)\.$", sec, re.M)
        paths = re.findall(r"`([^`]*)`", reached.group(1)) if reached else [heading]
        paths = [""] if heading == "Top-level keys" else paths
        rows = re.findall(r"^\| \[`([^`]+)`\]", sec, re.M)
        assert rows, f"section {heading!r} has no key rows"
        out |= {f"{p}.{r}" if p else r for p in paths for r in rows}
    return out


@pytest.mark.parametrize("which", ["job", "cluster"])
def test_every_key_is_in_the_generated_reference(which):
    from orchestrator.core.config import ClusterConfig, JobConfig

    model = {"job": JobConfig, "cluster": ClusterConfig}[which]
    page = getattr(config_reference, f"{which}_reference")()
    keys, documented = model_keys(model), documented_keys(page)
    assert keys - documented == set(), f"keys the {which} reference lacks"
    assert documented - keys == set(), f"the {which} reference documents keys the models lack"
    assert len(keys) > 40


def test_a_key_without_a_description_fails_the_reference():
    from orchestrator.core.config import JobConfig
    from orchestrator.core.config.fields import Frozen

    class Section(Frozen):
        """`extra:` — a section a helper added."""

        described: int = Field(1, description="Has one.")
        bare: int = 2

    class Grown(JobConfig):
        extra: Section = Field(default_factory=Section, description="A new section.")

    with pytest.raises(config_reference.MissingDescription, match="Section.bare"):
        config_reference.reference(Grown, title="t", intro="", example_files=[])

    class GrownKey(JobConfig):
        new_key: int = 0

    with pytest.raises(config_reference.MissingDescription, match="GrownKey.new_key"):
        config_reference.reference(GrownKey, title="t", intro="", example_files=[])


def test_the_reference_states_types_defaults_and_rules():
    page = config_reference.job_reference()
    row = next(ln for ln in page.splitlines() if ln.startswith("| [`steps`](#run.steps)"))
    assert "int (≥ 1, ≤ 1,000,000,000)" in row and "**required**" in row
    row = next(ln for ln in page.splitlines() if ln.startswith("| [`schedule`](#pipeline.schedule)"))
    assert '`"1f1b"`' in row
    assert "As `examples/gpt.yaml` writes it:" in page


def test_the_cli_reference_renders_the_real_command_group():
    import click

    text = (ROOT / "docs" / "reference" / "cli.md").read_text()
    module = re.search(r":module: (\S+)", text).group(1)
    command = re.search(r":command: (\S+)", text).group(1)
    group = getattr(importlib.import_module(module), command)
    assert isinstance(group, click.Group) and {"run", "plan", "submit", "calibrate"} <= set(group.commands)


def test_the_api_reference_shows_every_public_name():
    import meshpipe

    text = (ROOT / "docs" / "reference" / "api.md").read_text()
    shown = set(re.findall(r"^::: meshpipe\.(\w+)$", text, re.M))
    assert set(meshpipe.__all__) - shown == set(), "exported by meshpipe, missing from docs/reference/api.md"
    assert shown - set(meshpipe.__all__) == set(), "in docs/reference/api.md, not exported by meshpipe"


def test_docs_hooks_stay_out_of_the_site():
    """Generators and readings are build inputs, not pages (mkdocs.yml's exclude_docs)."""
    import yaml

    config = yaml.safe_load(re.sub(r"!!python/\S+", "", (ROOT / "mkdocs.yml").read_text()))
    excluded = set(config["exclude_docs"].split())
    assert {"hooks/", "drafts/", "benchmarks/notes/"} <= excluded
    assert Path(ROOT / config["hooks"][0]).is_file()
