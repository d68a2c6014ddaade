"""The stage worker's step interpreter: one small handler per action kind.

Basic flow: `StageWorker` resolves its lowered action list once, at construction,
into `(action, text, handler)` triples (`HANDLERS[action.kind]`); a step then
calls `handler(worker, state, action)` for each in order. A handler reads the
stage's programs, parameters, edges and transport from the worker and keeps the
tensors that pass between actions in the per-step `StepState`, keyed
(microbatch, chunk). Adding an action kind (a forward-only eval, a checkpoint
copy) is one handler here and one entry in `HANDLERS`.

Invariants:
  - A handler blocks until the device work it issued is done, so the span the
    worker records around it is the action's real duration.
  - SEND_* never blocks on the peer; RECV_* waits at most `state.timeout`.
  - Nothing here decides what runs when: the order is the lowered schedule's.
  - jax is imported inside the handlers, never at module level: the worker
    process pins its CPUs before jax loads.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from orchestrator.core.schedule import Kind


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


# -- handlers: (worker, state, action) -> None -------------------------------

def _operands(w, st: StepState, a, prog):
    """F's input and labels: this host's rows of the batch on the first / last stage."""
    cfg = w.cfg
    mbs = cfg.data.global_batch // cfg.microbatches
    if prog.first:
        x = [w.host_operand(st.batch.xs[a.microbatch], w.rows_in, (mbs, *cfg.spec.input_shape),
                            prog.input_sharding())]
    else:
        x = st.inputs.pop((a.microbatch, a.chunk))     # the activation's leaves
    labels = None
    if prog.last:
        labels = w.host_operand(st.batch.ys[a.microbatch], w.rows_lab, (mbs, *cfg.spec.label_shape),
                                 prog.label_sharding())
    return x, labels


def _forward_output(w, st: StepState, a, prog, y) -> None:
    c = a.chunk
    if prog.last:
        st.losses[a.microbatch] = y
    elif w.edge_out[c][0][0].stage == w.cfg.stage:      # next chunk lives here (p = 1)
        st.inputs[(a.microbatch, c + 1)] = y
    else:
        st.outputs[(a.microbatch, c)] = y


def forward(w, st: StepState, a) -> None:
    """F: forward of (microbatch, chunk); the output goes to the loss, the next chunk here, or SEND_F."""
    c, key, prog = a.chunk, (a.microbatch, a.chunk), w.progs[a.chunk]
    x, labels = _operands(w, st, a, prog)
    ids = np.array([w.cfg.seed, st.step, a.microbatch], np.int32)     # the parts' RNG keys derive from these
    if prog.stateful:      # mutable model state (BatchNorm): threaded through this chunk's forwards in order
        y, st.residuals[key], w.mstate[c] = prog.fwd(w.params[c], x, labels, ids, w.mstate[c])
    else:
        y, st.residuals[key] = prog.fwd(w.params[c], x, labels, ids)
    _ready(y)
    st.stash.add(("r", key), st.residuals[key], ("r", c))
    _forward_output(w, st, a, prog, y)


def eval_forward(w, st: StepState, a) -> None:
    """F of the forward-only eval schedule: the forward alone (no VJP, nothing kept)."""
    prog = w.progs[a.chunk]
    x, labels = _operands(w, st, a, prog)
    y = _ready(prog.fwd_eval(w.params[a.chunk], x, labels, w.mstate[a.chunk]))
    _forward_output(w, st, a, prog, y)


def _input_grad(w, st: StepState, a, dx) -> None:
    """Where B/I's input gradient goes: the chunk before it here, or SEND_B."""
    if dx is None:
        return
    _ready(dx)
    c = a.chunk
    if w.edge_in[c][0][0].stage == w.cfg.stage:       # previous chunk lives here (p = 1)
        st.dys[(a.microbatch, c - 1)] = dx
    else:
        st.dxs[(a.microbatch, c)] = dx


def _output_grad(w, st: StepState, c: int, key, pop: bool):
    """The output gradient B/I start from: received (or from the next chunk here); on the
    model's last part under loss scaling, the scale (the program seeds scale / m)."""
    dy = st.dys.pop(key, None) if pop else st.dys.get(key)
    if dy is None and w.progs[c].last and w.scale_state is not None:
        return np.float32(w.scale_state[0])
    return dy


