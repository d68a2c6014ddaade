"""What the training-health check costs a `large` step (target ≤ 1 %), side by side in one run.

The check (`orchestrator.core.health`) adds, per stage and step: two reductions inside the
optimizer update (`StageProgram.update_checked`: the squared gradient norm and the count of
non-finite parameters), a read of those two scalars once the update has finished (the worker
already waits for it), and on the driver `HealthMonitor.observe` over the step's numbers. This
benchmark runs the `large` GPT (benchmarks/common.py) as one stage on one device, one step =
m fused forward+backward microbatches (`fwd_bwd_acc`) + the update, exactly as the worker calls
them, in three variants:

  plain    `update`, then block on the parameters (the step before this change);
  checked  `update_checked` + the scalar read + `HealthMonitor.observe` (the default, `stop`);
  skip     what `failure.on_nonfinite: skip` adds on top on one stage: the squared norm read
           back before the update (`sq_norm`, a host synchronisation; the cross-stage exchange
           of that scalar is not in it).

Then the update alone (`opt_pairs`): `update` against `update_checked` and its read, alternated,
many pairs — the added device work isolated from the forwards and backwards, whose noise on a
shared machine is far larger than 1 %; `added_fraction_of_step` = its median added seconds ÷ the
median plain step.

Pairs alternate the order (plain, checked, checked, plain, …; `benchmarks.paired.block_order`),
each pair's ratio checked ÷ plain (and skip ÷ plain) is one sample, and the verdict against
1.01 comes from the order-statistic interval of the median ratio (`benchmarks.paired.verdict`).
Recorded: the CPUs this process may run on (read back), its thread count, the load average
before and after, the machine and versions. A median ratio whose interval lies below 0.99 (the
check made the step faster) fails the run: no sound measurement produces it.

    python -m benchmarks.health_overhead --pairs 16 --m 8 --out benchmarks/results/health_overhead.json
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from benchmarks.common import SIZES, machine_info, median
from benchmarks.paired import block_order, verdict


def build(size, m: int):
    """The `large` model as one stage on one device: (program, params, opt_state, grads, operands)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from orchestrator.core.data.plan import synthetic_plan
    from orchestrator.core.model.registry import build_model, build_spec
    from stages.data import microbatch, synthetic_batch
    from stages.program import StageProgram, make_optimizer

    spec = build_spec("gpt", size.model_args(), size.seq)
    model = build_model(spec.factory, spec.args)
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    prog = StageProgram(spec, model, 0, spec.num_layers, microbatches=m, mesh=mesh, layout={"batch": "data"},
                        optimizer=make_optimizer("adam", {"learning_rate": 1e-4}))
    params = prog.init_params(0)
    opt_state, grads = prog.init_state(params)
    x, y = synthetic_batch(synthetic_plan(spec, size.mbs * m, 0), 0)
    mbs = [([microbatch(x, i, m)], microbatch(y, i, m)) for i in range(m)]
    return prog, [params, opt_state, grads], mbs


def step_fn(prog, state: list, mbs: list, variant: str, step: list):
    """One training step of `variant` (module docstring) over the mutable `state`."""
    import jax
    import numpy as np

    from orchestrator.core.health import HealthMonitor, HealthRule

    monitor = HealthMonitor(HealthRule())

    def run() -> float:
        params, opt_state, grads = state
        losses = []
        for i, (xs, labels) in enumerate(mbs):
            ids = np.array([0, step[0], i], np.int32)
            loss, _, grads = prog.fwd_bwd_acc(params, xs, labels, ids, grads)
            losses.append(loss)
        if variant == "skip":
            float(prog.sq_norm(grads))                       # read back before the update
        if variant == "plain":
            params, opt_state, grads = prog.update(params, opt_state, grads, np.float32(0.0))
            jax.block_until_ready(params)
        else:
            params, opt_state, grads, h = prog.update_checked(params, opt_state, grads, np.float32(0.0))
            jax.block_until_ready(params)
            got = np.asarray(h)
            monitor.observe(step[0], float(np.mean([float(v) for v in losses])), [float(got[0])], [float(got[1])])
        state[:] = [params, opt_state, grads]
        loss = float(np.mean([float(v) for v in losses]))     # the losses reach the driver either way
        step[0] += 1
        return loss

    return run


