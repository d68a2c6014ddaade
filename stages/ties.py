"""Tied weights across parts and stages: the gradients of an array's two copies summed.

A tie (`ModelSpec.ties`) is one array of the user's model held by two parts, e.g. a GPT's token
embedding in the first part and again as the unembedding in the head. Each part keeps a copy;
the copies are equal at init (both come from the model's own init). At the step's end, after
loss-scale unscaling and before the global norm and the optimizer update, each copy's
accumulated gradient is replaced by the sum of both (`sum_tied`). Both copies then take the
same update from the same optimizer state, so they stay bit-identical: the sum is computed on
the host in float32 numpy as `g_earlier + g_later` on both sides (the same operands in the same
order, so the same bits), and put back in the copy's own sharding.

Basic flow (per tie, on every host of a stage holding a side):
  - both sides on this stage (one stage, or two chunks of it): add them here;
  - one side here, the other on stage s: host 0 of each side's stage sends its gradient (the
    global array, gathered across the stage's hosts) to every host of the other stage through
    the actors' `deliver` mailbox (tag ("TIE", tie index)), the same exchange as the global
    norm's scalars; each host takes the peer's array (bounded wait) and adds.
The global gradient norm counts a tied array once: `norm_exclusions` names the later side,
whose squared norm the stage leaves out of its share.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np


def locate(progs, ties) -> list[list[tuple[int, int, int, str]]]:
    """Per tie: the sides held here as (side 0/1, chunk, part index within the chunk, leaf path)."""
    out = []
    for (a, b) in ties:
        here = []
        for k, (layer, path) in enumerate((a, b)):
            for c, prog in enumerate(progs):
                if prog.start <= layer < prog.stop:
                    here.append((k, c, layer - prog.start, path))
        out.append(here)
    return out


def _leaf_index(tree, path: str) -> int:
    import jax

    from orchestrator.core.model.pipeline import key_path

    for i, (p, _) in enumerate(jax.tree_util.tree_flatten_with_path(tree)[0]):
        if key_path(p) == path:
            return i
    raise KeyError(path)


def get_leaf(grads, c: int, j: int, path: str):
    import jax

    return jax.tree.leaves(grads[c][j])[_leaf_index(grads[c][j], path)]


def set_leaf(grads, c: int, j: int, path: str, value) -> None:
    """Replace one leaf of grads[c][j] (a part's gradient pytree) in place of the list."""
    import jax

    leaves, treedef = jax.tree.flatten(grads[c][j])
    leaves[_leaf_index(grads[c][j], path)] = value
    parts = list(grads[c])
    parts[j] = jax.tree.unflatten(treedef, leaves)
    grads[c] = parts


def _host(leaf) -> np.ndarray:
    """The whole array on this host (gathered across the stage's hosts when sharded over several)."""
    from stages.dataplane import gather

    return gather(leaf)


def _device(value: np.ndarray, like):
    """`value` laid out as `like` (its sharding, possibly over several hosts)."""
    import jax

    return jax.make_array_from_callback(value.shape, like.sharding, lambda idx: value[idx])


def sum_tied(grads: list, progs: Sequence[Any], ties, exchange=None) -> None:
    """Each tied copy's gradient := g(earlier side) + g(later side), in place of `grads` (a list
    per chunk of lists per part). `exchange(t, mine) -> the other side's array`: for a tie with
    one side here (the worker sends `mine` to the other side's stage and takes theirs)."""
    for t, here in enumerate(locate(progs, ties)):
        if not here:
            continue
        mine = {k: _host(get_leaf(grads, c, j, path)) for k, c, j, path in here}
        if len(mine) == 1:
            (k, mine_k), = mine.items()
            if exchange is None:
                raise RuntimeError(f"tie {t}: the other side is on another stage and there is no exchange")
            other = np.asarray(exchange(t, mine_k))
            mine = {k: mine_k, 1 - k: other}
        total = mine[0] + mine[1]        # the same operands in the same order on both sides
        for k, c, j, path in here:
            set_leaf(grads, c, j, path, _device(total, get_leaf(grads, c, j, path)))


def norm_exclusions(progs, ties) -> list[tuple[int, int, str]]:
    """(chunk, part, leaf path) of the later side of every tie held here: the global norm counts
    a tied array once (its earlier side)."""
    return [(c, j, path) for here in locate(progs, ties) for k, c, j, path in here if k == 1]


def for_norm(grads: list, progs, ties) -> list:
    """`grads` with the later side of every tie zeroed (a copy; `grads` itself is unchanged)."""
    out = list(grads)
    for c, j, path in norm_exclusions(progs, ties):
        leaf = get_leaf(out, c, j, path)
        set_leaf(out, c, j, path, _device(np.zeros(leaf.shape, leaf.dtype), leaf))
    return out


def tie_stages(ties, stage_chunks: Sequence[Sequence[tuple[int, int]]]) -> tuple[tuple[int, int], ...]:
    """Per tie: (stage holding the earlier side, stage holding the later side).

    Example:
        >>> tie_stages([((0, "embed/embedding"), (3, "embed/embedding"))], [[(0, 2)], [(2, 4)]])
        ((0, 1),)
    """
    def stage_of(layer):
        for s, chunks in enumerate(stage_chunks):
            if any(a <= layer < b for a, b in chunks):
                return s
        raise ValueError(f"layer {layer} is on no stage")

    return tuple((stage_of(a[0]), stage_of(b[0])) for a, b in ties)