def backward(w, st: StepState, a) -> None:
    """B: full backward; accumulates the weight gradient, releases the residuals."""
    c, key = a.chunk, (a.microbatch, a.chunk)
    dy = _output_grad(w, st, c, key, pop=True)
    dx, w.grads[c] = w.progs[c].bwd_acc(w.params[c], st.residuals.pop(key), dy, w.grads[c])
    _ready(w.grads[c])
    st.stash.drop(("r", key))
    _input_grad(w, st, a, dx)


def backward_input(w, st: StepState, a) -> None:
    """I (zero-bubble): the input gradient; keeps only what W reads (`stages.zb_split`: per layer
    the residuals and output cotangents its weight gradients need) and releases the rest."""
    c, key = a.chunk, (a.microbatch, a.chunk)
    dx, st.held[key] = w.progs[c].bwd_i(w.params[c], st.residuals.pop(key), _output_grad(w, st, c, key, pop=True))
    _ready(st.held[key])
    st.stash.drop(("r", key))
    st.stash.add(("w", key), st.held[key], ("w", c))      # kept until W
    _input_grad(w, st, a, dx)


def backward_weight(w, st: StepState, a) -> None:
    """W (zero-bubble): the weight gradients only, from what I kept; releases it."""
    c, key = a.chunk, (a.microbatch, a.chunk)
    w.grads[c] = _ready(w.progs[c].bwd_w_acc(w.params[c], st.held.pop(key), w.grads[c]))
    st.stash.drop(("w", key))


def forward_backward(w, st: StepState, a) -> None:
    """F of the loss chunk when its B comes right after it (`fused_chunks`): forward and backward as
    one program (`StageProgram.fwd_bwd_acc`), nothing kept but the input gradient for that B."""
    c, key, prog = a.chunk, (a.microbatch, a.chunk), w.progs[a.chunk]
    x, labels = _operands(w, st, a, prog)
    ids = np.array([w.cfg.seed, st.step, a.microbatch], np.int32)
    scale = None if w.scale_state is None else np.float32(w.scale_state[0])     # loss scaling: seed scale / m
    if prog.stateful:
        loss, dx, w.grads[c], w.mstate[c] = prog.fwd_bwd_acc(w.params[c], x, labels, ids, w.grads[c], scale,
                                                               w.mstate[c])
    else:
        loss, dx, w.grads[c] = prog.fwd_bwd_acc(w.params[c], x, labels, ids, w.grads[c], scale)
    _ready(w.grads[c])
    st.losses[a.microbatch] = loss
    st.fused[key] = dx


def fused_backward(w, st: StepState, a) -> None:
    """B whose work its F already did (`forward_backward`): hands the input gradient on."""
    _input_grad(w, st, a, st.fused.pop((a.microbatch, a.chunk)))


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


def recv_forward(w, st: StepState, a) -> None:
    """RECV_F: this chunk's forward input from the previous virtual stage (bounded wait), leaf by
    leaf (key ... + (leaf index,)), each with its own shape, dtype and sharding."""
    c, key = a.chunk, (a.microbatch, a.chunk)
    shardings = w.progs[c].input_shardings()
    st.inputs[key] = [w.transport.recv_operand((st.step, st.tag) + key + (j,), shape, dtype, shardings[j], edge,
                                               st.timeout)
                      for j, (edge, shape, dtype) in enumerate(w.edge_in[c])]


def recv_backward(w, st: StepState, a) -> None:
    """RECV_B: this chunk's output gradient from the next virtual stage (bounded wait): one per
    floating output leaf."""
    c, key = a.chunk, (a.microbatch, a.chunk)
    prog, shardings = w.progs[c], w.progs[c].output_shardings()
    st.dys[key] = [w.transport.recv_operand((st.step, "B") + key + (j,), w.edge_out[c][j][1], w.edge_out[c][j][2],
                                            shardings[j], w.edge_out[c][j][0], st.timeout)
                   for j in prog.out_diff]


