"""The typed job configuration (pydantic v2, frozen, unknown keys rejected), and the parse entry points.

These models check what a single value or section can check on its own: types
(strict: `"3"`, `3.0` and `true` are not integers), ranges, names, the shape of
`layers`, layout syntax. Checks that need the model, the cluster or several
sections together live in `check.py` (`check_job`). The cluster's models live in
`cluster_schema.py`, the shared base and value types in `fields.py`, the schema walking and
error conversion in `walk.py`; this module re-exports them so callers import one place.

Validation errors are converted into `ConfigError`s, one line per problem:
`key.path = value: rule`, unknown keys with the closest valid key suggested.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Mapping, Optional, Union

from pydantic import ConfigDict, Field, field_validator, model_validator

from orchestrator.core.config.cluster_schema import (ClusterConfig, DeviceConfig, GpuConfig, LinkClassConfig,
                                                     LinksConfig, TimeoutsConfig, TpuConfig)
from orchestrator.core.config.errors import Problem, suggest
from orchestrator.core.config.fields import (FACTORY_RE, IDENT_RE, MAX_RESTARTS, MAX_SEED, MAX_STEPS, NAME_RE,
                                             Frozen, PosFloat, PosInt, Rule,
                                             check_axis_name, layout_value)
from orchestrator.core.config.walk import field_kind, key_homes, parse_model, unknown_key_hint
from orchestrator.core.model.registry import BUILTIN

__all__ = [
    "RunConfig", "ModelConfig", "DataConfig", "EvalConfig", "OptimizerConfig", "StageConfig", "PipelineConfig",
    "PrecisionConfig", "ChainEntry", "FailureConfig",
    "JobConfig", "TimeoutsConfig", "ClusterConfig", "GpuConfig", "TpuConfig", "LinkClassConfig",
    "LinksConfig", "DeviceConfig", "parse_job", "parse_cluster", "field_kind",
    "NAME_RE", "Rule", "key_homes", "unknown_key_hint",
]


class RunConfig(Frozen):
    """`run:` — what the run is called, how long it trains, where it writes."""

    name: str
    steps: Annotated[int, Field(ge=1, le=MAX_STEPS)]
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] = 0
    output_dir: str = "runs"
    eval_every: Optional[PosInt] = None     # run data.eval every k steps (and after the last)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if "\x00" in v:
            raise Problem("must not contain a NUL byte")
        if v.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", v):
            raise Problem("must not be an absolute path; it names a directory under run.output_dir")
        if "/" in v or "\\" in v:
            raise Problem("must not contain a path separator ('/' or '\\'); it is one directory name")
        if ".." in v:
            raise Problem("must not contain '..' (path traversal)")
        if not NAME_RE.match(v):
            raise Problem(f"must match {NAME_RE.pattern} (letters, digits, '.', '_', '-'; starting "
                          "with a letter or digit; at most 64 characters)")
        return v

    @field_validator("output_dir")
    @classmethod
    def _output_dir(cls, v: str) -> str:
        if not v.strip():
            raise Problem("must not be empty (use '.' for the current directory)")
        if "\x00" in v:
            raise Problem("must not contain a NUL byte")
        return v


class ModelConfig(Frozen):
    """`model:` — a built-in model `name` or a `factory` ('package.module:function' returning a
    PipelineModel, see `orchestrator.core.model.adapters`), and its keyword arguments.

    `name: 'package.module:function'` is accepted too (the older spelling of `factory`).
    """

    name: Optional[str] = None
    factory: Optional[str] = None
    args: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _name(cls, v: Optional[str]) -> Optional[str]:
        if v is None or v in BUILTIN or FACTORY_RE.match(v):
            return v
        raise Problem(f"unknown model; built-in models are {', '.join(sorted(BUILTIN))}, or give a "
                      f"factory as 'package.module:function'{suggest(v, BUILTIN)}")

    @field_validator("factory")
    @classmethod
    def _factory(cls, v: Optional[str]) -> Optional[str]:
        if v is None or FACTORY_RE.match(v):
            return v
        raise Problem("must be an import path 'package.module:function' (a function returning a "
                      "PipelineModel)")

    @model_validator(mode="after")
    def _one_of(self) -> "ModelConfig":
        if (self.name is None) == (self.factory is None):
            raise Problem(f"give exactly one of model.name (built-in: {', '.join(sorted(BUILTIN))}) "
                          "and model.factory ('package.module:function')", ("name",), self.name)
        return self

    @property
    def ref(self) -> str:
        """The built-in name or the factory path."""
        return self.factory or self.name  # type: ignore[return-value]


class EvalConfig(Frozen):
    """`data.eval:` — held-out data for `run.eval_every`: a `holdout` fraction of the data set's
    windows (its tail, never trained on) or other files (`path`, same source kind); `batches`
    eval batches of `data.global_batch` rows each, the same ones at every evaluation."""

    path: Optional[Union[str, tuple[str, ...]]] = None
    holdout: Optional[Annotated[float, Field(gt=0, lt=1, allow_inf_nan=False)]] = None
    batches: PosInt = 2

    @field_validator("path", mode="before")
    @classmethod
    def _path(cls, v: Any) -> Any:
        return tuple(v) if isinstance(v, list) else v

    @model_validator(mode="after")
    def _one(self) -> "EvalConfig":
        if (self.path is None) == (self.holdout is None):
            raise Problem("give exactly one of data.eval.path (held-out files) or data.eval.holdout "
                          "(a fraction of the data set, e.g. 0.05)", ("path",), self.path)
        return self


_SOURCE_KEYS = {"synthetic": set(), "text": {"path"}, "tokens": {"path", "dtype"},
                "hf": {"path", "format", "column", "tokenizer"}, "grain": {"factory", "args"}}
_REQUIRED = {"text": ("path",), "tokens": ("path",), "hf": ("path", "tokenizer"), "grain": ("factory",)}


class DataConfig(Frozen):
    """`data:` — where examples come from and how many per step.

    Sources: `synthetic` (generated from (seed, step)), `text` (bytes of a text file as
    tokens), `tokens` (token shards: a directory with index.json, `.bin` files), `hf` (a
    Hugging Face `datasets` data set from local files, `column` tokenized with the
    `tokenizer` file), `grain` (`factory: package.module:function` returning a grain
    random-access source or MapDataset of token windows). `prefetch`: batches the
    host's loader thread keeps ready (0: load on the step's path).
    """

    source: Literal["synthetic", "text", "tokens", "hf", "grain"] = "synthetic"
    path: Optional[Union[str, tuple[str, ...]]] = None
    dtype: Optional[Literal["uint16", "uint32"]] = None
    format: Optional[Literal["parquet", "json", "arrow", "csv"]] = None
    column: Optional[str] = None
    tokenizer: Optional[str] = None
    factory: Optional[str] = None
    args: Optional[dict[str, Any]] = None
    global_batch: PosInt
    seq_len: Optional[PosInt] = None
    prefetch: Annotated[int, Field(ge=0, le=64)] = 2
    eval: Optional[EvalConfig] = None

    @field_validator("path", mode="before")
    @classmethod
    def _path(cls, v: Any) -> Any:
        if isinstance(v, list):
            if not v:
                raise Problem("must name at least one file")
            return tuple(v)
        return v

    @field_validator("factory")
    @classmethod
    def _factory(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not FACTORY_RE.match(v):
            raise Problem("must be an import path 'package.module:function'")
        return v

    @model_validator(mode="after")
    def _keys_of_source(self) -> "DataConfig":
        src = self.source
        for key in _REQUIRED.get(src, ()):
            if getattr(self, key) in (None, ""):
                what = {"path": "the data to read", "tokenizer": "a tokenizers JSON file",
                        "factory": "'package.module:function'"}[key]
                raise Problem(f"required when data.source is {src!r} ({what})", (key,), getattr(self, key))
        for key in ("path", "dtype", "format", "column", "tokenizer", "factory", "args"):
            if getattr(self, key) is not None and key not in _SOURCE_KEYS[src]:
                users = [s for s, keys in _SOURCE_KEYS.items() if key in keys]
                raise Problem(f"only used when data.source is {' or '.join(repr(u) for u in users)} "
                              f"(it is {src!r}); remove it or set it to null", (key,), getattr(self, key))
        if src == "text" and not isinstance(self.path, str):
            raise Problem("source 'text' reads one file: give one path", ("path",), list(self.path or ()))
        if self.eval is not None and src == "synthetic":
            raise Problem("synthetic data has no held-out set; evaluate a real source", ("eval",), None)
        return self


class ChainEntry(Frozen):
    """One element of `optimizer.chain`: an optax function name and its keyword arguments."""

    name: str
    args: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not IDENT_RE.match(v) or v.startswith("_"):
            raise Problem("must be the name of an optax function, e.g. 'clip_by_global_norm', 'adamw'")
        return v


class OptimizerConfig(Frozen):
    """`optimizer:` — an optax optimizer function `name` and its keyword arguments, or a `chain`
    of optax functions (schedules, weight-decay masks, global-norm clipping across stages:
    `orchestrator.core.model.optim`). Every hyperparameter is checked by its meaning, wherever it
    is written (`orchestrator.core.model.optim_rules`)."""

    name: Optional[str] = None
    args: dict[str, Any] = Field(default_factory=dict)
    chain: Optional[tuple[ChainEntry, ...]] = None
    # a chain whose updates climb the loss (no learning rate, a positive final `scale`) is refused
    # at plan time (`orchestrator.core.model.optim_rules`) unless this says it is meant
    allow_ascent: bool = False

    @field_validator("name")
    @classmethod
    def _name(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and (not IDENT_RE.match(v) or v.startswith("_")):
            raise Problem("must be the name of an optax optimizer function, e.g. 'adam', 'sgd', 'adamw'")
        return v

    @field_validator("chain", mode="before")
    @classmethod
    def _chain(cls, v: Any) -> Any:
        if isinstance(v, (list, tuple)) and not v:
            raise Problem("must list at least one optax function")
        return tuple(v) if isinstance(v, list) else v

    @model_validator(mode="after")
    def _one_of(self) -> "OptimizerConfig":
        if (self.name is None) == (self.chain is None):
            raise Problem("give exactly one of optimizer.name (with optimizer.args) and optimizer.chain",
                          ("name",), self.name)
        if self.chain is not None and self.args:
            raise Problem("with optimizer.chain, give each function's args in its chain entry",
                          ("args",), self.args)
        return self

    def spec(self) -> dict[str, Any]:
        """Plain data the stages build the optax chain from (`orchestrator.core.model.optim.build`)."""
        if self.chain is not None:
            return {"chain": [{"name": e.name, "args": dict(e.args)} for e in self.chain]}
        return {"name": self.name, "args": dict(self.args)}


class StageConfig(Frozen):
    """One entry of `pipeline.stages`: its layers, its mesh, its hosts, an optional layout override.

    `layers` is a half-open range `[start, stop)` of model layer indices; with
    `pipeline.virtual_stages: v > 1` it is a list of v such ranges (the stage's
    chunks; chunk j of stage i is virtual stage j * num_stages + i). It is left out
    when `pipeline.split_at` names the cuts, or on every stage for the default cut: the
    layers cut so the (virtual) stages' forward FLOPs are balanced
    (`orchestrator.core.model.balance`); `check_job` fills it in from the model.
    """

    layers: Optional[Union[tuple[int, int], tuple[tuple[int, int], ...]]] = None
    mesh: Annotated[dict[str, PosInt], Field(min_length=1)]
    hosts: PosInt = 1
    layout: Optional[dict[str, Any]] = None
    remat: Optional[str] = None     # this stage's rematerialisation (null: pipeline.remat)

    @field_validator("layers", mode="before")
    @classmethod
    def _layers(cls, v: Any) -> Any:
        if v is None:
            return None

        def pair(x: Any, sub: tuple) -> tuple[int, int]:
            if not (isinstance(x, (list, tuple)) and len(x) == 2
                    and all(isinstance(i, int) and not isinstance(i, bool) for i in x)):
                raise Problem("must be a half-open range [start, stop) of two integers "
                              "(or, with virtual_stages > 1, a list of such ranges)", sub, x)
            if x[0] < 0:
                raise Problem("layer indices must be >= 0", sub, x)
            if x[0] >= x[1]:
                raise Problem("start must be < stop (a stage holds at least one layer)", sub, x)
            return (x[0], x[1])

        if isinstance(v, (list, tuple)) and v and all(isinstance(x, (list, tuple)) for x in v):
            return tuple(pair(x, (i,)) for i, x in enumerate(v))
        return pair(v, ())

    @field_validator("mesh", mode="before")
    @classmethod
    def _mesh(cls, v: Any) -> Any:
        if isinstance(v, Mapping):
            for k in v:
                check_axis_name(k, "mesh axis name", (k,))
        return v

    @field_validator("layout", mode="before")
    @classmethod
    def _layout(cls, v: Any) -> Any:
        return None if v is None else layout_value(v)

    @property
    def chunks(self) -> tuple[tuple[int, int], ...]:
        """The stage's layer ranges, one per virtual stage (a single range when v == 1; none
        before `check_job` resolved `pipeline.split_at`)."""
        if self.layers is None:
            return ()
        return self.layers if isinstance(self.layers[0], tuple) else (self.layers,)  # type: ignore


def _listed(value: Any) -> Any:
    return [_listed(x) for x in value] if isinstance(value, (tuple, list)) else value


class PipelineConfig(Frozen):
    """`pipeline:` — schedule, microbatches and the stages."""

    schedule: str = "1f1b"
    microbatches: PosInt
    virtual_stages: PosInt = 1
    stages: tuple[StageConfig, ...]
    remat: str = "none"   # none | full | a jax.checkpoint_policies name (e.g. dots_saveable); per stage: stages[i].remat
    # where stages 1.. begin, by part name or attribute path (orchestrator.core.model.split),
    # instead of each stage's `layers`; one point per boundary between (virtual) stages
    split_at: Optional[tuple[str, ...]] = None
    # the loss chunk's F and B as one forward+backward program where the schedule puts them back
    # to back (stages.actions.fused_chunks). Off by default: on CPU at `large` the fused program
    # measured 68 ms against 58 ms for F + B apart (benchmarks/zb_check.py, README Benchmarks)
    fuse_loss_chunk: bool = False

    @field_validator("stages", mode="before")
    @classmethod
    def _stages(cls, v: Any) -> Any:
        if isinstance(v, (list, tuple)) and not v:
            raise Problem("must list at least one stage")
        return tuple(v) if isinstance(v, list) else v

    @field_validator("split_at", mode="before")
    @classmethod
    def _split_at(cls, v: Any) -> Any:
        if v is None:
            return None
        if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) and x.strip() for x in v):
            raise Problem("must be a list of split point names (part names or attribute paths, "
                          "e.g. [\"blocks.2\", \"head\"])", (), v)
        return tuple(v)

    @model_validator(mode="after")
    def _cuts(self) -> "PipelineConfig":
        given = [i for i, st in enumerate(self.stages) if st.layers is not None]
        if self.split_at is not None:
            if given:
                raise Problem("give either pipeline.split_at or each stage's layers, not both",
                              ("stages", given[0], "layers"), _listed(self.stages[given[0]].layers))
            want = len(self.stages) * self.virtual_stages - 1
            if len(self.split_at) != want:
                per = f" × virtual_stages {self.virtual_stages}" if self.virtual_stages > 1 else ""
                raise Problem(f"{len(self.stages)} stages{per} need {want} split point(s) (one where each "
                              f"stage after the first begins), got {len(self.split_at)}",
                              ("split_at",), list(self.split_at))
        elif given and len(given) != len(self.stages):    # none given: the cost-balanced default cut
            missing = next(i for i in range(len(self.stages)) if i not in given)
            raise Problem("required key is missing: the stage's layer range [start, stop), given for "
                          f"stage(s) {given} (give every stage's layers, none of them for the "
                          "cost-balanced default cut, or name the cuts with pipeline.split_at)",
                          ("stages", missing, "layers"))
        return self


class LossScaleConfig(Frozen):
    """`precision.loss_scale:` — dynamic loss scaling (`orchestrator.core.model.policy.DynamicLossScale`):
    start at `initial`; a step with any non-finite gradient on any stage is skipped by every
    stage and divides the scale by `factor` (not below `min_scale`); `growth_interval`
    finite steps in a row multiply it by `factor`."""

    initial: PosFloat = 2.0 ** 15
    growth_interval: PosInt = 2000
    factor: PosFloat = 2.0
    min_scale: PosFloat = 1.0

    @field_validator("initial", "factor", "min_scale", mode="before")
    @classmethod
    def _number(cls, v: Any) -> Any:
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v

    @model_validator(mode="after")
    def _sane(self) -> "LossScaleConfig":
        if not self.factor > 1:
            raise Problem("must be > 1 (the scale grows and backs off by this factor)", ("factor",), self.factor)
        if self.min_scale > self.initial:
            raise Problem(f"must be <= initial ({self.initial})", ("min_scale",), self.min_scale)
        if self.initial > 2.0 ** 64:
            raise Problem("must be <= 2**64 (a larger scale overflows float32 gradients)", ("initial",),
                          self.initial)
        return self


class PrecisionConfig(Frozen):
    """`precision:` — mixed precision policy. Parameters, gradients and optimizer state stay
    float32; `compute` is the dtype the parts compute in and activations (and their
    gradients) cross stages in; the loss is computed in float32. `loss_scale`: dynamic
    loss scaling, on by default for float16 (its range is narrow), off otherwise unless given."""

    compute: Literal["float32", "bfloat16", "float16"] = "float32"
    loss_scale: Optional[LossScaleConfig] = None

    def scaling(self):
        """The job's `DynamicLossScale` rule, or None (no loss scaling)."""
        from orchestrator.core.model.policy import DynamicLossScale

        ls = self.loss_scale or (LossScaleConfig() if self.compute == "float16" else None)
        if ls is None:
            return None
        return DynamicLossScale(ls.initial, ls.growth_interval, ls.factor, ls.min_scale)


