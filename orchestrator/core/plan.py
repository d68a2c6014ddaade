"""The job plan as data: placement, schedule, simulation. Pure: no ray, no jax.

`make_plan(checked)` builds, lowers and validates the schedule and simulates it
with per-stage costs proportional to each stage's parameter count (a forward is
~2 flops per parameter per token, a backward twice that), so `meshpipe plan`
answers "what will this job look like" before any Ray process exists.
`plan_json` is what `meshpipe plan --json` prints and what summary.json embeds: with
each stage's per-device memory lower bound (`stage_memory`: a tied array's copy and the
mutable state count on the stage holding them), the tied parameter groups (which stage
holds each copy, bytes per copy) and the parameter count with each tied array once.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from orchestrator.core.config.limits import stage_memory
from orchestrator.core.dataplane import listeners
from orchestrator.core.edges import edges_json
from orchestrator.core.hosts import describe
from orchestrator.core.redact import redact
from orchestrator.core.schedule import (
    Schedule, SimResult, add_comms, forward_only, generate, lower, render_grid, simulate, validate,
)
from orchestrator.core.model.layout import format_layout


@dataclass(frozen=True)
class Plan:
    """A checked job's plan (`make_plan`): the `Checked` job, its lowered and validated schedule, the
    schedule's simulation with per-stage costs, those costs, and the forward-only eval schedule."""

    checked: object
    schedule: Schedule      # lowered and validated
    sim: SimResult
    costs: list[dict]
    eval_schedule: Schedule | None = None   # forward-only, lowered and validated (with data.eval)


def _chunks(s) -> tuple[tuple[int, int], ...]:
    return tuple(s.chunks) or (tuple(s.layers),)


def stage_costs(checked) -> list[dict]:
    """Per stage, F and B relative to the largest stage.

    Each F/B action runs one chunk, so a stage's action cost is the mean of its chunks'
    parameter counts (all of its chunks count; with one chunk per stage, its layers).
    """
    counts = [max(1, sum(checked.model.param_count(a, b) for a, b in _chunks(s)) / len(_chunks(s)))
              for s in checked.stages]
    top = max(counts)
    return [{"F": c / top, "B": 2 * c / top} for c in counts]


def make_plan(checked) -> Plan:
    job = checked.job
    sched = generate(job.pipeline.schedule, len(checked.stages), job.pipeline.microbatches,
                     job.pipeline.virtual_stages)
    lowered = lower(sched)
    validate(lowered)
    costs = stage_costs(checked)
    ev = None
    if job.data.eval is not None:
        ev = add_comms(forward_only(len(checked.stages), job.pipeline.microbatches, job.pipeline.virtual_stages))
        validate(ev)
    return Plan(checked, lowered, simulate(lowered, costs), costs, ev)


def cross_host_axes(mesh: dict[str, int], devices_per_host: int) -> list[str]:
    """Mesh axes along which neighbouring devices sit on different hosts (their collectives cross hosts)."""
    shape = tuple(mesh.values())
    hosts = np.arange(int(np.prod(shape))).reshape(shape) // devices_per_host
    return [name for i, name in enumerate(mesh) if shape[i] > 1 and np.any(np.diff(hosts, axis=i) != 0)]


def stage_of_layer(checked, layer: int) -> int:
    """The stage whose chunks hold `layer`."""
    for s in checked.stages:
        if any(a <= layer < b for a, b in _chunks(s)):
            return s.index
    raise ValueError(f"layer {layer} is on no stage")


def ties_json(checked) -> list[dict]:
    """Tied parameter groups: both names, the stage holding each copy, shape, dtype, bytes per copy."""
    return [{**t, "stages": [stage_of_layer(checked, la) for la in t["layers"]]}
            for t in checked.model.tie_groups()]


def memory_json(checked, s) -> dict:
    """Per-device lower-bound bytes of stage `s` (`stage_memory`: tie copies and state counted here)."""
    return stage_memory(checked.model, _chunks(s), dict(s.mesh), s.layout, checked.microbatch_size)


def plan_json(plan: Plan) -> dict:
    """The plan as plain JSON-able data: what `meshpipe plan --json` prints and summary.json embeds
    (stages with hosts, meshes, layouts and memory bounds, edges with their bytes, the lowered
    schedule, the simulated bubble)."""
    checked, job = plan.checked, plan.checked.job
    stages = []
    p = len(checked.stages)
    ties = ties_json(checked)
    for s in checked.stages:
        chunks = [{"chunk": j, "virtual_stage": j * p + s.index, "layers": [a, b],
                   "layer_names": [checked.model.layers[i].name for i in range(a, b)],
                   "params": checked.model.param_count(a, b)} for j, (a, b) in enumerate(_chunks(s))]
        stages.append({
            "index": s.index,
            "layers": list(s.layers),
            "layer_names": [checked.model.layers[i].name for i in range(*s.layers)],
            "chunks": chunks,
            "hosts": list(s.hosts),
            "devices_per_host": s.devices_per_host,
            "mesh": dict(s.mesh),
            "cross_host_axes": cross_host_axes(dict(s.mesh), s.devices_per_host),
            "layout": {k: (list(v) if isinstance(v, tuple) else v) for k, v in s.layout.items()},
            "params": sum(c["params"] for c in chunks),
            "state_bytes": sum(checked.model.layers[i].state_bytes() for a, b in _chunks(s) for i in range(a, b)),
            "tied_copies": [t["params"][k] for t in ties for k in (0, 1) if t["stages"][k] == s.index],
            "memory_per_device": memory_json(checked, s),
        })
    return {
        "model": checked.model.name,
        "parameters": {"held": checked.model.param_count(), "unique": checked.model.unique_param_count()},
        "ties": ties,
        "stages": stages,
        "schedule": {
            "name": job.pipeline.schedule,
            "microbatches": job.pipeline.microbatches,
            "virtual_stages": job.pipeline.virtual_stages,
            "grid": plan.schedule.grid(),
        },
        "edges": edges_json(checked),
        "data_plane": {"transport": checked.cluster.transport, "resolved": checked.cluster.data_plane,
                       "listeners": listeners(checked)},
        "placement": redact(describe(checked)),
        "simulated": {
            "costs": plan.costs,
            "step_time": plan.sim.step_time,
            "bubble_fraction": plan.sim.bubble_fraction,
            "bubble_per_stage": list(plan.sim.bubble_per_stage),
            "peak_inflight": list(plan.sim.peak_inflight),
        },
    }


