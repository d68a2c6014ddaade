"""The cost model: one stage's time per microbatch and memory per device, from layer profiles. Pure.

A stage is a contiguous layer range on k consecutive hosts with a `MeshChoice`:
a `(data=D, model=M)` mesh in a given axis order and layout rules (logical
axis → `model`; `batch → data`). Per microbatch of B examples, each layer runs
its profiled program at b = B / D examples per device (`profile.py`), so

  F(layer) = roofline(flops, bytes accessed) of the forward + its collectives
  B(layer) = the same for backward+accumulate + the gradient all-reduce over `data`

where roofline = max(flops / device flops, bytes / memory bandwidth) + the phase's compiled
kernels × `Topology.kernel_overhead_s` (each launch's own cost, in neither figure), each
collective is charged by `topology.collective_time` on the farthest link class
its group spans once the stage's mesh is laid onto its hosts — that class's
collective figures (`Topology.collective_link`), not its stage-edge ones (positions are
row-major over the mesh in its axis order, `devices_per_host` per host — how the
stage worker builds its `Mesh`), and the gradient all-reduce moves each
parameter's local shard over the `data` groups. XLA combines a backward's gradient
all-reduces into one of many arrays, so each array beyond the first adds the link's
`per_array_s` (measured by `meshpipe calibrate`: on CPU the arrays go one by one).

Memory per device (`orchestrator.core.memory.device_bytes`, the sum `meshpipe plan`
uses too) = parameters × (2 + optimizer slots) (parameters, gradient accumulator,
optimizer state; a tied array's copy counts on the stage holding it) + the layers'
mutable state (replicated) + residuals × microbatches in flight (from the schedule)
+ the largest temporary buffer of any of its programs. With `fuse_loss_chunk`, where
the schedule runs the loss stage's F and B back to back (`search`), the loss layer
keeps no residuals between actions: they live inside its one F+B program, whose temp
is XLA's figure for it (`LayerProfile.fused_temp_bytes`) or, when not compiled, the
residuals plus the layer's temporaries (no saving claimed).

A third mesh axis, `fsdp` (`MeshChoice.fsdp` > 1; with `data` and `model` a 3-D mesh): the
batch is split over `data` × `fsdp` (`batch → [data, fsdp]`), and every parameter dim named
`MeshChoice.fsdp_axis` (a logical axis the rules leave off `model`, e.g. `embed`) over
`fsdp` — activations keep that dim whole, since their batch dim already takes `fsdp` (a
mesh axis shards one dim per tensor, `layout.partition_spec`). So parameters, gradient
accumulator and optimizer state shrink by `fsdp`, each layer runs its profiled program at
b = B / (D·F) examples, and F and B each all-gather the layer's parameters over `fsdp`
(the gathered copy counts as a temporary), B reduce-scatters the gradient over `fsdp`
before the `data` all-reduce of its shard — each collective charged on the link class its
axis's groups span, as above.

Zero-bubble (ZB-H1): where the profile has the split backward (`LayerProfile.split`), I and W
are charged like B from their own compiled programs (`LayerCost.i_s`, `w_s`): I with its
collectives and the fsdp all-gather, W with its collectives, the `data` all-reduce and the fsdp
reduce-scatter; `held_bytes` is what I keeps for W. A profile without the split (synthetic)
falls back to half of B each and the residuals as held.

Remat (`MeshChoice.remat`, the stage's `remat:`): under `full` each layer runs under
`jax.checkpoint` (how `stages.program` applies it, part by part), so a microbatch
keeps only each layer's input between F and B (b examples of the previous layer's
activation; the first layer's token input is not described and counts 0), the
backward first recomputes the forward — B grows by the layer's compiled forward
cost and its forward collectives — and the recomputed residuals of one layer live
as a temporary during its backward.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Mapping, Optional

import numpy as np

from orchestrator.core.memory import optimizer_slots  # noqa: F401 - part of this module's API
from orchestrator.core.model.layout import partition_spec, shard_count
from orchestrator.core.planner.model import PlanLayer
from orchestrator.core.planner.profile import LayerProfile, ProfileRequest, linear
from orchestrator.core.planner.topology import Topology, collective_time

__all__ = ["MeshChoice", "LayerCost", "layer_request", "layer_cost", "local_param_bytes", "fits_layer",
           "optimizer_slots", "mesh_choices", "fsdp_axis", "AXES", "FSDP_AXES"]


AXES = ("data", "fsdp", "model")     # a MeshChoice's mesh axes, in their canonical order


@dataclass(frozen=True)
class MeshChoice:
    """A stage's mesh and layout: sizes, axis order (outer first), rules, a short name for the rules.

    `fsdp` > 1 adds a third mesh axis (module docstring): the batch is split over
    `data` × `fsdp` and each parameter dim named `fsdp_axis` over `fsdp`.
    """

    data: int
    model: int
    order: tuple[str, ...]
    rules: tuple[tuple[str, str], ...]
    rules_name: str
    remat: str = "none"          # none | full: the stage's rematerialisation (module docstring)
    fsdp: int = 1
    fsdp_axis: str = ""          # the logical axis sharded over `fsdp` (parameters only)

    @property
    def devices(self) -> int:
        return self.data * self.fsdp * self.model

    @property
    def batch_shards(self) -> int:
        """How many pieces a microbatch is cut into (data × fsdp)."""
        return self.data * self.fsdp

    def sizes(self) -> dict[str, int]:
        return {"data": self.data, "fsdp": self.fsdp, "model": self.model}

    def mesh(self) -> dict[str, int]:
        """The job YAML's `mesh:` (axes of size 1 left out; `{data: 1}` for one device)."""
        sizes = self.sizes()
        out = {a: sizes[a] for a in self.order if sizes[a] > 1}
        return out or {"data": 1}

    def layout(self) -> dict[str, object]:
        """The stage's layout over its mesh axes (batch → data [× fsdp], the rules → model,
        `fsdp_axis` → fsdp)."""
        batch = [a for a in self.order if a in ("data", "fsdp") and self.sizes()[a] > 1]
        out: dict[str, object] = {"batch": batch[0] if len(batch) == 1 else batch} if batch else {}
        if self.model > 1:
            out.update(dict(self.rules))
        if self.fsdp > 1:
            out[self.fsdp_axis] = "fsdp"
        return out

    def groups(self, axis: str) -> tuple[tuple[int, ...], ...]:
        """Flat device positions (row-major in `order`) of every group along mesh axis `axis`."""
        return _groups(self.order, self.data, self.fsdp, self.model, axis)

    def positions(self, d: int, m: int) -> int:
        """Flat device position of mesh coordinate (data=d, model=m) (a mesh without `fsdp`)."""
        return d * self.model + m if self.order[0] == "data" else m * self.data + d

    def label(self) -> str:
        mesh = "×".join(f"{a}={v}" for a, v in self.mesh().items())
        return (f"{mesh} {self.rules_name if self.model > 1 else 'dp'}"
                + (f" fsdp:{self.fsdp_axis}" if self.fsdp > 1 else "")
                + (" remat" if self.remat != "none" else ""))


