"""Cross-checks of a job's plan against its model and cluster: `check_plan(job, cluster) -> Checked`.

`check_job` (`orchestrator.core.config.job_check`, what callers use) is `check_plan` and the checks
that re-plan the job (`failure.elastic`); the re-plan itself checks its candidates with
`check_plan`, so the two never call each other.

Basic flow: build the model's `ModelSpec` (the factory is called and the model
described by `jax.eval_shape`: no devices, no arrays) → check data, optimizer
(optax is imported to look the function up and call it with the args), the
stages' layer ranges (named split points, `pipeline.split_at`, resolved to ranges
first: `Checked.job` carries the ranges), hosts and meshes, the schedule (through
`orchestrator.core.schedule.check_params`), the layout (names, mesh axes, and that
every sharded parameter / activation dim divides evenly) → a `Checked` value
with one `StagePlan` per physical stage.

Invariants:
  - Pure: no Ray, no jax arrays, no files written (the checks that touch the disk,
    `check_output_dir` and `check_checkpoint_dir`, are `orchestrator.core.config.disk`'s,
    and the runner calls them separately).
  - All problems found are reported together, one line each
    (`key.path = value: rule`); checks that depend on a failed one are skipped.
  - Stages take consecutive cluster host indices in order: stage 0 gets hosts
    0..h0-1, stage 1 the next h1, and so on.
"""
from __future__ import annotations

import importlib
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from orchestrator.core.backends import get_backend
from orchestrator.core.config.errors import ConfigError, problem, suggest
from orchestrator.core.config.limits import memory_problems
from orchestrator.core.config.schema import ClusterConfig, JobConfig, Rule
from orchestrator.core.redact import redact
from orchestrator.core.model.layout import FirstOf, choose, partition_spec, rule_axes, shard_count, stage_layout
from orchestrator.core.model.optim import OptimError, build as build_optimizer
from orchestrator.core.model.optim_rules import problems as optimizer_rules
from orchestrator.core.model.policy import remat_names, with_compute_dtype
from orchestrator.core.model.registry import BUILTIN, ModelError, build_spec
from orchestrator.core.model.spec import ModelSpec, param_name
from orchestrator.core.model.split import SplitError, split_ranges
from orchestrator.core.schedule import SCHEDULES, ScheduleError, check_params

__all__ = ["Checked", "StagePlan", "check_code", "check_plan", "job_code"]


@dataclass(frozen=True)
class StagePlan:
    """One physical pipeline stage after checking.

    Attributes:
      index: stage number (0-based).
      layers: the stage's layer range [start, stop); with virtual_stages > 1 this
        is its first chunk; `chunks` lists all of them.
      chunks: the stage's layer ranges, one per virtual stage.
      mesh: ordered axis name -> size; the product is the stage's device count.
      hosts: cluster host indices assigned to the stage (consecutive).
      devices_per_host: devices each of those hosts contributes.
      layout: the effective logical -> mesh axis layout on this stage's mesh.
      remat: the stage's rematerialisation (none | full | a jax.checkpoint_policies name).
    """

    index: int
    layers: tuple[int, int]
    mesh: dict[str, int]
    hosts: tuple[int, ...]
    devices_per_host: int
    layout: dict[str, Rule]
    chunks: tuple[tuple[int, int], ...] = ()
    remat: str = "none"

    @property
    def num_devices(self) -> int:
        return len(self.hosts) * self.devices_per_host

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        return tuple(self.mesh)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.mesh.values())

    def layer_indices(self) -> tuple[int, ...]:
        return tuple(i for a, b in (self.chunks or (self.layers,)) for i in range(a, b))

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "layers": list(self.layers),
                "chunks": [list(c) for c in self.chunks], "mesh": dict(self.mesh),
                "hosts": list(self.hosts), "devices_per_host": self.devices_per_host,
                "devices": self.num_devices, "layout": _json_layout(self.layout), "remat": self.remat}


