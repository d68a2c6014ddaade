"""A stage host's training state as one pytree: `StageState`, passed into and out of every handler.

    StageState
      chunks: (ChunkState, ...)   one per virtual chunk of the stage, in chunk order
        params      the parts' parameters (a list: one pytree per part)
        opt_state   the optimizer state over them
        grads       the gradient accumulator (zeros between steps: TRANSIENT)
        mstate      the parts' mutable model state (BatchNorm's statistics; None per stateless part)
      step         steps done: the next step to run, and the data position (a loader serves
                   step n's rows from (seed, n) alone, `orchestrator.core.data.WindowSampler`)
      loss_scale   `precision.loss_scale`'s (scale, finite steps in a row), or None (off)
      data_offset  batches a training-health rollback skipped (`orchestrator.core.health`): step n
                   trains on batch n + data_offset; None: none skipped (nothing saved)

Basic flow: `init(progs, seed)` builds the state a run starts from; the step's handlers
(`stages.actions`) take it and return a new one (`with_chunk`, `NamedTuple._replace`); the
checkpoint (`stages.checkpoint`) saves every leaf but the TRANSIENT fields under model-wide
names and restores into `abstract(state, mesh)`'s targets — whatever the layout.

Invariants:
  - Plain NamedTuples: pytrees to jax and optax without registration, immutable, and this
    module imports no jax (the worker pins its CPUs before jax loads).
  - A field that is not a chunk's is stage-wide: it is saved as `opt:<field>|<path>` (a scalar
    `opt:<field>|*`), a host scalar as a 0-d float64 or int64 array, and a checkpoint that lacks
    it is refused by name (`stages.checkpoint.restore`). None means off: nothing is saved.
  - A new piece of per-stage state is a field here (with its value in `init`) and the handler
    that updates it: the checkpoint, the restore and `abstract` follow from the field.
"""
from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["ChunkState", "LossScaleState", "StageState", "TRANSIENT", "abstract", "init", "stage_fields", "with_chunk"]


class ChunkState(NamedTuple):
    """One virtual chunk's state (see the module docstring)."""

    params: list
    opt_state: Any
    grads: Any
    mstate: list


class LossScaleState(NamedTuple):
    """Dynamic loss scaling's state (`orchestrator.core.model.policy.DynamicLossScale`), the same on every stage."""

    scale: float
    good: int          # finite steps in a row since the scale last changed


class StageState(NamedTuple):
    """One stage host's training state (see the module docstring)."""

    chunks: tuple
    step: int
    loss_scale: LossScaleState | None = None
    data_offset: int | None = None


TRANSIENT = frozenset({"grads"})     # ChunkState fields a checkpoint leaves out: zero between steps


def stage_fields(state: StageState) -> list[tuple[str, Any]]:
    """The stage-wide fields (neither `chunks` nor `step`) that are on (not None), as (name, value)."""
    return [(name, value) for name, value in zip(state._fields, state)
            if name not in ("chunks", "step") and value is not None]


def init(progs, seed: int, scaler=None, step: int = 0) -> StageState:
    """The state a run starts from: each chunk's parameters and mutable state from the model's own
    init (the same model key as the whole model's), its optimizer state, zero gradients; the loss
    scaler's start (`scaler`: a `DynamicLossScale`, or None)."""
    chunks = []
    for prog in progs:
        params = prog.init_params(seed)
        opt_state, zeros = prog.init_state(params)
        chunks.append(ChunkState(params, opt_state, zeros, prog.init_mstate(seed)))
    return StageState(tuple(chunks), step, None if scaler is None else LossScaleState(*scaler.start()))


def with_chunk(state: StageState, c: int, **fields) -> StageState:
    """`state` with chunk `c`'s `fields` replaced."""
    chunks = list(state.chunks)
    chunks[c] = chunks[c]._replace(**fields)
    return state._replace(chunks=tuple(chunks))


def abstract(tree, mesh):
    """The restore targets of `tree` (a StageState or any part of it): each device array as a
    `jax.ShapeDtypeStruct` with its sharding — one that jit left uncommitted on one device (adam's
    count) replicated over the stage mesh, so the programs see one device set — and each host
    scalar as a 0-d numpy array of its checkpoint dtype (`host_array`)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    replicated = NamedSharding(mesh, PartitionSpec())

    def target(leaf):
        if not isinstance(leaf, jax.Array):
            return host_array(leaf)
        sh = leaf.sharding if isinstance(leaf.sharding, NamedSharding) else replicated
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sh)

    return jax.tree.map(target, tree)


def host_array(value):
    """A host scalar as the checkpoint stores it: 0-d float64 (a float) or int64 (an int)."""
    import numpy as np

    if isinstance(value, (bool, np.bool_)):
        return np.asarray(value, np.bool_)
    if isinstance(value, (int, np.integer)):
        return np.asarray(value, np.int64)
    if isinstance(value, (float, np.floating)):
        return np.asarray(value, np.float64)
    return np.asarray(value)
