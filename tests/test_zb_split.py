"""The zero-bubble split (`stages.zb_split`): I and W are one backward cut in two.

Checked on real stage programs (GPT and MLP, two stages, with and without remat):
  - numerics: the gradients from I then W equal an independent oracle, plain
    `jax.value_and_grad` of the whole model (float32, rtol 1e-5 / atol 1e-6, as tests/test_residuals.py);
  - work: XLA's own cost analysis of the compiled programs: I + W <= 1.1 x B on every stage, and
    where the stage has an input gradient, W alone is well under B (it is not a second backward);
  - memory: W's held inputs exclude residuals only I reads.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orchestrator.core.model.registry import build_model, build_spec
from stages.zb_split import Held, split_backward
from tests.test_residuals import GPT, MLP, _batch, _stages

RTOL, ATOL = 1e-5, 1e-6


pytestmark = [pytest.mark.jax_min_0_10]


def assert_close(a, b) -> None:
    """rtol 1e-5; atol 1e-6 of the array's own scale (max |b|, at least 1). The stage programs and
    the oracle sum the same terms in different orders (fused vs op by op), so an entry's float32
    error follows the size of what is summed, not of the entry: on an AVX2-only CPU one entry of
    -0.408 in a gradient whose largest entry is 10.7 differed by 5.7e-6 (5e-7 of the scale)."""
    a, b = np.asarray(a), np.asarray(b)
    scale = max(1.0, float(np.max(np.abs(b)))) if b.size else 1.0
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL * scale)
CASES = [(m, r) for m in (GPT, MLP) for r in ("none", "full")]
IDS = [f"{m[0]}-{r}" for m, r in CASES]


def _run(model, remat):
    name, args, seq = model
    spec = build_spec(name, args, seq_len=seq)
    x, y = _batch(spec)
    first, last = _stages(spec, remat=remat)
    p0, p1 = first.init_params(0), last.init_params(0)
    h, res0 = first.fwd(p0, [x])
    loss, res1 = last.fwd(p1, h, y)
    return spec, x, y, (first, last), (p0, p1), (res0, res1), h, loss


def _flops(jitted, *args) -> float:
    cost = jitted.lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost.get("flops", 0.0))


@pytest.mark.parametrize("model,remat", CASES, ids=IDS)
def test_i_then_w_gradients_equal_the_oracle(model, remat):
    spec, x, y, (first, last), (p0, p1), (res0, res1), h, loss = _run(model, remat)
    dh, held1 = last.bwd_i(p1, res1, None)
    dx0, held0 = first.bwd_i(p0, res0, dh)
    assert dx0 is None and isinstance(held0, Held) and isinstance(held1, Held)
    g1, g0 = last.bwd_w(p1, held1), first.bwd_w(p0, held0)
    zeros = jax.tree.map(jnp.zeros_like, p1)
    acc = last.bwd_w_acc(p1, held1, zeros)        # the accumulating W the worker runs
    for a, b in zip(jax.tree.leaves(acc), jax.tree.leaves(g1)):
        assert_close(a, b)

    parts = build_model(spec.factory, spec.args).parts

    def whole(params):       # the model's own parts composed plainly: no stage program
        z = x
        for part, p in zip(parts, params):
            z = part.apply(p, z, rng=None, train=True)
        return build_model(spec.factory, spec.args).loss(z, y)

    want_loss, want = jax.value_and_grad(whole)([*p0, *p1])
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=RTOL, atol=ATOL)
    got = jax.tree.leaves([*g0, *g1])
    assert len(got) == len(jax.tree.leaves(want))
    for a, b in zip(got, jax.tree.leaves(want)):
        assert_close(a, b)


@pytest.mark.parametrize("model,remat", CASES, ids=IDS)
def test_w_is_not_a_second_backward(model, remat):
    """FLOPs from XLA's cost analysis of the compiled programs (nothing is timed)."""
    _, _, _, progs, params, ress, h, _ = _run(model, remat)
    dys = (None, [a for a in h if jnp.issubdtype(a.dtype, jnp.inexact)])
    for prog, p, res, dy in zip(reversed(progs), reversed(params), reversed(ress), dys):
        zb = prog.zero_bubble(p, res, dy)
        _, held = zb.i(p, res, dy)
        b = _flops(prog.bwd, p, res, dy)
        i, w = _flops(zb.jit_i, p, res, dy), _flops(zb.jit_w, p, held.leaves)
        assert b > 0 and i + w <= 1.1 * b, (prog.first, b, i, w)
        if prog.first:          # no input gradient: I has nothing to do, W is the whole backward
            assert i == 0 and zb.split.i_eqns == (), (b, i, w)
        else:                   # both halves do real work; W alone is far from a full backward
            assert 0.25 * b < w < 0.6 * b and 0.4 * b < i < 0.75 * b, (b, i, w)
            share = zb.split.flops_share()
            assert share["I"] > 0 and share["W"] > 0, share