class CheckpointConfig(Frozen):
    """`checkpoint:` — save the training state every `every_steps` steps (and after the last) under
    `dir` (one directory per step, a commit marker last; `orchestrator.core.checkpoint`), keep the
    newest `keep` committed ones; `async`: the step loop continues while the bytes are written."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, populate_by_name=True)

    dir: str
    every_steps: PosInt
    keep: PosInt = 2
    async_: bool = Field(True, alias="async")

    @field_validator("dir")
    @classmethod
    def _dir(cls, v: str) -> str:
        if not v.strip():
            raise Problem("must not be empty")
        if "\x00" in v:
            raise Problem("must not contain a NUL byte")
        return v


class FailureConfig(Frozen):
    """`failure:` — automatic recovery (Ray Train's `FailureConfig` vocabulary): on an actor death, a
    stage error or a hang, tear the job down, re-place it and continue from the last committed
    checkpoint, at most `max_restarts` times (0: any failure ends the run, as without this section).
    Needs `checkpoint:` when `max_restarts` > 0 (`orchestrator.driver.recovery`). A restart after a
    node loss waits up to `placement_timeout_s` for the placement to fit again; `compile_cache`
    (JAX's persistent compilation cache) spares a restarted stage most of its compilation."""

    max_restarts: Annotated[int, Field(ge=0, le=MAX_RESTARTS)] = 0
    # how long a restart waits for the placement to fit again (a lost node replaced); null: timeouts.init_s
    placement_timeout_s: Optional[PosFloat] = None
    # JAX's persistent compilation cache for the stage actors (a restarted stage loads its programs
    # instead of compiling them): "auto" = <run.output_dir>/<run.name>/compile_cache when
    # max_restarts > 0, else off; a directory path = always there; null = off
    compile_cache: Optional[str] = "auto"

    @field_validator("compile_cache")
    @classmethod
    def _cache(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and (not v.strip() or "\x00" in v):
            raise Problem("must be \"auto\", a directory path (not empty, no NUL byte) or null (off)")
        return v


class JobConfig(Frozen):
    """A whole job (`job.yaml`). Load with `load_job`, check against a cluster with `check_job`."""

    run: RunConfig
    model: ModelConfig
    data: DataConfig
    optimizer: OptimizerConfig
    pipeline: PipelineConfig
    layout: dict[str, Any] = Field(default_factory=dict)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    checkpoint: Optional[CheckpointConfig] = None
    failure: FailureConfig = Field(default_factory=FailureConfig)

    @field_validator("layout", mode="before")
    @classmethod
    def _layout(cls, v: Any) -> Any:
        return layout_value(v)

    @model_validator(mode="after")
    def _restarts_need_checkpoints(self) -> "JobConfig":
        if self.failure.max_restarts > 0 and self.checkpoint is None:
            raise Problem("restarts continue from the last committed checkpoint: add a `checkpoint:` section "
                          "(checkpoint.dir, checkpoint.every_steps) or set failure.max_restarts: 0",
                          ("failure", "max_restarts"), self.failure.max_restarts)
        return self

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict; `parse_job(job.to_dict()) == job`."""
        return self.model_dump(mode="json", by_alias=True)


def parse_job(raw: Mapping[str, Any], source: Optional[str] = None) -> JobConfig:
    """Validate a plain dict (e.g. from YAML) into a `JobConfig`.

    Raises:
      ConfigError: every problem found, one line each.

    Example:
        >>> job = parse_job({"run": {"name": "t", "steps": 1}, "model": {"name": "mlp"},
        ...                  "data": {"global_batch": 8}, "optimizer": {"name": "sgd"},
        ...                  "pipeline": {"microbatches": 2, "stages": [{"layers": [0, 4], "mesh": {"data": 1}}]}})
        >>> job.pipeline.stages[0].layers
        (0, 4)
    """
    return parse_model(JobConfig, raw, source)


def parse_cluster(raw: Mapping[str, Any], source: Optional[str] = None) -> ClusterConfig:
    """Validate a plain dict into a `ClusterConfig` (raises `ConfigError`).

    Example:
        >>> parse_cluster({"hosts": 2, "devices_per_host": 4}).placement_strategy
        'PACK'
    """
    return parse_model(ClusterConfig, raw, source)