@dataclass(frozen=True)
class Checked:
    """A job that passed every check, with its model spec and stage plans.

    Attributes:
      job, cluster: the validated configs.
      model: the `ModelSpec` built from `job.model` and `job.data.seq_len`.
      stages: one `StagePlan` per physical stage.
      microbatch_size: job.data.global_batch // job.pipeline.microbatches.
      data_path: absolute path of the text file for `data.source: text`, else None.
      data: the `DataPlan` every host opens its own reader from (`orchestrator.core.data`).
      import_dir: a directory the stage actors put first on their import path (the CLI
        sets the job file's, so a `module:factory` model beside the job imports).
    """

    job: JobConfig
    cluster: ClusterConfig
    model: ModelSpec
    stages: tuple[StagePlan, ...]
    microbatch_size: int
    data_path: Optional[str] = None
    data: Any = None
    import_dir: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able summary (for summary.json), secrets redacted (`orchestrator.core.redact`).

        `job.to_dict()` / `cluster.to_dict()` keep the real values (they round-trip).
        """
        m = self.model
        return redact({
            "job": self.job.to_dict(),
            "cluster": self.cluster.to_dict(),
            "model": {"name": m.name, "factory": m.factory, "num_layers": m.num_layers,
                      "layers": [layer.name for layer in m.layers], "params": m.unique_param_count(),
                      "params_held": m.param_count(),
                      "args": json.loads(json.dumps(dict(m.args), default=repr))},
            "microbatch_size": self.microbatch_size,
            "data_path": self.data_path,
            "data": None if self.data is None else {
                "source": self.data.source, "files": list(self.data.files), "dtype": self.data.dtype,
                "windows": None if self.data.counts is None else sum(self.data.counts),
                "split": list(self.data.split), "eval_batches": self.data.eval_batches,
                "eval_files": [] if self.data.eval is None else list(self.data.eval.files)},
            "stages": [dict(s.to_dict(), params=sum(m.param_count(a, b) for a, b in s.chunks))
                       for s in self.stages],
        })

    def to_json(self, indent: int = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


def _json_layout(layout: Mapping[str, Rule]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in layout.items()}


class _Problems(list):
    def add(self, loc: str, value: Any, rule: str) -> None:
        self.append(problem(loc, value, rule))


# ----------------------------------------------------------------------------- model, data, run

def _model_layers(model: ModelSpec) -> str:
    names = " ".join(f"{i}:{layer.name}" for i, layer in enumerate(model.layers))
    return f"model {model.name!r} has {model.num_layers} layers ({names})"


def _build_model(job: JobConfig) -> ModelSpec:
    """Call the model factory and describe the model by shape evaluation (jax inside, no devices)."""
    name, args, seq_len = job.model.ref, job.model.args, job.data.seq_len
    key = "model.factory" if job.model.factory else "model.name"
    builtin = BUILTIN.get(name)
    defaults = builtin.defaults if builtin else None
    probs = _Problems()
    if defaults is not None:
        for k, v in args.items():
            if k not in defaults:
                probs.add(f"model.args.{k}", v, f"unknown argument of model {name!r} (valid: "
                          f"{', '.join(sorted(defaults))}){suggest(k, defaults)}")
            elif isinstance(defaults[k], int):
                low = 0 if k == "blocks" else 1  # zero blocks is a valid (tiny) model; sizes are not
                if not isinstance(v, int) or isinstance(v, bool) or v < low:
                    probs.add(f"model.args.{k}", v, f"must be an integer >= {low}")
        if probs:
            raise ConfigError(probs)
    try:
        return build_spec(name, args, seq_len=seq_len)
    except ModelError as e:
        raise ConfigError(problem(key, name, f"the model cannot be pipelined: {e}")) from None
    except KeyError as e:
        k = e.args[0] if e.args else "?"
        if name not in BUILTIN and ":" not in name:
            raise ConfigError(problem(key, name, f"unknown model; built-in models are "
                                      f"{', '.join(sorted(BUILTIN))}{suggest(name, BUILTIN)}")) from None
        if builtin is None:
            raise ConfigError(problem(key, name, f"the model factory failed: KeyError: {e}")) from None
        valid = f" (valid: {', '.join(sorted(defaults))})" if defaults else ""
        raise ConfigError(problem(f"model.args.{k}", args.get(k), f"unknown argument of model "
                                  f"{name!r}{valid}{suggest(k, defaults or ())}")) from None
    except (ImportError, AttributeError) as e:
        if builtin is None and isinstance(e, AttributeError) and _importable(name):
            raise ConfigError(problem(key, name, f"the model factory failed: AttributeError: {e}")) from None
        raise ConfigError(problem(key, name, f"cannot import the model factory: {e}")) from None
    except Exception as e:  # noqa: BLE001 - a user factory may raise anything; report it with the key
        if seq_len is None and "seq_len" in str(e):
            raise ConfigError(problem("data.seq_len", None, f"required by model {name!r} ({e})")) from None
        if builtin is None:
            raise ConfigError(problem(key, name, f"the model factory failed: "
                                      f"{type(e).__name__}: {e}")) from None
        raise ConfigError(problem("model.args", dict(args), f"invalid model arguments: {e}")) from None


def check_code(job: JobConfig, step=lambda key, value: None) -> None:
    """Import and call the code `job` names — its model factory (described by shape evaluation)
    and a grain data factory (its first records read) — with the checks `check_job` makes of them;
    `step(key, value)` is told before each. What `orchestrator.driver.usercode` runs in a child
    process under a deadline before `check_job` runs the same code in the caller's.

    Raises:
      ConfigError: what `check_job` would report about that code.
    """
    step("model.factory" if job.model.factory else "model.name", job.model.ref)
    model = with_compute_dtype(_build_model(job), job.precision.compute)
    if job.data.factory:
        step("data.factory", job.data.factory)
        probs = _Problems()
        _check_data(job, model, probs)
        if probs:
            raise ConfigError(probs)


def job_code(job: JobConfig) -> list[tuple[str, str]]:
    """The keys of `job` that name code meshpipe imports and calls, as (key, 'package.module:function').

    `meshpipe plan` starts no Ray and is used to inspect job files; it refuses these unless
    asked (`--allow-code`), since checking such a job runs its code (docs/security.md).

    Example:
        >>> from orchestrator.core.config.schema import parse_job
        >>> job = parse_job({"run": {"name": "t", "steps": 1}, "model": {"factory": "pkg.mod:build"},
        ...                  "data": {"global_batch": 8}, "optimizer": {"name": "sgd"},
        ...                  "pipeline": {"microbatches": 2, "stages": [{"layers": [0, 4], "mesh": {"data": 1}}]}})
        >>> job_code(job)
        [('model.factory', 'pkg.mod:build')]
    """
    out = []
    if job.model.factory:
        out.append(("model.factory", job.model.factory))
    elif job.model.name and ":" in job.model.name:
        out.append(("model.name", job.model.name))
    if job.data.factory:
        out.append(("data.factory", job.data.factory))
    return out


def _importable(path: str) -> bool:
    """Whether `module:attr` names an attribute that exists (so an AttributeError came from calling it)."""
    module, _, attr = path.partition(":")
    try:
        return hasattr(importlib.import_module(module), attr)
    except Exception:  # noqa: BLE001
        return False


def _check_remat(job: JobConfig, probs: _Problems) -> None:
    names = remat_names()
    wanted = [("pipeline.remat", job.pipeline.remat)]
    wanted += [(f"pipeline.stages[{i}].remat", st.remat) for i, st in enumerate(job.pipeline.stages)
               if st.remat is not None]
    for key, value in wanted:
        if value not in names:
            probs.add(key, value, f"unknown remat policy{suggest(value, names)}; valid: none, full, or a "
                      f"jax.checkpoint_policies name ({', '.join(names[2:])})")


def _check_data(job: JobConfig, model: ModelSpec, probs: _Problems):
    """The job's `DataPlan` (`orchestrator.core.data.plan`), or None after adding its problems."""
    from orchestrator.core.data.plan import DataProblems, plan_data

    d = job.data
    if d.seq_len is not None and "seq" not in model.logical_axes():
        probs.add("data.seq_len", d.seq_len, f"model {model.name!r} has no 'seq' axis, so seq_len "
                  "does not apply; remove it or set it to null")
    if job.run.eval_every is not None and d.eval is None:
        probs.add("run.eval_every", job.run.eval_every, "needs data.eval (held-out data to evaluate on)")
    try:
        return plan_data(d, model, job.run.seed)
    except DataProblems as e:
        for key, value, rule in e.problems:
            probs.add(key, value, rule)
        return None


