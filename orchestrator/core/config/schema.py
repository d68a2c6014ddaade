"""The typed job and cluster configuration (pydantic v2, frozen, unknown keys rejected).

These models check what a single value or section can check on its own: types
(strict: `"3"`, `3.0` and `true` are not integers), ranges, names, the shape of
`layers`, layout syntax. Checks that need the model, the cluster or several
sections together live in `check.py` (`check_job`).

Validation errors are converted into `ConfigError`s, one line per problem:
`key.path = value: rule`, unknown keys with the closest valid key suggested.
"""
from __future__ import annotations

import re
import typing
from typing import Annotated, Any, ClassVar, Literal, Mapping, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from orchestrator.core.backends import get_backend
from orchestrator.core.backends.tpu_topology import TpuTypeError, geometry
from orchestrator.core.config.errors import ConfigError, Problem, fmt_value, problem, problem_nv, suggest
from orchestrator.core.redact import redact
from orchestrator.core.model.layout import FirstOf, parse_layout
from orchestrator.core.model.registry import BUILTIN

__all__ = [
    "RunConfig", "ModelConfig", "DataConfig", "EvalConfig", "OptimizerConfig", "StageConfig", "PipelineConfig",
    "PrecisionConfig", "ChainEntry", "FailureConfig",
    "JobConfig", "TimeoutsConfig", "ClusterConfig", "GpuConfig", "TpuConfig", "LinkClassConfig",
    "LinksConfig", "DeviceConfig", "parse_job", "parse_cluster", "field_kind",
    "NAME_RE", "Rule", "key_homes", "unknown_key_hint",
]

PosInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
PosFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Rule = Union[str, tuple[str, ...], None]
MAX_STEPS = 10**9          # ~11 days at 1 ms a step; more is a typo, not a run
MAX_SEED = 2**32 - 1       # JAX PRNG keys and numpy seed sequences take it without overflow
MAX_RESTARTS = 1000        # a run that fails more often than this is not recovering

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_FACTORY_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
_HOSTPORT_RE = re.compile(r"^(ray://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


def _check_axis_name(name: Any, what: str, sub: tuple = ()) -> str:
    if not isinstance(name, str) or not _IDENT_RE.match(name):
        raise Problem(f"{what} {name!r} must be an identifier (letters, digits, '_'; not starting "
                      "with a digit)", sub, name)
    return name


def _layout_value(value: Any) -> dict[str, Rule]:
    """Validate and normalise a layout (mapping or Mesh-TF text) with per-key errors."""
    if value is None:
        return {}
    if isinstance(value, str):
        names = [p.partition(":")[0].strip() for p in value.split(";") if p.strip()]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise Problem(f"logical axis {dups[0]!r} has more than one rule in the layout text; "
                          "write each logical axis once")
        try:
            rules = parse_layout(value)
        except ValueError as e:
            raise Problem(f"invalid Mesh-TF layout text ({e}); write 'logical:mesh_axis;...', "
                          "e.g. 'batch:data;mlp:model'") from None
    elif isinstance(value, Mapping):
        for k, v in value.items():
            ok = v is None or isinstance(v, (str, FirstOf, Mapping)) or (
                isinstance(v, (list, tuple)) and v and all(isinstance(t, str) for t in v))
            if ok and isinstance(v, Mapping) and (set(v) != {"first"} or not isinstance(v.get("first"), list)
                                                  or not v["first"]):
                ok = False
            if not ok:
                raise Problem("must be a mesh axis name, a non-empty list of them (sharded over their "
                              "product), {first: [candidate, ...]} (the first that fits each stage) or null",
                              (k,), v)
        try:
            rules = parse_layout(value)
        except ValueError as e:
            raise Problem(str(e).partition(": ")[2] or str(e)) from None
    else:
        raise Problem(f"must be a mapping (logical: mesh_axis) or Mesh-TF text like "
                      f"'batch:data;mlp:model', not {type(value).__name__}")
    for logical, rule in rules.items():
        _check_axis_name(logical, "logical axis", (logical,))
        for option in rule.first if isinstance(rule, FirstOf) else (rule,):
            axes = (option,) if isinstance(option, str) else tuple(option or ())
            for a in axes:
                _check_axis_name(a, "mesh axis", (logical,))
            if len(set(axes)) != len(axes):
                raise Problem("a mesh axis may appear only once in a rule", (logical,), option)
    return rules


class RunConfig(_Frozen):
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


class ModelConfig(_Frozen):
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
        if v is None or v in BUILTIN or _FACTORY_RE.match(v):
            return v
        raise Problem(f"unknown model; built-in models are {', '.join(sorted(BUILTIN))}, or give a "
                      f"factory as 'package.module:function'{suggest(v, BUILTIN)}")

    @field_validator("factory")
    @classmethod
    def _factory(cls, v: Optional[str]) -> Optional[str]:
        if v is None or _FACTORY_RE.match(v):
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


class EvalConfig(_Frozen):
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


class DataConfig(_Frozen):
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
        if v is not None and not _FACTORY_RE.match(v):
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


class ChainEntry(_Frozen):
    """One element of `optimizer.chain`: an optax function name and its keyword arguments."""

    name: str
    args: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _IDENT_RE.match(v) or v.startswith("_"):
            raise Problem("must be the name of an optax function, e.g. 'clip_by_global_norm', 'adamw'")
        return v


class OptimizerConfig(_Frozen):
    """`optimizer:` — an optax optimizer function `name` and its keyword arguments, or a `chain`
    of optax functions (schedules, weight-decay masks, global-norm clipping across stages:
    `orchestrator.core.model.optim`)."""

    name: Optional[str] = None
    args: dict[str, Any] = Field(default_factory=dict)
    chain: Optional[tuple[ChainEntry, ...]] = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and (not _IDENT_RE.match(v) or v.startswith("_")):
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


class StageConfig(_Frozen):
    """One entry of `pipeline.stages`: its layers, its mesh, its hosts, an optional layout override.

    `layers` is a half-open range `[start, stop)` of model layer indices; with
    `pipeline.virtual_stages: v > 1` it is a list of v such ranges (the stage's
    chunks; chunk j of stage i is virtual stage j * num_stages + i). It is left out
    when `pipeline.split_at` names the cuts (`check_job` fills it in from the model).
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
                _check_axis_name(k, "mesh axis name", (k,))
        return v

    @field_validator("layout", mode="before")
    @classmethod
    def _layout(cls, v: Any) -> Any:
        return None if v is None else _layout_value(v)

    @property
    def chunks(self) -> tuple[tuple[int, int], ...]:
        """The stage's layer ranges, one per virtual stage (a single range when v == 1; none
        before `check_job` resolved `pipeline.split_at`)."""
        if self.layers is None:
            return ()
        return self.layers if isinstance(self.layers[0], tuple) else (self.layers,)  # type: ignore


def _listed(value: Any) -> Any:
    return [_listed(x) for x in value] if isinstance(value, (tuple, list)) else value


class PipelineConfig(_Frozen):
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
        elif len(given) != len(self.stages):
            missing = next(i for i in range(len(self.stages)) if i not in given)
            raise Problem("required key is missing: the stage's layer range [start, stop) (or name the "
                          "cuts with pipeline.split_at)", ("stages", missing, "layers"))
        return self


class LossScaleConfig(_Frozen):
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


class PrecisionConfig(_Frozen):
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


class CheckpointConfig(_Frozen):
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


class FailureConfig(_Frozen):
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


class JobConfig(_Frozen):
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
        return _layout_value(v)

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


class TimeoutsConfig(_Frozen):
    """`timeouts:` (seconds, all > 0): every remote wait has a deadline."""

    init_s: PosFloat = 120.0
    step_s: PosFloat = 600.0
    shutdown_s: PosFloat = 30.0
    jax_distributed_init_s: PosFloat = 60.0


class GpuConfig(_Frozen):
    """`gpu:` (platform gpu, optional) — what the GPU nodes are and how XLA uses their memory."""

    gpus_per_node: Optional[PosInt] = None       # checked against devices_per_host at load (null: at placement)
    accelerator_type: Optional[str] = None       # Ray's accelerator_type:<T> resource, e.g. H100 (null: any)
    memory_fraction: Optional[float] = None      # XLA_PYTHON_CLIENT_MEM_FRACTION (null: XLA's default, 0.75)
    preallocate: bool = True                     # XLA_PYTHON_CLIENT_PREALLOCATE

    @field_validator("memory_fraction")
    @classmethod
    def _fraction(cls, v: Optional[float]) -> Optional[float]:
        if v is not None and not 0 < v <= 1:
            raise Problem("must be in (0, 1]: the fraction of each GPU's memory XLA may use")
        return v

    @field_validator("accelerator_type")
    @classmethod
    def _accelerator_type(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", v):
            raise Problem("must be a Ray accelerator type name, e.g. H100, A100, L4 (see ray.util.accelerators)")
        return v


class TpuConfig(_Frozen):
    """`tpu:` (platform tpu, required) — the TPU slice type the cluster is made of."""

    type: str                                   # GCP accelerator type, e.g. v5litepod-16, v6e-16, v4-16
    topology: str                               # chips, e.g. 4x4 (v5e/v6e) or 2x2x2 (v4/v5p)
    slices: PosInt = 1                          # slices of that type (more than 1: stages across slices / DCN)
    chips_per_host: Optional[PosInt] = None     # override Ray's default (4, or 8 for single-VM v5e/v6e)

    @model_validator(mode="after")
    def _geometry(self) -> "TpuConfig":
        try:
            geometry(self.type, self.topology, self.chips_per_host)
        except TpuTypeError as e:
            raise Problem(str(e), (e.key,), getattr(self, e.key)) from None
        return self


class LinkClassConfig(_Frozen):
    """One link class of `links:` for the planner's α-β model: t(bytes) = latency + bytes / bandwidth."""

    bandwidth_gbps: PosFloat      # GB/s (1e9 bytes per second) per device on this link
    latency_us: NonNegFloat       # per message, microseconds


