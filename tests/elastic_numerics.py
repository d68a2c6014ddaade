"""What a re-plan changes in the arithmetic, measured in one process (a test helper, not product code).

`python -m tests.elastic_numerics --steps 5 --optimizer adam` trains the README's GPT
(examples/gpt.yaml) in one process — the loop of `orchestrator.driver.reference.train_reference`:
the same data (seed, step), init, optimizer and microbatch accumulation — once per (m, d): m
microbatches over the same global batch, the whole model on a (data = d) mesh of simulated CPU
devices with the batch sharded over it (the stage program's GSPMD sum of the gradient). Every
case is compared with (m = 4, d = 1), which also runs twice to show the process is deterministic.
Prints one JSON object: per case the largest relative loss difference, the largest parameter
difference, the largest relative L2 difference of one parameter array, and the array where the
parameter difference is largest. Set XLA_FLAGS=--xla_force_host_platform_device_count=4 (the
test does) before running it.
"""
from __future__ import annotations

import argparse
import json

import numpy as np

CASES = ((4, 1), (8, 1), (2, 1), (4, 2), (8, 2))


def train(checked, optimizer: dict, steps: int, m: int, d: int):
    """Per-step losses and final parameters (name -> array) of `steps` steps with m microbatches on d devices."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from orchestrator.core.model.pipeline import key_path
    from orchestrator.core.model.registry import build_model
    from orchestrator.core.model.spec import param_name
    from stages.data import global_batch, microbatch, open_reader
    from stages.program import StageProgram

    spec = checked.model
    mesh = Mesh(np.array(jax.devices()[:d]), ("data",)) if d > 1 else None
    prog = StageProgram(spec, build_model(spec.factory, spec.args), 0, spec.num_layers, microbatches=m,
                        optimizer=optimizer, mesh=mesh, layout={"batch": "data"} if d > 1 else None)
    params = prog.init_params(checked.job.run.seed)
    opt_state, grads = prog.init_state(params)
    reader = open_reader(checked.data)
    losses = []
    for step in range(steps):
        x, y = global_batch(reader, checked.data, step)
        per = []
        for i in range(m):
            xi, yi = jnp.asarray(microbatch(x, i, m)), jnp.asarray(microbatch(y, i, m))
            if mesh is not None:
                xi, yi = jax.device_put(xi, prog.input_shardings()[0]), jax.device_put(yi, prog.label_sharding())
            loss, res = prog.fwd(params, [xi], yi, np.array([checked.job.run.seed, step, i], np.int32))
            _, g = prog.bwd(params, res, None)
            grads = prog.accumulate(grads, g)
            per.append(loss)
        gnorm = np.float32(np.sqrt(float(prog.sq_norm(grads))))
        params, opt_state, grads = prog.update(params, opt_state, grads, gnorm)
        losses.append(float(np.mean([float(v) for v in per])))
    arrays = {}
    for i, (layer, p) in enumerate(zip(spec.layers, params)):
        for path, leaf in jax.tree_util.tree_flatten_with_path(p)[0]:
            arrays[param_name(i, layer, key_path(path))] = np.asarray(leaf)
    return losses, arrays


def compare(base, other) -> dict:
    (la, pa), (lb, pb) = base, other
    diff = {k: np.abs(pa[k] - pb[k]) for k in pa}
    worst = max(diff, key=lambda k: float(diff[k].max()))
    return {"max_rel_loss_diff": float(np.max(np.abs(np.array(la) - np.array(lb)) / np.abs(la))),
            "max_abs_param_diff": float(diff[worst].max()), "worst_array": worst,
            "max_rel_l2_per_array": max(float(np.linalg.norm(pa[k] - pb[k]) / np.linalg.norm(pa[k])) for k in pa),
            "bit_equal": all(np.array_equal(pa[k], pb[k]) for k in pa) and la == lb}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--optimizer", default="adam")
    ap.add_argument("--lr", type=float, default=None, help="default: the example's 0.003 (adam), 0.1 (sgd)")
    args = ap.parse_args(argv)
    from orchestrator.core.config import check_job, load_cluster, load_job

    job = load_job("examples/gpt.yaml", overrides=[f"run.steps={args.steps}"])
    checked = check_job(job, load_cluster("cluster_configs/local.yaml"))
    lr = args.lr if args.lr is not None else (0.003 if args.optimizer == "adam" else 0.1)
    optimizer = {"name": args.optimizer, "args": {"learning_rate": lr}}
    runs = {case: train(checked, optimizer, args.steps, *case) for case in CASES}
    base = runs[CASES[0]]
    out = {"optimizer": args.optimizer, "learning_rate": lr, "steps": args.steps, "baseline": list(CASES[0]),
           "repeat": compare(base, train(checked, optimizer, args.steps, *CASES[0])),
           "cases": [{"m": m, "d": d, **compare(base, runs[(m, d)])} for m, d in CASES[1:]]}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
