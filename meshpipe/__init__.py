"""meshpipe: pipelined, mesh-sharded JAX training on Ray — the public API.

What a user writes against, in one namespace (the internal packages, `orchestrator` and
`stages`, may move; these names stay):

- **Bring your own model**: an adapter turns a flax.nnx, flax.linen, equinox or plain-JAX
  model, unchanged, into a `PipelineModel` (a sequence of `Part`s and a loss):
  `nnx_model`, `linen_model`, `eqx_model`, `plain`; `describe` checks one by shape only.
- **Axes and layouts**: `by_path` names parameter axes by path pattern, `batch_first` and
  `replicated` are the default axes rules; `parse_layout` / `format_layout` read and write a
  layout (`batch:data;mlp:model`), `partition_spec` applies one to a tensor's axes, `FirstOf`
  lists candidate mesh axes.
- **Jobs**: `load_job` / `load_cluster` read the YAML files (`JobConfig`, `ClusterConfig`),
  `check_job` cross-checks them (`ConfigError` names key, value and rule); `plan` is
  `meshpipe plan` (`plan_text`, `plan_json` print it) and `run` is `meshpipe run`, with
  `WorkerHook`s for code that runs inside every stage worker (a profiler, a check).

Importing meshpipe loads neither Ray nor JAX nor any model framework: `run` imports the
driver (and Ray) when called, the adapters import their framework when a model is built.

Example:
    >>> import meshpipe
    >>> job = meshpipe.load_job("examples/mlp.yaml", overrides=["run.steps=3"])
    >>> job.run.steps
    3
    >>> meshpipe.parse_layout("batch:data;mlp:model")
    {'batch': 'data', 'mlp': 'model'}
"""
from orchestrator.core.config import (ClusterConfig, ConfigError, JobConfig, check_job, load_cluster,
                                      load_job)
from orchestrator.core.model.adapters import eqx_model, linen_model, nnx_model, plain
from orchestrator.core.model.layout import FirstOf, format_layout, parse_layout, partition_spec
from orchestrator.core.model.pipeline import (ArraySpec, ModelError, Part, PipelineModel, batch_first, by_path,
                                              replicated)
from orchestrator.core.plan import Plan, plan_json, plan_text
from stages.hooks import WorkerHook

from meshpipe._api import batches, describe, plan, run

__all__ = [
    # bring your own model
    "nnx_model", "linen_model", "eqx_model", "plain", "PipelineModel", "Part", "ArraySpec", "ModelError",
    "describe",
    # axes and layouts
    "by_path", "batch_first", "replicated", "parse_layout", "format_layout", "partition_spec", "FirstOf",
    # jobs
    "load_job", "load_cluster", "check_job", "JobConfig", "ClusterConfig", "ConfigError",
    "plan", "Plan", "plan_text", "plan_json", "run", "batches", "WorkerHook",
]
