"""The numerical oracle: the same model trained in one process with plain JAX.

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
                    optimizer: tuple[str, dict], on_step: Callable[[dict], None] | None = None,
                    eval_every: int | None = None) -> dict:
    """Train for `steps`; return {"losses", "step_times_s", "param_norms", "eval_losses"}.

    With `source.eval` (data.eval), after every `eval_every`-th step and the last one the
    whole model's plain forward (`eval_loss`, not meshpipe's stage programs) is evaluated on
    the eval batches: their mean over microbatches, then over batches → eval_losses[(step, loss)].
    """
    import jax
    import jax.numpy as jnp

    from stages.models.base import load_impl
    from stages.program import StageProgram, make_optimizer

    prog = StageProgram(spec, load_impl(spec), 0, spec.num_layers, microbatches=microbatches,
                        optimizer=make_optimizer(*optimizer))
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
            loss, res = prog.fwd(params, jnp.asarray(microbatch(x, i, microbatches)),
                                 jnp.asarray(microbatch(y, i, microbatches)))
            _, g = prog.bwd(params, res, None)
            grads = prog.accumulate(grads, g)
            mb_losses.append(loss)
        params, opt_state, grads = prog.update(params, opt_state, grads)
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
    norms = {}
    for i, (layer, p) in enumerate(zip(spec.layers, params)):
        for name in sorted(p):
            norms[param_name(i, layer, name)] = float(np.linalg.norm(np.asarray(p[name], dtype=np.float64)))
    return {"losses": losses, "step_times_s": times, "param_norms": norms, "eval_losses": evals}


def eval_loss(spec: ModelSpec, params, reader, plan, batches: int, microbatches: int) -> float:
    """Mean over `batches` eval batches of the mean microbatch loss of the whole model, plain JAX."""
    import jax
    import jax.numpy as jnp

    from stages.models.base import load_impl

    impl = load_impl(spec)

    @jax.jit
    def loss(ps, x, y):
        for layer, p in zip(spec.layers, ps):
            x = impl.apply(layer, p, x)
        return impl.loss(x, y)

    per_batch = []
    for b in range(batches):
        x, y = global_batch(reader, plan, b)
        per_batch.append(float(np.mean([float(loss(params, jnp.asarray(microbatch(x, i, microbatches)),
                                                   jnp.asarray(microbatch(y, i, microbatches))))
                                        for i in range(microbatches)])))
    return float(np.mean(per_batch))
