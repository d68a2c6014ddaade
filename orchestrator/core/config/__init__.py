"""meshpipe's typed, validated configuration: job and cluster YAML → frozen config objects.

Basic flow:
    job = load_job("examples/gpt.yaml", overrides=["run.steps=3"])   # safe YAML → JobConfig
    cluster = load_cluster("cluster_configs/local.yaml")              # → ClusterConfig
    checked = check_job(job, cluster)   # cross-checks (pure) → Checked with StagePlans
    run_dir = check_output_dir(job)     # the checks that touch the disk (and check_checkpoint_dir)

Every problem raises `ConfigError` (a ValueError) whose lines read
`key.path = value: rule`, e.g.
`pipeline.stages[1].mesh = {'model': 4}: mesh has 4 devices (product of axis sizes) ...`.

Modules: `schema` (the job's pydantic models: per-value rules; re-exports the rest),
`cluster_schema` (the cluster's), `fields` (shared base and value types), `walk` (schema walking,
error conversion), `overrides` (`key.path=value`),
`load` (files), `check` (cross-checks of the plan against the model and the cluster), `job_check`
(`check_job`: those and the re-plan checks of `failure.elastic`), `disk` (the
output and checkpoint directory checks, which touch the disk),
`errors` (ConfigError and message helpers).

Decisions:
  - `data.seq_len` is required by models with a `seq` axis (gpt) and must be
    absent/null for models without one (mlp): a value there would be silently
    meaningless, so it is an error.
  - `data.path` (for `source: text`) is read relative to the current directory.
  - With `pipeline.virtual_stages: v > 1` a stage's `layers` is a list of v
    ranges; chunk j of stage i is virtual stage j * num_stages + i.
  - Integers are strict: `"3"`, `3.0` and `true` are rejected where an int is due.
"""
from orchestrator.core.config.check import Checked, StagePlan, check_plan
from orchestrator.core.config.disk import check_checkpoint_dir, check_output_dir, checkpoint_bytes
from orchestrator.core.config.errors import ConfigError
from orchestrator.core.config.job_check import check_job
from orchestrator.core.config.load import load_cluster, load_job, load_raw
from orchestrator.core.config.overrides import apply_overrides, parse_key_path
from orchestrator.core.config.schema import (ClusterConfig, DataConfig, JobConfig, ModelConfig,
                                        OptimizerConfig, PipelineConfig, RunConfig, StageConfig,
                                        TimeoutsConfig, parse_cluster, parse_job)

__all__ = [
    "ConfigError", "JobConfig", "ClusterConfig", "load_job", "load_cluster", "load_raw",
    "parse_job", "parse_cluster", "apply_overrides", "parse_key_path", "check_job", "check_plan",
    "check_output_dir", "check_checkpoint_dir", "checkpoint_bytes", "Checked", "StagePlan", "RunConfig", "ModelConfig",
    "DataConfig",
    "OptimizerConfig", "StageConfig", "PipelineConfig", "TimeoutsConfig",
]
