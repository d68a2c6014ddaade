"""Per-job numerics policies: mixed precision and rematerialisation (pure; jax inside functions).

Precision: parameters, gradients and optimizer state are float32; each part computes
in `compute` (float32 or bfloat16): its floating parameters and inputs are cast to it
and its floating outputs leave in it, so activations and their gradients cross stage
edges in the compute dtype (bfloat16: half the bytes); the loss is float32.

Remat: `none` keeps every part's residuals (the default, no recompute); `full`
recomputes each part's forward in its backward (`jax.checkpoint`, saving only the
part's inputs); any other value names a ready-made policy in
`jax.checkpoint_policies` (e.g. `dots_saveable`: keep matmul outputs, recompute
the rest).
"""
from __future__ import annotations

from dataclasses import replace

from orchestrator.core.model.spec import ModelSpec

REMAT_FIXED = ("none", "full")


def remat_names() -> list[str]:
    """Valid `remat` values: none, full, and the argument-free jax.checkpoint_policies."""
    import inspect

    import jax

    names = []
    for name in sorted(dir(jax.checkpoint_policies)):
        fn = getattr(jax.checkpoint_policies, name)
        if name.startswith("_") or not callable(fn):
            continue
        try:
            first = next(iter(inspect.signature(fn).parameters), "")
        except (TypeError, ValueError):
            continue
        if first in ("prim", "_"):           # a policy itself, not a factory that needs arguments
            names.append(name)
    return list(REMAT_FIXED) + names


def remat_policy(name: str):
    """(use checkpoint?, policy) for a remat value; ValueError for an unknown one."""
    if name == "none":
        return False, None
    if name == "full":
        return True, None
    if name not in remat_names():
        raise ValueError(f"unknown remat {name!r}; valid: {', '.join(remat_names())}")
    import jax

    return True, getattr(jax.checkpoint_policies, name)


def _floating(dtype: str) -> bool:
    import numpy as np

    return dtype in ("bfloat16", "float16") or np.issubdtype(np.dtype(dtype), np.floating)


def with_compute_dtype(spec: ModelSpec, compute: str) -> ModelSpec:
    """The spec with every floating activation leaf in `compute` (what crosses stage edges)."""
    if compute == spec.compute_dtype:
        return spec
    layers = []
    for layer in spec.layers:
        outs = tuple(replace(o, dtype=compute) if _floating(o.dtype) else o for o in layer.outputs)
        tree = layer.out_tree
        if tree is not None:
            import jax

            by_id = {id(o): n for o, n in zip(layer.outputs, outs)}
            tree = jax.tree.map(lambda o: by_id.get(id(o), o), tree)
        layers.append(replace(layer, outputs=outs, out_tree=tree))
    return replace(spec, layers=tuple(layers), compute_dtype=compute)