def test_held_keeps_only_what_w_reads():
    """Last stage of the MLP: W reads each dot's input and the cotangents I carried, not every
    residual (the activation derivatives stay with I and are released there)."""
    _, _, _, (_, last), (_, p1), (_, res1), _, _ = _run(MLP, "none")
    zb = last.zero_bubble(p1, res1, None)
    sp = zb.split
    assert 0 < len(sp.kept) < len(res1), (sp.kept, len(res1))
    assert len(sp.carried) > 0
    _, held = zb.i(p1, res1, None)
    assert len(held.leaves) == len(sp.kept) + len(sp.carried)
    kept_bytes = sum(a.nbytes for a in held.leaves[:len(sp.kept)])
    assert kept_bytes < sum(a.nbytes for a in res1)
    # the same shapes give the same cut (traced once per argument shapes)
    assert last.zero_bubble(p1, res1, None) is zb


def test_split_runs_every_equation_once():
    """A hand-written backward: the cut is a partition (no equation in both I and W)."""
    def bwd(p, res, dy):
        x, y = res
        dz = dy * (1 - y * y)
        return dz @ p["w"].T, {"w": x.T @ dz, "b": dz.sum(0)}

    p = {"b": jnp.zeros(2), "w": jnp.ones((3, 2))}
    x = jnp.arange(12.0).reshape(4, 3) / 10
    res = [x, jnp.tanh(x @ p["w"])]
    dy = jnp.ones((4, 2))
    sp = split_backward(bwd, p, res, dy)
    assert not set(sp.i_eqns) & set(sp.w_eqns)
    assert sp.flops_share() == {"I": 1, "W": 1}
    assert sp.kept == (2,)           # x (flat input 2: after params b, w); y is I's alone
    dx, carried = sp.run_i(p, res, dy)
    g = sp.run_w(p, sp.held(res, dy, carried))
    want_dx, want_g = bwd(p, res, dy)
    assert_close(dx, want_dx)
    for k in want_g:
        assert_close(g[k], want_g[k])


def test_module_examples_hold():
    import doctest

    from stages import zb_split

    result = doctest.testmod(zb_split)
    assert result.attempted >= 8 and result.failed == 0


def test_the_stash_counts_what_w_reads_from_i_to_w():
    """The worker's I handler swaps a microbatch's residuals for its Held in the stash: the bytes
    counted are those of W's inputs, and the microbatch still counts as one in flight (the
    simulator's peak_inflight counts it from F until W)."""
    from stages.actions import Stash

    _, _, _, (_, last), (_, p1), (_, res1), _, _ = _run(MLP, "none")
    _, held = last.bwd_i(p1, res1, None)
    stash = Stash()
    stash.add(("r", (0, 0)), res1)
    stash.add(("r", (1, 0)), res1)
    stash.drop(("r", (0, 0)))                 # I of microbatch 0
    stash.add(("w", (0, 0)), held)
    assert stash.now == sum(a.nbytes for a in res1) + sum(a.nbytes for a in held.leaves)
    assert stash.peak_items == 2
    stash.drop(("w", (0, 0)))                 # W of microbatch 0
    assert stash.now == sum(a.nbytes for a in res1)


