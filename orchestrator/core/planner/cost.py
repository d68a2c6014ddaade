"""The cost model: one stage's time per microbatch and memory per device, from layer profiles. Pure.

A stage is a contiguous layer range on k consecutive hosts with a `MeshChoice`:
a `(data=D, model=M)` mesh in a given axis order and layout rules (logical
axis → `model`; `batch → data`). Per microbatch of B examples, each layer runs
its profiled program at b = B / D examples per device (`profile.py`), so

  F(layer) = roofline(flops, bytes accessed) of the forward + its collectives
  B(layer) = the same for backward+accumulate + the gradient all-reduce over `data`

where roofline = max(flops / device flops, bytes / memory bandwidth), each
collective is charged by `topology.collective_time` on the farthest link class
its group spans once the stage's mesh is laid onto its hosts — that class's
collective figures (`Topology.collective_link`), not its stage-edge ones (positions are
row-major over the mesh in its axis order, `devices_per_host` per host — how the
stage worker builds its `Mesh`), and the gradient all-reduce moves each
parameter's local shard over the `data` groups.

Memory per device (`orchestrator.core.memory.device_bytes`, the sum `meshpipe plan`
uses too) = parameters × (2 + optimizer slots) (parameters, gradient accumulator,
optimizer state; a tied array's copy counts on the stage holding it) + the layers'
mutable state (replicated) + residuals × microbatches in flight (from the schedule)
+ the largest temporary buffer of any of its programs. With `fuse_loss_chunk`, where
the schedule runs the loss stage's F and B back to back (`search`), the loss layer
keeps no residuals between actions: they live inside its one F+B program, whose temp
is XLA's figure for it (`LayerProfile.fused_temp_bytes`) or, when not compiled, the
residuals plus the layer's temporaries (no saving claimed).

Remat (`MeshChoice.remat`, the stage's `remat:`): under `full` each layer runs under
`jax.checkpoint` (how `stages.program` applies it, part by part), so a microbatch
keeps only each layer's input between F and B (b examples of the previous layer's
activation; the first layer's token input is not described and counts 0), the
backward first recomputes the forward — B grows by the layer's compiled forward
cost and its forward collectives — and the recomputed residuals of one layer live
as a temporary during its backward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from orchestrator.core.model.layout import partition_spec, shard_count
from orchestrator.core.planner.model import PlanLayer
from orchestrator.core.planner.profile import LayerProfile, ProfileRequest, linear
from orchestrator.core.planner.topology import Topology, collective_time

__all__ = ["MeshChoice", "LayerCost", "layer_request", "layer_cost", "local_param_bytes", "fits_layer",
           "optimizer_slots", "mesh_choices"]


@dataclass(frozen=True)
class MeshChoice:
    """A stage's mesh and layout: sizes, axis order (outer first), rules, a short name for the rules."""

    data: int
    model: int
    order: tuple[str, str]
    rules: tuple[tuple[str, str], ...]
    rules_name: str
    remat: str = "none"          # none | full: the stage's rematerialisation (module docstring)

    @property
    def devices(self) -> int:
        return self.data * self.model

    def mesh(self) -> dict[str, int]:
        """The job YAML's `mesh:` (axes of size 1 left out; `{data: 1}` for one device)."""
        sizes = {"data": self.data, "model": self.model}
        out = {a: sizes[a] for a in self.order if sizes[a] > 1}
        return out or {"data": 1}

    def layout(self) -> dict[str, str]:
        """The stage's layout over its mesh axes (batch → data, the rules → model)."""
        out = {"batch": "data"} if self.data > 1 else {}
        if self.model > 1:
            out.update(dict(self.rules))
        return out

    def positions(self, d: int, m: int) -> int:
        """Flat device position (row-major in `order`) of mesh coordinate (data=d, model=m)."""
        return d * self.model + m if self.order[0] == "data" else m * self.data + d

    def label(self) -> str:
        mesh = "×".join(f"{a}={v}" for a, v in self.mesh().items())
        return f"{mesh} {self.rules_name if self.model > 1 else 'dp'}" + (" remat" if self.remat != "none" else "")


@dataclass(frozen=True)
class LayerCost:
    """One layer on one MeshChoice at one microbatch size (seconds, bytes per device)."""

    fwd_s: float
    bwd_s: float
    compute_s: float
    tp_comm_s: float
    dp_comm_s: float
    param_bytes: float
    residual_bytes: float
    temp_bytes: float
    tp_bytes: float
    dp_bytes: float
    state_bytes: float = 0.0           # mutable state, replicated: all of it on every device
    fused_temp_bytes: float = 0.0      # temp when this (loss) layer's F and B run as one program


def optimizer_slots(name: str, args: Mapping[str, object] | None = None) -> int:
    """Per-parameter state arrays of an optax optimizer (sgd 0, momentum 1, adam-like 2)."""
    args = args or {}
    if name == "sgd":
        return 1 if args.get("momentum") else 0
    if name in ("adagrad", "rmsprop", "sm3", "lion", "adafactor"):
        return 1
    return 2