def _check_optimizer(job: JobConfig, probs: _Problems) -> None:
    """The optimizer section: the name (single form), every hyperparameter by its meaning and the
    chain's direction (`orchestrator.core.model.optim_rules`, one rule set for every place), then
    what optax itself says when the chain is built (`orchestrator.core.model.optim.build`)."""
    import optax  # builds a GradientTransformation (closures): no arrays, no device state

    opt = job.optimizer
    if opt.chain is None:
        fn = getattr(optax, opt.name, None)
        if fn is None or not callable(fn) or isinstance(fn, type):
            known = [n for n in dir(optax) if n[:1].islower() and callable(getattr(optax, n))]
            probs.add("optimizer.name", opt.name, f"not an optax optimizer function{suggest(opt.name, known)}")
            return
    found = optimizer_rules(opt.spec(), job.run.steps, opt.allow_ascent)
    for key, value, rule in found:
        probs.add(key, value, rule)
    if found:
        return
    try:
        build_optimizer(opt.spec())
    except OptimError as e:
        probs.add(e.key, e.value, e.rule)


# ----------------------------------------------------------------------------- stages

def _resolve_split(job: JobConfig, model: ModelSpec, probs: _Problems) -> Optional[JobConfig]:
    """The job with each stage's `layers` filled in from `pipeline.split_at` (and split_at
    cleared, so the resolved job round-trips through `parse_job`), or, when no stage gives its
    layers, from the cost-balanced default cut (`_default_cut`); None after adding a problem.
    Virtual stage k = chunk j of stage i (k = j * p + i) takes the k-th range."""
    names = job.pipeline.split_at
    p, v = len(job.pipeline.stages), job.pipeline.virtual_stages
    if names is None:
        if any(st.layers is not None for st in job.pipeline.stages):
            return job
        ranges = _default_cut(model, p * v, probs)
        if ranges is None:
            return None
    else:
        try:
            ranges = split_ranges(model, names)
        except SplitError as e:
            probs.add(f"pipeline.split_at[{e.index}]", e.name, e.rule)
            return None
    stages = []
    for i, st in enumerate(job.pipeline.stages):
        chunks = tuple(ranges[j * p + i] for j in range(v))
        stages.append(st.model_copy(update={"layers": chunks[0] if v == 1 else chunks}))
    pipeline = job.pipeline.model_copy(update={"stages": tuple(stages), "split_at": None})
    return job.model_copy(update={"pipeline": pipeline})


