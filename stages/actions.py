"""The stage worker's step interpreter: one small handler per action kind.

Basic flow: `StageWorker` resolves its lowered action list once, at construction,
into `(action, text, handler)` triples (`HANDLERS[action.kind]`); a step then runs
`state = handler(ctx, state, step_state, action)` for each in order:
  ctx         `StageContext`: the stage's contract, programs and I/O (`stages.stage_io`) —
              what a handler reads; it never reaches into the actor;
  state       the stage's training state (`stages.state.StageState`): in, and the new one out;
  step_state  `StepState`: the tensors that pass between one step's actions, keyed
              (microbatch, chunk), its losses and spans.
Adding an action kind (a forward-only eval, a checkpoint copy) is one handler here and
one entry in `HANDLERS`; a new piece of per-stage state is a `StageState` field and the
handler that updates it.

Invariants:
  - A handler blocks until the device work it issued is done, so the span the
    worker records around it is the action's real duration.
  - SEND_* never blocks on the peer; RECV_* waits at most `step_state.timeout`.
  - Nothing here decides what runs when: the order is the lowered schedule's.
  - jax is imported inside the handlers, never at module level: the worker
    process pins its CPUs before jax loads.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from orchestrator.core.schedule import Kind
from stages.state import LossScaleState, StageState, with_chunk


class StepState:
    """What one step keeps between its actions: host batch, tensors by (microbatch, chunk), spans.

    Attributes:
      step: the step number.
      done: actions of the list executed so far.
      timeout: seconds a receive (and the end-of-step flush) may wait.
      tag: the forward key's kind: "F" for training; the eval uses "E<batch>", so its tensors
        never meet a training step's in a mailbox.
      batch: this host's rows of the step's batch (`stages.data.HostBatch`; first/last stage).
      data_wait_s: how long the step waited for `batch` (the loader on the critical path).
      inputs: forward inputs waiting for their F (received, or from the chunk before here).
      residuals: what F kept for its backward.
      outputs: F outputs waiting for their SEND_F.
      dys: output gradients waiting for their B/I.
      held: zero-bubble: what W reads, kept from its I (`stages.zb_split.Held`).
      fused: input gradients a fused F computed, waiting for their B (`forward_backward`).
      dxs: input gradients waiting for their SEND_B.
      losses: the last stage's loss per microbatch.
      loss_scale, skipped: under loss scaling, the scale this step used and whether its update
        was skipped (a non-finite gradient on some stage); None otherwise.
      health: (this stage's squared gradient norm, its non-finite parameters after the update, None
        when the update was skipped) once OPT ran (`orchestrator.core.health`); None before.
      spans: (action text, start, end) of each executed action.
      stash: bytes per device of what is kept between actions.
    """

    def __init__(self, step: int, timeout: float, tag: str = "F", on_peak=None, sizes: dict | None = None):
        self.step, self.done, self.timeout, self.tag = step, 0, timeout, tag
        self.batch = None
        self.data_wait_s = 0.0
        self.inputs, self.residuals, self.outputs, self.dys, self.dxs = {}, {}, {}, {}, {}
        self.held: dict = {}
        self.fused: dict = {}
        self.losses: dict[int, Any] = {}
        self.loss_scale, self.skipped = None, None
        self.health = None
        self.spans: list = []
        self.stash = Stash(on_peak, sizes)


class Stash:
    """Bytes per device of what a step keeps between actions (forward residuals "r", and for
    zero-bubble schedules what W reads, "w", kept from I to W), and their peak; `peak_items`
    is the most microbatches held at once (an entry each).

    Measured from the arrays themselves: each leaf counts its per-device shard size. `sizes`
    (the worker's, kept across steps) memoises a tree's bytes under the `memo` key `add` is
    given — (kind, chunk): one program's outputs have the same shapes on every microbatch —
    so a steady step sums no leaves.
    """

    def __init__(self, on_peak=None, sizes: dict | None = None):
        self.held: dict = {}
        self.now = self.peak = self.peak_items = self.items = 0
        self.on_peak = on_peak       # called with the bytes when they pass the step's peak (`LivePeak`)
        self.sizes = {} if sizes is None else sizes

    def add(self, key, tree, memo=None) -> None:
        n = None if memo is None else self.sizes.get(memo)
        if n is None:
            import jax

            n = sum(_shard_bytes(leaf) for leaf in jax.tree_util.tree_leaves(tree))
            if memo is not None:
                self.sizes[memo] = n
        before = self.held.get(key)
        if before is None and key[0] in _ITEMS:
            self.items += 1
            if self.items > self.peak_items:
                self.peak_items = self.items
        self.now += n - (before or 0)
        self.held[key] = n
        if self.now > self.peak:
            self.peak = self.now
            if self.on_peak is not None:
                self.on_peak(self.now)

    def drop(self, key) -> None:
        n = self.held.pop(key, None)
        if n is not None:
            self.now -= n
            if key[0] in _ITEMS:
                self.items -= 1


_ITEMS = ("r", "w")      # the entries a microbatch in flight holds (`Stash.peak_items`)


_SHARD_BYTES: dict = {}


def _shard_bytes(leaf) -> int:
    """Bytes one device holds of `leaf` (its shard shape × itemsize), memoised per shape/sharding.
    A numpy leaf (a received tensor of a one-device stage) counts whole."""
    if isinstance(leaf, np.ndarray):
        return leaf.nbytes
    memo = (leaf.shape, leaf.dtype, leaf.sharding)
    n = _SHARD_BYTES.get(memo)
    if n is None:
        shard = leaf.sharding.shard_shape(leaf.shape)
        n = _SHARD_BYTES[memo] = int(np.prod(shard, dtype=np.int64)) * leaf.dtype.itemsize
    return n


def _ready(tree):
    """Wait until the program that produced `tree` has finished; returns `tree`. Every output of
    one XLA execution is defined by the same completion (per device, and each output of an SPMD
    program lives on all its devices), so one leaf's wait is the whole tree's: blocking on each of
    a gradient tree's leaves in turn cost ~10-30 µs more per action at `tiny`."""
    import jax

    for leaf in jax.tree_util.tree_leaves(tree):
        if hasattr(leaf, "block_until_ready"):     # the first device array (a host array needs no wait)
            leaf.block_until_ready()
            break
    return tree


# -- handlers: (context, state, step, action) -> state ---------------------------

class StageContext:
    """What a handler reads besides the state: the stage's contract, programs and I/O; never the actor.

    Attributes:
      cfg: the stage host's `orchestrator.core.contract.WorkerConfig`.
      progs: one `stages.program.StageProgram` per chunk.
      io: the stage's `stages.stage_io.StageIO` (transport, edges, rows, scalar exchanges).
      scaler: `precision.loss_scale`'s rule (`orchestrator.core.model.policy.DynamicLossScale`), or None.
    """

    __slots__ = ("cfg", "progs", "io", "scaler")

    def __init__(self, cfg, progs, io, scaler=None):
        self.cfg, self.progs, self.io, self.scaler = cfg, progs, io, scaler


def _operands(ctx: StageContext, st: StepState, a, prog):
    """F's input and labels: this host's rows of the batch on the first / last stage."""
    cfg, io = ctx.cfg, ctx.io
    mbs = cfg.microbatch_size
    if prog.first:
        x = [io.host_operand(st.batch.xs[a.microbatch], io.rows_in, (mbs, *cfg.spec.input_shape),
                             prog.input_sharding())]
    else:
        x = st.inputs.pop((a.microbatch, a.chunk))     # the activation's leaves
    labels = None
    if prog.last:
        labels = io.host_operand(st.batch.ys[a.microbatch], io.rows_lab, (mbs, *cfg.spec.label_shape),
                                 prog.label_sharding())
    return x, labels


def _forward_output(ctx: StageContext, st: StepState, a, prog, y) -> None:
    c = a.chunk
    if prog.last:
        st.losses[a.microbatch] = y
    elif ctx.io.edge_out[c][0][0].stage == ctx.cfg.stage:      # next chunk lives here (p = 1)
        st.inputs[(a.microbatch, c + 1)] = y
    else:
        st.outputs[(a.microbatch, c)] = y


def forward(ctx: StageContext, state: StageState, st: StepState, a) -> StageState:
    """F: forward of (microbatch, chunk); the output goes to the loss, the next chunk here, or SEND_F."""
    c, key, prog = a.chunk, (a.microbatch, a.chunk), ctx.progs[a.chunk]
    chunk = state.chunks[c]
    x, labels = _operands(ctx, st, a, prog)
    ids = np.array([ctx.cfg.seed, st.step, a.microbatch], np.int32)     # the parts' RNG keys derive from these
    if prog.stateful:      # mutable model state (BatchNorm): threaded through this chunk's forwards in order
        y, st.residuals[key], mstate = prog.fwd(chunk.params, x, labels, ids, chunk.mstate)
        state = with_chunk(state, c, mstate=mstate)
    else:
        y, st.residuals[key] = prog.fwd(chunk.params, x, labels, ids)
    _ready(y)
    st.stash.add(("r", key), st.residuals[key], ("r", c))
    _forward_output(ctx, st, a, prog, y)
    return state


def eval_forward(ctx: StageContext, state: StageState, st: StepState, a) -> StageState:
    """F of the forward-only eval schedule: the forward alone (no VJP, nothing kept)."""
    prog, chunk = ctx.progs[a.chunk], state.chunks[a.chunk]
    x, labels = _operands(ctx, st, a, prog)
    y = _ready(prog.fwd_eval(chunk.params, x, labels, chunk.mstate))
    _forward_output(ctx, st, a, prog, y)
    return state


def _input_grad(ctx: StageContext, st: StepState, a, dx) -> None:
    """Where B/I's input gradient goes: the chunk before it here, or SEND_B."""
    if dx is None:
        return
    _ready(dx)
    c = a.chunk
    if ctx.io.edge_in[c][0][0].stage == ctx.cfg.stage:       # previous chunk lives here (p = 1)
        st.dys[(a.microbatch, c - 1)] = dx
    else:
        st.dxs[(a.microbatch, c)] = dx


def _output_grad(ctx: StageContext, state: StageState, st: StepState, c: int, key, pop: bool):
    """The output gradient B/I start from: received (or from the next chunk here); on the
    model's last part under loss scaling, the scale (the program seeds scale / m)."""
    dy = st.dys.pop(key, None) if pop else st.dys.get(key)
    if dy is None and ctx.progs[c].last and state.loss_scale is not None:
        return np.float32(state.loss_scale.scale)
    return dy


def backward(ctx: StageContext, state: StageState, st: StepState, a) -> StageState:
    """B: full backward; accumulates the weight gradient, releases the residuals."""
    c, key = a.chunk, (a.microbatch, a.chunk)
    chunk = state.chunks[c]
    dy = _output_grad(ctx, state, st, c, key, pop=True)
    dx, grads = ctx.progs[c].bwd_acc(chunk.params, st.residuals.pop(key), dy, chunk.grads)
    _ready(grads)
    st.stash.drop(("r", key))
    _input_grad(ctx, st, a, dx)
    return with_chunk(state, c, grads=grads)


def backward_input(ctx: StageContext, state: StageState, st: StepState, a) -> StageState:
    """I (zero-bubble): the input gradient; keeps only what W reads (`stages.zb_split`: per layer
    the residuals and output cotangents its weight gradients need) and releases the rest."""
    c, key = a.chunk, (a.microbatch, a.chunk)
    dx, st.held[key] = ctx.progs[c].bwd_i(state.chunks[c].params, st.residuals.pop(key),
                                          _output_grad(ctx, state, st, c, key, pop=True))
    _ready(st.held[key])
    st.stash.drop(("r", key))
    st.stash.add(("w", key), st.held[key], ("w", c))      # kept until W
    _input_grad(ctx, st, a, dx)
    return state


def backward_weight(ctx: StageContext, state: StageState, st: StepState, a) -> StageState:
    """W (zero-bubble): the weight gradients only, from what I kept; releases it."""
    c, key = a.chunk, (a.microbatch, a.chunk)
    chunk = state.chunks[c]
    grads = _ready(ctx.progs[c].bwd_w_acc(chunk.params, st.held.pop(key), chunk.grads))
    st.stash.drop(("w", key))
    return with_chunk(state, c, grads=grads)


def forward_backward(ctx: StageContext, state: StageState, st: StepState, a) -> StageState:
    """F of the loss chunk when its B comes right after it (`fused_chunks`): forward and backward as
    one program (`StageProgram.fwd_bwd_acc`), nothing kept but the input gradient for that B."""
    c, key, prog = a.chunk, (a.microbatch, a.chunk), ctx.progs[a.chunk]
    chunk = state.chunks[c]
    x, labels = _operands(ctx, st, a, prog)
    ids = np.array([ctx.cfg.seed, st.step, a.microbatch], np.int32)
    scale = None if state.loss_scale is None else np.float32(state.loss_scale.scale)   # loss scaling: seed scale / m
    if prog.stateful:
        loss, dx, grads, mstate = prog.fwd_bwd_acc(chunk.params, x, labels, ids, chunk.grads, scale, chunk.mstate)
        state = with_chunk(state, c, grads=grads, mstate=mstate)
    else:
        loss, dx, grads = prog.fwd_bwd_acc(chunk.params, x, labels, ids, chunk.grads, scale)
        state = with_chunk(state, c, grads=grads)
    _ready(grads)
    st.losses[a.microbatch] = loss
    st.fused[key] = dx
    return state


def fused_backward(ctx: StageContext, state: StageState, st: StepState, a) -> StageState:
    """B whose work its F already did (`forward_backward`): hands the input gradient on."""
    _input_grad(ctx, st, a, st.fused.pop((a.microbatch, a.chunk)))
    return state


def fused_chunks(actions, loss_chunk: int | None) -> frozenset:
    """The chunks whose F and B `program_of` runs as one program: the loss chunk (`loss_chunk`, None
    when this stage has none), when every one of its F is directly followed in `actions` by the
    B of the same microbatch (1F1B and eager-1F1B's last stage; not GPipe's, not zero-bubble's).

    Example:
        >>> from orchestrator.core.schedule import Action
        >>> row = [Action.parse(t) for t in ("1RECV_F0", "1F0", "1B0", "1SEND_B0", "1F1", "1B1", "1OPT")]
        >>> sorted(fused_chunks(row, 0)), sorted(fused_chunks(row[:5] + row[6:], 0)), sorted(fused_chunks(row, None))
        ([0], [], [])
    """
    if loss_chunk is None:
        return frozenset()
    fs = [i for i, a in enumerate(actions) if a.kind is Kind.F and a.chunk == loss_chunk]
    ok = bool(fs) and all(i + 1 < len(actions) and actions[i + 1].kind is Kind.B
                          and actions[i + 1].chunk == loss_chunk
                          and actions[i + 1].microbatch == actions[i].microbatch for i in fs)
    return frozenset({loss_chunk}) if ok else frozenset()


def recv_forward(ctx: StageContext, state: StageState, st: StepState, a) -> StageState:
    """RECV_F: this chunk's forward input from the previous virtual stage (bounded wait), leaf by
    leaf (key ... + (leaf index,)), each with its own shape, dtype and sharding."""
    c, key, io = a.chunk, (a.microbatch, a.chunk), ctx.io
    shardings = ctx.progs[c].input_shardings()
    st.inputs[key] = [io.transport.recv_operand((st.step, st.tag) + key + (j,), shape, dtype, shardings[j], edge,
                                                st.timeout)
                      for j, (edge, shape, dtype) in enumerate(io.edge_in[c])]
    return state


def recv_backward(ctx: StageContext, state: StageState, st: StepState, a) -> StageState:
    """RECV_B: this chunk's output gradient from the next virtual stage (bounded wait): one per
    floating output leaf."""
    c, key, io = a.chunk, (a.microbatch, a.chunk), ctx.io
    prog, shardings, edges = ctx.progs[c], ctx.progs[c].output_shardings(), io.edge_out[c]
    st.dys[key] = [io.transport.recv_operand((st.step, "B") + key + (j,), edges[j][1], edges[j][2], shardings[j],
                                             edges[j][0], st.timeout)
                   for j in prog.out_diff]
    return state


def send_forward(ctx: StageContext, state: StageState, st: StepState, a) -> StageState:
    """SEND_F: F's output leaves to the next virtual stage (never blocks)."""
    c, edges = a.chunk, ctx.io.edge_out[a.chunk]
    peer_chunk = c + (1 if edges[0][0].stage < ctx.cfg.stage else 0)
    for j, leaf in enumerate(st.outputs.pop((a.microbatch, c))):
        ctx.io.transport.send((st.step, st.tag, a.microbatch, peer_chunk, j), leaf, edges[j][0])
    return state


def send_backward(ctx: StageContext, state: StageState, st: StepState, a) -> StageState:
    """SEND_B: B/I's input gradients (floating input leaves) to the previous virtual stage."""
    c, edges = a.chunk, ctx.io.edge_in[a.chunk]
    peer_chunk = c - (1 if edges[0][0].stage > ctx.cfg.stage else 0)
    for j, leaf in zip(ctx.progs[c].in_diff, st.dxs.pop((a.microbatch, c))):
        ctx.io.transport.send((st.step, "B", a.microbatch, peer_chunk, j), leaf, edges[j][0])
    return state


def optimizer_step(ctx: StageContext, state: StageState, st: StepState, a) -> StageState:
    """OPT: every chunk's optimizer update from its accumulated gradients; the step counter moves on.
    When the chain clips by the global norm, the stages first exchange their squared norms
    (`StageIO.sum_over_stages`), so every stage clips with the whole model's norm before any stage
    updates. Under loss scaling the gradients are unscaled first and the stages sum their
    non-finite counts (tag "FINITE"): when any is non-zero every stage skips its update and all
    move the scale the same way (`orchestrator.core.model.policy.DynamicLossScale`).

    Training health (`orchestrator.core.health`): each update also returns the stage's squared
    gradient norm and its count of non-finite parameters (`st.health`, read once the update is
    done). Under `failure.on_nonfinite: skip` the squared norms are exchanged even without
    clipping, made NaN by a non-finite loss on the last stage, and a non-finite sum drops the
    step's update on every stage (`_skipped`) — one global decision before any stage updates."""
    import jax

    progs, io = ctx.progs, ctx.io
    grads = [c.grads for c in state.chunks]
    if state.loss_scale is not None:
        scale = state.loss_scale.scale
        bad = 0.0
        for i, p in enumerate(progs):
            grads[i], n = p.unscale(grads[i], np.float32(scale))
            bad += float(n)
        finite = io.sum_over_stages(st.step, bad, st.timeout, tag="FINITE") == 0
        st.loss_scale, st.skipped = scale, not finite
        state = state._replace(loss_scale=LossScaleState(*ctx.scaler.next(state.loss_scale, finite)))
        if not finite:
            return _skipped(progs, state, grads)
    ties = ctx.cfg.spec.ties
    if ties:      # tied weights: each copy's gradient := the sum of both (stages.ties)
        from stages.ties import sum_tied

        sum_tied(grads, progs, ties, exchange=lambda t, mine: io.exchange_tie(st.step, t, mine, st.timeout))
    gnorm = np.float32(0.0)
    skip = ctx.cfg.on_nonfinite == "skip"
    if progs[0].clip is not None or skip:
        from stages.ties import for_norm

        normed = for_norm(grads, progs, ties) if ties else grads     # a tied array counts once
        mine = sum(float(p.sq_norm(g)) for p, g in zip(progs, normed))
        nan_loss = skip and not all(np.isfinite(float(x)) for x in st.losses.values())
        total = io.sum_over_stages(st.step, float("nan") if nan_loss else mine, st.timeout)
        if skip and not np.isfinite(total):      # every stage sees the same sum: all skip
            st.health = (mine, None)
            return _skipped(progs, state, grads)
        gnorm = np.float32(np.sqrt(total))
    chunks, health = [], []
    for p, c, g in zip(progs, state.chunks, grads):
        params, opt_state, zeros, h = p.update_checked(c.params, c.opt_state, g, gnorm)
        chunks.append(c._replace(params=params, opt_state=opt_state, grads=zeros))
        health.append(h)
    jax.block_until_ready([c.params for c in chunks])
    got = np.sum([np.asarray(h) for h in health], axis=0)     # done above: no further synchronisation
    st.health = (float(got[0]), float(got[1]))
    return state._replace(chunks=tuple(chunks), step=state.step + 1)


def _skipped(progs, state: StageState, grads) -> StageState:
    """A step whose update every stage drops: the accumulators zeroed, the step counter moved on."""
    import jax

    zeros = [p.zero_grads(g) for p, g in zip(progs, grads)]
    jax.block_until_ready(zeros)
    return state._replace(chunks=tuple(c._replace(grads=g) for c, g in zip(state.chunks, zeros)),
                          step=state.step + 1)


Handler = Callable[[StageContext, StageState, StepState, Any], StageState]

HANDLERS: dict[Kind, Handler] = {
    Kind.F: forward,
    Kind.B: backward,
    Kind.I: backward_input,
    Kind.W: backward_weight,
    Kind.RECV_F: recv_forward,
    Kind.RECV_B: recv_backward,
    Kind.SEND_F: send_forward,
    Kind.SEND_B: send_backward,
    Kind.OPT: optimizer_step,
}


# the forward-only eval schedule (`orchestrator.core.schedule.forward_only`): forwards and their comms
EVAL_HANDLERS: dict[Kind, Handler] = {
    Kind.F: eval_forward,
    Kind.RECV_F: recv_forward,
    Kind.SEND_F: send_forward,
}


def program_of(actions, who: str, loss_chunk: int | None, fuse: bool = False) -> list[tuple[Any, str, Handler]]:
    """A step's program: `(action, text, handler)` per action, in the schedule's order; F and B of
    a fused chunk (`fused_chunks`) get the one-program pair."""
    fused = fused_chunks(actions, loss_chunk) if fuse else frozenset()
    out = []
    for a in actions:
        handler = handler_for(a, who)
        if a.chunk in fused and a.kind in (Kind.F, Kind.B):
            handler = forward_backward if a.kind is Kind.F else fused_backward
        out.append((a, str(a), handler))
    return out


def handler_for(action, who: str, table: dict[Kind, Handler] = HANDLERS) -> Handler:
    """The handler of `action`'s kind in `table`; a ValueError naming the action when there is none."""
    handler = table.get(action.kind)
    if handler is None:
        raise ValueError(f"{who}: cannot execute action {action} (kind {action.kind} has no handler; "
                         f"known: {', '.join(str(k) for k in table)})")
    return handler
