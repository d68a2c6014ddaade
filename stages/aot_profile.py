"""The planner's profiling worker: compile one layer's stage programs ahead of time, report XLA's figures.

Run as `python -m stages.aot_profile` by `orchestrator.core.planner.profile.Profiler`
(in a subprocess whose environment already has
`XLA_FLAGS=--xla_force_host_platform_device_count=N` and `JAX_PLATFORMS=cpu`).
Reads one JSON request on stdin:
    {"protocol": 4, "source": {"kind": "modelspec", "name", "args", "seq_len"[, "compute"]},
     "requests": [{"key", "layer", "model_size", "rules", "batch"}, ...]}
and writes one JSON line per request, `{"key": ..., "profile": LayerProfile JSON}` (or
`{"key": ..., "error": "..."}`), as soon as it is compiled (so a timeout keeps what was done).

For each request it builds the layer as a one-layer `StageProgram` on a
`(data=1, model=M)` mesh with layout `batch → data` plus the request's rules,
lowers and compiles its forward, its backward+accumulate and its zero-bubble I and
W+accumulate (`StageProgram.zero_bubble`: the same cut of the same backward the stage
worker runs; nothing runs here, inputs are `ShapeDtypeStruct`s), and reads `cost_analysis()`,
`memory_analysis()`, the collectives and the kernel count of `as_text()`; what I keeps for W (`held_bytes`) is
the per-device size of the held leaves (kept residuals and output cotangents, with the
compiled forward's shardings, plus I's outputs for W, with I's), as
`benchmarks/stage_bytes.py` counts them. For the last layer also the temp of its
forward+backward as one program (`fwd_bwd_acc`, what `pipeline.fuse_loss_chunk` runs). `build_source` and
`build_layer` are the only functions that know the model front-end (`ModelSpec` + the
factory's `PipelineModel`).

Cost: the model is described and built once per run (for a plain-JAX model, describing it
traces the whole init once per part: ~5 s CPU for a 64-layer GPT, which used to be paid per
request), the batch-1 and batch-2 requests of one (layer, M, rules) share one `StageProgram`,
and the programs compile with LLVM at -O0 (`ANALYSIS_ONLY`). A profile's `compile_s` is the
wall time of its own work; the run's first one also carries the model build.
"""
from __future__ import annotations

import json
import sys
import time


def build_source(source: dict):
    """(spec, model) of the model described by `source` (built once per worker run: describing
    a model shape-evaluates every part, which for a plain-JAX model traces its whole init per part)."""
    from orchestrator.core.model.policy import with_compute_dtype
    from orchestrator.core.model.registry import build_model, build_spec

    if source.get("kind") != "modelspec":
        raise ValueError(f"unknown model source kind {source.get('kind')!r}")
    spec = with_compute_dtype(build_spec(source["name"], source.get("args") or {}, seq_len=source.get("seq_len")),
                              source.get("compute", "float32"))
    return spec, build_model(spec.factory, spec.args)


def build_layer(source: dict, layer: int, mesh, layout: dict, built=None):
    """(program, spec) for one layer of the model described by `source`, on `mesh` with `layout`;
    `built`: `build_source(source)` when the caller already has it."""
    import optax

    from stages.program import StageProgram

    spec, model = built if built is not None else build_source(source)
    prog = StageProgram(spec, model, layer, layer + 1, microbatches=1,
                        optimizer=optax.sgd(0.1), mesh=mesh, layout=layout)
    return prog, spec


# XLA options for these compiles: LLVM's code generation at -O0 and without its expensive passes.
# Nothing compiled here runs; the figures read come from the HLO passes, buffer assignment and the
# partitioned HLO, which these options leave alone (measured on jax 0.10: every figure of a GPT's
# embed/block/head profiles equal with and without them, about 40 % less compile CPU).
ANALYSIS_ONLY = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _compile(lowered):
    return lowered.compile(compiler_options=ANALYSIS_ONLY)


def _figures(compiled, n: int) -> dict:
    from orchestrator.core.planner.profile import count_kernels, parse_collectives

    cost = compiled.cost_analysis()
    if isinstance(cost, list):  # older jax returned one dict per program
        cost = cost[0] if cost else {}
    mem = compiled.memory_analysis()
    text = compiled.as_text()
    return {"flops": float(cost.get("flops", 0.0)), "bytes": float(cost.get("bytes accessed", 0.0)),
            "out": float(getattr(mem, "output_size_in_bytes", 0)),
            "temp": float(getattr(mem, "temp_size_in_bytes", 0)),
            "colls": parse_collectives(text, n), "kernels": count_kernels(text)}


def _device_bytes(leaves) -> float:
    """Bytes one device holds of `leaves` (shape structs; a leaf without a sharding counts whole)."""
    import math

    import numpy as np

    total = 0.0
    for leaf in leaves:
        sh = getattr(leaf, "sharding", None)
        shape = sh.shard_shape(tuple(leaf.shape)) if sh is not None and hasattr(sh, "shard_shape") else leaf.shape
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return float(total)