class LinksConfig(_Frozen):
    """`links:` (optional; `meshpipe plan --auto` only) — the cluster's link classes.

    `host`: between devices of one host; `group`: between hosts of one node group
    (an NVLink/ICI domain: `hosts_per_group` consecutive hosts; a TPU slice);
    `dcn`: between node groups. Left out: the platform's nominal defaults
    (`orchestrator.core.planner.topology`).
    """

    host: Optional[LinkClassConfig] = None
    group: Optional[LinkClassConfig] = None
    dcn: Optional[LinkClassConfig] = None
    hosts_per_group: Optional[PosInt] = None


class DeviceConfig(_Frozen):
    """`device:` (optional; `meshpipe plan --auto` only) — what one device can hold and do."""

    memory_gb: Optional[PosFloat] = None      # bytes the planner may fill per device (1e9 bytes)
    tflops: Optional[PosFloat] = None         # sustained float32 TFLOP/s per device
    memory_bandwidth_gbps: Optional[PosFloat] = None   # GB/s per device
    # fixed runtime cost of one pipeline action (F, B, OPT) on a stage, microseconds: dispatch,
    # interpreter, spans, transport bookkeeping (`meshpipe calibrate` measures it; null: 0)
    action_overhead_us: Optional[NonNegFloat] = None
    # fixed runtime cost of one stage-to-stage transfer (its SEND and RECV) beyond the link's α-β time,
    # microseconds: wake-ups, mailbox, framing (`meshpipe calibrate` measures it; null: 0)
    transfer_overhead_us: Optional[NonNegFloat] = None


