"""A stage's compiled programs: forward, backward (B, or I and W), accumulate, update.

Basic flow for one microbatch on one stage:
    y, res = fwd(params, x[, labels])       # res: residuals kept until the backward
    dx, grads = bwd_acc(params, res, dy, grads)   # or bwd_i -> dx, later bwd_w_acc -> grads
                                                  # (= bwd, then accumulate: the reference's way)
and once per step: params, opt_state, grads = update(params, opt_state, grads).
Evaluation runs `fwd_eval(params, x[, labels])`: the forward alone (the last stage's loss).

Invariants:
  - No recompute: the forward returns the VJP residuals. Residuals that are the
    parameters themselves are dropped from the forward's outputs and re-inserted
    from the live params in the backward, so a forward never copies weights
    (a jitted `jax.vjp` returning its pullback would carry the parameters as
    outputs: XLA copies every weight per forward).
  - The last stage's forward returns the microbatch loss; its backward seeds the
    cotangent 1/m, so accumulated gradients are those of the mean loss over the
    m microbatches, in microbatch order — exactly what the reference does.
  - The first stage takes no gradient with respect to its input (tokens).
  - `mesh=None` gives the unsharded programs the single-process reference uses.
"""
from __future__ import annotations

import warnings
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import optax

from stages import sharding
from stages.residuals import forwarded_params
from stages.models.base import ModelImpl, init_layer, layer_key
from orchestrator.core.model.spec import LayerSpec, ModelSpec


def make_optimizer(name: str, args: dict[str, Any]) -> optax.GradientTransformation:
    return getattr(optax, name)(**args)


