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


def edges_json(checked) -> list[dict]:
    """Per stage edge: reshard bytes vs lower bound, forward and backward (for `meshpipe plan`)."""
    geoms = stage_geoms(checked)
    out = []
    for s in range(len(geoms) - 1):
        boundary = checked.stages[s].layers[1]
        axes = checked.model.layers[boundary - 1].out_axes
        shape = activation_shape(checked, boundary)
        fwd = edge_plan(geoms[s], geoms[s + 1], axes, shape, np.float32)
        bwd = edge_plan(geoms[s + 1], geoms[s], axes, shape, np.float32)
        out.append({"edge": [s, s + 1], "shape": list(shape), "axes": list(axes),
                    "src_spec": repr(fwd.src.spec), "dst_spec": repr(fwd.dst.spec),
                    "forward": {"cross_host_bytes": fwd.cross_host_bytes,
                                "lower_bound_bytes": fwd.lower_bound_bytes, "tiles": len(fwd.tiles)},
                    "backward": {"cross_host_bytes": bwd.cross_host_bytes,
                                 "lower_bound_bytes": bwd.lower_bound_bytes, "tiles": len(bwd.tiles)}})
    return out
