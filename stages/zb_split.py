"""The zero-bubble split of a stage's backward: I (input gradient) and W (weight gradients).

ZB-H1 runs a stage's backward as two actions: I, on the critical path, produces the
cotangent of the stage input; W, later, produces the weight gradients. A W that calls the
whole pullback again is a second backward (W ≈ B). Here the backward is cut once, as data:
its jaxpr (`fn(params, res, dys) -> (dxs, dparams)`, traced once per argument shapes) is
flattened (calls to `jit`, `closed_call`, `checkpoint` (remat) and `custom_jvp_call` inlined, so a
layer wrapped in jit is cut inside too), then every equation is assigned to

  I — the equations the input cotangent needs (the cotangent chain through every layer:
      dy·Wᵀ and the elementwise steps between), plus any with effects;
  W — the equations only the weight gradients need (x·dy per dot, the bias sums, the
      casts and accumulations of the parameter cotangents).

Each equation of the backward runs exactly once, in I or in W, so the floating-point work
of I + W is that of B. What W reads from I — per layer, the output cotangents and any
other values computed in I that the weight equations consume — I returns ("carried"); what
W reads from the backward's own inputs (residuals such as each dot's layer input; output
gradients `dys`) is kept by the caller, and everything else of the residuals is released at
I. `held = kept inputs + carried` is the stash W's inputs occupy from I to W.

Invariants:
  - The same equations with the same operands as `fn`: gradients equal B's up to XLA's
    fusion choices (the pipeline tests compare them with the single-process oracle).
  - W never reads a value I does not hold for it; the parameters W reads are the live
    ones (they do not change within a step).
  - Control flow stays whole: a layer loop written as `lax.scan` (or a `while`, `cond`,
    `shard_map`) is one equation whose outputs feed both sides, so its backward runs in I
    and W gets only what follows it — correct, but no split inside the loop.
  - Inlining a jit drops its own in/out shardings (the stage's sharding constraints,
    which are equations, stay); that changes layouts GSPMD may choose, never values.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import count
from typing import Any, Callable

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

_INLINED = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
            "checkpoint": "jaxpr", "remat": "jaxpr", "remat2": "jaxpr", "custom_jvp_call": "call_jaxpr"}


@dataclass(frozen=True)
class _Const:
    val: Any


@dataclass(frozen=True)
class _Eqn:
    prim: Any
    params: dict
    ctx: Any
    ins: tuple          # ints (values) or _Const
    outs: tuple         # ints
    effects: bool


@dataclass(frozen=True)
class Split:
    """One backward cut into I and W (see the module docstring).

    Attributes:
      eqns: the flattened equations of the backward.
      i_eqns / w_eqns: indices of the equations I / W run, in program order.
      n_in / n_params: flattened input leaves of (params, res, dys) / of params alone.
      outs: the backward's flattened outputs, dxs leaves first (`n_dx` of them).
      carried: values I computes and returns for W.
      kept: indices of non-parameter inputs (residual or output-gradient leaves) W reads.
      out_tree: the treedef of `(dxs, dparams)`.
    """

    eqns: tuple
    i_eqns: tuple
    w_eqns: tuple
    n_in: int
    n_params: int
    outs: tuple
    n_dx: int
    carried: tuple
    kept: tuple
    params_read: tuple
    out_tree: Any

    def flops_share(self) -> dict[str, int]:
        """Equations per side that are dot products (a cheap structural summary)."""
        dots = {j for j, e in enumerate(self.eqns) if e.prim.name in ("dot_general", "conv_general_dilated")}
        return {"I": len(dots & set(self.i_eqns)), "W": len(dots & set(self.w_eqns))}

    def run_i(self, params, res, dys):
        """I: `(dxs, carried)`; dxs as `fn` returns it (None on the first stage)."""
        flat = jax.tree.leaves((params, res, dys))
        env = dict(enumerate(flat))
        _run(self.eqns, self.i_eqns, env)
        dx = [_read(env, a) for a in self.outs[:self.n_dx]]
        dummy = [None] * (len(self.outs) - self.n_dx)
        dxs = jax.tree.unflatten(self.out_tree, dx + dummy)[0] if self.n_dx else None
        return dxs, [env[k] for k in self.carried]

    def held(self, res, dys, carried) -> list:
        """What W needs, as one flat list: the kept input leaves, then what I carried."""
        flat = jax.tree.leaves((res, dys))
        return [flat[i - self.n_params] for i in self.kept] + list(carried)

    def run_w(self, params, held):
        """W: the parameter cotangents (the tree `fn` returns as dparams)."""
        plist = jax.tree.leaves(params)
        env = {i: plist[i] for i in self.params_read}
        env.update(zip(self.kept + self.carried, held))
        _run(self.eqns, self.w_eqns, env)
        vals = [None] * self.n_dx + [_read(env, a) for a in self.outs[self.n_dx:]]
        return jax.tree.unflatten(self.out_tree, vals)[1]


def split_backward(fn: Callable, params, res, dys) -> Split:
    """Trace `fn(params, res, dys) -> (dxs, dparams)` once and cut it into I and W.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> def bwd(p, res, dy):
        ...     x, y = res                      # forward: y = tanh(x @ w), residuals x and y
        ...     dz = dy * (1 - y * y)
        ...     return dz @ p["w"].T, {"w": x.T @ dz}
        >>> p, x, dy = {"w": jnp.ones((3, 2))}, jnp.ones((4, 3)), jnp.ones((4, 2))
        >>> res = [x, jnp.tanh(x @ p["w"])]
        >>> sp = split_backward(bwd, p, res, dy)
        >>> sp.flops_share()
        {'I': 1, 'W': 1}
        >>> dx, carried = sp.run_i(p, res, dy)         # dz @ w.T; carries dz for W
        >>> len(carried), sp.kept                        # W keeps x (input leaf 1), not y
        (1, (1,))
        >>> g = sp.run_w(p, sp.held(res, dy, carried))   # x.T @ dz only
        >>> bool(jnp.allclose(g["w"], bwd(p, res, dy)[1]["w"]))
        True
    """
    closed, shape = jax.make_jaxpr(fn, return_shape=True)(params, res, dys)
    n_dx = 0 if shape[0] is None else len(jax.tree.leaves(shape[0]))
    out_tree = jax.tree.structure((shape[0], shape[1]))
    n_in = len(jax.tree.leaves((params, res, dys)))
    n_params = len(jax.tree.leaves(params))
    eqns: list[_Eqn] = []
    fresh = count(n_in)
    outs = _flatten(closed.jaxpr, closed.consts, list(range(n_in)), eqns, fresh)

    need_i = {a for a in outs[:n_dx] if isinstance(a, int)}
    in_i = [False] * len(eqns)
    for j in reversed(range(len(eqns))):
        e = eqns[j]
        if e.effects or any(o in need_i for o in e.outs):
            in_i[j] = True
            need_i.update(a for a in e.ins if isinstance(a, int))
    need_w = {a for a in outs[n_dx:] if isinstance(a, int)}
    in_w = [False] * len(eqns)
    for j in reversed(range(len(eqns))):
        e = eqns[j]
        if not in_i[j] and any(o in need_w for o in e.outs):
            in_w[j] = True
            need_w.update(a for a in e.ins if isinstance(a, int))
    made_by_i = {o for j, e in enumerate(eqns) if in_i[j] for o in e.outs}
    inputs = set(range(n_in))
    return Split(eqns=tuple(eqns), i_eqns=tuple(j for j in range(len(eqns)) if in_i[j]),
                 w_eqns=tuple(j for j in range(len(eqns)) if in_w[j]), n_in=n_in, n_params=n_params,
                 outs=tuple(outs), n_dx=n_dx, carried=tuple(sorted(need_w & made_by_i)),
                 kept=tuple(sorted(i for i in need_w & inputs if i >= n_params)),
                 params_read=tuple(sorted(i for i in need_w & inputs if i < n_params)), out_tree=out_tree)


def _flatten(jaxpr: Jaxpr, consts, in_atoms: list, eqns: list, fresh) -> list:
    """Append `jaxpr`'s equations to `eqns` with values renamed to ints (calls inlined); its outputs."""
    env: dict = {}
    for v, c in zip(jaxpr.constvars, consts):
        env[v] = _Const(c)
    for v, a in zip(jaxpr.invars, in_atoms):
        env[v] = a

    def read(v):
        return _Const(v.val) if isinstance(v, Literal) else env[v]

    for e in jaxpr.eqns:
        ins = [read(v) for v in e.invars]
        sub = e.params.get(_INLINED.get(e.primitive.name, ""), None)
        if isinstance(sub, (ClosedJaxpr, Jaxpr)):
            inner, inner_consts = (sub.jaxpr, sub.consts) if isinstance(sub, ClosedJaxpr) else (sub, ())
            for v, a in zip(e.outvars, _flatten(inner, inner_consts, ins, eqns, fresh)):
                env[v] = a
            continue
        outs = tuple(next(fresh) for _ in e.outvars)
        eqns.append(_Eqn(e.primitive, e.primitive.get_bind_params(e.params), e.ctx, tuple(ins), outs,
                         bool(e.effects)))
        env.update(zip(e.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _read(env: dict, atom):
    return atom.val if isinstance(atom, _Const) else env[atom]


def _run(eqns, which, env: dict) -> None:
    for j in which:
        e = eqns[j]
        with e.ctx.manager:
            ans = e.prim.bind(*[_read(env, a) for a in e.ins], **e.params)
        if e.prim.multiple_results:
            env.update(zip(e.outs, ans))
        else:
            env[e.outs[0]] = ans


class ZeroBubble:
    """A split with its compiled programs: `i(params, res, dys) -> (dxs, Held)`,
    `w(params, held) -> dparams`, `w_acc(params, held, acc) -> acc + dparams`.

    Attributes:
      split: the `Split`.
      jit_i / jit_w / jit_w_acc: the jitted programs themselves (for AOT lowering and cost analysis):
        `jit_i(params, res, dys) -> (dxs, carried)`, `jit_w(params, leaves)`, `jit_w_acc(params, leaves, acc)`.
    """

    def __init__(self, split: Split, jit: Callable[[Callable, Any], Callable], dx_sharding, param_sharding):
        """`jit(fn, out_shardings)` compiles one program (the stage program's jit)."""
        self.split = split
        self.jit_i = jit(split.run_i, (dx_sharding, None))
        self.jit_w = jit(split.run_w, param_sharding)
        self.jit_w_acc = jit(lambda p, leaves, acc: jax.tree.map(jax.numpy.add, acc, split.run_w(p, leaves)),
                             param_sharding)

    def i(self, params, res, dys):
        if not self.split.i_eqns and not self.split.n_dx:     # first stage: no input gradient, nothing to run
            return None, Held(self.split.held(res, dys, []), self)
        dxs, carried = self.jit_i(params, res, dys)
        return dxs, Held(self.split.held(res, dys, carried), self)

    def w(self, params, held: "Held"):
        return self.jit_w(params, held.leaves)

    def w_acc(self, params, held: "Held", acc):
        return self.jit_w_acc(params, held.leaves, acc)


@jax.tree_util.register_pytree_node_class
class Held:
    """What one microbatch's W needs, kept from its I (a pytree of its arrays, so the stash
    counts its bytes), with the `ZeroBubble` it belongs to."""

    def __init__(self, leaves: list, owner: ZeroBubble):
        self.leaves, self.owner = leaves, owner

    def tree_flatten(self):
        return self.leaves, self.owner

    @classmethod
    def tree_unflatten(cls, owner, leaves):
        return cls(list(leaves), owner)
