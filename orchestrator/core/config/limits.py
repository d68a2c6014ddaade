"""Plan-time limits: values that pass the schema but would fail late or train garbage.

Each check returns problem lines (`key = value: rule`) for `check_job` to report with
the others, before Ray starts:

  (Optimizer hyperparameters: `orchestrator.core.model.optim_rules` — one rule set for
    `optimizer.args`, every chain entry and every schedule, and the chain's direction.)
  (Data files: `orchestrator.core.data.shards.regular_file` — regular, non-empty, and not
    a symlink out of its own directory.)
  - `memory_problems`: a lower bound of what each device and each host must hold
    (`stage_memory`: parameters, their gradients, mutable state, one microbatch of
    activations; the global batch on
    every host), against what the cluster can have: this machine's memory for an
    embedded CPU cluster, otherwise the largest memory any device / server has
    (MAX_DEVICE_BYTES / MAX_HOST_BYTES) — so an impossible plan is refused, a tight one
    is left to the run.
Pure: reads only this machine's memory size.
"""
from __future__ import annotations

import math
import os
from typing import Optional

from orchestrator.core.config.errors import problem
from orchestrator.core.edges import leaf_dtype
from orchestrator.core.memory import device_bytes
from orchestrator.core.model.layout import partition_spec, shard_count
from orchestrator.core.model.optim_rules import MAX_LEARNING_RATE  # noqa: F401 - re-exported (its old home)

__all__ = ["memory_problems", "stage_memory", "MAX_LEARNING_RATE", "MAX_DEVICE_BYTES", "MAX_HOST_BYTES"]

MAX_DEVICE_BYTES = 288 << 30      # the largest accelerator memory shipping (288 GB HBM)
MAX_HOST_BYTES = 32 << 40         # the largest single servers (32 TiB)


def _nbytes(shape, itemsize: int = 4) -> int:
    return math.prod(int(n) for n in shape) * itemsize


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def _machine_bytes() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def stage_memory(model, chunks, mesh: dict, layout, mb: int) -> dict:
    """A lower bound of what each device of a stage holds, in bytes: its shard of every parameter
    its layers hold (a tied array's copy counts on each stage holding one: it is an array there),
    as much again for the gradients, the mutable state (replicated: all of it on every device) and
    its share of one microbatch of outputs.

    Returns {"params", "grads", "state", "activations", "per_device", "devices"}.
    """
    params = acts = state = 0
    for a, b in chunks:
        for li in range(a, b):
            layer = model.layers[li]
            for pdef in layer.params.values():
                pieces = 1
                for entry in partition_spec(pdef.axes, layout):
                    if entry is not None:
                        pieces *= shard_count(entry, mesh)
                params += _nbytes(pdef.shape, leaf_dtype(pdef.dtype).itemsize) // max(1, pieces)
            state += sum(_nbytes(d.shape, leaf_dtype(d.dtype).itemsize) for d in layer.state.values())
            acts += sum(_nbytes(leaf.batched(mb), leaf_dtype(leaf.dtype).itemsize) for leaf in layer.outputs)
    devices = math.prod(mesh.values())
    per_device = device_bytes(params, state, acts // devices)     # the sum `plan --auto` uses too
    return {"params": params, "grads": params, "state": state, "activations": acts // devices,
            "per_device": per_device, "devices": devices}


def memory_problems(job, cluster, model, layouts: list, mb: int) -> list[str]:
    """Refuse a plan whose lower-bound memory cannot fit (see the module docstring)."""
    out = []
    embedded_cpu = cluster.address is None and cluster.platform == "cpu"
    machine = _machine_bytes() if embedded_cpu else None
    device_cap = machine if machine else MAX_DEVICE_BYTES
    host_cap = machine if machine else MAX_HOST_BYTES
    where = ("this machine's memory" if machine else
             f"the most any device has ({_gib(MAX_DEVICE_BYTES)})")
    total = 0
    for i, (st, layout) in enumerate(zip(job.pipeline.stages, layouts)):
        mem = stage_memory(model, st.chunks, dict(st.mesh), layout, mb)
        params, per_device = mem["params"], mem["per_device"]
        total += per_device * mem["devices"]
        if per_device > device_cap:
            out.append(problem(f"pipeline.stages[{i}]", {"layers": [list(c) for c in st.chunks], "mesh": dict(st.mesh)},
                               f"cannot fit: each device needs at least {_gib(per_device)} (parameters "
                               f"{_gib(params)} + gradients + mutable state + one microbatch of activations), more than "
                               f"{where}; shard the stage over more devices or use a smaller model"))
    per_example = sum(_nbytes(leaf.shape, leaf_dtype(leaf.dtype).itemsize) for leaf in (model.input, model.label))
    batch = per_example * job.data.global_batch
    if batch > host_cap:
        out.append(problem("data.global_batch", job.data.global_batch, f"cannot fit: every host builds the "
                           f"global batch ({_gib(batch)}), more than {where if machine else 'any server has (' + _gib(MAX_HOST_BYTES) + ')'}"))
    if machine and total + batch * len(job.pipeline.stages) > machine and not out:
        out.append(problem("pipeline.stages", f"{len(job.pipeline.stages)} stages", f"cannot fit: the embedded "
                           f"cluster's stages together need at least {_gib(total + batch * len(job.pipeline.stages))}, "
                           f"more than this machine's memory ({_gib(machine)})"))
    return out