def _bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{int(n)} B"


def plan_text(plan: Plan) -> str:
    """The plan as `meshpipe plan` prints it: placement, layouts, bytes per stage edge against their
    lower bound, the lowered schedule grid, the simulated bubble and peak in-flight microbatches."""
    checked, job = plan.checked, plan.checked.job
    model = checked.model
    held, unique = model.param_count(), model.unique_param_count()
    counted = f"{unique:,} parameters" + (f" ({held:,} held: tied copies counted per stage)" if held != unique else "")
    lines = [f"model {model.name}: {model.num_layers} layers, {counted}; global batch {job.data.global_batch} = "
             f"{job.pipeline.microbatches} microbatches × {checked.microbatch_size}", "", "placement:"]
    p = len(checked.stages)
    for s in checked.stages:
        mesh = " × ".join(f"{k}={v}" for k, v in s.mesh.items())
        chunks = _chunks(s)
        for j, (a, b) in enumerate(chunks):
            names = ",".join(checked.model.layers[i].name for i in range(a, b))
            head = f"  stage {s.index}:" if j == 0 else " " * len(f"  stage {s.index}:")
            which = f" chunk {j} (virtual stage {j * p + s.index})" if len(chunks) > 1 else ""
            lines.append(f"{head}{which} layers [{a}, {b}) {names}  "
                         f"{checked.model.param_count(a, b):,} parameters")
        crossing = cross_host_axes(dict(s.mesh), s.devices_per_host)
        lines.append(f"    hosts {list(s.hosts)} × {s.devices_per_host} devices  mesh {mesh}  "
                     f"layout {format_layout(s.layout) or '(replicated)'}")
        mem = memory_json(checked, s)
        lines.append(f"    per device ≥ {_bytes(mem['per_device'])}: parameters {_bytes(mem['params'])} + gradients "
                     f"{_bytes(mem['grads'])} + state {_bytes(mem['state'])} + activations "
                     f"{_bytes(mem['activations'])} (one microbatch)")
        if len(s.hosts) > 1:
            lines.append(f"    multi-host submesh: {len(s.hosts)} jax processes; axes crossing hosts: "
                         f"{', '.join(crossing) or 'none'}")
    ties = ties_json(checked)
    if ties:
        lines += ["", "tied parameters (one array, a copy on each stage holding it; gradients summed):"]
    for t in ties:
        lines.append(f"  {t['params'][0]} (stage {t['stages'][0]}) = {t['params'][1]} (stage {t['stages'][1]}): "
                     f"{t['dtype']}{t['shape']}, {_bytes(t['bytes'])} per copy")
    lines += ["", "host actors (bundle: Ray resources; jax init):"]
    for h in describe(checked):
        lines.append(f"  stage {h['stage']} host {h['host']}: bundle {h['bundle']} {h['bundle_resources']}; "
                     f"jax {h['jax_init'].get('mode')} ({h['jax_init'].get('num_processes')} process(es))")
    edges = edges_json(checked)
    if edges:
        lines += ["", "resharding per stage edge (one microbatch; cross-host bytes / lower bound):"]
    for e in edges:
        f, b = e["forward"], e["backward"]
        where = (f" (virtual {e['virtual'][0]}→{e['virtual'][1]}, layer {e['boundary']}"
                 + (", chunk boundary: last stage back to the first)" if e["wraps"] else ")")
                 if plan.checked.job.pipeline.virtual_stages > 1 else "")
        lines.append(f"  {e['edge'][0]}→{e['edge'][1]}{where} {e['dtype']} {tuple(e['shape'])} "
                     f"{e['src_spec']} → {e['dst_spec']}: "
                     f"forward {f['cross_host_bytes']:,} B / {f['lower_bound_bytes']:,} B in {f['tiles']} tiles, "
                     f"backward {b['cross_host_bytes']:,} B / {b['lower_bound_bytes']:,} B")
    cl = checked.cluster
    plane = cl.data_plane if cl.transport == cl.data_plane else f"{cl.transport} → {cl.data_plane} on {cl.platform}"
    lines += ["", f"data plane: transport {plane}; listeners (each bound to its node's address):"]
    lines += [f"  {r['listener']}: {r['who']}, {r['binds']}; authentication {r['authentication']}"
              for r in listeners(checked)] or ["  none beyond Ray's own (tensors travel as Ray calls)"]
    lines += ["", f"schedule {job.pipeline.schedule} (lowered):", render_grid(plan.schedule), "",
              f"simulated (costs ∝ parameters per chunk): bubble {plan.sim.bubble_fraction:.3f}; per stage "
              + ", ".join(f"{b:.3f}" for b in plan.sim.bubble_per_stage),
              "peak in-flight microbatches per stage: " + ", ".join(map(str, plan.sim.peak_inflight))]
    return "\n".join(lines)
