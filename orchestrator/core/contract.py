"""The driver ↔ stage-actor contract: everything that crosses the Ray boundary, as frozen values (pure).

Driver → actor. The executor (`orchestrator.driver.executor.PipelineExecutor.worker_config`)
builds one `WorkerConfig` per stage host from the checked job and the plan, once per attempt; it
travels with the actor's creation (Ray pickles it) and the actor never asks for more:

    WorkerConfig
      run, stage, host, cluster_host, seed, num_stages, steps, eval_every   identity and the run
      stage_spec: StageSpec        this stage: hosts, mesh, layout, chunks, action lists, remat
      spec: ModelSpec              the model's description (`orchestrator.core.model.spec`)
      data: DataPlan               where each host reads its rows (`orchestrator.core.data`)
      microbatches, microbatch_size
      optimizer: OptimizerSpec     the optax chain the stage builds (`orchestrator.core.model.optim`)
      loss_scale: DynamicLossScale | None            `precision.loss_scale`
      geoms: (StageGeom, ...)      every stage's mesh, hosts and layout (the peers' edges)
      tie_stages: ((int, int), ...)                  per tied array: the stages of its two sides
      timeouts: Timeouts
      transport: TransportSpec     how activations move: "ray", "socket" (token, TLS files) or "xla"
                                   (one JAX world: the transfer order of each program)
      checkpoint: CheckpointSpec | None              where and how often to save, and what to restore
        restore: RestorePlan | None                  the commit to restore, by array name
      compile_cache, pin_cpus, hooks
      on_nonfinite: "stop" | "skip" | "rollback"   `failure.on_nonfinite` ("skip": decided on the stages)

Actor → driver. A failed step raises its own error with a `StepFailure` on it (`FAILURE_ATTR`),
and the actors it aborts get the same record (`stages.worker.StageWorker.abort_step`): the driver
decides what happened from these fields (`orchestrator.driver.recovery.classify`), never from an
error's text. `ActorId` names an actor in both directions (its `str` is the label messages show).

Invariants:
  - Every value here is immutable and picklable; nothing imports ray, jax or the runtime.
  - A new piece of the contract is one field here, set in `worker_config`, read by the actor.
  - The checkpoint restore plan names arrays model-wide (`orchestrator.core.checkpoint`), so
    a plan restores onto any layout: the actor asks `RestorePlan.locate(name)` for each leaf.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Optional, Protocol, Union

from orchestrator.core.data.plan import DataPlan
from orchestrator.core.edges import StageGeom
from orchestrator.core.model.policy import DynamicLossScale
from orchestrator.core.model.spec import ModelSpec
from orchestrator.core.schedule.transfers import Transfer

__all__ = ["ActorId", "CheckpointSpec", "FAILURE_ATTR", "Hook", "LoaderPosition", "OptimizerEntry",
           "OptimizerSpec", "RestorePlan", "SavedArray", "SavedStage", "StageSpec", "StepFailure", "Timeouts",
           "TlsFiles", "TransferOrder", "TransportSpec", "WorkerConfig", "failure_of"]


class ActorId(str):
    """One stage actor, (stage, host index within the stage), as typed fields on its label.

    It is the label itself (`"stage 1 host 0"`: a `str`, so messages, JSON records and dict keys
    take it as they are), and code reads `stage` and `host` from it, never from the text.

    >>> a = ActorId(1, 0)
    >>> a, a.stage, a.host, f"{a} failed", ActorId.of("x") is None
    ('stage 1 host 0', 1, 0, 'stage 1 host 0 failed', True)
    """

    stage: int
    host: int

    def __new__(cls, stage: int, host: int) -> "ActorId":
        self = super().__new__(cls, f"stage {stage} host {host}")
        self.stage, self.host = int(stage), int(host)
        return self

    def __getnewargs__(self) -> tuple[int, int]:      # pickles as (stage, host)
        return self.stage, self.host

    @staticmethod
    def of(label) -> Optional["ActorId"]:
        """`label` if it is an ActorId, else None (an actor not known by its fields)."""
        return label if isinstance(label, ActorId) else None


@dataclass(frozen=True)
class Timeouts:
    """`cluster.timeouts` (seconds): every remote wait has a deadline."""

    init_s: float = 120.0
    step_s: float = 600.0
    shutdown_s: float = 30.0
    jax_distributed_init_s: float = 60.0


@dataclass(frozen=True)
class TlsFiles:
    """`cluster.transport_tls`: absolute paths, the same on every node."""

    cert_file: str
    key_file: str
    ca_file: str


@dataclass(frozen=True)
class TransferOrder:
    """`transport: xla`: the order in which every process of the one JAX world issues a program's
    stage-to-stage transfers (`orchestrator.core.schedule.transfers.world_order`).

    Attributes:
      program: "F" (a training step) or "E" (an eval batch).
      transfers: every transfer of the program, in the world's order.
    """

    program: str
    transfers: tuple[Transfer, ...]


@dataclass(frozen=True)
class TransportSpec:
    """How a stage's activations and gradients reach its neighbours (`cluster.transport`, "auto"
    resolved for the platform by the driver).

    Attributes:
      kind: "ray" (actor calls, `stages.transport`), "socket" (`stages.socket_transport`) or "xla"
        (XLA's own transfers in one JAX world of every host of the job, `stages.xla_transport`:
        process index = `WorkerConfig.cluster_host`, world size = the hosts of `WorkerConfig.geoms`).
      token: the run's secret a socket peer must present (a fresh one per attempt).
      same_machine: "socket": same-machine peers over "unix" (+ shared memory) or "tcp".
      tls: "socket": mutual TLS on TCP links, or None.
      transfers: "xla": the world's transfer order per program (every stage gets the same); else ().
    """

    kind: str = "ray"
    token: Optional[bytes] = field(default=None, repr=False)
    same_machine: str = "unix"
    tls: Optional[TlsFiles] = None
    transfers: tuple[TransferOrder, ...] = ()

    def orders(self) -> dict[str, tuple[Transfer, ...]]:
        """program -> its transfers, in the world's order."""
        return {o.program: o.transfers for o in self.transfers}