def _default_cut(model: ModelSpec, parts: int, probs: _Problems) -> Optional[list]:
    """No stage gives its layers and there is no split_at: the cut into `parts` (virtual) stages
    balanced by per-layer forward FLOPs (`orchestrator.core.model.balance`); None after a problem."""
    from orchestrator.core.model.balance import balanced_ranges, layer_costs
    from orchestrator.core.model.registry import build_model

    n = len(model.layers)
    if parts > n:
        probs.add("pipeline.stages", f"{parts} (virtual) stages",
                  f"the default cut needs at least one layer per (virtual) stage: {_model_layers(model)}")
        return None
    costs, _ = layer_costs(build_model(model.factory, model.args), model)
    return balanced_ranges(costs, parts)


def _check_layers(job: JobConfig, model: ModelSpec, probs: _Problems) -> bool:
    p, v = len(job.pipeline.stages), job.pipeline.virtual_stages
    ok = True
    for i, st in enumerate(job.pipeline.stages):
        if len(st.chunks) != v:
            form = "[start, stop]" if v == 1 else f"a list of {v} [start, stop] ranges"
            probs.add(f"pipeline.stages[{i}].layers", _plain(st.layers), f"pipeline.virtual_stages is "
                      f"{v}, so each stage needs {form} (one per virtual stage)")
            ok = False
    if not ok:
        return False
    # Virtual stage k = chunk j of stage i with k = j * p + i; they must tile [0, num_layers).
    order = sorted(((j * p + i, i, j) for i in range(p) for j in range(v)))
    expect, what, owner = 0, _model_layers(model), None

    def label(i: int, j: int) -> str:
        return f"stage {i}" if v == 1 else f"stage {i} chunk {j} (virtual stage {j * p + i})"

    for k, i, j in order:
        start, stop = job.pipeline.stages[i].chunks[j]
        key = f"pipeline.stages[{i}].layers" + (f"[{j}]" if v > 1 else "")
        where = f"{owner} ends at layer {expect}" if owner else "the first stage must start at 0"
        if start > expect:
            probs.add(key, [start, stop], f"gap: layers [{expect}, {start}) are in no stage ({where}); "
                      f"ranges must be contiguous; {what}")
            ok = False
        elif start < expect:
            probs.add(key, [start, stop], f"overlap: layers [{start}, {min(expect, stop)}) are already "
                      f"in an earlier stage ({where}); {what}")
            ok = False
        if stop > model.num_layers:
            probs.add(key, [start, stop], f"stop {stop} is past the model's last layer; {what}")
            return False
        if stop > expect:
            expect, owner = stop, label(i, j)
    if expect < model.num_layers:
        i = order[-1][1]
        probs.add(f"pipeline.stages[{i}].layers", _plain(job.pipeline.stages[i].layers),
                  f"stages cover layers [0, {expect}) but must cover all of [0, {model.num_layers}); "
                  f"{what}")
        ok = False
    return ok


