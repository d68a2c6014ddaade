"""Stage edges as resharding problems. Pure: numpy only.

A stage's devices are numbered by their flat position in the stage's mesh
(row-major), and host h of the stage owns positions [h·d, (h+1)·d) where d is
devices per host — the worker checks that jax's device order agrees. Hosts are
named by their cluster host index, so two stages never share a host id.

`edge_plan(src_geom, dst_geom, axes, shape, dtype)` is the (cached) plan for a
tensor with logical `axes` leaving one stage and entering another; the same
function serves activations (forward) and gradients (backward, roles swapped).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from orchestrator.core.reshard import MeshSide, ReshardPlan, plan_cache
from orchestrator.core.model.layout import partition_spec


@dataclass(frozen=True)
class StageGeom:
    """Where a stage lives: its mesh, its cluster hosts, devices per host, its layout."""

    mesh: tuple[tuple[str, int], ...]
    hosts: tuple[int, ...]
    devices_per_host: int
    layout: tuple[tuple[str, Any], ...]

    @staticmethod
    def of(mesh: Mapping[str, int], hosts: Sequence[int], devices_per_host: int,
           layout: Mapping[str, Any]) -> "StageGeom":
        return StageGeom(tuple(mesh.items()), tuple(hosts), int(devices_per_host), tuple(layout.items()))

    def side(self, axes: Sequence[str | None]) -> MeshSide:
        shape = tuple(size for _, size in self.mesh)
        n = int(np.prod(shape))
        flat = np.arange(n)
        hosts = np.asarray(self.hosts)[flat // self.devices_per_host]
        spec = partition_spec(tuple(axes), dict(self.layout))
        return MeshSide(flat.reshape(shape), hosts.reshape(shape), tuple(name for name, _ in self.mesh), spec)


def edge_plan(src: StageGeom, dst: StageGeom, axes: Sequence[str | None], shape: Sequence[int],
              dtype: Any) -> ReshardPlan:
    return plan_cache(tuple(shape), np.dtype(dtype), src.side(axes), dst.side(axes))


def stage_geoms(checked) -> list[StageGeom]:
    return [StageGeom.of(s.mesh, s.hosts, s.devices_per_host, s.layout) for s in checked.stages]


def activation_shape(checked, boundary: int) -> tuple[int, ...]:
    """Global shape of the activation leaving layer `boundary - 1` (one microbatch)."""
    return (checked.microbatch_size, *checked.model.layers[boundary - 1].out_shape)


# The wire dtype of activations and their gradients: stages/worker.py receives every
# stage edge as float32 (the built-in models compute in float32).
WIRE_DTYPE = np.dtype(np.float32)


@dataclass(frozen=True)
class PlannedEdge:
    """One stage edge the executor plans: virtual stage `virtual` → `virtual + 1`.

    `src`/`dst` are the (physical) stages; `boundary` the layer index the activation
    enters; `wraps` marks the edge from the last stage back to the first (a chunk boundary
    of an interleaved schedule).
    """

    virtual: int
    src: int
    dst: int
    src_chunk: int
    boundary: int

    @property
    def wraps(self) -> bool:
        return self.dst < self.src


def planned_edges(checked) -> list[PlannedEdge]:
    """Every edge between virtual stages k and k+1 that crosses actors, in virtual-stage order.

    Virtual stage k is chunk k // p of stage k % p (the worker's `_plan_edges` rule); an
    edge whose two ends are the same stage (p = 1) stays inside the actor and is left out.
    """
    p = len(checked.stages)
    v = len(checked.stages[0].chunks or (checked.stages[0].layers,))
    out = []
    for k in range(p * v - 1):
        src, dst, j = k % p, (k + 1) % p, k // p
        if src == dst:
            continue
        chunks = checked.stages[src].chunks or (checked.stages[src].layers,)
        out.append(PlannedEdge(k, src, dst, j, chunks[j][1]))
    return out


def edges_json(checked) -> list[dict]:
    """Per stage edge: reshard bytes vs lower bound, forward and backward (for `meshpipe plan`).

    Lists the same edges the executor plans (`planned_edges`), with their wire dtype.
    """
    geoms = stage_geoms(checked)
    out = []
    for e in planned_edges(checked):
        axes = checked.model.layers[e.boundary - 1].out_axes
        shape = activation_shape(checked, e.boundary)
        fwd = edge_plan(geoms[e.src], geoms[e.dst], axes, shape, WIRE_DTYPE)
        bwd = edge_plan(geoms[e.dst], geoms[e.src], axes, shape, WIRE_DTYPE)
        out.append({"edge": [e.src, e.dst], "virtual": [e.virtual, e.virtual + 1], "boundary": e.boundary,
                    "wraps": e.wraps, "dtype": WIRE_DTYPE.name, "shape": list(shape), "axes": list(axes),
                    "src_spec": repr(fwd.src.spec), "dst_spec": repr(fwd.dst.spec),
                    "forward": {"cross_host_bytes": fwd.cross_host_bytes,
                                "lower_bound_bytes": fwd.lower_bound_bytes, "tiles": len(fwd.tiles)},
                    "backward": {"cross_host_bytes": bwd.cross_host_bytes,
                                 "lower_bound_bytes": bwd.lower_bound_bytes, "tiles": len(bwd.tiles)}})
    return out
