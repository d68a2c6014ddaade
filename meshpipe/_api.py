"""`run`, `plan` and `describe`: what the `meshpipe` command does, callable from Python.

A thin layer over the driver and the pure core, doing what `meshpipe run` / `meshpipe plan`
do with their arguments (`orchestrator.driver.cli`): load the job and cluster (a YAML path, a
plain dict or an already-loaded config), apply `key.path=value` overrides, check the job
against the cluster, then plan or train. Errors are raised, not turned into exit codes:
`ConfigError` (what the CLI exits 2 for), `RunDirError` (a `run_id` that names no run),
and whatever a failed run raises (the CLI's exit 1). The driver, and with it Ray, is
imported only when `run` is called.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union

from orchestrator.core.config import ClusterConfig, JobConfig, apply_overrides, check_job, load_cluster
from orchestrator.core.config import load_job, parse_cluster, parse_job
from orchestrator.core.config.check import Checked
from orchestrator.core.model.spec import ModelSpec
from orchestrator.core.plan import Plan, make_plan

JobLike = Union[str, "os.PathLike[str]", Mapping[str, Any], JobConfig]
ClusterLike = Union[str, "os.PathLike[str]", Mapping[str, Any], ClusterConfig, None]

__all__ = ["run", "plan", "describe", "batches"]


def _job(job: JobLike, overrides: Sequence[str]) -> JobConfig:
    if isinstance(job, JobConfig):
        return job if not overrides else parse_job(apply_overrides(job.to_dict(), list(overrides), JobConfig))
    if isinstance(job, Mapping):
        return parse_job(apply_overrides(dict(job), list(overrides), JobConfig), source="<dict>")
    return load_job(job, overrides=list(overrides))


def _cluster(cluster: ClusterLike, overrides: Sequence[str]) -> ClusterConfig:
    if cluster is None:
        from orchestrator.driver.cli import DEFAULT_CLUSTER   # the packaged cluster_configs/local.yaml

        cluster = DEFAULT_CLUSTER
    if isinstance(cluster, ClusterConfig):
        return cluster if not overrides else parse_cluster(
            apply_overrides(cluster.to_dict(), list(overrides), ClusterConfig))
    if isinstance(cluster, Mapping):
        return parse_cluster(apply_overrides(dict(cluster), list(overrides), ClusterConfig), source="<dict>")
    return load_cluster(cluster, overrides=list(overrides))


def _checked(job: JobLike, cluster: ClusterLike, overrides: Sequence[str], address: Optional[str]) -> Checked:
    """Load, override and cross-check, as the CLI's `_checked` does (raises ConfigError)."""
    from orchestrator.driver.cli import job_import_dir, split_overrides

    job_sets, cluster_sets = split_overrides(list(overrides))
    import_dir = None
    if isinstance(job, (str, os.PathLike)):
        import_dir = job_import_dir(os.fspath(job))   # a factory module beside the job file imports
    if address:                                       # a running Ray replaces the file's address
        cluster_sets += [f"address={address}", "num_cpus=null"]
    checked = check_job(_job(job, job_sets), _cluster(cluster, cluster_sets))
    return dataclasses.replace(checked, import_dir=import_dir) if import_dir else checked


def plan(job: JobLike, cluster: ClusterLike = None, *, overrides: Sequence[str] = ()) -> Plan:
    """The plan of a job, as `meshpipe plan` shows it: no Ray, no devices.

    Checking the job builds its model (`jax.eval_shape` only), so a job naming a model
    factory imports and calls it — `meshpipe plan` asks for `--allow-code` first; here the
    caller has chosen the job.

    Args:
      job: a job YAML path, a plain dict of the same keys, or a `JobConfig`.
      cluster: a cluster YAML path, dict or `ClusterConfig`; None: the packaged local cluster
        (`cluster_configs/local.yaml`: an embedded Ray, 4 simulated hosts × 2 CPU devices).
      overrides: `key.path=value` strings, as `--set` takes them (`cluster.` prefix: a cluster key).

    Returns:
      The `Plan`: the lowered, validated schedule and its simulation; `plan_text(p)` is what
      `meshpipe plan` prints, `plan_json(p)` what `--json` prints.

    Raises:
      ConfigError: every problem found, one line each (`key.path = value: rule`).

    Example:
        >>> import meshpipe
        >>> p = meshpipe.plan("examples/gpt.yaml", overrides=["pipeline.microbatches=8"])
        >>> len(p.checked.stages), p.schedule.microbatches
        (2, 8)
        >>> 0 < p.sim.bubble_fraction < 1
        True
    """
    return make_plan(_checked(job, cluster, overrides, None))


