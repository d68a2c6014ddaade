"""A stage's compiled programs: forward, backward (B, or I and W), accumulate, update.

A stage runs parts [start, stop) of a `PipelineModel` (`orchestrator.core.model.pipeline`).
Activations between stages are pytrees; the programs take and return them as flat
lists of leaves (jax's flatten order, as in `LayerSpec.outputs`), which is what the
transport moves. Basic flow for one microbatch on one stage:
    ys, res = fwd(params, xs[, labels])          # res: residuals kept until the backward
    dxs, grads = bwd_acc(params, res, dys, grads)   # or, zero-bubble:
    dxs, held = bwd_i(params, res, dys)   ...   grads = bwd_w_acc(params, held, grads)
    loss, dxs, grads = fwd_bwd_acc(params, xs, labels, ids, grads[, scale])   # last stage, F and B back to back
and once per step: params, opt_state, grads = update(params, opt_state, grads, gnorm), where
gnorm is the global gradient norm over every stage when the chain clips by it (the worker
exchanges one squared norm per stage, `sq_norm`, before any stage updates). The worker runs
`update_checked`, the same update that also returns the stage's health on the device (its squared
gradient norm before clipping and its count of non-finite parameters after the update,
`orchestrator.core.health`).
Evaluation runs `fwd_eval(params, xs[, labels])`: the forward alone, train=False (the last
stage's loss).

Invariants:
  - No recompute: the forward returns the VJP residuals. Residuals that are the
    parameters themselves are dropped from the forward's outputs and re-inserted
    from the live params in the backward, so a forward never copies weights
    (a jitted `jax.vjp` returning its pullback would carry the parameters as
    outputs: XLA copies every weight per forward).
  - Gradients cross only for the inexact (floating) leaves of an activation: `dys`
    lists the cotangents of this stage's floating output leaves, `dxs` those of its
    floating input leaves; integer leaves (positions, masks) get none.
  - The last stage's forward returns the microbatch loss; its backward seeds the
    cotangent 1/m, so accumulated gradients are those of the mean loss over the
    m microbatches, in microbatch order. Under loss scaling the last stage's `dys` is
    the scale S (a float32 scalar) and the seed S/m; `unscale(grads, S)` divides the
    accumulated gradients by S and counts their non-finite elements (the worker sums
    the counts over stages and skips the update everywhere when any is non-zero).
  - The first stage takes no gradient with respect to its input (the data).
  - Every part's output is constrained to its logical axes on the stage's mesh.
  - Precision (`spec.compute_dtype`, `orchestrator.core.model.policy`): parameters,
    gradients and optimizer state are float32; each part sees its floating params and
    inputs cast to the compute dtype and its floating outputs leave in it; the loss
    takes float32 outputs. Remat (`remat`): each part under `jax.checkpoint` with the
    named policy, so the residuals kept until the backward are what the policy saves.
  - RNG: `fwd(..., ids=[seed, step, microbatch])` gives part i the key
    fold_in(microbatch_key(seed, step, microbatch), i) with train=True (dropout is
    deterministic in (seed, step, microbatch, part), the same on any layout); without
    `ids` parts get rng=None.
  - Mutable model state (`Part.state_init`: BatchNorm's running statistics): a stateful
    stage's `fwd(params, xs, labels, ids, mstate)` returns (ys, res, new mstate) and
    `fwd_bwd_acc(..., scale, mstate)` the new mstate last; `mstate` is a list per part (None
    for a stateless part), replicated over the mesh, never differentiated or optimised. The
    worker threads it through the chunk's forwards, which every schedule runs in microbatch
    order, so microbatch i sees the state microbatch i − 1 left. The backward reads the state
    the forward saw from the residuals (the recompute fallback keeps it with the inputs).
    `fwd_eval(params, xs, labels, mstate)` uses it in eval mode and returns no new state.
    A step skipped under loss scaling keeps the state its forwards produced (so does `--reference`).
  - Zero-bubble I and W are one backward cut in two (`stages.zb_split`): each equation of
    `bwd` runs once, in I (the input-gradient chain) or in W (weight gradients only); `held`
    is what W reads (per layer: its inputs' residuals and output cotangents), kept from I to W.
  - `mesh=None` gives the unsharded programs (the `--reference` run uses them).
"""
from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from stages import sharding
from stages.residuals import forwarded_params
from stages.zb_split import Held, ZeroBubble, split_backward
from orchestrator.core.model.optim import build as build_optimizer
from orchestrator.core.model.pipeline import PipelineModel, key_path, run_part
from orchestrator.core.model.policy import remat_policy
from orchestrator.core.model.spec import LeafSpec, ModelSpec


