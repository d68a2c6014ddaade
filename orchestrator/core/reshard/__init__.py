"""Cross-mesh resharding: a pure plan (`plan.py`) and numpy tile packing (`tiles.py`).

Example:
    >>> import numpy as np
    >>> from orchestrator.core.reshard import MeshSide, make_plan
    >>> src = MeshSide(np.arange(4).reshape(2, 2), np.array([[0, 0], [1, 1]]), ("x", "y"), ("x", "y"))
    >>> dst = MeshSide(np.arange(4).reshape(4, 1), np.array([[2], [2], [3], [3]]), ("a", "b"), (None, "a"))
    >>> plan = make_plan((8, 8), np.float32, src, dst)
    >>> plan.cross_host_bytes == plan.lower_bound_bytes
    True
"""
from orchestrator.core.reshard.plan import (
    MeshSide,
    ReshardError,
    ReshardPlan,
    Tile,
    make_plan,
    plan_cache,
    shard_boxes,
    shard_shape,
)
from orchestrator.core.reshard.tiles import assemble, pack, shards_of

__all__ = [
    "MeshSide",
    "ReshardError",
    "ReshardPlan",
    "Tile",
    "assemble",
    "make_plan",
    "pack",
    "plan_cache",
    "shard_boxes",
    "shard_shape",
    "shards_of",
]
