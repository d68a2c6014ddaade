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
from orchestrator.core.model.spec import ModelSpec, param_name


def train_reference(spec: ModelSpec, source, *, steps: int, seed: int, microbatches: int,
                    optimizer: dict, on_step: Callable[[dict], None] | None = None,
                    eval_every: int | None = None) -> dict:
    """Train for `steps`; return {"losses", "step_times_s", "param_norms", "params",
    "eval_losses"} (params: name -> final array).

    With `source.eval` (data.eval), after every `eval_every`-th step and the last one the
    whole model's plain forward (`eval_loss`, not meshpipe's stage programs) is evaluated on
    the eval batches: their mean over microbatches, then over batches → eval_losses[(step, loss)].
    """
    import jax
    import jax.numpy as jnp

    from orchestrator.core.model.pipeline import key_path
    from orchestrator.core.model.registry import build_model
    from stages.program import StageProgram

    prog = StageProgram(spec, build_model(spec.factory, spec.args), 0, spec.num_layers,
                        microbatches=microbatches, optimizer=optimizer)
    params = prog.init_params(seed)
    opt_state, grads = prog.init_state(params)
    losses, times, evals = [], [], []
    ev_reader = open_reader(source.eval) if source.eval is not None else None
    reader = open_reader(source)      # source: a DataPlan; the whole global batch, in this process
    for step in range(steps):
        t0 = time.perf_counter()
        x, y = global_batch(reader, source, step)
        mb_losses = []
        for i in range(microbatches):
            loss, res = prog.fwd(params, [jnp.asarray(microbatch(x, i, microbatches))],
                                 jnp.asarray(microbatch(y, i, microbatches)), np.array([seed, step, i], np.int32))
            _, g = prog.bwd(params, res, None)
            grads = prog.accumulate(grads, g)
            mb_losses.append(loss)
        gnorm = np.float32(np.sqrt(float(prog.sq_norm(grads))))
        params, opt_state, grads = prog.update(params, opt_state, grads, gnorm)
        loss = float(np.mean([float(v) for v in mb_losses]))
        jax.block_until_ready(params)
        losses.append(loss)
        times.append(time.perf_counter() - t0)
        rec = {"step": step, "loss": loss, "step_time_s": times[-1]}
        if ev_reader is not None and ((eval_every and (step + 1) % eval_every == 0) or step + 1 == steps):
            rec["eval_loss"] = eval_loss(spec, params, ev_reader, source.eval, source.eval_batches, microbatches)
            evals.append([step, rec["eval_loss"]])
        if on_step:
            on_step(rec)
    arrays = {}
    for i, (layer, p) in enumerate(zip(spec.layers, params)):
        for path, leaf in jax.tree_util.tree_flatten_with_path(p)[0]:
            arrays[param_name(i, layer, key_path(path))] = np.asarray(leaf)
    norms = {k: float(np.linalg.norm(np.asarray(v, dtype=np.float64))) for k, v in arrays.items()}
    return {"losses": losses, "step_times_s": times, "param_norms": norms, "params": arrays,
            "eval_losses": evals}


def eval_loss(spec: ModelSpec, params, reader, plan, batches: int, microbatches: int) -> float:
    """Mean over `batches` eval batches of the mean microbatch loss of the whole model, plain JAX."""
    import jax
    import jax.numpy as jnp

    from orchestrator.core.model.registry import build_model

    model = build_model(spec.factory, spec.args)

    @jax.jit
    def loss(ps, x, y):
        for part, p in zip(model.parts, ps):
            x = part.apply(p, x, rng=None, train=False)
        return model.loss(x, y)

    per_batch = []
    for b in range(batches):
        x, y = global_batch(reader, plan, b)
        per_batch.append(float(np.mean([float(loss(params, jnp.asarray(microbatch(x, i, microbatches)),
                                                   jnp.asarray(microbatch(y, i, microbatches))))
                                        for i in range(microbatches)])))
    return float(np.mean(per_batch))
