"""`meshpipe run --reference`: the same model trained in one process, unpipelined.

Same parameters (seed, layer index), same data (seed, step), same optimizer and
the same microbatch accumulation order (microbatch 0, 1, …, m−1; gradients of
the mean loss), no pipeline and no mesh. `meshpipe run JOB.yaml --reference`
runs this; every pipeline numerics test compares against it.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from stages.data import global_batch, microbatch, open_reader
from orchestrator.core.checkpoint import is_param_name, state_name
from orchestrator.core.model.spec import ModelSpec, param_name


def train_reference(spec: ModelSpec, source, *, steps: int, seed: int, microbatches: int,
                    optimizer: dict, on_step: Callable[[dict], None] | None = None,
                    eval_every: int | None = None, loss_scale=None) -> dict:
    """Train for `steps`; return {"losses", "step_times_s", "param_norms", "params",
    "eval_losses"} (params: name -> final array).

    With `source.eval` (data.eval), after every `eval_every`-th step and the last one the
    whole model's plain forward (`eval_loss`, not meshpipe's stage programs) is evaluated on
    the eval batches: their mean over microbatches, then over batches → eval_losses[(step, loss)].
    `loss_scale`: a `DynamicLossScale` rule (precision.loss_scale), applied as the pipeline does:
    backward seeded with scale / m, gradients unscaled, a step with a non-finite one skipped.
    The training state is a one-chunk `stages.state.StageState`, as a stage's is.
    """
    import jax

    from orchestrator.core.model.registry import build_model
    from stages.program import StageProgram
    from stages.state import init

    prog = StageProgram(spec, build_model(spec.factory, spec.args), 0, spec.num_layers,
                        microbatches=microbatches, optimizer=optimizer)
    state = init([prog], seed, loss_scale)
    losses, times, evals = [], [], []
    ev_reader = open_reader(source.eval) if source.eval is not None else None
    reader = open_reader(source)      # source: a DataPlan; the whole global batch, in this process
    for step in range(steps):
        t0 = time.perf_counter()
        used = state.loss_scale.scale if state.loss_scale is not None else None
        state, loss, finite = _step(prog, state, global_batch(reader, source, step), microbatches, seed, loss_scale)
        jax.block_until_ready(state.chunks[0].params)
        losses.append(loss)
        times.append(time.perf_counter() - t0)
        rec = {"step": step, "loss": loss, "step_time_s": times[-1]}
        if used is not None:
            rec.update(loss_scale=float(used), skipped=not finite)
        if ev_reader is not None and ((eval_every and (step + 1) % eval_every == 0) or step + 1 == steps):
            rec["eval_loss"] = eval_loss(spec, state.chunks[0].params, ev_reader, source.eval, source.eval_batches,
                                         microbatches, state.chunks[0].mstate)
            evals.append([step, rec["eval_loss"]])
        if on_step:
            on_step(rec)
    arrays = _arrays(spec, state.chunks[0])
    norms = {k: float(np.linalg.norm(np.asarray(v, dtype=np.float64))) for k, v in arrays.items()
             if is_param_name(k)}
    return {"losses": losses, "step_times_s": times, "param_norms": norms, "params": arrays,
            "eval_losses": evals}


def _step(prog, state, batch, microbatches: int, seed: int, scaler):
    """One training step of the whole model: (new state, mean loss, whether its update was applied)."""
    import jax.numpy as jnp

    spec, (x, y) = prog.spec, batch
    c = state.chunks[0]
    params, mstate, grads = c.params, c.mstate, c.grads
    scale = None if state.loss_scale is None else np.float32(state.loss_scale.scale)
    mb_losses = []
    for i in range(microbatches):
        args = (params, [jnp.asarray(microbatch(x, i, microbatches))],
                jnp.asarray(microbatch(y, i, microbatches)), np.array([seed, state.step, i], np.int32))
        if prog.stateful:      # mutable model state (BatchNorm), threaded in microbatch order
            loss, res, mstate = prog.fwd(*args, mstate)
        else:
            loss, res = prog.fwd(*args)
        _, g = prog.bwd(params, res, scale)
        grads = prog.accumulate(grads, g)
        mb_losses.append(loss)
    finite = True
    if state.loss_scale is not None:
        grads, bad = prog.unscale(grads, scale)
        finite = float(bad) == 0
        state = state._replace(loss_scale=type(state.loss_scale)(*scaler.next(state.loss_scale, finite)))
    opt_state = c.opt_state
    if finite:
        if spec.ties:       # both copies of a tied array are here: each gets the sum (stages.ties)
            from stages.ties import for_norm, sum_tied

            box = [grads]
            sum_tied(box, [prog], spec.ties)
            grads = box[0]
            gnorm = np.float32(np.sqrt(float(prog.sq_norm(for_norm([grads], [prog], spec.ties)[0]))))
        else:
            gnorm = np.float32(np.sqrt(float(prog.sq_norm(grads))))
        params, opt_state, grads = prog.update(params, opt_state, grads, gnorm)
    else:
        grads = prog.zero_grads(grads)
    chunk = c._replace(params=params, opt_state=opt_state, grads=grads, mstate=mstate)
    loss = float(np.mean([float(v) for v in mb_losses]))
    return state._replace(chunks=(chunk,), step=state.step + 1), loss, finite


def _arrays(spec: ModelSpec, chunk) -> dict:
    """Every parameter and mutable-state leaf of the whole model by name (as the pipeline reports them)."""
    import jax

    from orchestrator.core.model.pipeline import key_path

    arrays = {}
    for i, (layer, p) in enumerate(zip(spec.layers, chunk.params)):
        for path, leaf in jax.tree_util.tree_flatten_with_path(p)[0]:
            arrays[param_name(i, layer, key_path(path))] = np.asarray(leaf)
    for i, (layer, s) in enumerate(zip(spec.layers, chunk.mstate)):
        for path, leaf in jax.tree_util.tree_flatten_with_path(s)[0]:
            arrays[state_name(param_name(i, layer, key_path(path)))] = np.asarray(leaf)
    return arrays


def eval_loss(spec: ModelSpec, params, reader, plan, batches: int, microbatches: int, mstate=None) -> float:
    """Mean over `batches` eval batches of the mean microbatch loss of the whole model, plain JAX
    (eval mode: stateful parts use `mstate`, a list with None per stateless part, unchanged)."""
    import jax
    import jax.numpy as jnp

    from orchestrator.core.model.pipeline import run_part
    from orchestrator.core.model.registry import build_model

    model = build_model(spec.factory, spec.args)
    mstate = [None] * len(model.parts) if mstate is None else mstate

    @jax.jit
    def loss(ps, x, y):
        for part, p, s in zip(model.parts, ps, mstate):
            x, _ = run_part(part, p, x, s, rng=None, train=False)
        return model.loss(x, y)

    per_batch = []
    for b in range(batches):
        x, y = global_batch(reader, plan, b)
        per_batch.append(float(np.mean([float(loss(params, jnp.asarray(microbatch(x, i, microbatches)),
                                                   jnp.asarray(microbatch(y, i, microbatches))))
                                        for i in range(microbatches)])))
    return float(np.mean(per_batch))
