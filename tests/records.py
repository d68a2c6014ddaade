"""Reading a run's record in tests: the run directory is `<output_dir>/<name>/<run id>/`
(`orchestrator.driver.rundir`); these helpers find the latest one."""
from __future__ import annotations

import json
from pathlib import Path


def run_dir(output_dir, name: str) -> Path:
    """The latest run directory of run `name` under `output_dir` (what `latest` names)."""
    from orchestrator.driver.rundir import latest

    found = latest(Path(output_dir) / name)
    assert found is not None, f"no run directory of {name!r} under {output_dir}"
    return found


def summary(output_dir, name: str, reference: bool = False) -> dict:
    """The latest run's summary.json (summary.reference.json with `reference`)."""
    return json.loads((run_dir(output_dir, name) / f"summary{'.reference' if reference else ''}.json").read_text())


def metrics(output_dir, name: str, reference: bool = False) -> list[dict]:
    """The latest run's metrics.jsonl records."""
    text = (run_dir(output_dir, name) / f"metrics{'.reference' if reference else ''}.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def run_ids_of(output_dir, name: str) -> list[str]:
    """The run ids (directory names) of run `name`, oldest first."""
    from orchestrator.driver.rundir import run_ids

    return run_ids(Path(output_dir) / name)
