"""`check_job(job, cluster) -> Checked`: every check a job passes before anything starts.

Basic flow: `check_plan` (`orchestrator.core.config.check`: the model, data, optimizer, stages,
meshes, schedule, layout and memory of the job's own plan) → with `failure.elastic`, the checks that
need a re-plan (`orchestrator.core.elastic.check_elastic`: `min_hosts` against the smallest legal
plan the re-plan rule finds) → the `Checked` job.

Invariant: the re-plan checks its candidates with `check_plan`, not with this function (a candidate
carries no `failure.elastic`), so checking a job never re-plans recursively and the modules import
in one direction: config.check ← elastic ← config.job_check.
"""
from __future__ import annotations

from orchestrator.core.config.check import Checked, check_plan
from orchestrator.core.config.errors import ConfigError
from orchestrator.core.config.schema import ClusterConfig, JobConfig

__all__ = ["check_job"]


def check_job(job: JobConfig, cluster: ClusterConfig) -> Checked:
    """Cross-check a job against its model and a cluster, its elastic re-planning included.

    Raises:
      ConfigError: every problem found, one line each `key.path = value: rule`.

    Example:
        >>> from orchestrator.core.config import load_job, load_cluster
        >>> job = load_job("examples/gpt.yaml", overrides=["checkpoint={dir: /tmp/c, every_steps: 2}",
        ...                                                "failure={max_restarts: 1, elastic: {min_hosts: 3}}"])
        >>> try:
        ...     check_job(job, load_cluster("cluster_configs/local.yaml"))
        ... except ConfigError as e:
        ...     print(e.problems[0].split(":")[0])
        failure.elastic.min_hosts = 3
    """
    from orchestrator.core.elastic.replan import check_elastic

    checked = check_plan(job, cluster)
    problems = check_elastic(checked)
    if problems:
        raise ConfigError(problems)
    return checked