def make_optimizer(name: str, args: dict[str, Any]) -> optax.GradientTransformation:
    """One optax optimizer by name (a job's optimizer section goes to StageProgram as is)."""
    return getattr(optax, name)(**args)


def model_key(seed: int) -> jax.Array:
    """The key every part's init gets (so the parts hold the whole model's own init)."""
    return jax.random.key(seed)


def microbatch_key(seed, step, microbatch) -> jax.Array:
    """The RNG key of one microbatch's forward; part i gets fold_in(this, i) (dropout etc.)."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), microbatch)


def _inexact(leaf: LeafSpec) -> bool:
    return jnp.issubdtype(np.dtype(leaf.dtype), jnp.inexact)


class StageProgram:
    """The jitted programs of parts [start, stop) of `model` (described by `spec`) on one mesh."""

    def __init__(self, spec: ModelSpec, model: PipelineModel, start: int, stop: int, *,
                 microbatches: int, optimizer: optax.GradientTransformation,
                 mesh=None, layout: dict | None = None, remat: str = "none", recompute: bool = False):
        """`optimizer`: an optax GradientTransformation, or the job's optimizer section (a chain
        with schedules, masks over "<part>/<leaf path>" names and global-norm clipping,
        `orchestrator.core.model.optim`). `recompute`: keep only the stage inputs and rerun the
        forward in the backward (the fallback `stages.residuals` switches to)."""
        self.spec, self.model = spec, model
        self.start, self.stop = start, stop
        self.parts = model.parts[start:stop]
        self.layers = spec.layers[start:stop]
        self.first, self.last = start == 0, stop == spec.num_layers
        self.mesh, self.layout = mesh, dict(layout or {})
        self._shardings: dict = {}      # axes -> NamedSharding (`_sh`)
        self.m = microbatches
        if isinstance(optimizer, optax.GradientTransformation):
            self.tx, self.clip = optimizer, None
        else:
            built = build_optimizer(optimizer, names=self.param_names)
            self.tx, self.clip = built.tx, built.clip
        self.compute = jnp.dtype(spec.compute_dtype)
        self.remat, self.remat_policy = remat_policy(remat)
        # the activation entering / leaving this stage, as leaves
        self.in_leaves = (spec.input,) if self.first else spec.layers[start - 1].outputs
        self.in_tree = None if self.first else jax.tree.structure(spec.layers[start - 1].out_tree)
        self.out_leaves = self.layers[-1].outputs
        self.in_diff = tuple(i for i, leaf in enumerate(self.in_leaves) if _inexact(leaf))
        self.out_diff = tuple(i for i, leaf in enumerate(self.out_leaves) if _inexact(leaf))
        self._vjp_meta: dict[str, Any] = {"recompute": recompute}   # see stages.residuals
        self.stateful = any(part.state_init is not None for part in self.parts)
        self._build()

    # -- shardings ---------------------------------------------------------
    def _sh(self, axes):
        """The NamedSharding of `axes` on this stage's mesh, built once per axes (the RECV / F
        handlers ask for their operands' shardings on every action)."""
        if self.mesh is None:
            return None
        axes = tuple(axes)
        got = self._shardings.get(axes)
        if got is None:
            got = self._shardings[axes] = sharding.named(self.mesh, self.layout, axes)
        return got

    def param_trees(self):
        """Per part: the parameter pytree of shape structs (from its init, by shape evaluation)."""
        if not hasattr(self, "_ptrees"):
            key = jax.eval_shape(lambda: model_key(0))
            self._ptrees = [jax.eval_shape(part.init, key) for part in self.parts]
        return self._ptrees

    def param_shardings(self):
        out = []
        for tree, layer in zip(self.param_trees(), self.layers):
            treedef = jax.tree.structure(tree)
            out.append(jax.tree.unflatten(treedef, [self._sh(p.axes) for p in layer.params.values()]))
        return out

    def input_shardings(self) -> list:
        """One sharding per input leaf (the model input on the first stage)."""
        return [self._sh(leaf.axes) for leaf in self.in_leaves]

    def output_shardings(self) -> list:
        return [self._sh(leaf.axes) for leaf in self.out_leaves]

    def input_sharding(self):
        return self.input_shardings()[0] if self.first else self.input_shardings()

    def label_sharding(self):
        return self._sh(self.spec.label.axes)

    # -- programs ----------------------------------------------------------
    def _cast(self, tree, dtype):
        """Floating leaves of `tree` in `dtype` (integer leaves as they are)."""
        return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)

    def _part_fn(self, part, layer, train: bool):
        """One part as the stage runs it: compute-dtype params and inputs, outputs in the compute
        dtype and constrained to their logical axes; under jax.checkpoint when remat is on.
        Returns (y, new state); the state (a stateful part's, else None) keeps its own dtypes."""
        def run(p, x, rng, state):
            y, new = run_part(part, self._cast(p, self.compute), self._cast(x, self.compute), state,
                              rng=rng, train=train)
            if state is not None:
                new = jax.tree.map(lambda n, o: n.astype(o.dtype), new, state)
            leaves, treedef = jax.tree.flatten(self._cast(y, self.compute))
            leaves = [sharding.constrain(leaf, spec.axes) for leaf, spec in zip(leaves, layer.outputs)]
            return jax.tree.unflatten(treedef, leaves), new

        return jax.checkpoint(run, policy=self.remat_policy) if self.remat else run

    def _apply(self, params, xs, key=None, train: bool = True, mstate=None):
        """(the stage's output, its parts' new mutable state: a list, None per stateless part)."""
        x = xs[0] if self.first else jax.tree.unflatten(self.in_tree, xs)
        mstate = [None] * len(self.parts) if mstate is None else mstate
        new = []
        with sharding.use(self.mesh, self.layout):
            for j, (part, layer, p) in enumerate(zip(self.parts, self.layers, params)):
                rng = None if key is None else jax.random.fold_in(key, self.start + j)
                x, s = self._part_fn(part, layer, train)(p, x, rng, mstate[j])
                new.append(s)
            return x, new

    def _build(self):
        """Jit the stage's programs (the module docstring's flow); each is a method below."""
        psh = self.param_shardings() if self.mesh is not None else None
        ssh = self.state_sharding()
        xsh = None
        if self.mesh is not None and not self.first:
            ins = self.input_shardings()
            xsh = [ins[i] for i in self.in_diff]
        self._psh, self._xsh, self._splits = psh, xsh, {}
        self.fwd_eval = jax.jit(self._fwd_eval) if self.mesh is None or self.last else jax.jit(
            self._fwd_eval, out_shardings=self.output_shardings())
        self._fwd_out_sh = (None if self.last else self.output_shardings(), None) + ((ssh,) if self.stateful else ())
        self._compiled_fwd = self._jit_fwd()
        self.jitted_fwd = lambda: self._compiled_fwd     # the jitted forward itself (for AOT lowering)
        self.bwd = self._jit(self._bwd, (xsh, psh))
        # backward and gradient accumulation in one program: one dispatch per B/W. Not donated:
        # XLA refused to alias the accumulator when GSPMD chose another layout for it
        # (examples/gpt.yaml, stage {model: 2}: "Expected aliased input ... to have the same size").
        self.bwd_acc = self._jit(self._bwd_acc, (xsh, psh))
        if self.last:
            # the accumulator is donated where its layout is the parameters' by construction (no mesh or
            # one device: `init_state` makes it with the parameter shardings); with a multi-device mesh
            # GSPMD may lay it out otherwise and XLA refuses the alias (see bwd_acc above)
            donate = (4,) if self.mesh is None or self.mesh.size == 1 else ()
            self.fwd_bwd_acc = jax.jit(self._fwd_bwd_acc, donate_argnums=donate) if self.mesh is None else jax.jit(
                self._fwd_bwd_acc, out_shardings=(None, xsh, psh) + ((ssh,) if self.stateful else ()),
                donate_argnums=donate)
        self.sq_norm = jax.jit(_sq_norm)
        self.unscale = jax.jit(_unscale, donate_argnums=0)
        self.zero_grads = jax.jit(lambda g: jax.tree.map(jnp.zeros_like, g), donate_argnums=0)
        self.accumulate = jax.jit(_accumulate, donate_argnums=0)
        self.update = jax.jit(self._update, donate_argnums=(0, 1, 2))
        self.update_checked = jax.jit(self._update_checked, donate_argnums=(0, 1, 2))

    def _jit(self, fn, out_sh):
        return jax.jit(fn) if self.mesh is None else jax.jit(fn, out_shardings=out_sh)

    def _jit_fwd(self):
        return jax.jit(self._fwd, out_shardings=self._fwd_out_sh) if self.mesh is not None else jax.jit(self._fwd)

    @property
    def _aux(self) -> bool:
        """Does the objective return auxiliary outputs (the rest of the outputs, the new state)?"""
        return self.stateful or not self.last

    def _objective(self, xs, labels, ids, mstate=None):
        """The stage as a function of (params, floating inputs) for jax.vjp, and its primals.
        A stateful stage's objective also returns the parts' new mutable state (aux)."""
        xs = list(xs)
        key = None if ids is None else microbatch_key(ids[0], ids[1], ids[2])
        in_diff, out_diff, stateful = self.in_diff, self.out_diff, self.stateful

        def f(p, *dx):
            full = list(xs)
            for i, v in zip(in_diff, dx):
                full[i] = v
            y, new = self._apply(p, full, key, mstate=mstate)
            if self.last:
                with sharding.use(self.mesh, self.layout):
                    loss = self.model.loss(self._cast(y, jnp.float32), labels).astype(jnp.float32)
                return (loss, new) if stateful else loss
            leaves = jax.tree.leaves(y)
            rest = [leaf for i, leaf in enumerate(leaves) if i not in out_diff]
            return [leaves[i] for i in out_diff], ((rest, new) if stateful else rest)

        return f, [xs[i] for i in in_diff]

    def _split_aux(self, a):
        """(the rest of the outputs, the new state) from the objective's aux."""
        if self.last:
            return [], a
        return a if self.stateful else (a, None)

    def _fwd(self, params, xs, labels=None, ids=None, mstate=None):
        """(outputs, residuals), and for a stateful stage (outputs, residuals, new state)."""
        meta, stateful = self._vjp_meta, self.stateful
        f, dx = self._objective(xs, labels, ids, mstate)
        primals = (params,) if self.first else (params, *dx)
        if meta["recompute"]:      # fallback (stages.residuals): keep the inputs, rerun in the backward
            out = f(*primals)
            if self._aux:
                out, (rest, new) = out[0], self._split_aux(out[1])
            outs = out if self.last else _merge(out, rest, self.out_diff, len(self.out_leaves))
            meta["has_ids"] = ids is not None
            res = (list(xs) + ([labels] if self.last else []) + ([ids] if ids is not None else [])
                   + ([mstate] if stateful else []))
            return (outs, res, new) if stateful else (outs, res)
        if self._aux:
            diff, vjp, a = jax.vjp(f, *primals, has_aux=True)
            rest, new = self._split_aux(a)
            outs = diff if self.last else _merge(diff, rest, self.out_diff, len(self.out_leaves))
        else:
            outs, vjp = jax.vjp(f, *primals)
        leaves, treedef = jax.tree.flatten(vjp)
        where = {id(leaf): i for i, leaf in enumerate(jax.tree.leaves(params))}
        slots = tuple(where.get(id(leaf)) for leaf in leaves)
        meta["treedef"], meta["slots"] = treedef, slots
        res = [leaf for leaf, s in zip(leaves, slots) if s is None]
        return (outs, res, new) if stateful else (outs, res)

    def fwd(self, params, *args, **kw):
        """The jitted forward (`_fwd`); the first call verifies that no parameter comes back as a
        residual (`stages.residuals`), else switches to recomputing the forward in the backward."""
        meta = self._vjp_meta
        if "checked" not in meta:
            meta["checked"] = True
            if not meta["recompute"] and forwarded_params(lambda p, *a: self._fwd(p, *a, **kw), params, *args):
                warnings.warn(f"parts [{self.start}, {self.stop}): this JAX ({jax.__version__}) returns "
                              "parameters as VJP residuals, so each forward would copy the weights; "
                              "recomputing the forward in the backward instead", RuntimeWarning, stacklevel=2)
                meta["recompute"] = True
                self._compiled_fwd = self._jit_fwd()
        return self._compiled_fwd(params, *args, **kw)

    def _pullback(self, params, res, dys):
        meta = self._vjp_meta
        if meta["recompute"]:
            n = len(self.in_leaves)
            xs, rest = list(res[:n]), list(res[n:])
            labels = rest.pop(0) if self.last else None
            ids = rest.pop(0) if meta.get("has_ids") else None
            mstate = rest.pop(0) if self.stateful else None
            f, dx = self._objective(xs, labels, ids, mstate)
            primals = (params,) if self.first else (params, *dx)
            vjp = jax.vjp(f, *primals, has_aux=True)[1] if self._aux else jax.vjp(f, *primals)[1]
            grads = vjp(dys)
        else:
            plist, it = jax.tree.leaves(params), iter(res)
            leaves = [plist[s] if s is not None else next(it) for s in meta["slots"]]
            grads = jax.tree.unflatten(meta["treedef"], leaves)(dys)
        dparams = grads[0]
        dxs = None if self.first else list(grads[1:])
        return dxs, dparams

    def _seed(self, dys):
        if not self.last:
            return list(dys)
        if dys is None:
            return jnp.float32(1.0 / self.m)
        return jnp.asarray(dys, jnp.float32) / jnp.float32(self.m)     # loss scaling: S / m

    def _fwd_eval(self, params, xs, labels=None, mstate=None):     # evaluation: no VJP, nothing kept, train=False
        y, _ = self._apply(params, list(xs), None, train=False, mstate=mstate)
        if self.last:
            with sharding.use(self.mesh, self.layout):
                return self.model.loss(self._cast(y, jnp.float32), labels).astype(jnp.float32)
        return jax.tree.leaves(y)

    def _bwd(self, params, res, dys):
        with sharding.use(self.mesh, self.layout):
            return self._pullback(params, res, self._seed(dys))

    def _bwd_acc(self, params, res, dys, acc):
        dxs, dparams = self._bwd(params, res, dys)
        return dxs, jax.tree.map(jnp.add, acc, dparams)

    def zero_bubble(self, params, res, dys) -> ZeroBubble:
        """The I/W programs of this backward (`stages.zb_split`), cut once per argument shapes."""
        leaves, tree = jax.tree.flatten((params, res, dys))
        key = (tree, tuple((np.shape(a), np.dtype(a.dtype).str) for a in leaves))
        if key not in self._splits:
            self._splits[key] = ZeroBubble(split_backward(self._bwd, params, res, dys), self._jit, self._xsh,
                                           self._psh)
        return self._splits[key]

    def bwd_i(self, params, res, dys):
        return self.zero_bubble(params, res, dys).i(params, res, dys)

    def _fwd_bwd_acc(self, params, xs, labels, ids, acc, scale=None, mstate=None):
        """The loss stage's F and B as one program (schedules that run them back to back);
        `scale`: the loss scale under loss scaling (seed scale / m), else None (1 / m).
        A stateful stage also returns the parts' new mutable state."""
        f, dx = self._objective(list(xs), labels, ids, mstate)
        primals = (params,) if self.first else (params, *dx)
        with sharding.use(self.mesh, self.layout):
            if self.stateful:
                loss, vjp, new = jax.vjp(f, *primals, has_aux=True)
            else:
                loss, vjp = jax.vjp(f, *primals)
            grads = vjp(self._seed(scale))
        out = (loss, None if self.first else list(grads[1:]), jax.tree.map(jnp.add, acc, grads[0]))
        return out + (new,) if self.stateful else out

    def _update(self, params, opt_state, grads, gnorm=None):
        if self.clip is not None:     # optax.clip_by_global_norm's own arithmetic, with the global norm
            trigger = gnorm < self.clip
            grads = jax.tree.map(
                lambda t: jax.lax.select(trigger, t, (t / gnorm.astype(t.dtype)) * self.clip), grads)
        updates, opt_state = self.tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, jax.tree.map(jnp.zeros_like, grads)

    def _update_checked(self, params, opt_state, grads, gnorm=None):
        """`_update`, and the stage's training health on the device (`orchestrator.core.health`):
        [its squared gradient norm before clipping, its count of non-finite parameters after]."""
        sq = _sq_norm(grads)
        params, opt_state, zeros = self._update(params, opt_state, grads, gnorm)
        bad = sum(jnp.sum(~jnp.isfinite(p)).astype(jnp.float32) for p in jax.tree.leaves(params)
                  if jnp.issubdtype(p.dtype, jnp.inexact))
        return params, opt_state, zeros, jnp.stack([jnp.asarray(sq, jnp.float32), jnp.float32(bad)])

    def bwd_w(self, params, held: Held):
        """W (zero-bubble): the weight gradients from what `bwd_i` returned as `held`."""
        return held.owner.w(params, held)

    def bwd_w_acc(self, params, held: Held, acc):
        """W accumulated into `acc` in one program."""
        return held.owner.w_acc(params, held, acc)

    def param_names(self, params):
        """The params pytree (a list per part) with each leaf's name "<part name>/<leaf path>"."""
        return [jax.tree_util.tree_map_with_path(lambda path, _, part=part: f"{part.name}/{key_path(path)}", tree)
                for part, tree in zip(self.parts, params)]

    # -- state -------------------------------------------------------------
    def state_sharding(self):
        """Where mutable model state lives: replicated over the stage's mesh (None: no mesh)."""
        return None if self.mesh is None else sharding.named(self.mesh, {}, ())

    def init_mstate(self, seed: int):
        """The parts' mutable (non-parameter) state, a list with None per stateless part, from the
        model's own init (`Part.state_init`, the same model key as the parameters)."""
        out = []
        for part in self.parts:
            if part.state_init is None:
                out.append(None)
                continue
            fn = jax.jit(part.state_init) if self.mesh is None else jax.jit(part.state_init,
                                                                             out_shardings=self.state_sharding())
            out.append(fn(model_key(seed)))
        return out

    def init_params(self, seed: int):
        """Parameters of this stage's parts, created directly with their shardings."""
        params = []
        for part, shard in zip(self.parts, self.param_shardings()):
            fn = jax.jit(part.init, out_shardings=shard) if self.mesh is not None else jax.jit(part.init)
            params.append(fn(model_key(seed)))
        return params

    def init_state(self, params):
        """The optimizer state and zeroed gradient accumulators of `params`, laid out on the stage
        mesh as the parameters are: each per-parameter leaf of the optimizer state (Adam's moments)
        with its parameter's sharding, the rest (step counts, schedule state) replicated. Left to
        itself, `jax.jit(tx.init)` puts the whole state on one device."""
        zero = (lambda p: jax.tree.map(jnp.zeros_like, p))
        if self.mesh is None:
            return jax.jit(self.tx.init)(params), jax.jit(zero)(params)
        psh = self.param_shardings()
        replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        state_sh = optax.tree_map_params(self.tx, lambda _, sh: sh, jax.eval_shape(self.tx.init, params), psh,
                                         transform_non_params=lambda _: replicated)
        return jax.jit(self.tx.init, out_shardings=state_sh)(params), jax.jit(zero, out_shardings=psh)(params)


def _merge(diff: list, rest: list, diff_index: tuple, n: int) -> list:
    out, d, r = [], iter(diff), iter(rest)
    for i in range(n):
        out.append(next(d) if i in diff_index else next(r))
    return out


def _accumulate(acc, g):
    return jax.tree.map(jnp.add, acc, g)


def _sq_norm(grads):
    return sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads))


def _unscale(grads, scale):
    grads = jax.tree.map(lambda g: g / scale.astype(g.dtype), grads)
    bad = sum(jnp.sum(~jnp.isfinite(g)).astype(jnp.float32) for g in jax.tree.leaves(grads))
    return grads, bad
