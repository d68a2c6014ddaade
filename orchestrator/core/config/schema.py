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
    "PrecisionConfig", "ChainEntry", "FailureConfig", "DivergenceConfig",
    "JobConfig", "TimeoutsConfig", "ClusterConfig", "GpuConfig", "TpuConfig", "LinkClassConfig",
    "LinksConfig", "DeviceConfig", "parse_job", "parse_cluster", "field_kind",
    "NAME_RE", "Rule", "key_homes", "unknown_key_hint",
]


class RunConfig(Frozen):
    """`run:` — what the run is called, how long it trains, where it writes."""

    name: str = Field(description="The run's name: its record goes to `<output_dir>/<name>/`, its Ray actors are "
                      "named `<name>/stage<s>/host<h>`. One directory name: letters, digits, `.`, `_`, `-`, "
                      "at most 64 characters, no path separator.", examples=["gpt-tiny"])
    steps: Annotated[int, Field(ge=1, le=MAX_STEPS)] = Field(description="Optimizer steps to train.")
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] = Field(
        0, description="Seeds the parameter init (one model key for every part) and the data order: the batch "
                       "at step n depends only on (seed, n), whatever the layout.")
    output_dir: str = Field("runs", description="Parent of the run directory; relative paths are read from the "
                                                "current directory.")
    eval_every: Optional[PosInt] = Field(None, description="Evaluate on `data.eval` after every k-th step and "
                                                           "after the last (needs `data.eval`).")

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
    PipelineModel, built with an adapter: `meshpipe.nnx_model`, ...), and its keyword arguments.

    `name: 'package.module:function'` is accepted too (the older spelling of `factory`).
    """

    name: Optional[str] = Field(None, description="A built-in model (`gpt`, `mlp`; `meshpipe plan` lists their "
                                                  "layers). Give exactly one of `name` and `factory`.",
                                examples=["gpt"])
    factory: Optional[str] = Field(None, description="Your own model: `package.module:function` returning a "
                                                     "`PipelineModel` (built with an adapter: `meshpipe.nnx_model`, "
                                                     "`linen_model`, `eqx_model`, `plain`). The job file's directory "
                                                     "is on the import path.",
                                   examples=["examples.llama_model:pipeline"])
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the built-in model or "
                                                                   "the factory; `seq_len` comes from `data.seq_len`.")

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

    path: Optional[Union[str, tuple[str, ...]]] = Field(
        None, description="Held-out files of the same source kind as `data.path`. Give exactly one of `path` "
                          "and `holdout`.")
    holdout: Optional[Annotated[float, Field(gt=0, lt=1, allow_inf_nan=False)]] = Field(
        None, description="The fraction of the data set's windows (its tail) kept out of training for "
                          "evaluation.", examples=[0.05])
    batches: PosInt = Field(2, description="Eval batches of `data.global_batch` rows, the same ones at every "
                                           "evaluation.")

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

    source: Literal["synthetic", "text", "tokens", "hf", "grain"] = Field(
        "synthetic", description="Where rows come from: `synthetic` (generated from (seed, step)), `text` (a "
                                 "text file's bytes as token ids), `tokens` (token shards), `hf` (a Hugging Face "
                                 "`datasets` data set from local files), `grain` (a grain source from a factory).")
    path: Optional[Union[str, tuple[str, ...]]] = Field(
        None, description="`text`: one file; `tokens`: a shard directory with `index.json`, or a list of `.bin` "
                          "shards; `hf`: data files. Relative paths are read from the current directory.")
    dtype: Optional[Literal["uint16", "uint32"]] = Field(
        None, description="`tokens` without an `index.json`: the bare shards' token dtype.")
    format: Optional[Literal["parquet", "json", "arrow", "csv"]] = Field(
        None, description="`hf`: the files' format (null: from the extension).")
    column: Optional[str] = Field(None, description="`hf`: the text column to tokenize.")
    tokenizer: Optional[str] = Field(None, description="`hf`: a `tokenizers` JSON file.")
    factory: Optional[str] = Field(None, description="`grain`: `package.module:function`, called with `args`, "
                                                     "returning a grain MapDataset or random-access source of "
                                                     "token windows.")
    args: Optional[dict[str, Any]] = Field(None, description="`grain`: keyword arguments of the factory.")
    global_batch: PosInt = Field(description="Sequences (rows) per optimizer step, over all microbatches.")
    seq_len: Optional[PosInt] = Field(None, description="Tokens per sequence: each row reads seq_len + 1 tokens. "
                                                        "Required by models with a `seq` axis (gpt), absent for "
                                                        "models without one (mlp).")
    prefetch: Annotated[int, Field(ge=0, le=64)] = Field(
        2, description="Batches each loading host's thread keeps ready (0: load on the step's path).")
    eval: Optional[EvalConfig] = Field(None, description="Held-out data for `run.eval_every`.")

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

    name: str = Field(description="An optax function, e.g. `clip_by_global_norm`, `adamw`.")
    args: dict[str, Any] = Field(default_factory=dict, description="Its keyword arguments; a value "
                                 "`{schedule: NAME, args: {...}}` becomes that optax schedule, `mask: {exclude: "
                                 "[patterns]}` a weight-decay mask over parameter names.")

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

    name: Optional[str] = Field(None, description="An optax optimizer function (`adam`, `sgd`, `adamw`, ...). "
                                                  "Give exactly one of `name` and `chain`.", examples=["adam"])
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of `name`, e.g. "
                                 "`{learning_rate: 0.003}`.")
    chain: Optional[tuple[ChainEntry, ...]] = Field(
        None, description="An optax chain, applied in order. `clip_by_global_norm` first clips with the whole "
                          "model's norm across stages.")
    allow_ascent: bool = Field(
        False, description="Allow a chain whose updates climb the loss (no learning rate, a positive final "
                           "`scale`); refused at plan time otherwise (`orchestrator.core.model.optim_rules`).")

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

    layers: Optional[Union[tuple[int, int], tuple[tuple[int, int], ...]]] = Field(
        None, description="Half-open range [start, stop) of the model's layers (with `virtual_stages` v > 1: v "
                          "ranges). Left out on every stage: the cut that balances forward FLOPs.",
        examples=[[0, 2]])
    mesh: Annotated[dict[str, PosInt], Field(min_length=1)] = Field(
        description="The stage's mesh: axis name → size; the product is the stage's devices (hosts × "
                    "devices_per_host).", examples=[{"data": 2}, {"data": 2, "model": 4}])
    hosts: PosInt = Field(1, description="Cluster hosts this stage spans; more than 1 makes its actors one "
                                         "multi-process JAX world (`jax.distributed`).")
    layout: Optional[dict[str, Any]] = Field(None, description="Layout rules for this stage only, over the "
                                                               "job-wide `layout`.")
    remat: Optional[str] = Field(None, description="This stage's rematerialisation (null: `pipeline.remat`).")

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

    schedule: str = Field("1f1b", description="`gpipe`, `1f1b`, `eager-1f1b`, `zb-h1` (zero bubble; JAX ≥ "
                                              "0.10) or `interleaved-1f1b` (with `virtual_stages` > 1).")
    microbatches: PosInt = Field(description="Microbatches per step; `data.global_batch` must divide by it.")
    virtual_stages: PosInt = Field(1, description="Chunks per stage (interleaved-1f1b): chunk j of stage i is "
                                                  "virtual stage j × stages + i.")
    stages: tuple[StageConfig, ...] = Field(description="The pipeline stages, in order.")
    remat: str = Field("none", description="Rematerialisation of every stage: `none`, `full` or a "
                                           "`jax.checkpoint_policies` name (e.g. `dots_saveable`); a stage's own "
                                           "`remat` wins.")
    split_at: Optional[tuple[str, ...]] = Field(
        None, description="Where stages 1, 2, … begin, by part name or attribute path, instead of each stage's "
                          "`layers`: one point per boundary between (virtual) stages.",
        examples=[["blocks.1"]])
    fuse_loss_chunk: bool = Field(
        False, description="Run the loss chunk's forward and backward as one program where the schedule puts "
                           "them back to back (1F1B's last stage). Off by default: it saves nothing on XLA:CPU, "
                           "4–10 % on an H200 (the decision log's 'fused loss chunk').")

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

    initial: PosFloat = Field(2.0 ** 15, description="The scale at step 0 (at most 2**64).")
    growth_interval: PosInt = Field(2000, description="Finite steps in a row after which the scale grows × "
                                                      "`factor`.")
    factor: PosFloat = Field(2.0, description="Growth and back-off factor (> 1).")
    min_scale: PosFloat = Field(1.0, description="The scale never backs off below this (≤ `initial`).")

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

    compute: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="The dtype the parts compute in and activations cross stages in; parameters, "
                               "gradients and optimizer state stay float32, the loss is float32.")
    loss_scale: Optional[LossScaleConfig] = Field(None, description="Dynamic loss scaling (null: on with its "
                                                                    "defaults for float16, off otherwise).")

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

    dir: str = Field(description="Where the checkpoints go (one `step_<N>` directory per save). On several "
                                 "machines: storage the driver and every host share.", examples=["ckpt/gpt-tiny"])
    every_steps: PosInt = Field(description="Save after every this many steps, and after the last.")
    keep: PosInt = Field(2, description="Committed checkpoints kept; an older one is deleted only after a newer "
                                        "one commits.")
    async_: bool = Field(True, alias="async", description="Write the bytes in the background while the next "
                                                          "steps run (the step waits only for the device→host copy).")

    @field_validator("dir")
    @classmethod
    def _dir(cls, v: str) -> str:
        if not v.strip():
            raise Problem("must not be empty")
        if "\x00" in v:
            raise Problem("must not contain a NUL byte")
        return v


class ElasticConfig(Frozen):
    """`failure.elastic:` — elastic recovery (`orchestrator.core.elastic`): when a restart's placement
    cannot be had within `failure.placement_timeout_s` (a lost node and no spare), plan the job again
    for the hosts the live cluster still holds, restore the last commit onto that plan and go on;
    the global batch and the data order stay the job's. Absent: a restart that cannot be placed stops
    the run with the `--resume` command (as before).

    `min_hosts`: the fewest hosts to train on; below it the run stops as without this section (null:
    as few as a legal plan of the job needs). `replan`: `rule` — a documented deterministic rule on
    the job's own plan (fewer data-parallel replicas per stage first, then fewer stages); `auto` — the
    `meshpipe plan --auto` search on the calibrated cluster's figures, restricted to the hosts there
    (without a calibrated cluster: the rule, and the record says why). `grow`: when hosts come back,
    at the next commit plan again onto them (`next_commit`), only when the predicted step gets faster
    by at least `min_gain` (`gain`: 0.25 = 25 % more steps per second; default 0.1), or `never`."""

    min_hosts: Optional[PosInt] = Field(
        None, description="The fewest hosts to train on; below it the run stops with the resume command "
                          "(null: as few as a legal plan of the job needs).")
    replan: Literal["rule", "auto"] = Field(
        "rule", description="How the smaller plan is found: `rule` (fewer data-parallel replicas per stage, "
                            "then fewer stages) or `auto` (the `plan --auto` search on the calibrated figures).")
    grow: Literal["never", "next_commit", "gain"] = Field(
        "next_commit", description="When hosts come back: re-plan onto them at the next commit (`next_commit`), "
                                   "only when the predicted step gets faster by `min_gain` (`gain`), or `never`.")
    min_gain: Optional[Annotated[float, Field(gt=0, le=10, allow_inf_nan=False)]] = Field(
        None, description="With `grow: gain`: the predicted speed-up a grow-back must reach (0.25 = 25 % more "
                          "steps per second; null: 0.1).")

    @field_validator("min_gain", mode="before")
    @classmethod
    def _number(cls, v: Any) -> Any:
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v

    @model_validator(mode="after")
    def _gain_only_for_gain(self) -> "ElasticConfig":
        if self.min_gain is not None and self.grow != "gain":
            raise Problem(f"only used with grow: gain (it is {self.grow!r}): the predicted speed-up a "
                          "grow-back must reach; remove it or set grow: gain", ("min_gain",), self.min_gain)
        return self

    @property
    def gain_threshold(self) -> float:
        """The speed-up (new steps per second ÷ old − 1) a `grow: gain` re-plan must reach."""
        return 0.1 if self.min_gain is None else self.min_gain


class DivergenceConfig(Frozen):
    """`failure.divergence:` — a loss far above its running median is a training-health event
    (`orchestrator.core.health`): a step whose mean loss exceeds `factor` × the median of the last
    `window` healthy steps' losses (checked from the second step on; a median ≤ 0 checks nothing)
    gets `action`. Null turns the test off."""

    factor: Annotated[float, Field(gt=1, allow_inf_nan=False)] = Field(
        100.0, description="A step diverged when its loss exceeds this many times the running median.")
    window: Annotated[int, Field(ge=1, le=100_000)] = Field(
        50, description="How many of the latest healthy steps' losses the running median is over.")
    action: Literal["stop", "rollback"] = Field(
        "stop", description="`stop` (the run fails, naming the step) or `rollback` (restore the last commit and "
                            "skip the data from there through the diverged step; needs `failure.max_restarts` > 0).")

    @field_validator("factor", mode="before")
    @classmethod
    def _number(cls, v: Any) -> Any:
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v


class FailureConfig(Frozen):
    """`failure:` — automatic recovery (Ray Train's `FailureConfig` vocabulary): on an actor death, a
    stage error or a hang, tear the job down, re-place it and continue from the last committed
    checkpoint, at most `max_restarts` times (0: any failure ends the run, as without this section).
    Needs `checkpoint:` when `max_restarts` > 0 (`orchestrator.driver.recovery`). A restart after a
    node loss waits up to `placement_timeout_s` for the placement to fit again; `compile_cache`
    (JAX's persistent compilation cache) spares a restarted stage most of its compilation;
    `elastic` (`ElasticConfig`): past that wait, train on the hosts that are left.

    Training health (`orchestrator.core.health`): a non-finite loss, gradient norm or parameter gets
    `on_nonfinite` — `stop` (the run fails naming the step, the stage and which went non-finite
    first), `skip` (every stage drops the step's update; more than `max_skips` in a row stop the run)
    or `rollback` (restore the last commit, skip the data up to and including the bad step; each
    rollback is one of `max_restarts`). `divergence` (`DivergenceConfig`): a loss far above its
    running median."""

    max_restarts: Annotated[int, Field(ge=0, le=MAX_RESTARTS)] = Field(
        0, description="Failures the run recovers from (0: any failure ends the run); > 0 needs `checkpoint:`.")
    placement_timeout_s: Optional[PosFloat] = Field(
        None, description="How long a restart waits for the placement to fit again (a lost node replaced); "
                          "null: `timeouts.init_s`.")
    compile_cache: Optional[str] = Field(
        "auto", description="JAX's persistent compilation cache for the stage actors, so a restarted stage loads "
                            "its programs: `auto` = `<output_dir>/<name>/compile_cache` when `max_restarts` > 0, "
                            "else off; a directory = always there; null = off.")
    elastic: Optional[ElasticConfig] = Field(
        None, description="Re-plan onto the hosts that are left when a restart cannot have its placement again "
                          "within `placement_timeout_s` (null: stop with the resume command, as before).")
    on_nonfinite: Literal["stop", "skip", "rollback"] = Field(
        "stop", description="A non-finite loss, gradient norm or parameter: `stop` (the run fails, naming the step, "
                            "the stage and which went non-finite first), `skip` (every stage drops that step's "
                            "update) or `rollback` (restore the last commit and skip the data through that step; "
                            "needs `max_restarts` > 0).")
    max_skips: Annotated[int, Field(ge=1, le=MAX_STEPS)] = Field(
        3, description="With `on_nonfinite: skip`: this many skipped steps in a row stop the run at the next one.")
    divergence: Optional[DivergenceConfig] = Field(
        default_factory=DivergenceConfig, description="A loss far above its running median (null: not checked).")

    @field_validator("compile_cache")
    @classmethod
    def _cache(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and (not v.strip() or "\x00" in v):
            raise Problem("must be \"auto\", a directory path (not empty, no NUL byte) or null (off)")
        return v

    @model_validator(mode="after")
    def _elastic_needs_restarts(self) -> "FailureConfig":
        if self.elastic is not None and self.max_restarts == 0:
            raise Problem("a re-plan continues a run after a failure, which needs restarts: set "
                          "failure.max_restarts > 0 (and a `checkpoint:` section), or remove failure.elastic",
                          ("elastic",), self.elastic.model_dump(mode="json", exclude_defaults=True))
        return self

    @model_validator(mode="after")
    def _rollback_needs_restarts(self) -> "FailureConfig":
        for key, value in ((("on_nonfinite",), self.on_nonfinite),
                           (("divergence", "action"), self.divergence and self.divergence.action)):
            if value == "rollback" and self.max_restarts == 0:
                raise Problem("a rollback restores the last commit the way a restart does, which needs "
                              "restarts: set failure.max_restarts > 0 (and a `checkpoint:` section), or choose "
                              "stop" + (" or skip" if key == ("on_nonfinite",) else ""), key, value)
        return self


class JobConfig(Frozen):
    """A whole job (`job.yaml`). Load with `load_job`, check against a cluster with `check_job`."""

    run: RunConfig = Field(description="What the run is called, how long it trains, where it writes.")
    model: ModelConfig = Field(description="The model: a built-in one or your factory.")
    data: DataConfig = Field(description="Where examples come from and how many per step.")
    optimizer: OptimizerConfig = Field(description="An optax optimizer or chain.")
    pipeline: PipelineConfig = Field(description="Schedule, microbatches and stages.")
    layout: dict[str, Any] = Field(
        default_factory=dict, description="Logical axis → mesh axis, for every stage (rules naming an axis a "
                                          "stage's mesh lacks are skipped there): a mesh axis, a list of them "
                                          "(their product), `{first: [candidates]}` or null; or Mesh-TF text.",
        examples=[{"batch": "data", "mlp": "model"}, "batch:data;mlp:model"])
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig, description="Mixed precision.")
    checkpoint: Optional[CheckpointConfig] = Field(None, description="Checkpoints (null: none; needs the "
                                                                     "`checkpoint` extra).")
    failure: FailureConfig = Field(default_factory=FailureConfig, description="Automatic recovery.")

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