def _restricted(layer: PlanLayer, rules: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    names = layer.logical_axes()
    return tuple(r for r in rules if r[0] in names)


def layer_request(layer: PlanLayer, choice: MeshChoice, batch: int) -> ProfileRequest:
    """The profile a layer needs on this choice (M and rules collapse when the layer uses no `model`)."""
    rules = _restricted(layer, choice.rules) if choice.model > 1 else ()
    m = choice.model if rules else 1
    return ProfileRequest(layer.signature, layer.index, m, rules, batch)


def fits_layer(layer: PlanLayer, choice: MeshChoice) -> bool:
    """Every dim the layout shards (parameters and the output) divides by the model axis size."""
    if choice.model == 1:
        return True
    layout = {k: "model" for k, _ in choice.rules}
    tensors = [(p.axes, p.shape) for p in layer.params] + [(layer.out_axes[1:], layer.out_shape)]
    for axes, shape in tensors:
        for entry, size in zip(partition_spec(axes, layout), shape):
            if entry is not None and size % choice.model:
                return False
    return True


def local_param_bytes(layer: PlanLayer, choice: MeshChoice) -> float:
    """Bytes of this layer's parameters held by one device."""
    if choice.model == 1:
        return float(layer.param_bytes)
    layout = dict(_restricted(layer, choice.rules))
    total = 0.0
    for p in layer.params:
        n = 1
        for entry in partition_spec(p.axes, layout):
            n *= shard_count(entry, {"model": choice.model}) if entry else 1
        total += p.nbytes / n
    return total


def _group_class(topo: Topology, first_host: int, choice: MeshChoice, group: tuple[int, ...], along: str) -> str:
    """Farthest link class of a collective group (positions along `along`) over every coordinate of the other axis."""
    worst = "host"
    rank = {"host": 0, "group": 1, "dcn": 2}
    other = choice.data if along == "model" else choice.model
    for o in range(other):
        pos = [choice.positions(o, g) if along == "model" else choice.positions(g, o) for g in group]
        c = topo.class_of_devices(first_host, pos)
        if rank[c] > rank[worst]:
            worst = c
    return worst


def layer_cost(layer: PlanLayer, choice: MeshChoice, micro: int, topo: Topology, first_host: int,
               profiles: Mapping[ProfileRequest, LayerProfile], in_bytes: float = 0.0) -> Optional[LayerCost]:
    """The layer's `LayerCost`, or None when the choice cannot run it (batch or a dim not divisible).

    `in_bytes`: bytes per example of the layer's input (what `remat: full` keeps per microbatch).
    """
    if micro % choice.data or not fits_layer(layer, choice):
        return None
    b = micro // choice.data
    p1, p2 = profiles[layer_request(layer, choice, 1)], profiles[layer_request(layer, choice, 2)]
    prof = p1 if b == 1 else p2 if b == 2 else linear(p1, p2, b)
    compute = {ph: max(prof.flops.get(ph, 0.0) / topo.flops, prof.bytes_accessed.get(ph, 0.0) / topo.memory_bandwidth)
               for ph in ("fwd", "bwd")}
    comm = {"fwd": 0.0, "bwd": 0.0}
    tp_bytes = 0.0
    for phase, kind, nbytes, groups in prof.collectives:
        k = max(len(g) for g in groups)
        cls = _group_class(topo, first_host, choice, max(groups, key=len), "model") if choice.model > 1 else "host"
        comm[phase] += collective_time(kind, nbytes, k, topo.collective_link(cls))
        tp_bytes += nbytes
    pbytes = local_param_bytes(layer, choice)
    dp = 0.0
    if choice.data > 1:
        cls = _group_class(topo, first_host, choice, tuple(range(choice.data)), "data")
        dp = collective_time("all-reduce", pbytes, choice.data, topo.collective_link(cls))
    fwd = compute["fwd"] + comm["fwd"]
    bwd = compute["bwd"] + comm["bwd"] + dp
    compute_s, tp_s, resid, temp = compute["fwd"] + compute["bwd"], comm["fwd"] + comm["bwd"], \
        prof.residual_bytes, prof.temp_bytes
    fused = prof.fused_temp_bytes
    if choice.remat == "full":      # keep the input only; recompute the forward inside the backward
        bwd += fwd
        compute_s += compute["fwd"]
        tp_s += comm["fwd"]
        resid, temp = b * in_bytes, max(temp, prof.residual_bytes)
        fused = None                # not compiled under remat
    elif choice.remat != "none":
        raise ValueError(f"remat = {choice.remat!r}: the planner models none and full only")
    # F+B as one program: what XLA compiled for it, else the residuals inside it next to the temporaries
    fused = resid + temp if fused is None else fused
    return LayerCost(fwd, bwd, compute_s, tp_s, dp, pbytes, resid, temp, tp_bytes, pbytes if choice.data > 1 else 0.0,
                     float(layer.state_bytes), fused)


def mesh_choices(devices: int, max_model: int, rulesets: Mapping[str, tuple[tuple[str, str], ...]],
                 multi_host: bool, remats: tuple[str, ...] = ("none",)) -> list[MeshChoice]:
    """Every (data, model) factorisation of `devices`, each rules set, both axis orders when it
    matters, each remat in `remats`."""
    out = []
    for m in range(1, min(devices, max_model) + 1):
        if devices % m:
            continue
        d = devices // m
        orders = [("data", "model")] + ([("model", "data")] if multi_host and d > 1 and m > 1 else [])
        sets = rulesets.items() if m > 1 else [("dp", ())]
        for name, rules in sets:
            for order in orders:
                out += [MeshChoice(d, m, order, rules, name, r) for r in remats]
    return out