@pytest.mark.parametrize("remat", ["none", "full"])
def test_the_predicted_stash_is_what_the_worker_counts_on_real_programs(remat):
    """`stash_timeline` with sizes from the programs' shapes (`benchmarks.stage_bytes`) equals the
    worker's `Stash` fed the arrays the real F and I return, action by action, in ZB-H1's order
    (stage 1: each W one backward late, so a held microbatch sits beside the next one's residuals)."""
    from benchmarks.stage_bytes import kept_bytes
    from orchestrator.core.schedule import Kind, generate, lower, stash_timeline
    from stages.actions import Stash

    spec, x, y, progs, params, _, h, _ = _run(GPT, remat)
    low = lower(generate("zb-h1", 2, 3))
    inputs, labels = [[x], h], [None, y]
    kept = [kept_bytes(prog, p, xs, lab) for prog, p, xs, lab in zip(progs, params, inputs, labels)]
    want = stash_timeline(low, [{"F": k["F"], "I": k["I"]} for k in kept])
    # without remat the loss stage releases at I the residuals only I reads; under full remat F keeps
    # only the inputs and I recomputes the forward, so what it hands W outweighs F's residuals
    assert (kept[1]["I"] < kept[1]["F"]) == (remat == "none"), kept
    for s, (prog, p) in enumerate(zip(progs, params)):
        stash, res, held, got = Stash(), {}, {}, []
        dy = None if prog.last else [jnp.ones_like(leaf) for leaf in h]
        for a in (a for a in low.actions[s] if a is not None and a.kind in (Kind.F, Kind.I, Kind.W)):
            key = (a.microbatch, a.chunk)
            if a.kind is Kind.F:
                res[key] = prog.fwd(p, inputs[s], labels[s])[1]
                stash.add(("r", key), res[key])
            elif a.kind is Kind.I:
                _, held[key] = prog.bwd_i(p, res.pop(key), dy)
                stash.drop(("r", key))
                stash.add(("w", key), held[key])
            else:
                held.pop(key)
                stash.drop(("w", key))
            got.append((str(a), stash.now))
        assert got == [(str(a), n) for a, n in want.timeline[s]], s
        assert stash.peak == want.peak[s] and stash.peak_items == want.peak_items[s]


@pytest.mark.parametrize("model", [GPT, MLP], ids=["gpt", "mlp"])
def test_fused_forward_backward_equals_the_oracle_and_donates(model):
    """The loss stage's F+B in one program (1F1B's last stage): the same loss and gradients as the
    oracle, accumulated into the donated accumulator."""
    spec, x, y, (first, last), (p0, p1), (res0, res1), h, loss = _run(model, "none")
    acc = last.init_state(p1)[1]
    ids = None
    loss2, dh, acc2 = last.fwd_bwd_acc(p1, h, y, ids, acc)
    assert all(a.is_deleted() for a in jax.tree.leaves(acc))          # donated: XLA reused it
    _, g0 = first.bwd(p0, res0, dh)
    parts = build_model(spec.factory, spec.args)

    def whole(params):
        z = x
        for part, p in zip(parts.parts, params):
            z = part.apply(p, z, rng=None, train=True)
        return parts.loss(z, y)

    want_loss, want = jax.value_and_grad(whole)([*p0, *p1])
    np.testing.assert_allclose(float(loss2), float(want_loss), rtol=RTOL, atol=ATOL)
    for a, b in zip(jax.tree.leaves([*g0, *acc2]), jax.tree.leaves(want)):
        assert_close(a, b)


def test_only_back_to_back_loss_chunks_fuse():
    from orchestrator.core.schedule import generate, lower
    from stages.actions import forward_backward, fused_backward, fused_chunks, program_of

    def row(name, s, v=1):
        low = lower(generate(name, 2, 4, **({"v": v} if v > 1 else {})))
        return [a for a in low.actions[s] if a is not None]

    assert fused_chunks(row("1f1b", 1), 0) == {0} and fused_chunks(row("eager-1f1b", 1), 0) == {0}
    assert fused_chunks(row("gpipe", 1), 0) == set() and fused_chunks(row("zb-h1", 1), 0) == set()
    assert fused_chunks(row("1f1b", 0), None) == set()
    assert fused_chunks(row("interleaved-1f1b", 1, v=2), 1) == {1}     # the loss chunk only
    prog = program_of(row("1f1b", 1), "stage1", 0, fuse=True)
    kinds = {a.kind.value: h for a, _, h in prog if a.kind.value in ("F", "B")}
    assert kinds == {"F": forward_backward, "B": fused_backward}
    unfused = program_of(row("1f1b", 1), "stage1", 0)      # pipeline.fuse_loss_chunk's default: off
    assert not {h for _, _, h in unfused} & {forward_backward, fused_backward}