class StageProgram:
    """The jitted programs of layers [start, stop) of `spec` on one mesh."""

    def __init__(self, spec: ModelSpec, impl: ModelImpl, start: int, stop: int, *,
                 microbatches: int, optimizer: optax.GradientTransformation,
                 mesh=None, layout: dict | None = None, recompute: bool = False):
        self.spec, self.impl = spec, impl
        self.start, self.stop = start, stop
        self.layers: Sequence[LayerSpec] = spec.layers[start:stop]
        self.first, self.last = start == 0, stop == spec.num_layers
        self.mesh, self.layout = mesh, dict(layout or {})
        self.m = microbatches
        self.tx = optimizer
        self._vjp_meta: dict[str, Any] = {"recompute": recompute}   # see stages.residuals
        self._build()

    # -- shardings ---------------------------------------------------------
    def _sh(self, axes):
        return None if self.mesh is None else sharding.named(self.mesh, self.layout, axes)

    def param_shardings(self):
        return [{n: self._sh(p.axes) for n, p in layer.params.items()} for layer in self.layers]

    def input_sharding(self):
        axes = self.spec.input_axes if self.first else self.spec.layers[self.start - 1].out_axes
        return self._sh(axes)

    def output_sharding(self):
        return None if self.last else self._sh(self.layers[-1].out_axes)

    def label_sharding(self):
        return self._sh(("batch",) + (None,) * len(self.spec.label_shape))

    # -- programs ----------------------------------------------------------
    def _apply(self, params, x):
        with sharding.use(self.mesh, self.layout):
            for layer, p in zip(self.layers, params):
                x = self.impl.apply(layer, p, x)
            return x

    def _build(self):
        meta = self._vjp_meta

        def fwd(params, x, labels=None):
            if self.last:
                def f(p, *xs):
                    with sharding.use(self.mesh, self.layout):
                        return self.impl.loss(self._apply(p, xs[0] if xs else x), labels)
            else:
                def f(p, *xs):
                    return self._apply(p, xs[0] if xs else x)
            primals = (params,) if self.first else (params, x)
            if meta["recompute"]:      # the backward recomputes the forward: keep its inputs only
                return f(*primals), [x] + ([labels] if self.last else [])
            y, vjp = jax.vjp(f, *primals)
            leaves, treedef = jax.tree.flatten(vjp)
            where = {id(leaf): i for i, leaf in enumerate(jax.tree.leaves(params))}
            slots = tuple(where.get(id(leaf)) for leaf in leaves)
            meta["treedef"], meta["slots"] = treedef, slots
            return y, [leaf for leaf, s in zip(leaves, slots) if s is None]

        def pullback(params, res, dy):
            if meta["recompute"]:
                x, labels = res[0], (res[1] if self.last else None)
                f = (lambda p, *xs: self.impl.loss(self._apply(p, xs[0] if xs else x), labels)) if self.last \
                    else (lambda p, *xs: self._apply(p, xs[0] if xs else x))
                with sharding.use(self.mesh, self.layout):
                    _, vjp = jax.vjp(f, *((params,) if self.first else (params, x)))
                    grads = vjp(dy)
                return (None if self.first else grads[1]), grads[0]
            plist, it = jax.tree.leaves(params), iter(res)
            leaves = [plist[s] if s is not None else next(it) for s in meta["slots"]]
            grads = jax.tree.unflatten(meta["treedef"], leaves)(dy)
            dparams = grads[0]
            dx = None if self.first else grads[1]
            return dx, dparams

        def seed(dy):
            return jnp.float32(1.0 / self.m) if self.last else dy

        def fwd_eval(params, x, labels=None):     # evaluation: no VJP, nothing kept
            y = self._apply(params, x)
            if self.last:
                with sharding.use(self.mesh, self.layout):
                    return self.impl.loss(y, labels)
            return y

        self.fwd_eval = jax.jit(fwd_eval) if self.mesh is None or self.last else jax.jit(
            fwd_eval, out_shardings=self.output_sharding())

        psh = self.param_shardings() if self.mesh is not None else None
        out_sh = None if self.mesh is None else (self.output_sharding(), None)
        jit_fwd = jax.jit(fwd, out_shardings=out_sh) if self.mesh is not None else jax.jit(fwd)

        def checked_fwd(params, *args):
            """The first call verifies that no parameter comes back as a residual (stages.residuals)."""
            if "checked" not in meta:
                meta["checked"] = True
                if not meta["recompute"] and forwarded_params(fwd, params, *args):
                    warnings.warn(f"layers [{self.start}, {self.stop}): this JAX ({jax.__version__}) returns "
                                  "parameters as VJP residuals, so each forward would copy the weights; "
                                  "recomputing the forward in the backward instead", RuntimeWarning, stacklevel=2)
                    meta["recompute"] = True
                    meta["jit"] = jax.jit(fwd, out_shardings=out_sh) if self.mesh is not None else jax.jit(fwd)
            return meta.get("jit", jit_fwd)(params, *args)

        self.fwd = checked_fwd
        xsh = None if (self.mesh is None or self.first) else self.input_sharding()

        def bwd(params, res, dy):
            with sharding.use(self.mesh, self.layout):
                return pullback(params, res, seed(dy))

        def bwd_i(params, res, dy):
            with sharding.use(self.mesh, self.layout):
                return pullback(params, res, seed(dy))[0]

        def bwd_w(params, res, dy):
            with sharding.use(self.mesh, self.layout):
                return pullback(params, res, seed(dy))[1]

        def bwd_acc(params, res, dy, acc):
            dx, dparams = bwd(params, res, dy)
            return dx, jax.tree.map(jnp.add, acc, dparams)

        def bwd_w_acc(params, res, dy, acc):
            return jax.tree.map(jnp.add, acc, bwd_w(params, res, dy))

        if self.mesh is None:
            self.bwd, self.bwd_i, self.bwd_w = jax.jit(bwd), jax.jit(bwd_i), jax.jit(bwd_w)
            self.bwd_acc = jax.jit(bwd_acc)
            self.bwd_w_acc = jax.jit(bwd_w_acc)
        else:
            self.bwd = jax.jit(bwd, out_shardings=(xsh, psh))
            self.bwd_i = jax.jit(bwd_i, out_shardings=xsh)
            self.bwd_w = jax.jit(bwd_w, out_shardings=psh)
            # backward and gradient accumulation in one program: one dispatch per B/W. Not donated:
            # XLA refused to alias the accumulator when GSPMD chose another layout for it
            # (examples/gpt.yaml, stage {model: 2}: "Expected aliased input ... to have the same size").
            self.bwd_acc = jax.jit(bwd_acc, out_shardings=(xsh, psh))
            self.bwd_w_acc = jax.jit(bwd_w_acc, out_shardings=psh)

        def accumulate(acc, g):
            return jax.tree.map(jnp.add, acc, g)

        def update(params, opt_state, grads):
            updates, opt_state = self.tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            return params, opt_state, jax.tree.map(jnp.zeros_like, grads)

        self.accumulate = jax.jit(accumulate, donate_argnums=0)
        self.update = jax.jit(update, donate_argnums=(0, 1, 2))

    # -- state -------------------------------------------------------------
    def init_params(self, seed: int):
        """Parameters of this stage's layers, created directly with their shardings."""
        params = []
        for i, (layer, shard) in enumerate(zip(self.layers, self.param_shardings()), start=self.start):
            make = lambda key, layer=layer: init_layer(layer, key)  # noqa: E731
            fn = jax.jit(make, out_shardings=shard) if self.mesh is not None else jax.jit(make)
            params.append(fn(layer_key(seed, i)))
        return params

    def init_state(self, params):
        opt_state = jax.jit(self.tx.init)(params)
        zeros = jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p))(params)
        return opt_state, zeros