@functools.lru_cache(maxsize=4096)
def _groups(order: tuple[str, ...], data: int, fsdp: int, model: int, axis: str) -> tuple[tuple[int, ...], ...]:
    sizes = {"data": data, "fsdp": fsdp, "model": model}
    names = [a for a in order if sizes[a] > 1 or a == axis] or [axis]
    ids = np.arange(data * fsdp * model).reshape([sizes[a] for a in names])
    i = names.index(axis)
    return tuple(tuple(int(x) for x in row) for row in np.moveaxis(ids, i, -1).reshape(-1, sizes[axis]))


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
    fsdp_comm_s: float = 0.0           # the fsdp axis's parameter all-gathers and gradient reduce-scatter
    fsdp_bytes: float = 0.0            # their bytes per device per microbatch
    i_s: float = 0.0                   # zero-bubble I (input gradient), W (weight gradients + accumulate)
    w_s: float = 0.0
    held_bytes: float = 0.0            # what I keeps for W per microbatch
    split_temp_bytes: float = 0.0      # the largest temp of F, I and W


def _restricted(layer: PlanLayer, rules: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    names = layer.logical_axes()
    return tuple(r for r in rules if r[0] in names)


def layer_request(layer: PlanLayer, choice: MeshChoice, batch: int) -> ProfileRequest:
    """The profile a layer needs on this choice (M and rules collapse when the layer uses no `model`)."""
    rules = _restricted(layer, choice.rules) if choice.model > 1 else ()
    m = choice.model if rules else 1
    return ProfileRequest(layer.signature, layer.index, m, rules, batch)


def _layout(choice: MeshChoice, layer: PlanLayer) -> dict[str, str]:
    """The choice's parameter layout restricted to the layer (rules → model, fsdp_axis → fsdp)."""
    out = dict(_restricted(layer, choice.rules)) if choice.model > 1 else {}
    if choice.fsdp > 1:
        out[choice.fsdp_axis] = "fsdp"
    return out


def fits_layer(layer: PlanLayer, choice: MeshChoice) -> bool:
    """Every dim the layout shards (parameters, and the output over `model`) divides by its axis size."""
    if choice.model == 1 and choice.fsdp == 1:
        return True
    sizes = choice.sizes()
    layout = _layout(choice, layer)
    for p in layer.params:
        for entry, size in zip(partition_spec(p.axes, layout), p.shape):
            if entry is not None and size % shard_count(entry, sizes):
                return False
    if choice.model > 1:     # the output's batch dim takes data (× fsdp): only the model rules apply to the rest
        rules = {k: "model" for k, _ in choice.rules}
        for entry, size in zip(partition_spec(layer.out_axes[1:], rules), layer.out_shape):
            if entry is not None and size % choice.model:
                return False
    return True


def local_param_bytes(layer: PlanLayer, choice: MeshChoice, fsdp: bool = True) -> float:
    """Bytes of this layer's parameters held by one device (`fsdp=False`: as gathered over `fsdp`)."""
    layout = _layout(choice, layer)
    if not fsdp:
        layout.pop(choice.fsdp_axis, None)
    if not layout:
        return float(layer.param_bytes)
    sizes = choice.sizes()
    total = 0.0
    for p in layer.params:
        n = 1
        for entry in partition_spec(p.axes, layout):
            n *= shard_count(entry, sizes) if entry else 1
        total += p.nbytes / n
    return total


def _group_class(topo: Topology, first_host: int, choice: MeshChoice, group: tuple[int, ...], along: str) -> str:
    """Farthest link class of a collective group (`group`: indices along mesh axis `along`), over
    every coordinate of the other axes."""
    return _farthest(topo.hosts_per_group, topo.devices_per_host, first_host, choice.groups(along), tuple(group))


@functools.lru_cache(maxsize=65536)
def _farthest(hpg: int, dph: int, first_host: int, rows, group) -> str:
    """`Topology.class_of_devices`'s farthest class over the groups (cached: the search asks often)."""
    worst = 0
    for row in rows:
        hosts = {first_host + row[g] // dph for g in group}
        worst = max(worst, 0 if len(hosts) <= 1 else 1 if len({h // hpg for h in hosts}) == 1 else 2)
    return ("host", "group", "dcn")[worst]


def layer_cost(layer: PlanLayer, choice: MeshChoice, micro: int, topo: Topology, first_host: int,
               profiles: Mapping[ProfileRequest, LayerProfile], in_bytes: float = 0.0) -> Optional[LayerCost]:
    """The layer's `LayerCost`, or None when the choice cannot run it (batch or a dim not divisible).

    `in_bytes`: bytes per example of the layer's input (what `remat: full` keeps per microbatch).
    """
    if micro % choice.batch_shards or not fits_layer(layer, choice):
        return None
    b = micro // choice.batch_shards
    p1, p2 = profiles[layer_request(layer, choice, 1)], profiles[layer_request(layer, choice, 2)]
    prof = p1 if b == 1 else p2 if b == 2 else linear(p1, p2, b)
    compute = {ph: _device_time(prof, ph, topo) for ph in ("fwd", "bwd")}
    comm = {"fwd": 0.0, "bwd": 0.0}
    tp_bytes = 0.0
    for phase, kind, nbytes, groups in prof.collectives:
        if phase not in comm:       # the zero-bubble I and W programs' own (`_split_times`)
            continue
        k = max(len(g) for g in groups)
        cls = _group_class(topo, first_host, choice, max(groups, key=len), "model") if choice.model > 1 else "host"
        comm[phase] += collective_time(kind, nbytes, k, topo.collective_link(cls))
        tp_bytes += nbytes
    pbytes = local_param_bytes(layer, choice)
    dp = 0.0
    if choice.data > 1:
        cls = _group_class(topo, first_host, choice, tuple(range(choice.data)), "data")
        link = topo.collective_link(cls)    # XLA combines the gradients' all-reduces: one, of every array
        dp = collective_time("all-reduce", pbytes, choice.data, link) + (len(layer.params) - 1) * link.per_array_s
    fsdp = {"fwd": 0.0, "bwd": 0.0}
    fsdp_bytes = gathered = 0.0
    if choice.fsdp > 1:     # F and B each gather the parameters; B reduce-scatters their gradient
        gathered = local_param_bytes(layer, choice, fsdp=False)
        link = topo.collective_link(_group_class(topo, first_host, choice, tuple(range(choice.fsdp)), "fsdp"))
        ag = collective_time("all-gather", gathered, choice.fsdp, link)
        fsdp = {"fwd": ag, "bwd": ag + collective_time("reduce-scatter", gathered, choice.fsdp, link)}
        fsdp_bytes = 3 * gathered
    fwd = compute["fwd"] + comm["fwd"] + fsdp["fwd"]
    bwd = compute["bwd"] + comm["bwd"] + dp + fsdp["bwd"]
    compute_s, tp_s, resid, temp = compute["fwd"] + compute["bwd"], comm["fwd"] + comm["bwd"], \
        prof.residual_bytes, prof.temp_bytes
    fsdp_s = fsdp["fwd"] + fsdp["bwd"]
    temp += max(0.0, gathered - pbytes)      # the gathered parameters live while a program runs
    fused = prof.fused_temp_bytes
    if choice.remat == "full":      # keep the input only; recompute the forward inside the backward
        bwd += fwd
        compute_s += compute["fwd"]
        tp_s += comm["fwd"]
        fsdp_s += fsdp["fwd"]
        resid, temp = b * in_bytes, max(temp, prof.residual_bytes)
        fused = None                # not compiled under remat
    elif choice.remat != "none":
        raise ValueError(f"remat = {choice.remat!r}: the planner models none and full only")
    # F+B as one program: what XLA compiled for it, else the residuals inside it next to the temporaries
    fused = resid + temp if fused is None else fused + max(0.0, gathered - pbytes)
    if prof.split:
        i_s, w_s = _split_times(prof, topo, first_host, choice, fsdp, dp)
        held, split_temp = float(prof.held_bytes), float(prof.split_temp_bytes or 0.0) + max(0.0, gathered - pbytes)
        if choice.remat == "full":      # I recomputes the forward (the input-gradient chain needs its residuals)
            i_s, split_temp = i_s + fwd, max(split_temp, prof.residual_bytes)
    else:                               # not compiled (synthetic profiles): half of B each, F's residuals held
        i_s, w_s, held, split_temp = bwd / 2, bwd / 2, resid, temp
    return LayerCost(fwd, bwd, compute_s, tp_s, dp, pbytes, resid, temp, tp_bytes, pbytes if choice.data > 1 else 0.0,
                     float(layer.state_bytes), fused, fsdp_s, fsdp_bytes, i_s, w_s, held, split_temp)


def _device_time(prof: LayerProfile, phase: str, topo: Topology) -> float:
    """One phase's device seconds: the flops/bytes roofline plus its kernels' own time."""
    return (max(prof.flops.get(phase, 0.0) / topo.flops, prof.bytes_accessed.get(phase, 0.0) / topo.memory_bandwidth)
            + prof.kernels.get(phase, 0) * topo.kernel_overhead_s)


def _split_times(prof: LayerProfile, topo: Topology, first_host: int, choice: MeshChoice,
                 fsdp: Mapping[str, float], dp: float) -> tuple[float, float]:
    """(I, W) seconds of a profile with the split backward, without remat (module docstring)."""
    t = {ph: _device_time(prof, ph, topo) for ph in ("i", "w")}
    for phase, kind, nbytes, groups in prof.collectives:
        if phase in t:
            cls = _group_class(topo, first_host, choice, max(groups, key=len), "model") if choice.model > 1 else "host"
            t[phase] += collective_time(kind, nbytes, max(len(g) for g in groups), topo.collective_link(cls))
    ag = fsdp["fwd"]        # F's all-gather; B's fsdp time is that gather again plus the reduce-scatter
    return t["i"] + ag, t["w"] + dp + fsdp["bwd"] - ag


def fsdp_axis(model_axes, rules: tuple[tuple[str, str], ...]) -> Optional[str]:
    """The logical axis a rules set's `fsdp` axis shards: the first of `FSDP_AXES` the
    parameters carry that the rules do not send to `model` (None: no fsdp for these rules)."""
    taken = {a for a, _ in rules}
    return next((a for a in FSDP_AXES if a in model_axes and a not in taken), None)


FSDP_AXES = ("embed", "mlp", "heads", "vocab")


def _orders(sizes: Mapping[str, int], multi_host: bool) -> list[tuple[str, ...]]:
    """Axis orders worth telling apart (which axis crosses hosts changes a collective's link class):
    canonical, and on several hosts each other used axis outermost — `model` only when it is one of
    two axes (a 3-D mesh keeps tensor parallelism inside, data or fsdp across hosts)."""
    used = [a for a in AXES if sizes[a] > 1]
    canon = tuple(a for a in AXES if a in sizes)
    out = [canon]
    if multi_host and len(used) > 1:
        for a in used[1:]:
            if a == "model" and len(used) == 3:
                continue
            out.append((a,) + tuple(x for x in canon if x != a))
    return out


def mesh_choices(devices: int, max_model: int, rulesets: Mapping[str, tuple[tuple[str, str], ...]],
                 multi_host: bool, remats: tuple[str, ...] = ("none",), max_fsdp: int = 1,
                 param_axes: frozenset = frozenset()) -> list[MeshChoice]:
    """Every (data, model) factorisation of `devices`, each rules set, both axis orders when it
    matters, each remat in `remats`; with `max_fsdp` > 1 also every (data, fsdp, model) one with
    2 ≤ fsdp ≤ max_fsdp (3-D meshes when data and model are > 1), its fsdp axis the first of
    `FSDP_AXES` in `param_axes` that the rules leave alone."""
    out = []
    for m in range(1, min(devices, max_model) + 1):
        if devices % m:
            continue
        sets = list(rulesets.items()) if m > 1 else [("dp", ())]
        for f in range(1, min(devices // m, max(max_fsdp, 1)) + 1):
            if (devices // m) % f:
                continue
            d = devices // m // f
            for name, rules in sets:
                axis = ""
                if f > 1:
                    axis = fsdp_axis(param_axes, rules if m > 1 else ()) or ""
                    if not axis:
                        continue
                    orders = _orders({"data": d, "fsdp": f, "model": m}, multi_host)
                else:
                    orders = [("data", "model")] + ([("model", "data")] if multi_host and d > 1 and m > 1 else [])
                for order in orders:
                    out += [MeshChoice(d, m, order, rules, name, r, f, axis) for r in remats]
    return out
