"""TPU without a TPU: compile meshpipe's stage programs ahead of time for a v5e-16 slice and
report XLA's memory per chip, with the `libtpu` wheel on a CPU-only machine.

`jax.experimental.topologies.get_topology_desc("v5e:4x4", "tpu")` gives compile-only devices
of a 16-chip v5e slice (4 hosts × 4 chips, each device with its ICI coordinates and the
process that would drive it). Each pipeline stage is a submesh of that one world: stage s
takes the chips of hosts {2s, 2s + 1} (8 chips, the ICI-aligned 2x4 subslice meshpipe's
`tpu_topology.aligned_block` names for two consecutive workers), with the stage's mesh and
layout. For each stage the script builds the `stages.program.StageProgram` the stage worker
would (same model front-end, optimizer, layout), lowers its forward, its backward +
accumulate and its optimizer update on `ShapeDtypeStruct`s sharded over the submesh, compiles
them with the TPU compiler, and reads `compiled.memory_analysis()` per program (per chip:
arguments, outputs, temporaries, generated code). A stage's peak per chip is then assembled
as the runtime holds it under 1F1B: the update's arguments (parameters, optimizer state,
gradient accumulator) + in-flight microbatches × the forward's outputs (residuals + the
activation) + the largest temporary of the three programs — next to the chip's 16 GB HBM.

It also checks the sub-slice arithmetic against what libtpu itself says: the chips of each
stage's hosts form one contiguous block of the 4x4 torus, and Ray's own
`_get_physical_worker_id_from_coords` maps each host's chip coordinates to the host index.

Configs: `readme` is examples/gpt.yaml's GPT (d_model 64, 2 blocks) on two 8-chip stages;
`gpt1b` a 24-block d_model 2048 GPT with remat, `gpt1b-no-remat` the same without (XLA refuses
it: the refusal and the bytes it asked for are the result), `gpt7b` a 32-block d_model 4096 GPT.
A program XLA refuses is recorded with its error (`errors`, with the bytes an out-of-memory
refusal names). If libtpu is missing or cannot load, the JSON says exactly what failed.

Run: `python -m benchmarks.tpu_aot [--configs readme,gpt1b]`; writes
benchmarks/results/tpu_aot.json (or `--out`). Imports jax, meshpipe's `stages` and
`orchestrator.core`; never ray's runtime (only its pure TPU helpers module).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RESULTS = Path(__file__).resolve().parent / "results"
TOPOLOGY = ("v5e:4x4", "v5litepod-16", "4x4")       # jax topology name, GCP type, Ray topology
HBM_BYTES = 16e9
CONFIGS = {
    "readme": {"args": {"vocab": 128, "d_model": 64, "heads": 4, "d_mlp": 256, "blocks": 2},
               "seq_len": 32, "microbatch": 4, "microbatches": 4, "mesh": {"data": 2, "model": 4}},
    # a 1.3B GPT: 24 blocks of d_model 2048, 2048 tokens; the first try (8 sequences per microbatch,
    # {data 2, model 4}, no remat) needs ~27 GB of temporaries per chip, so: 4 sequences, model 8, remat
    "gpt1b": {"args": {"vocab": 32768, "d_model": 2048, "heads": 16, "d_mlp": 8192, "blocks": 24},
              "seq_len": 2048, "microbatch": 4, "microbatches": 8, "mesh": {"data": 1, "model": 8},
              "compute": "bfloat16", "remat": "full"},
    "gpt1b-no-remat": {"args": {"vocab": 32768, "d_model": 2048, "heads": 16, "d_mlp": 8192, "blocks": 24},
                       "seq_len": 2048, "microbatch": 8, "microbatches": 8, "mesh": {"data": 2, "model": 4},
                       "compute": "bfloat16"},
    # a 6.7B GPT (Llama-7B-sized: 32 blocks of d_model 4096) on 2 × 8 v5e chips
    "gpt7b": {"args": {"vocab": 32768, "d_model": 4096, "heads": 32, "d_mlp": 16384, "blocks": 32},
              "seq_len": 2048, "microbatch": 2, "microbatches": 8, "mesh": {"data": 1, "model": 8},
              "compute": "bfloat16", "remat": "full"},
}
LAYOUT = {"batch": "data", "heads": "model", "mlp": "model", "vocab": "model"}
OPTIMIZER = {"name": "adam", "args": {"learning_rate": 1e-4}}


def versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version(), "machine": platform.machine()}
    for pkg in ("jax", "jaxlib", "libtpu", "ray"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def topology():
    """(devices of the v5e-16 topology, None) or (None, {"error": ..., "what_it_would_take": ...})."""
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", TOPOLOGY[1])    # silences libtpu's metadata-server probe
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    try:
        from jax.experimental import topologies

        desc = topologies.get_topology_desc(TOPOLOGY[0], "tpu", chips_per_host_bounds=(2, 2, 1), num_slices=1)
        return list(desc.devices), None
    except Exception as e:  # noqa: BLE001 - the record of why is the result
        return None, {"error": f"{type(e).__name__}: {e}",
                      "what_it_would_take": "the libtpu wheel matching this jax (jax[tpu]'s pin: "
                                            "pip install 'jax[tpu]==<jax version>' or the libtpu pin in jax's "
                                            "metadata) on x86-64 Linux; no TPU is needed to compile"}


def subslices(devices) -> list[dict]:
    """Per stage (hosts 2s, 2s+1): its chips' coordinates, whether they form one contiguous block,
    meshpipe's `aligned_block` for those workers, and Ray's physical worker id per host."""
    from ray._private.accelerators.tpu import _get_physical_worker_id_from_coords

    from orchestrator.core.backends.tpu_topology import aligned_block, geometry

    geom = geometry(TOPOLOGY[1], TOPOLOGY[2])
    by_host: dict[int, list] = {}
    for d in devices:
        by_host.setdefault(d.process_index, []).append(list(d.coords)[:2])
    out = []
    for s in range(geom.hosts // 2):
        hosts = [2 * s, 2 * s + 1]
        coords = [c for h in hosts for c in by_host[h]]
        xs, ys = sorted({c[0] for c in coords}), sorted({c[1] for c in coords})
        block = len(coords) == len(xs) * len(ys) and xs == list(range(xs[0], xs[-1] + 1)) \
            and ys == list(range(ys[0], ys[-1] + 1))
        out.append({"stage": s, "hosts": hosts, "coords": coords, "contiguous_block": block,
                    "block_shape": [len(xs), len(ys)], "meshpipe_aligned_block": aligned_block(geom, hosts[0], 2),
                    "ray_physical_worker_ids": [_get_physical_worker_id_from_coords(by_host[h], TOPOLOGY[2])
                                                for h in hosts]})
    return out


def _mem(compiled) -> dict:
    m = compiled.memory_analysis()
    return {k: int(getattr(m, f"{k}_size_in_bytes", 0)) for k in ("argument", "output", "alias", "temp",
                                                                    "generated_code")}


def stage_programs(cfg: dict, devices, stage: int, stages: int = 2) -> dict:
    """Compile one stage's F, B+accumulate and update for the TPU topology; XLA's bytes per chip."""
    import math

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh

    from orchestrator.core.schedule import generate, lower, simulate
    from stages.aot_profile import build_source
    from stages.program import StageProgram

    source = {"kind": "modelspec", "name": "gpt", "args": cfg["args"], "seq_len": cfg["seq_len"],
              "compute": cfg.get("compute", "float32")}
    spec, model = build_source(source)
    L = spec.num_layers
    cuts = [round(i * L / stages) for i in range(stages + 1)]
    mine = sorted((d for d in devices if d.process_index in (2 * stage, 2 * stage + 1)), key=lambda d: d.id)
    mesh = Mesh(np.array(mine).reshape(tuple(cfg["mesh"].values())), tuple(cfg["mesh"]))
    prog = StageProgram(spec, model, cuts[stage], cuts[stage + 1], microbatches=cfg["microbatches"],
                        optimizer=OPTIMIZER, mesh=mesh, layout=LAYOUT, remat=cfg.get("remat", "none"))
    b = cfg["microbatch"]

    def sds(shape, dtype, sh):
        return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sh)

    def params():
        return [jax.tree.map(lambda s, sh: sds(s.shape, s.dtype, sh), tree, shard)
                for tree, shard in zip(prog.param_trees(), prog.param_shardings())]

    t0 = time.perf_counter()
    mem, errors = {}, {}
    xs = [sds(leaf.batched(b), leaf.dtype, sh) for leaf, sh in zip(prog.in_leaves, prog.input_shardings())]
    args = [params(), xs] + ([sds(spec.label.batched(b), spec.label.dtype, prog.label_sharding())] if prog.last else [])
    fwd = _try(lambda: prog.jitted_fwd().lower(*args).compile(), "F", mem, errors)
    if fwd is not None:
        y_info, res_info = fwd.out_info[:2]
        dy = sds((), "float32", None) if prog.last else [y_info[i] for i in prog.out_diff]
        _try(lambda: prog.bwd_acc.lower(params(), res_info, dy, params()).compile(), "B", mem, errors)
    # the optimizer state as the update keeps it after its first step: each parameter-shaped leaf sharded
    # like its parameter (XLA's propagation gives that), the rest (adam's count) replicated
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    shapes = jax.eval_shape(prog.tx.init, params())
    opt_info = optax.tree_map_params(prog.tx, lambda s, p: sds(s.shape, s.dtype, p.sharding), shapes, params(),
                                     transform_non_params=lambda s: sds(s.shape, s.dtype, rep))
    # ... and where a bare `jax.jit(tx.init)` puts it (what `StageProgram.init_state` did before it gave
    # the optimizer state its parameters' shardings)
    init_out = jax.jit(prog.tx.init).lower(params()).compile().out_info
    init_bytes = {}
    for leaf in jax.tree.leaves(init_out):
        for d in leaf.sharding.device_set:
            n = math.prod(leaf.sharding.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize
            init_bytes[str(d)] = init_bytes.get(str(d), 0) + n
    opt_init = {"devices": len(init_bytes), "max_bytes_on_one_device": max(init_bytes.values(), default=0),
                "steady_bytes_per_chip": sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
                                             for x in jax.tree.leaves(opt_info))}
    _try(lambda: prog.update.lower(params(), opt_info, params()).compile(), "OPT", mem, errors)
    out = {"stage": stage, "layers": [cuts[stage], cuts[stage + 1]], "chips": len(mine), "mesh": cfg["mesh"],
           "device_kind": mine[0].device_kind, "programs": mem, "optimizer_state_at_init": opt_init,
           "compile_s": time.perf_counter() - t0}
    if errors:
        out["errors"] = errors
        return out
    inflight = simulate(lower(generate("1f1b", stages, cfg["microbatches"])), {"F": 1, "B": 2}).peak_inflight[stage]
    held = mem["OPT"]["argument"]                      # parameters + optimizer state + gradient accumulator
    stash = inflight * mem["F"]["output"]              # residuals + activation of each microbatch in flight
    temp = max(m["temp"] for m in mem.values())
    code = sum(m["generated_code"] for m in mem.values())
    peak = held + stash + temp + code
    out.update(inflight=inflight, per_chip={"params_opt_grads": held, "stash": stash, "temp": temp, "code": code,
                                            "peak": peak, "hbm": HBM_BYTES, "fits": peak <= HBM_BYTES})
    return out


def _try(compile_fn, name: str, mem: dict, errors: dict):
    """Compile one program; its memory_analysis into `mem`, or what XLA said into `errors`
    (an out-of-memory refusal names the bytes it needed: `required_bytes`)."""
    import re

    try:
        compiled = compile_fn()
    except Exception as e:  # noqa: BLE001 - XLA refusing a program is a finding
        msg = str(e).splitlines()[0][:400]
        rec = {"error": f"{type(e).__name__}: {msg}"}
        m = re.search(r"required for HLO temporaries \(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)", msg)
        if m:
            unit = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
            rec.update(required_temp_bytes=float(m.group(1)) * unit[m.group(2)],
                       available_bytes=float(m.group(3)) * unit[m.group(4)])
        errors[name] = rec
        return None
    mem[name] = _mem(compiled)
    return compiled


def run(configs, budget_s: float = 900.0) -> dict:
    t0 = time.perf_counter()
    out = {"what": "stage programs compiled ahead of time for a TPU v5e-16 slice (compile-only devices from "
                   "libtpu); XLA's memory_analysis per chip; nothing ran on a TPU",
           "topology": {"jax_name": TOPOLOGY[0], "type": TOPOLOGY[1], "ray_topology": TOPOLOGY[2]},
           "versions": versions(), "configs": {}}
    devices, failure = topology()
    if failure is not None:
        out["libtpu"] = {"loaded": False, **failure}
        return out
    out["libtpu"] = {"loaded": True, "devices": len(devices), "device_kind": devices[0].device_kind,
                     "processes": len({d.process_index for d in devices})}
    out["subslices"] = subslices(devices)
    for name in configs:
        cfg = CONFIGS[name]
        rec = {"config": cfg, "stages": []}
        for s in range(2):
            if time.perf_counter() - t0 > budget_s:
                rec["skipped"] = f"budget of {budget_s:g} s spent"
                break
            try:
                rec["stages"].append(stage_programs(cfg, devices, s))
            except Exception as e:  # noqa: BLE001 - a config that cannot be built is a finding
                rec["stages"].append({"stage": s, "errors": {"build": {
                    "error": f"{type(e).__name__}: {str(e).splitlines()[0][:400]}"}}})
        out["configs"][name] = rec
    out["wall_s"] = time.perf_counter() - t0
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="readme,gpt1b,gpt1b-no-remat,gpt7b")
    ap.add_argument("--budget-s", type=float, default=900.0)
    ap.add_argument("--out", type=Path, default=RESULTS / "tpu_aot.json")
    args = ap.parse_args(argv)
    names = [c for c in args.configs.split(",") if c]
    bad = [c for c in names if c not in CONFIGS]
    if bad:
        ap.error(f"--configs: unknown {bad}; known: {', '.join(CONFIGS)}")
    res = run(names, args.budget_s)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1, default=str) + "\n")
    if not res["libtpu"]["loaded"]:
        print(f"libtpu did not load: {res['libtpu']['error']}")
        return 1
    for s in res["subslices"]:
        print(f"stage {s['stage']} hosts {s['hosts']}: chips block {s['block_shape']} contiguous "
              f"{s['contiguous_block']}, meshpipe {s['meshpipe_aligned_block']}, Ray ids {s['ray_physical_worker_ids']}")
    for name, rec in res["configs"].items():
        for st in rec["stages"]:
            if "errors" in st:
                for prog, err in st["errors"].items():
                    print(f"{name} stage {st['stage']} {prog}: {err['error'][:200]}")
                continue
            pc = st["per_chip"]
            print(f"{name} stage {st['stage']} layers {st['layers']} on {st['chips']} {st['device_kind']} chips "
                  f"{st['mesh']}: peak {pc['peak'] / 2**30:.3f} GiB per chip (params+opt+grads "
                  f"{pc['params_opt_grads'] / 2**30:.3f}, stash {pc['stash'] / 2**30:.3f}, temp {pc['temp'] / 2**30:.3f})"
                  f" of {pc['hbm'] / 1e9:g} GB; compiled in {st['compile_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
