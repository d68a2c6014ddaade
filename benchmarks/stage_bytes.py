"""Bytes a stage's programs keep per microbatch, from the programs themselves (shapes only).

`kept_bytes` traces a `stages.program.StageProgram`'s forward and its zero-bubble I
with `jax.eval_shape` (nothing runs, no device memory) and sums the outputs each keeps:

  F        the residuals its forward returns for the backward (parameters are not among
           them by construction), kept until B or I;
  I        what I hands W (`stages.zb_split.Held`: the residual and output-gradient leaves
           W reads, plus what I computed for it), kept until W;
  output   the stage's output activation (sent on, not kept);
  dx       the input gradient B or I returns (sent back, not kept).

{"F": ..., "I": ...} is what `orchestrator.core.schedule.stash_timeline` takes. Bytes are
whole arrays: per device on a one-device stage. Imports jax and `stages` only (no ray).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def tree_bytes(tree) -> int:
    """Bytes of every array leaf of `tree` (arrays or shape structs)."""
    return sum(int(leaf.size) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


def stage_operands(prog, mbs: int, seq: int, d_model: int):
    """Shape structs of (params, xs, labels) for one microbatch of a GPT stage (`prog`)."""
    params = jax.eval_shape(prog.init_params, 0)
    xs = [jax.ShapeDtypeStruct((mbs, seq), jnp.int32) if prog.first
          else jax.ShapeDtypeStruct((mbs, seq, d_model), jnp.dtype(prog.in_leaves[0].dtype))]
    labels = jax.ShapeDtypeStruct((mbs, seq), jnp.int32) if prog.last else None
    return params, xs, labels


def kept_bytes(prog, params, xs, labels=None) -> dict:
    """{"F", "I", "output", "dx", "param", "residual_leaves", "held_leaves"} for one microbatch of
    `prog` (see the module docstring); arguments may be arrays or `jax.ShapeDtypeStruct`s.

    Example:
        >>> from orchestrator.core.model.registry import build_model, build_spec
        >>> from stages.program import StageProgram, make_optimizer
        >>> spec = build_spec("gpt", {"vocab": 16, "d_model": 8, "heads": 2, "d_mlp": 16, "blocks": 2}, 4)
        >>> prog = StageProgram(spec, build_model(spec.factory, spec.args), 1, 4, microbatches=1,
        ...                     optimizer=make_optimizer("sgd", {"learning_rate": 0.1}))
        >>> got = kept_bytes(prog, *stage_operands(prog, 2, 4, 8))
        >>> 0 < got["I"] < got["F"], got["dx"], got["output"]     # the loss is a float32 scalar
        (True, 256, 4)
    """
    y, res = jax.eval_shape(prog.fwd, params, xs, labels)[:2]
    dys = None if prog.last else [jax.ShapeDtypeStruct(y[i].shape, y[i].dtype) for i in prog.out_diff]
    split = prog.zero_bubble(params, res, dys).split

    def i_program(p, r, d):
        dxs, carried = split.run_i(p, r, d)
        return dxs, split.held(r, d, carried)

    dxs, held = jax.eval_shape(i_program, params, res, dys)
    return {"F": tree_bytes(res), "I": tree_bytes(held), "output": tree_bytes(y), "dx": tree_bytes(dxs),
            "param": tree_bytes(params), "residual_leaves": len(jax.tree.leaves(res)),
            "held_leaves": len(held)}