def send_forward(w, st: StepState, a) -> None:
    """SEND_F: F's output leaves to the next virtual stage (never blocks)."""
    c, edges = a.chunk, w.edge_out[a.chunk]
    peer_chunk = c + (1 if edges[0][0].stage < w.cfg.stage else 0)
    for j, leaf in enumerate(st.outputs.pop((a.microbatch, c))):
        w.transport.send((st.step, st.tag, a.microbatch, peer_chunk, j), leaf, edges[j][0])


def send_backward(w, st: StepState, a) -> None:
    """SEND_B: B/I's input gradients (floating input leaves) to the previous virtual stage."""
    c, edges = a.chunk, w.edge_in[a.chunk]
    peer_chunk = c - (1 if edges[0][0].stage > w.cfg.stage else 0)
    for j, leaf in zip(w.progs[c].in_diff, st.dxs.pop((a.microbatch, c))):
        w.transport.send((st.step, "B", a.microbatch, peer_chunk, j), leaf, edges[j][0])


def optimizer_step(w, st: StepState, a) -> None:
    """OPT: every chunk's optimizer update from its accumulated gradients. When the chain clips by
    the global norm, the stages first exchange their squared norms (`sum_over_stages`), so every
    stage clips with the whole model's norm before any stage updates. Under loss scaling the
    gradients are unscaled first and the stages sum their non-finite counts (tag "FINITE"):
    when any is non-zero every stage skips its update and all move the scale the same way
    (`orchestrator.core.model.policy.DynamicLossScale`).

    Training health (`orchestrator.core.health`): each update also returns the stage's squared
    gradient norm and its count of non-finite parameters (`st.health`, read once the update is
    done). Under `failure.on_nonfinite: skip` the stages exchange their squared norms (the clipping
    exchange, made NaN by a non-finite loss on the last stage) before any update, and a non-finite
    sum drops the step's update on every stage."""
    import jax

    if w.scale_state is not None:
        scale = w.scale_state[0]
        bad = 0.0
        for i, p in enumerate(w.progs):
            w.grads[i], n = p.unscale(w.grads[i], np.float32(scale))
            bad += float(n)
        finite = w.sum_over_stages(st.step, bad, st.timeout, tag="FINITE") == 0
        st.loss_scale, st.skipped = scale, not finite
        w.scale_state = w.scaler.next(w.scale_state, finite)
        if not finite:
            w.grads = [p.zero_grads(g) for p, g in zip(w.progs, w.grads)]
            jax.block_until_ready(w.grads)
            return
    ties = w.cfg.spec.ties
    if ties:      # tied weights: each copy's gradient := the sum of both (stages.ties)
        from stages.ties import sum_tied

        sum_tied(w.grads, w.progs, ties, exchange=lambda t, mine: w.exchange_tie(st.step, t, mine, st.timeout))
    gnorm = np.float32(0.0)
    skip = w.cfg.on_nonfinite == "skip"
    if w.progs[0].clip is not None or skip:
        from stages.ties import for_norm

        normed = for_norm(w.grads, w.progs, ties) if ties else w.grads     # a tied array counts once
        local = sum(float(p.sq_norm(g)) for p, g in zip(w.progs, normed))
        if skip:       # training health's skip: one global decision before any stage updates
            mine = local
            if st.losses and not all(np.isfinite(float(x)) for x in st.losses.values()):
                local = float("nan")      # a non-finite loss makes the sum, so every stage's decision, NaN
            total = w.sum_over_stages(st.step, local, st.timeout)
            if not np.isfinite(total):
                st.health = (mine, None)      # (squared gradient norm, non-finite parameters: not updated)
                w.grads = [p.zero_grads(g) for p, g in zip(w.progs, w.grads)]
                jax.block_until_ready(w.grads)
                return
        else:
            total = w.sum_over_stages(st.step, local, st.timeout)
        gnorm = np.float32(np.sqrt(total))
    health = []
    for i, p in enumerate(w.progs):
        w.params[i], w.opt_state[i], w.grads[i], h = p.update_checked(w.params[i], w.opt_state[i], w.grads[i],
                                                                      gnorm)
        health.append(h)
    jax.block_until_ready(w.params)
    # the programs have finished (above): reading their health scalars adds no synchronisation
    got = np.sum([np.asarray(h) for h in health], axis=0)
    st.health = (float(got[0]), float(got[1]))


Handler = Callable[[Any, StepState, Any], None]

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