def run(job: JobLike, cluster: ClusterLike = None, *, overrides: Sequence[str] = (), reference: bool = False,
        resume: Union[None, str, int] = None, run_id: Optional[str] = None, overwrite: bool = False,
        address: Optional[str] = None, echo: Callable[[str], None] = print, hooks: Sequence = (),
        keep_params: bool = False) -> dict:
    """Train a job, as `meshpipe run` does, and return its summary.

    Each run writes its record into a directory of its own,
    `<run.output_dir>/<run.name>/<UTC start time>/` (`summary.json`, `metrics.jsonl`,
    `workers.json`, `trace.json`, `timeline.png`), whether it completes or fails; `latest`
    beside it names the newest. Running a job again starts a new directory and replaces
    nothing. The returned dict is `summary.json`'s content (its `run_dir`: the directory). Whatever the run started (an embedded Ray,
    actors, a placement group) is shut down before it returns or raises.

    Args:
      job: a job YAML path, a plain dict of the same keys, or a `JobConfig`.
      cluster: a cluster YAML path, dict or `ClusterConfig`; None: the packaged local cluster.
      overrides: `key.path=value` strings, as `--set` takes them (`cluster.` prefix: a cluster key).
      reference: train the same model, data and optimizer in this process with plain JAX
        (`--reference`: the numerical oracle; no Ray).
      resume: None (a fresh run), "latest" (the newest committed checkpoint), "auto" (the
        newest if any is committed, else step 0) or a step number (`--resume`). The record
        goes on in the latest run directory (the earlier invocation's files set aside, unchanged,
        in its `previous/<k>/`).
      run_id: with `resume`, the run directory to continue (`--run-id`; default: `latest`'s).
      overwrite: no longer needed (every run gets its own directory); accepted and ignored.
      address: a running Ray to connect to ('auto', 'host:port') instead of the cluster's.
      echo: where progress lines go (one per step).
      hooks: `WorkerHook` objects every stage worker calls at set-up and at each step (a
        profiler started at a given step, a per-host check).
      keep_params: the returned summary also holds "params" (name -> final numpy array).

    Raises:
      ConfigError: the job or cluster is invalid (nothing started).
      ValueError: `run_id` without `resume`; `RunDirError` (a ValueError): `run_id` names no
        run of this job's name (nothing started).

    Example:
        A pipeline run starts Ray; `reference=True` trains in this process:

        >>> import tempfile
        >>> import meshpipe
        >>> s = meshpipe.run("examples/mlp.yaml", reference=True, echo=lambda line: None,
        ...                  overrides=["run.steps=2", f"run.output_dir={tempfile.mkdtemp()}"])
        >>> s["status"], len(s["losses"])
        ('completed', 2)
    """
    from orchestrator.core.config import check_checkpoint_dir, check_output_dir, checkpoint_bytes
    from orchestrator.driver.runner import run_job

    if run_id is not None and resume is None:
        raise ValueError(f"run_id = {run_id!r}: only with resume= (a new run gets a new directory)")
    del overwrite                  # every run writes into a new directory: nothing to replace
    checked = _checked(job, cluster, overrides, address)
    check_output_dir(checked.job)
    check_checkpoint_dir(checked.job, 0 if reference else checkpoint_bytes(checked))   # --reference saves none
    resume_arg = None if resume is None else resume if isinstance(resume, str) else str(int(resume))
    return run_job(checked, reference=reference, echo=echo, hooks=tuple(hooks), keep_params=keep_params,
                   resume=resume_arg, run_id=run_id)


def describe(model, *, name: str = "model") -> ModelSpec:
    """Check a `PipelineModel` the way a job would, by shape evaluation only (no devices).

    Each part is initialised abstractly (`jax.eval_shape`), its output fed to the next part,
    the loss checked to be a scalar; the result lists every layer's parameters and outputs
    with their logical axes. Use it to try an adapter before writing a job around it.

    Raises:
      ModelError: naming the part and the rule (a part that cannot take the previous part's
        output, an output without the batch dim first, a loss that is not a scalar, ...).

    Example:
        >>> import jax.numpy as jnp
        >>> import meshpipe
        >>> model = meshpipe.plain(
        ...     lambda key: {"in": {"w": jnp.ones((8, 16))}, "out": {"w": jnp.ones((16, 4))}},
        ...     [("in", lambda p, x: x @ p["w"]), ("out", lambda p, x: x @ p["w"])],
        ...     loss=lambda y, t: jnp.mean((y - t) ** 2), input=((8,), "float32"), label=((4,), "float32"))
        >>> spec = meshpipe.describe(model)
        >>> [layer.name for layer in spec.layers], spec.layers[-1].outputs[0].shape
        (['in', 'out'], (4,))
    """
    from orchestrator.core.model.pipeline import describe as describe_model

    return describe_model(model, name=name, factory=f"<python: {name}>", args={})


def batches(job: JobLike, cluster: ClusterLike = None, *, steps: Optional[Iterable[int]] = None,
            overrides: Sequence[str] = ()) -> Iterator[tuple[Any, Any]]:
    """The global batches a run of `job` trains on, step by step: `(inputs, labels)` numpy arrays
    of `data.global_batch` rows each, read from the job's data exactly as the stage hosts read
    their rows of it (the same source, seed and order; a resumed run reads the same batch at the
    same step). Use it to compare a pipelined run with your own training loop over the same data.

    Args:
      job, cluster, overrides: as for `run`.
      steps: the steps to read (default: every step of the run, `0 .. run.steps - 1`).

    Raises:
      ConfigError: the job does not check (key, value and rule).

    Example:
        >>> import meshpipe
        >>> (x, y), = meshpipe.batches("examples/gpt.yaml", steps=[0])
        >>> x.shape, y.shape, bool((x[:, 1:] == y[:, :-1]).all())
        ((16, 32), (16, 32), True)
    """
    from stages.data import global_batch, open_reader

    checked = _checked(job, cluster, overrides, None)
    reader = open_reader(checked.data)
    for step in range(checked.job.run.steps) if steps is None else steps:
        yield global_batch(reader, checked.data, int(step))