@dataclass(frozen=True)
class OptimizerEntry:
    """One optax transformation: its name and keyword arguments (numbers, or schedules as mappings)."""

    name: str
    args: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class OptimizerSpec:
    """The job's optimizer section as the stages build it (`orchestrator.core.model.optim.build`).

    Attributes:
      entries: the transformations, chained in order.
      chained: written as `optimizer.chain` (error keys then say `optimizer.chain[i]`).
    """

    entries: tuple[OptimizerEntry, ...]
    chained: bool = False

    @staticmethod
    def of(spec: Mapping[str, Any]) -> "OptimizerSpec":
        """From `JobConfig.optimizer.spec()` ({"name", "args"} or {"chain": [...]})."""
        if "chain" in spec:
            return OptimizerSpec(tuple(OptimizerEntry(e["name"], dict(e.get("args") or {})) for e in spec["chain"]),
                                 chained=True)
        return OptimizerSpec((OptimizerEntry(spec["name"], dict(spec.get("args") or {})),))

    def to_spec(self) -> dict[str, Any]:
        """The mapping `optim.build` takes."""
        if self.chained:
            return {"chain": [{"name": e.name, "args": dict(e.args)} for e in self.entries]}
        return {"name": self.entries[0].name, "args": dict(self.entries[0].args)}


@dataclass(frozen=True)
class LoaderPosition:
    """Where a loading host's reader stands (`stages.data.HostLoader.state`): the data set it reads
    (source, seed) and the next step it serves; `samples` = next_step × global batch."""

    source: str
    seed: int
    next_step: int
    samples: int

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "seed": self.seed, "next_step": self.next_step, "samples": self.samples}


@dataclass(frozen=True)
class SavedArray:
    """One array of a stage's checkpoint directory: its model-wide name, its key in the orbax tree,
    its global shape and dtype."""

    name: str
    key: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class SavedStage:
    """One stage directory of a committed step (`stage_<i>`, relative to the step directory)."""

    path: str
    arrays: tuple[SavedArray, ...]