def opt_pairs(prog, state: list, pairs: int) -> dict:
    """The update alone, `update` against `update_checked` + its scalar read, in alternated pairs:
    the device work the check adds, isolated from the forwards and backwards (whose noise on a
    shared machine dwarfs it). Seconds per program, and each pair's difference."""
    import jax
    import numpy as np

    def plain():
        state[:] = prog.update(*state, np.float32(0.0))
        jax.block_until_ready(state[0])

    def checked():
        *new, h = prog.update_checked(*state, np.float32(0.0))
        state[:] = new
        jax.block_until_ready(state[0])
        np.asarray(h)

    fns = {"plain": plain, "checked": checked}
    for fn in fns.values():
        fn(), fn()
    times: dict[str, list[float]] = {"plain": [], "checked": []}
    for i in range(pairs):
        for v in block_order(i, ("plain", "checked")):
            t0 = time.perf_counter()
            fns[v]()
            times[v].append(time.perf_counter() - t0)
    diffs = [c - p for c, p in zip(times["checked"], times["plain"])]
    return {"pairs": pairs, "median_s": {v: median(ts) for v, ts in times.items()},
            "median_added_s": median(diffs), "added_s": diffs}


def measure(m: int, pairs: int, warm: int = 3, opt: int = 60) -> dict:
    from stages.telemetry import conditions

    size = SIZES["large"]
    prog, state, mbs = build(size, m)
    step = [0]
    fns = {v: step_fn(prog, state, mbs, v, step) for v in ("plain", "checked", "skip")}
    for fn in fns.values():
        for _ in range(warm):
            fn()                                            # compile, then settle
    times: dict[str, list[float]] = {v: [] for v in fns}
    ratios: dict[str, list[float]] = {"checked": [], "skip": []}
    for i in range(pairs):
        got = {}
        for v in block_order(i, ("plain", "checked", "skip")):
            t0 = time.perf_counter()
            fns[v]()
            got[v] = time.perf_counter() - t0
            times[v].append(got[v])
        for v in ratios:
            ratios[v].append(got[v] / got["plain"])
    alone = opt_pairs(prog, state, opt)
    return {"size": size.describe(), "m": m, "pairs": pairs, "times_s": times, "opt_alone": alone,
            "added_fraction_of_step": alone["median_added_s"] / median(times["plain"]),
            "median_step_s": {v: median(ts) for v, ts in times.items()},
            "observed": conditions(), "ratios": ratios}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=8, help="microbatches per step")
    ap.add_argument("--pairs", type=int, default=16, help="blocks of (plain, checked, skip), order rotating")
    ap.add_argument("--target", type=float, default=1.01)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    info = machine_info()
    rec = measure(args.m, args.pairs)
    rec["verdict"] = verdict({"checked": rec["ratios"]["checked"]}, args.target)
    rec["skip_verdict"] = verdict({"skip": rec["ratios"]["skip"]}, args.target)
    rec["machine"] = {**info, "load_end": os.getloadavg()}
    for name, v in (("checked", rec["verdict"]), ("skip", rec["skip_verdict"])):
        ci = v["per"][name]["interval"]
        if ci is not None and ci["hi"] < 0.99:
            raise SystemExit(f"{name} ÷ plain: the median ratio's interval [{ci['lo']:.3f}, {ci['hi']:.3f}] lies "
                             "below 0.99: more work cannot make a step faster; the machine's speed drifted, so "
                             "this run measures nothing")
    opt = rec["opt_alone"]
    line = (f"update alone: {opt['median_s']['plain'] * 1e3:.2f} ms, checked {opt['median_s']['checked'] * 1e3:.2f} ms, "
            f"median added {opt['median_added_s'] * 1e3:.3f} ms = {rec['added_fraction_of_step'] * 100:.2f} % of the "
            f"step; "
            f"large step (m={args.m}) median {rec['median_step_s']['plain'] * 1e3:.1f} ms; checked ÷ plain: "
            f"median {rec['verdict']['per']['checked']['median']:.4f} ({rec['verdict']['overall']} ≤ {args.target}); "
            f"skip ÷ plain: median {rec['skip_verdict']['per']['skip']['median']:.4f}; "
            f"affinity {rec['observed']['affinity']}, load {info['load_start']} → {rec['machine']['load_end']}")
    print(line)
    rec["line"] = line
    if args.out:
        args.out.write_text(json.dumps(rec, indent=1))
    return rec


if __name__ == "__main__":
    main()