def _program(source: dict, req: dict, memo: dict):
    """The request's layer program, built through `memo`: the model once per source, and the
    last (layer, M, rules) program kept, so the batch-1 and batch-2 requests share one."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    m = int(req["model_size"])
    src = json.dumps(source, sort_keys=True)
    if memo.get("source") != src:
        memo.clear()
        memo["source"], memo["built"] = src, build_source(source)
    key = (int(req["layer"]), m, tuple(tuple(r) for r in req["rules"]))
    if memo.get("key") != key:
        mesh = Mesh(np.array(jax.devices()[:m]).reshape(1, m), ("data", "model"))
        layout = {"batch": "data", **{k: v for k, v in req["rules"]}}
        memo["key"], memo["prog"] = key, build_layer(source, key[0], mesh, layout, memo["built"])
    return memo["prog"]


def profile_one(source: dict, req: dict, memo: dict | None = None) -> dict:
    """One request's profile (see the module docstring); `memo`: a dict kept across the calls of
    one run, so the model is built once and equal programs are reused."""
    import jax
    import jax.numpy as jnp

    m = int(req["model_size"])
    t0 = time.perf_counter()
    prog, spec = _program(source, req, {} if memo is None else memo)
    b = int(req["batch"])

    def sds(shape, dtype, sh):
        return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sh)

    def param_structs():
        return [jax.tree.map(lambda s, sh: sds(s.shape, s.dtype, sh), tree, shard)
                for tree, shard in zip(prog.param_trees(), prog.param_shardings())]

    params = param_structs()
    xs = [sds(leaf.batched(b), leaf.dtype, sh) for leaf, sh in zip(prog.in_leaves, prog.input_shardings())]
    args = [params, xs]
    if prog.last:
        args.append(sds(spec.label.batched(b), spec.label.dtype, prog.label_sharding()))
    if prog.stateful:       # labels (None off the last stage), ids, the parts' mutable state
        key = jax.eval_shape(lambda: jax.random.key(0))
        mstate = [None if part.state_init is None else jax.tree.map(
            lambda s: sds(s.shape, s.dtype, prog.state_sharding()), jax.eval_shape(part.state_init, key))
            for part in prog.parts]
        args = args + ([None] if not prog.last else []) + [None, mstate]
    fwd = _compile(prog.jitted_fwd().lower(*args))
    y_info, res_info = fwd.out_info[:2]
    dy = sds((), "float32", None) if prog.last else [y_info[i] for i in prog.out_diff]
    bwd = _compile(prog.bwd_acc.lower(params, res_info, dy, param_structs()))
    f, g = _figures(fwd, m), _figures(bwd, m)
    # zero-bubble: the backward cut into I and W as the stage worker cuts it (stages.zb_split)
    zb = prog.zero_bubble(params, res_info, dy)
    i_prog = _compile(zb.jit_i.lower(params, res_info, dy))
    held = zb.split.held(res_info, dy, i_prog.out_info[1])
    w_prog = _compile(zb.jit_w_acc.lower(params, held, param_structs()))
    i, w = _figures(i_prog, m), _figures(w_prog, m)
    fused = None
    if prog.last:       # the loss layer's F and B as one program (pipeline.fuse_loss_chunk): its temp
        extra = [None, mstate] if prog.stateful else []
        fused = _figures(_compile(prog.fwd_bwd_acc.lower(params, xs, args[2], None, param_structs(), *extra)),
                         m)["temp"]
    colls = [["fwd", k, by, [list(x) for x in gs]] for k, by, gs in f["colls"]]
    colls += [["bwd", k, by, [list(x) for x in gs]] for k, by, gs in g["colls"]]
    for phase, fig in (("i", i), ("w", w)):
        colls += [[phase, k, by, [list(x) for x in gs]] for k, by, gs in fig["colls"]]
    return {"flops": {"fwd": f["flops"], "bwd": g["flops"], "i": i["flops"], "w": w["flops"]},
            "bytes_accessed": {"fwd": f["bytes"], "bwd": g["bytes"], "i": i["bytes"], "w": w["bytes"]},
            "residual_bytes": f["out"], "temp_bytes": max(f["temp"], g["temp"]),
            "held_bytes": _device_bytes(held), "split_temp_bytes": max(f["temp"], i["temp"], w["temp"]),
            "collectives": colls, "compile_s": time.perf_counter() - t0,
            "kernels": {"fwd": f["kernels"], "bwd": g["kernels"], "i": i["kernels"], "w": w["kernels"]},
            **({"fused_temp_bytes": fused} if fused is not None else {})}


def main() -> int:
    from orchestrator.core.planner.profile import PROTOCOL

    request = json.loads(sys.stdin.read())
    if request.get("protocol") != PROTOCOL:
        print(f"aot_profile: unsupported protocol {request.get('protocol')!r}", file=sys.stderr)
        return 2
    memo: dict = {}
    for req in request["requests"]:
        try:
            line = {"key": req["key"], "profile": profile_one(request["source"], req, memo)}
        except Exception as e:  # noqa: BLE001 - report which program failed and go on with the others
            line = {"key": req["key"], "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
