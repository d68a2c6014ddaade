"""Stage edges as resharding problems. Pure: numpy only.

A stage's devices are numbered by their flat position in the stage's mesh
(row-major), and host h of the stage owns positions [h·d, (h+1)·d) where d is
devices per host — the worker checks that jax's device order agrees. Hosts are
named by their cluster host index, so two stages never share a host id.

`edge_plan(src_geom, dst_geom, axes, shape, dtype)` is the (cached) plan for one
array leaf with logical `axes` leaving one stage and entering another; the same
function serves activations (forward) and gradients (backward, roles swapped).
An activation is a pytree: each of its leaves crosses with its own plan, shape
and dtype (`edge_leaves`).
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


def edge_leaves(checked, boundary: int) -> list[tuple]:
    """(leaf, global shape) of each leaf of the activation leaving layer `boundary - 1` (one microbatch)."""
    return [(leaf, leaf.batched(checked.microbatch_size)) for leaf in checked.model.layers[boundary - 1].outputs]


def _inexact(dtype: str) -> bool:
    return np.issubdtype(np.dtype(dtype), np.inexact) or dtype in ("bfloat16", "float8_e4m3fn", "float8_e5m2")


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
    """Per stage edge: reshard bytes vs lower bound, forward and backward, summed over the
    activation's leaves (each with its own dtype; gradients only for floating leaves), and
    per leaf (for `meshpipe plan`). Lists the same edges the executor plans (`planned_edges`),
    the wrap-around edge of interleaved schedules included."""
    geoms = stage_geoms(checked)
    out = []
    for e in planned_edges(checked):      # the same edges the executor plans
        s, d, boundary = e.src, e.dst, e.boundary
        leaves, total = [], {"forward": [0, 0, 0], "backward": [0, 0, 0]}
        for leaf, shape in edge_leaves(checked, boundary):
            dtype = leaf_dtype(leaf.dtype)
            fwd = edge_plan(geoms[s], geoms[d], leaf.axes, shape, dtype)
            row = {"path": leaf.path, "shape": list(shape), "dtype": leaf.dtype, "axes": list(leaf.axes),
                   "src_spec": repr(fwd.src.spec), "dst_spec": repr(fwd.dst.spec)}
            plans = {"forward": fwd}
            if _inexact(leaf.dtype):
                plans["backward"] = edge_plan(geoms[d], geoms[s], leaf.axes, shape, dtype)
            for way, plan in plans.items():
                row[way] = {"cross_host_bytes": plan.cross_host_bytes,
                            "lower_bound_bytes": plan.lower_bound_bytes, "tiles": len(plan.tiles)}
                for k, v in enumerate((plan.cross_host_bytes, plan.lower_bound_bytes, len(plan.tiles))):
                    total[way][k] += v
            leaves.append(row)
        first = leaves[0]
        out.append({"edge": [s, d], "virtual": [e.virtual, e.virtual + 1], "boundary": boundary,
                    "wraps": e.wraps, "dtype": first["dtype"], "shape": first["shape"], "axes": first["axes"],
                    "src_spec": first["src_spec"], "dst_spec": first["dst_spec"],
                    **{way: {"cross_host_bytes": t[0], "lower_bound_bytes": t[1], "tiles": t[2]}
                       for way, t in total.items()},
                    "leaves": leaves})
    return out


def leaf_dtype(name: str):
    """numpy dtype of a leaf's dtype name (bfloat16 and friends come from ml_dtypes, jax's own)."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