def _check_hosts_meshes(job: JobConfig, cluster: ClusterConfig, probs: _Problems) -> list[tuple[int, ...]]:
    stages, dph = job.pipeline.stages, cluster.devices_per_host
    total = sum(st.hosts for st in stages)
    if total > cluster.hosts:
        per = ", ".join(f"stage {i}: {st.hosts}" for i, st in enumerate(stages))
        probs.add("pipeline.stages[*].hosts", [st.hosts for st in stages], f"more stages than hosts "
                  f"can hold: the stages need {total} hosts ({per}) but the cluster offers "
                  f"cluster.hosts = {cluster.hosts}")
    assigned, first = [], 0
    for i, st in enumerate(stages):
        assigned.append(tuple(range(first, first + st.hosts)))
        first += st.hosts
        size = math.prod(st.mesh.values())
        if size != st.hosts * dph:
            probs.add(f"pipeline.stages[{i}].mesh", dict(st.mesh), f"mesh has {size} devices (product "
                      f"of axis sizes) but the stage has hosts × devices_per_host = {st.hosts} × {dph} "
                      f"= {st.hosts * dph} devices; the product must equal {st.hosts * dph}")
    if cluster.address is None and cluster.num_cpus is None:
        try:
            cpus = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cpus = os.cpu_count() or 1
        need = min(total, cluster.hosts) * cluster.cpus_per_host
        if need > cpus + 1e-9:
            probs.add("cluster.cpus_per_host", cluster.cpus_per_host, f"too few CPUs: {min(total, cluster.hosts)} "
                      f"hosts × {cluster.cpus_per_host} CPUs = {need:g} CPUs, but the embedded Ray "
                      f"will see {cpus}; the placement group would wait forever (lower cpus_per_host "
                      "or set num_cpus)")
    if total <= cluster.hosts:  # the platform's legal submesh shapes (e.g. TPU slices / aligned subslices)
        for key, value, rule in get_backend(cluster).check_stages(assigned):
            probs.add(key, value, rule)
    return assigned


ZB_MIN_JAX = (0, 10)   # the zero-bubble I/W split (stages.zb_split) reads jaxpr internals 0.8 lacks


