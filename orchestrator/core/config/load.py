"""Loading job and cluster YAML files: safe YAML → overrides → typed config.

Example:
    >>> from orchestrator.core.config import load_job
    >>> load_job("examples/mlp.yaml", overrides=["run.steps=3"]).run.steps
    3
"""
from __future__ import annotations

import os
from typing import Iterable, Optional

from orchestrator.core.config.errors import ConfigError
from orchestrator.core.config.overrides import apply_overrides, shown
from orchestrator.core.config.schema import ClusterConfig, JobConfig, parse_cluster, parse_job
from orchestrator.core.safe_yaml import YamlError, safe_load_file

__all__ = ["load_job", "load_cluster", "load_raw"]


def load_raw(path: str | os.PathLike) -> dict:
    """The YAML file as a plain dict (safe loader; raises `ConfigError`)."""
    try:
        return safe_load_file(path)
    except YamlError as e:
        raise ConfigError(str(e)) from None


def _source(path, overrides) -> str:
    return str(path) + (f" (with overrides {[shown(o) for o in overrides]})" if overrides else "")


def load_job(path: str | os.PathLike, overrides: Optional[Iterable[str]] = None) -> JobConfig:
    """Load and validate a job YAML file, applying `key.path=value` overrides first.

    Raises:
      ConfigError: unsafe/invalid YAML, a bad override, or invalid values (all listed).
    """
    overrides = list(overrides or ())
    raw = apply_overrides(load_raw(path), overrides, JobConfig)
    return parse_job(raw, source=_source(path, overrides))


def load_cluster(path: str | os.PathLike, overrides: Optional[Iterable[str]] = None) -> ClusterConfig:
    """Load and validate a cluster YAML file (same override syntax as `load_job`)."""
    overrides = list(overrides or ())
    raw = apply_overrides(load_raw(path), overrides, ClusterConfig)
    return parse_cluster(raw, source=_source(path, overrides))