class ClusterConfig(_Frozen):
    """A cluster (`cluster.yaml`): which Ray, what platform, how many hosts of how many devices."""

    address: Optional[str] = None
    platform: Literal["cpu", "gpu", "tpu"] = "cpu"
    hosts: PosInt
    devices_per_host: PosInt
    cpus_per_host: PosFloat = 1.0
    resources_per_host: dict[str, NonNegFloat] = Field(default_factory=dict)
    num_cpus: Optional[PosInt] = None
    dashboard_host: str = "127.0.0.1"
    node_ip_address: str = "127.0.0.1"  # embedded Ray only: 127.0.0.1 keeps every Ray port on loopback
    env_vars: dict[str, str] = Field(default_factory=dict, repr=False)  # stage actors' env; redacted in output
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    pin_cpus: bool = False   # pin each host actor to one core of its node (host index mod cores)
    transport: Literal["ray", "socket"] = "socket"   # stage-to-stage tensors: framed TCP (default) or Ray actor calls
    # how the driver triggers steps (orchestrator.driver.dispatch): a Ray call per actor per steps_per_call
    # steps (default), the same as a Ray Compiled Graph, or a Ray call per action (the slow reference)
    executor: Literal["step_calls", "compiled_graph", "action_calls"] = "step_calls"
    steps_per_call: Optional[PosInt] = None   # step_calls / compiled_graph; None: 4 (action_calls: 1)
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig)
    gpu: Optional[GpuConfig] = None   # platform gpu only
    tpu: Optional[TpuConfig] = None   # platform tpu only (required there)
    links: Optional[LinksConfig] = None     # link classes for the auto-planner (null: platform defaults)
    device: Optional[DeviceConfig] = None   # device memory/speed for the auto-planner (null: defaults)

    RESERVED_RESOURCES: ClassVar[frozenset[str]] = frozenset({"CPU", "GPU", "TPU", "memory",
                                                               "object_store_memory"})
    MESHPIPE_ENV: ClassVar[frozenset[str]] = frozenset({"XLA_FLAGS", "JAX_PLATFORMS",
                                                         "PYTHONUNBUFFERED", "MESHPIPE_JAX_INIT"})

    @field_validator("address")
    @classmethod
    def _address(cls, v: Optional[str]) -> Optional[str]:
        if v is None or v == "auto":
            return v
        m = _HOSTPORT_RE.match(v)
        if not m or not 1 <= int(m.group(3)) <= 65535:
            raise Problem("must be null (embedded Ray started by meshpipe), 'auto', "
                          "'ray://host:port' or 'host:port' (port 1-65535)")
        return v

    @field_validator("resources_per_host", mode="before")
    @classmethod
    def _resources(cls, v: Any) -> Any:
        if isinstance(v, Mapping):
            for k in v:
                if k in cls.RESERVED_RESOURCES:
                    raise Problem(f"{k!r} is reserved by Ray; CPUs come from cpus_per_host and "
                                  "accelerators from platform/devices_per_host", (k,), v[k])
        return v

    @field_validator("dashboard_host", "node_ip_address")
    @classmethod
    def _dashboard_host(cls, v: str) -> str:
        if not v or any(c.isspace() for c in v) or "\x00" in v:
            raise Problem("must be a host name or IP address (no spaces), e.g. 127.0.0.1")
        return v

    @field_validator("node_ip_address")
    @classmethod
    def _node_ip(cls, v: str) -> str:
        if v in ("0.0.0.0", "::", "[::]"):
            raise Problem("must be the address other machines reach this one at (Ray advertises it), "
                          "not a wildcard; 127.0.0.1 (the default) keeps every Ray port on loopback")
        return v

    @field_validator("env_vars", mode="before")
    @classmethod
    def _env_vars(cls, v: Any) -> Any:
        """Environment variables for every stage actor (Ray runtime_env); numbers become strings."""
        if not isinstance(v, Mapping):
            return v
        out = {}
        for k, val in v.items():
            if not isinstance(k, str) or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k):
                raise Problem("must be an environment variable name (letters, digits, '_'; not "
                              "starting with a digit)", (k,), val)
            if k in cls.MESHPIPE_ENV:
                raise Problem(f"{k} is set by meshpipe for each actor (simulated devices, platform); "
                              "it cannot be overridden here", (k,), val)
            if isinstance(val, bool) or not isinstance(val, (str, int, float)):
                raise Problem("must be a string (quote it: environment values are text)", (k,), val)
            out[k] = str(val)
        return out

    @model_validator(mode="after")
    def _cpus(self) -> "ClusterConfig":
        if self.num_cpus is not None and self.address is not None:
            raise Problem("only for an embedded cluster (address: null); a running cluster "
                          "declares its own CPUs", ("num_cpus",), self.num_cpus)
        need = self.hosts * self.cpus_per_host
        if self.num_cpus is not None and need > self.num_cpus + 1e-9:
            raise Problem(f"too few CPUs: hosts × cpus_per_host = {self.hosts} × {self.cpus_per_host} "
                          f"= {need:g} CPUs do not fit in num_cpus = {self.num_cpus}; the placement "
                          "group would wait forever", ("num_cpus",), self.num_cpus)
        return self

    @model_validator(mode="after")
    def _steps_per_call(self) -> "ClusterConfig":
        if self.executor == "action_calls" and self.steps_per_call not in (None, 1):
            raise Problem("must be 1 (or left out) with executor: action_calls, which makes one Ray call "
                          "per action", ("steps_per_call",), self.steps_per_call)
        return self

    @model_validator(mode="after")
    def _links(self) -> "ClusterConfig":
        g = self.links.hosts_per_group if self.links is not None else None
        if g is not None and self.hosts % g:
            raise Problem(f"must divide cluster.hosts = {self.hosts}: node groups are equal runs of "
                          "consecutive hosts", ("links", "hosts_per_group"), g)
        return self

    @property
    def calls_of_steps(self) -> int:
        """Steps per executor call: steps_per_call, or 4 (1 for action_calls) when left out."""
        if self.steps_per_call is not None:
            return self.steps_per_call
        return 1 if self.executor == "action_calls" else 4

    @model_validator(mode="after")
    def _platform(self) -> "ClusterConfig":
        """The platform's section and its backend's cluster rules (orchestrator.core.backends)."""
        for name in ("gpu", "tpu"):
            if getattr(self, name) is not None and self.platform != name:
                raise Problem(f"only for platform: {name} (this cluster is platform: {self.platform}); "
                              "remove it", (name,), getattr(self, name).model_dump(mode="json"))
        if self.platform == "tpu" and self.tpu is None:
            raise Problem("required for platform: tpu: the slice type, e.g. {type: v5litepod-16, "
                          "topology: 4x4}", ("tpu",), None)
        for key, value, rule in get_backend(self).check_cluster()[:1]:
            raise Problem(rule, tuple(key.split(".")), value)
        return self

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict; `parse_cluster(c.to_dict()) == c`."""
        return self.model_dump(mode="json")


# ----------------------------------------------------------------------------- schema walking

def _unwrap(tp: Any) -> Any:
    while True:
        origin = typing.get_origin(tp)
        if origin is Annotated:
            tp = typing.get_args(tp)[0]
        elif origin is Union:
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) != 1:
                return tp
            tp = args[0]
        else:
            return tp


def field_kind(cls: type[BaseModel], name: str) -> tuple[str, Any]:
    """What a field holds: ("model", cls) | ("list", item_cls) | ("free", None) | ("leaf", None).

    "free" fields are mappings whose keys the user chooses (model.args, layout, mesh, ...).
    """
    tp = _unwrap(cls.model_fields[name].annotation)
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return "model", tp
    if origin in (tuple, list):
        item = _unwrap(typing.get_args(tp)[0])
        if isinstance(item, type) and issubclass(item, BaseModel):
            return "list", item
    if origin is dict or tp is dict:
        return "free", None
    return "leaf", None


def key_homes(root: type[BaseModel], name: Any, prefix: str = "") -> list[str]:
    """Every section of the schema that has a key `name` (`steps` → `['run']`).

    Example:
        >>> key_homes(JobConfig, "global_batch"), key_homes(JobConfig, "hosts")
        (['data'], ['pipeline.stages[i]'])
    """
    out: list[str] = []
    for field in root.model_fields:
        kind, cls = field_kind(root, field)
        if kind not in ("model", "list"):
            continue
        path = (f"{prefix}.{field}" if prefix else field) + ("[i]" if kind == "list" else "")
        if name in cls.model_fields:
            out.append(path)
        out += key_homes(cls, name, path)
    return out


def unknown_key_hint(root: type[BaseModel], loc: tuple, valid: list[str]) -> str:
    """`"; did you mean 'x'?"`, or where the key belongs when it is misplaced, or the valid keys."""
    name = loc[-1]
    homes = key_homes(root, name)
    if name in root.model_fields and loc[:-1]:
        homes.insert(0, "the top level")
    if homes:
        where = homes[0] if len(homes) == 1 else ", ".join(homes[:-1]) + " or " + homes[-1]
        first = str(name) if homes[0] == "the top level" else f"{homes[0]}.{name}"
        return f"; '{name}' is a key of {where} (wrong nesting?), e.g. {first}"
    return suggest(name, valid) or (f"; valid keys: {', '.join(valid)}" if valid else "")


def _model_at(root: type[BaseModel], loc: tuple) -> Optional[type[BaseModel]]:
    """The model class that holds the last element of `loc`, or None if not a model."""
    cls: Any = root
    kind = "model"
    for part in loc[:-1]:
        if kind == "model" and isinstance(part, str) and part in cls.model_fields:
            kind, cls = field_kind(cls, part)
        elif kind == "list" and isinstance(part, int):
            kind = "model"
        else:
            return None
    return cls if kind == "model" else None


# ----------------------------------------------------------------------------- error conversion

def _type_name(v: Any) -> str:
    return {bool: "a boolean", str: "a string", int: "an integer", float: "a number",
            list: "a list", dict: "a mapping", type(None): "null"}.get(type(v), type(v).__name__)


def _rule_for(err: dict) -> str:
    t, ctx, v = err["type"], err.get("ctx") or {}, err.get("input")
    if t == "int_type":
        return f"must be an integer, not {_type_name(v)}"
    if t in ("float_type", "finite_number"):
        return ("must be a finite number" if t == "finite_number"
                else f"must be a number, not {_type_name(v)}")
    if t == "string_type":
        return f"must be a string, not {_type_name(v)}"
    if t == "bool_type":
        return f"must be true or false, not {_type_name(v)}"
    if t == "greater_than_equal":
        return f"must be >= {ctx.get('ge')}"
    if t == "greater_than":
        return f"must be > {ctx.get('gt')}"
    if t in ("dict_type", "model_type", "model_attributes_type"):
        return f"must be a mapping (key: value), not {_type_name(v)}"
    if t in ("list_type", "tuple_type"):
        return f"must be a list, not {_type_name(v)}"
    if t == "too_short":
        return f"must have at least {ctx.get('min_length')} item(s)"
    if t == "literal_error":
        choices = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        return f"must be one of {', '.join(repr(c) for c in choices)}{suggest(v, choices)}"
    return err["msg"]


def _convert(exc: ValidationError, root: type[BaseModel]) -> list[str]:
    out: list[str] = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        t = err["type"]
        if t == "extra_forbidden":
            cls = _model_at(root, loc)
            valid = list(cls.model_fields) if cls else []
            hint = suggest(loc[-1], valid) or unknown_key_hint(root, loc, valid)
            value = fmt_value(redact(err.get("input"), loc[-1]))
            out.append(f"{problem_nv(loc, 'unknown key' + hint)} (value {value})")
            continue
        if t == "missing":
            out.append(problem_nv(loc, "required key is missing"))
            continue
        if loc and loc[-1] == "[key]":
            out.append(problem(loc[:-2], loc[-2], "keys must be strings"))
            continue
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, Problem):
            value = cause.value if cause.has_value else err.get("input")
            value = list(value) if isinstance(value, tuple) else value
            out.append(problem(loc + cause.sub, value, cause.rule))
            continue
        value = err.get("input")
        out.append(problem(loc, list(value) if isinstance(value, tuple) else value, _rule_for(err)))
    return out


_CONTROL_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")   # tab and newline allowed
_KEY_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _control_characters(raw: Any, loc: tuple = ()) -> list[str]:
    """A problem line per key or string value holding a control character (YAML lets a
    double-quoted string spell any character as an escape; values may hold tabs and newlines)."""
    out = []
    if isinstance(raw, Mapping):
        for k, v in raw.items():
            if isinstance(k, str) and _KEY_CONTROL_RE.search(k):
                out.append(problem(loc + (repr(k),), v, "a key must not contain control characters"))
            else:
                out += _control_characters(v, loc + (k,))
    elif isinstance(raw, (list, tuple)):
        for i, v in enumerate(raw):
            out += _control_characters(v, loc + (i,))
    elif isinstance(raw, str) and _CONTROL_RE.search(raw):
        c = _CONTROL_RE.search(raw).group()
        what = "a NUL byte (U+0000)" if c == "\x00" else f"control character U+{ord(c):04X}"
        out.append(problem(loc, raw, f"contains {what}; names, paths and values must be printable text"))
    return out


def _parse(cls: type[BaseModel], raw: Any, source: Optional[str]) -> Any:
    if not isinstance(raw, Mapping):
        raise ConfigError(problem("<top level>", raw, "must be a mapping of sections"), source)
    bad = _control_characters(raw)
    if bad:
        raise ConfigError(bad, source)
    try:
        return cls.model_validate(dict(raw))
    except ValidationError as e:
        raise ConfigError(_convert(e, cls), source) from None


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
    return _parse(JobConfig, raw, source)


def parse_cluster(raw: Mapping[str, Any], source: Optional[str] = None) -> ClusterConfig:
    """Validate a plain dict into a `ClusterConfig` (raises `ConfigError`).

    Example:
        >>> parse_cluster({"hosts": 2, "devices_per_host": 4}).placement_strategy
        'PACK'
    """
    return _parse(ClusterConfig, raw, source)