def _jax_version() -> tuple[int, ...]:
    """The installed JAX's (major, minor), read from its metadata (JAX is not imported here)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return tuple(int(x) for x in version("jax").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return ZB_MIN_JAX


def _check_schedule(job: JobConfig, probs: _Problems) -> None:
    if job.pipeline.schedule == "zb-h1" and _jax_version() < ZB_MIN_JAX:
        probs.add("pipeline.schedule", "zb-h1", f"needs JAX >= {'.'.join(map(str, ZB_MIN_JAX))} (its I/W "
                  f"split reads jaxpr internals older JAX lacks); this is JAX "
                  f"{'.'.join(map(str, _jax_version()))}: upgrade JAX or use 1f1b")
    pc = job.pipeline
    if pc.schedule not in SCHEDULES:
        probs.add("pipeline.schedule", pc.schedule, f"unknown schedule; known: "
                  f"{', '.join(sorted(SCHEDULES))}{suggest(pc.schedule, SCHEDULES)}")
        return
    p, m, v = len(pc.stages), pc.microbatches, pc.virtual_stages
    try:
        check_params(pc.schedule, p, m, v)
    except ScheduleError as e:
        def ok(m2: int, v2: int) -> bool:
            try:
                check_params(pc.schedule, p, m2, v2)
                return True
            except ScheduleError:
                return False

        # Name the key to change: find which single parameter, changed, makes the schedule valid.
        key, value = "pipeline.schedule", pc.schedule
        if v != 1 and ok(m, 1):
            key, value = "pipeline.virtual_stages", v
        elif any(ok(m2, v) for m2 in (p * v, 2 * p * v, 4 * p * v, m * p * v)):
            key, value = "pipeline.microbatches", m
        probs.add(key, value, f"schedule {pc.schedule!r} rejects p={p} stages, m={m} microbatches, "
                  f"v={v} virtual stages: {e}")


# ----------------------------------------------------------------------------- layout

def _check_layout_names(job: JobConfig, model: ModelSpec, probs: _Problems) -> list[dict[str, Rule]] | None:
    logical = model.logical_axes()
    stages = job.pipeline.stages
    all_axes = {a for st in stages for a in st.mesh}
    ok = True
    for src, layout, axes, where in (
            [("layout", job.layout, all_axes, "in no stage's mesh")]
            + [(f"pipeline.stages[{i}].layout", st.layout or {}, set(st.mesh), f"not in stage {i}'s mesh")
               for i, st in enumerate(stages)]):
        for name, rule in layout.items():
            if name not in logical:
                probs.add(f"{src}.{name}", _json_rule(rule), f"unknown logical axis (model "
                          f"{model.name!r} names: {', '.join(sorted(logical))}){suggest(name, logical)}")
                ok = False
            for a in rule_axes(rule):
                if a not in axes:
                    probs.add(f"{src}.{name}", _json_rule(rule), f"mesh axis {a!r} is {where} "
                              f"(meshes have: {', '.join(sorted(axes))}){suggest(a, axes)}")
                    ok = False
    if not ok:
        return None
    return [stage_layout(job.layout, st.layout, st.mesh) for st in stages]


def _plain(value: Any) -> Any:
    """Tuples (as stored) → lists (as written in YAML), for messages."""
    return [_plain(x) for x in value] if isinstance(value, (tuple, list)) else value


def _json_rule(rule: Rule) -> Any:
    if isinstance(rule, FirstOf):
        return {"first": [_json_rule(o) for o in rule.first]}
    return list(rule) if isinstance(rule, tuple) else rule


def _rule_key(job: JobConfig, i: int, logical: str) -> tuple[str, Any]:
    over = job.pipeline.stages[i].layout or {}
    if logical in over:
        return f"pipeline.stages[{i}].layout.{logical}", _json_rule(over[logical])
    return f"layout.{logical}", _json_rule(job.layout.get(logical))


def _check_batch(job: JobConfig, layouts: Optional[list], mb: int, probs: _Problems) -> None:
    gb, m = job.data.global_batch, job.pipeline.microbatches
    if gb % m:
        probs.add("data.global_batch", gb, f"not divisible by pipeline.microbatches = {m}; the "
                  "global batch is split into equal microbatches")
        return
    for i, layout in enumerate(layouts or ()):
        st = job.pipeline.stages[i]
        n = shard_count(layout.get("batch"), st.mesh)
        if mb % n:
            key, rule = _rule_key(job, i, "batch")
            probs.add("pipeline.microbatches", m, f"microbatch size data.global_batch / microbatches = "
                      f"{gb} / {m} = {mb} is not divisible by {n}, the number of shards of logical axis "
                      f"'batch' on stage {i} ({key} = {rule!r}, mesh {dict(st.mesh)})")


def _stage_tensors(model: ModelSpec, st, mb: int) -> list[tuple[str, tuple, tuple]]:
    """(what, logical axes, shape) of every tensor a stage holds: inputs, parameters, outputs."""
    tensors: list[tuple[str, tuple, tuple]] = []
    for a, b in st.chunks:
        if a == 0:
            tensors.append(("the model input", model.input_axes, (mb, *model.input_shape)))
        else:
            for leaf in model.layers[a - 1].outputs:
                what = f"the activation{' leaf ' + leaf.path if leaf.path else ''}"
                tensors.append((f"{what} entering layer {a} ({model.layers[a].name})", leaf.axes,
                                leaf.batched(mb)))
        for li in range(a, b):
            layer = model.layers[li]
            for pname, pdef in layer.params.items():
                tensors.append((f"parameter {param_name(li, layer, pname)}", pdef.axes, pdef.shape))
            for leaf in layer.outputs:
                tensors.append((f"the output {leaf.path + ' ' if leaf.path else ''}of layer {li:02d}.{layer.name}",
                                leaf.axes, leaf.batched(mb)))
    return tensors


def _choose_layouts(job: JobConfig, model: ModelSpec, layouts: list, mb: int, sized: bool) -> list:
    """Each stage's layout with its candidate rules (`FirstOf`) chosen: the first candidate whose
    size divides every dim carrying the name on that stage (`sized`: the stage cuts are known;
    otherwise the first candidate the mesh has)."""
    out = []
    for st, layout in zip(job.pipeline.stages, layouts):
        sizes: dict[str, set] = {}
        for _, axes, shape in (_stage_tensors(model, st, mb) if sized else ()):
            for name, size in zip(axes, shape):
                if name:
                    sizes.setdefault(name, set()).add(size)
        out.append(choose(layout, st.mesh, sizes))
    return out


def _check_divisibility(job: JobConfig, model: ModelSpec, layouts: list, mb: int, probs: _Problems) -> None:
    reported: dict[tuple, int] = {}
    for i, (st, layout) in enumerate(zip(job.pipeline.stages, layouts)):
        for what, axes, shape in _stage_tensors(model, st, mb):
            for d, (name, entry) in enumerate(zip(axes, partition_spec(axes, layout))):
                size = shape[d] if d < len(shape) else None
                if entry is None or size is None or name == "batch":  # batch: see _check_batch
                    continue
                n = shard_count(entry, st.mesh)
                if size % n == 0:
                    continue
                tag = (i, name, size, n)
                reported[tag] = reported.get(tag, 0) + 1
                if reported[tag] > 1:
                    continue
                key, rule = _rule_key(job, i, name)
                probs.add(key, rule, f"not divisible: {what} has shape {tuple(shape)}, dim {d} "
                          f"('{name}') = {size} is not divisible by {n}, the size of mesh axis "
                          f"{'×'.join(rule_axes(entry))} on stage {i} (mesh {dict(st.mesh)})")


# ----------------------------------------------------------------------------- entry points

def check_plan(job: JobConfig, cluster: ClusterConfig) -> Checked:
    """Cross-check a job's plan against its model and a cluster (all of `check_job` but `failure.elastic`'s
    re-plan checks).

    Raises:
      ConfigError: every problem found, one line each `key.path = value: rule`.

    Example:
        >>> from orchestrator.core.config import load_job, load_cluster
        >>> checked = check_plan(load_job("examples/mlp.yaml"), load_cluster("cluster_configs/local.yaml"))
        >>> [s.hosts for s in checked.stages], checked.microbatch_size
        ([(0,), (1,), (2,)], 8)
    """
    model = with_compute_dtype(_build_model(job), job.precision.compute)
    probs = _Problems()
    if model.param_count() == 0:
        probs.add("model.name", job.model.name, f"the model has no parameters ({_model_layers(model)}): "
                  "there is nothing to train; give its layers ParamDefs")
    _check_remat(job, probs)
    data = _check_data(job, model, probs)
    data_path = data.files[0] if data is not None and data.source == "text" else None
    _check_optimizer(job, probs)
    resolved = _resolve_split(job, model, probs)
    layers_ok = resolved is not None and _check_layers(resolved, model, probs)
    job = resolved or job
    hosts = _check_hosts_meshes(job, cluster, probs)
    _check_schedule(job, probs)
    layouts = _check_layout_names(job, model, probs)
    mb, rest = divmod(job.data.global_batch, job.pipeline.microbatches)    # the microbatch size: here only
    if layouts is not None:           # candidate rules (layout `{first: [...]}`) chosen per stage
        layouts = _choose_layouts(job, model, layouts, max(1, mb), layers_ok and rest == 0)
    _check_batch(job, layouts, mb, probs)
    if layers_ok and layouts is not None and rest == 0:
        _check_divisibility(job, model, layouts, mb, probs)
        if not probs:
            probs.extend(memory_problems(job, cluster, model, layouts, mb))
    if probs:
        raise ConfigError(probs)
    stages = tuple(StagePlan(index=i, layers=st.chunks[0], mesh=dict(st.mesh), hosts=hosts[i],
                             devices_per_host=cluster.devices_per_host, layout=layouts[i],
                             chunks=tuple(st.chunks), remat=st.remat or job.pipeline.remat)
                   for i, st in enumerate(job.pipeline.stages))
    return Checked(job=job, cluster=cluster, model=model, stages=stages, microbatch_size=mb,
                   data_path=data_path, data=data)