@dataclass(frozen=True)
class RestorePlan:
    """What a stage restores at set-up: committed step `step` under `root`, array by array.

    Attributes:
      root: the checkpoint directory.
      step: the committed step (steps done).
      position: the loaders' position the marker recorded, None when no host loaded data.
      stages: the step's stage directories; an array is read from the first that holds it.
      skip_batches: a training-health rollback (`orchestrator.core.health.skip_data`): batches the
        restored run skips, from the commit's data position through the bad step (0: none).
    """

    root: str
    step: int
    position: Optional[LoaderPosition]
    stages: tuple[SavedStage, ...]
    skip_batches: int = 0

    def locate(self, name: str) -> Optional[tuple[int, SavedArray]]:
        """(index into `stages`, the saved array) of array `name`, or None when no stage saved it."""
        for i, rec in enumerate(self.stages):
            for arr in rec.arrays:
                if arr.name == name:
                    return i, arr
        return None

    @staticmethod
    def of_marker(root: str, marker: Mapping[str, Any]) -> "RestorePlan":
        """From a commit marker (`orchestrator.core.checkpoint.read_marker`; already validated)."""
        data = marker["data"]
        position = None
        if "source" in data:
            position = LoaderPosition(str(data["source"]), int(data["seed"]), int(data["next_step"]),
                                      int(data.get("samples", 0)))
        stages = tuple(SavedStage(r["path"], tuple(SavedArray(name, m["key"], tuple(m["shape"]), str(m["dtype"]))
                                                   for name, m in r["arrays"].items()))
                       for r in marker["stages"])
        return RestorePlan(str(root), int(marker["step"]), position, stages)


@dataclass(frozen=True)
class CheckpointSpec:
    """`checkpoint:` as a stage host saves it (`stages.checkpoint`).

    Attributes:
      root: `checkpoint.dir` (absolute).
      every: save after every `every` steps done ...
      total: ... and after the last (`run.steps`).
      asynchronous: `checkpoint.async` (False: each save is waited for before the next step).
      probe: the random content of the driver's probe file (`orchestrator.core.checkpoint.check_probe`).
      restore: the commit to restore at set-up, or None (a fresh start).
    """

    root: str
    every: int
    total: int
    asynchronous: bool = True
    probe: str = ""
    restore: Optional[RestorePlan] = None


MeshAxes = Union[str, tuple[str, ...], None]   # a logical axis's mesh axes after `layout.choose` (no FirstOf)


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage as its actors run it.

    Attributes:
      index: the stage's index.
      hosts: the cluster host (bundle) index of each host of the stage.
      devices_per_host: devices each host brings to the stage's mesh.
      mesh: (axis name, size) pairs, in mesh order.
      layout: (logical axis, mesh axes) pairs.
      chunks: the layer range [start, stop) of each virtual chunk, in chunk order.
      actions: this stage's lowered action list (`orchestrator.core.schedule.Action` texts).
      eval_actions: its forward-only eval list (`data.eval`), else ().
      remat: rematerialisation of its parts (`orchestrator.core.model.policy`).
      fuse_loss_chunk: `pipeline.fuse_loss_chunk` (`stages.actions.fused_chunks`).
    """

    index: int
    hosts: tuple[int, ...]
    devices_per_host: int
    mesh: tuple[tuple[str, int], ...]
    layout: tuple[tuple[str, MeshAxes], ...]
    chunks: tuple[tuple[int, int], ...]
    actions: tuple[str, ...]
    eval_actions: tuple[str, ...] = ()
    remat: str = "none"
    fuse_loss_chunk: bool = False

    @property
    def mesh_shape(self) -> dict[str, int]:
        return dict(self.mesh)

    @property
    def layout_map(self) -> dict[str, MeshAxes]:
        return dict(self.layout)


class Hook(Protocol):
    """A worker hook (`stages.hooks.WorkerHook`): called at set-up and at every step's start."""

    def on_setup(self, cfg: "WorkerConfig") -> None: ...

    def on_step(self, cfg: "WorkerConfig", step: int) -> None: ...


@dataclass(frozen=True)
class WorkerConfig:
    """Everything one stage actor is told (see the module docstring)."""

    run: str
    stage: int                 # this stage's index (= stage_spec.index)
    host: int                  # host index within the stage (= its jax process id there)
    cluster_host: int          # host index in the cluster (bundle index)
    stage_spec: StageSpec
    spec: ModelSpec
    data: Optional[DataPlan]   # each host that needs data opens its own reader
    microbatches: int
    microbatch_size: int       # rows of one microbatch (`Checked.microbatch_size`)
    optimizer: OptimizerSpec
    seed: int
    num_stages: int
    steps: int = 0             # run.steps (the last step evaluates; checkpoints save after it)
    eval_every: Optional[int] = None
    geoms: tuple[StageGeom, ...] = ()
    tie_stages: tuple[tuple[int, int], ...] = ()
    timeouts: Timeouts = Timeouts()
    transport: TransportSpec = TransportSpec()
    loss_scale: Optional[DynamicLossScale] = None
    checkpoint: Optional[CheckpointSpec] = None
    compile_cache: Optional[str] = None    # JAX persistent compilation cache directory, or None
    pin_cpus: bool = False     # pin this process to core (cluster_host mod cores) before jax loads
    hooks: tuple[Hook, ...] = ()
    # failure.on_nonfinite (orchestrator.core.health): under "skip" every stage drops a step's update
    # when the global squared gradient norm (or the loss) is non-finite, decided before any update
    on_nonfinite: Literal["stop", "skip", "rollback"] = "stop"

    @property
    def layer_chunks(self) -> tuple[tuple[int, int], ...]:
        return self.stage_spec.chunks

    @property
    def stage_hosts(self) -> int:
        return len(self.stage_spec.hosts)

    @property
    def actor(self) -> ActorId:
        return ActorId(self.stage, self.host)

    @property
    def world_size(self) -> int:
        """The processes of the job's one JAX world under `transport: xla` (every host of every stage)."""
        return sum(len(g.hosts) for g in self.geoms)

    @property
    def who(self) -> str:
        return f"{self.run} stage {self.stage} host {self.host}"


FAILURE_ATTR = "meshpipe_failure"    # the attribute a failed step's own error carries its StepFailure in


@dataclass(frozen=True)
class StepFailure:
    """Where a step failed, as the actor that failed knows it: carried on its error (`FAILURE_ATTR`)
    and in the abort every other actor gets, so a survivor's error names its peer.

    Attributes:
      stage, host: the actor whose step failed by itself.
      step: the step it failed in.
      error: the error, one line (`<type>: <message>`), for people.
      kind: what it was, for the driver's policy: "error" (raised in the step) or "storage"
        (a checkpoint save that `checkpoint.dir` refused: full, read-only, not permitted —
        `orchestrator.core.recovery.STORAGE_ERRNOS`).
      errno, path: "storage": the refused write's errno and path (None when not known).
    """

    stage: int
    host: int
    step: int
    error: str
    kind: str = "error"
    errno: Optional[int] = None
    path: Optional[str] = None

    @property
    def actor(self) -> ActorId:
        return ActorId(self.stage, self.host)

    def reason(self, who: str) -> str:
        """The text an aborted peer's wait reports (`<who> failed in step N: <error>`)."""
        return f"{who} failed in step {self.step}: {self.error}"


def failure_of(error: BaseException) -> Optional[StepFailure]:
    """The StepFailure an error (or one it was raised from, or Ray's wrapper's `cause`) carries, else None."""
    seen = set()
    e: Optional[BaseException] = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        found = getattr(e, FAILURE_ATTR, None)
        if isinstance(found, StepFailure):
            return found
        e = getattr(e, "cause", None) if isinstance(getattr(e, "cause", None), BaseException) else e.__cause__
    return None
