"""One pipeline stage's programs on whatever JAX backend is present: times, memory, numerics.

For one stage of the built-in GPT (`stages/models/gpt_impl.py`; the last stage by default:
`--layers` blocks and the head with its loss, so every program exists; `--stage middle`: blocks
only, with an output gradient), in float32 and bfloat16 compute (`precision.compute`:
parameters and gradients float32, activations in the compute dtype), this times each program
`stages.program.StageProgram` builds, alone on one device:

  F   the forward (keeps the residuals)         B   the backward, accumulating
  I   the zero-bubble input gradient            W   the weight gradients from what I held
  FB  F and B as one program (last stage)       ref jax.value_and_grad of the same stage function

(median of `--reps` calls after `--warmup`, each to `block_until_ready`; compiled ahead of time,
so no call compiles), and reports (I + W) ÷ B and FB ÷ (F + B).

Memory, per program: XLA's own buffer assignment (`compiled.memory_analysis()`: arguments,
outputs, aliased, temporaries) and the device's counters. With `Device.memory_stats()` (GPU,
TPU) the peak is `peak_bytes_in_use`, a high-water mark JAX cannot reset; so the programs run
once each in the order of XLA's estimated peak, smallest first, every input allocated fresh
(zeros of the right shapes: values do not change memory), and a program's measured peak is
reported only when it raised the high-water mark (`peak_resolved`), else left None. Without
memory stats (XLA:CPU) the bytes in use are those of `jax.live_arrays()` and there is no peak.
Each program's retained bytes (in use after − before, inputs still alive) are compared with
the prediction from its outputs' shapes (`benchmarks.stage_bytes`, the sizes
`orchestrator.core.schedule.stash_timeline` takes): F keeps residuals + output; I keeps
what W reads (measured after dropping the residuals, as the worker does: `held_after_release`).

Numerics, on this backend, from random inputs: the parameter and input gradients of B, of
I then W, of FB and of ref, compared leaf by leaf as max |a − b| ÷ max |b| (1 is the leaf's
scale); bit-exact equality is reported too. Tolerances: `TOLERANCE` (float32 allows for
XLA's fusion choices and TF32 matmuls on GPU by default; bfloat16 for elementwise chains XLA
computes unrounded inside a fusion in one program and rounded between two in another).

Imports jax, numpy, meshpipe's `stages` and `orchestrator.core`, and `benchmarks.stage_bytes`
(jax and `stages` only) — never ray (the JSON records `ray_imported`, and the run fails if it
is). Run from the repository root:

    PYTHONPATH=. python3 benchmarks/gpu_stage_check.py --size gpu     # one H200: < 4 min
    python -m benchmarks.gpu_stage_check --size small                  # CPU smoke test, < 1 min

Writes JSON to $OUT/gpu_stage_check.json if OUT is set, else
benchmarks/results/gpu_stage_check.json (`--out` overrides); rewritten after each phase, so a
run cut short keeps what it measured. `--budget-s` skips what is left once that much time
has passed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if __package__ in (None, ""):       # run as a file: the repository root holds stages/, orchestrator/, benchmarks/
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# sizes: GPT arguments, blocks per stage, sequence length, sequences per microbatch
SIZES = {
    "small": {"d_model": 128, "heads": 4, "d_mlp": 512, "vocab": 256, "layers": 2, "seq": 64, "mbs": 4},
    "gpu": {"d_model": 2048, "heads": 16, "d_mlp": 8192, "vocab": 32768, "layers": 8, "seq": 1024, "mbs": 8},
}
DTYPES = ("float32", "bfloat16")
PROGRAMS = ("F", "B", "I", "W", "FB", "ref")
TOLERANCE = {"float32": 2e-4, "bfloat16": 3e-2}     # max |a − b| ÷ max |b|, per leaf


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    for key in SIZES["small"]:
        ap.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help=f"override the size's {key}")
    ap.add_argument("--stage", choices=("last", "middle"), default="last")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=200.0, help="skip what is left after this many seconds")
    ap.add_argument("--compile-threads", type=int, default=None,
                    help="parallel compiles (default: 1 on GPU, where XLA autotunes on the device; else up to 8)")
    ap.add_argument("--cache-dir", default=None, help="JAX persistent compilation cache (a rerun compiles nothing)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dims = dict(SIZES[args.size])
    for key in dims:
        if getattr(args, key) is not None:
            dims[key] = getattr(args, key)
    for key, value in dims.items():
        if value < 1:
            raise SystemExit(f"--{key.replace('_', '-')}={value}: must be >= 1")
    if dims["d_model"] % dims["heads"]:
        raise SystemExit(f"--d-model={dims['d_model']} is not divisible by --heads={dims['heads']}")
    bad = [d for d in args.dtypes.split(",") if d not in DTYPES]
    if bad:
        raise SystemExit(f"--dtypes: {bad} unknown; known: {', '.join(DTYPES)}")
    args.dims = dims
    return args


def out_path(args) -> Path:
    if args.out:
        return Path(args.out)
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu_stage_check.json"
    return Path(__file__).resolve().parent / "results" / "gpu_stage_check.json"


# ----------------------------------------------------------------------------- device memory

class DeviceMemory:
    """Bytes in use on one device, and its peak where the platform keeps one."""

    def __init__(self, device):
        self.device = device
        stats = device.memory_stats()
        self.source = "memory_stats" if stats and "bytes_in_use" in stats else "live_arrays"

    def in_use(self) -> int:
        import jax

        if self.source == "memory_stats":
            return int(self.device.memory_stats()["bytes_in_use"])
        return sum(a.nbytes for a in jax.live_arrays() if self.device in a.devices())

    def peak(self):
        if self.source != "memory_stats":
            return None
        return int(self.device.memory_stats().get("peak_bytes_in_use", -1))


def xla_memory(compiled) -> dict:
    """XLA's buffer assignment of one compiled program (bytes)."""
    try:
        m = compiled.memory_analysis()
    except Exception as e:  # noqa: BLE001 - a platform without it: say so, keep measuring
        return {"error": f"{type(e).__name__}: {e}"}
    if m is None:
        return {}
    got = {k: int(getattr(m, f"{k}_size_in_bytes", 0)) for k in ("argument", "output", "alias", "temp")}
    got["peak_estimate"] = got["argument"] + got["output"] - got["alias"] + got["temp"]
    return got


# ----------------------------------------------------------------------------- the stage

class Stage:
    """One dtype's stage program, its operands (shapes) and its programs compiled ahead of time."""

    def __init__(self, dims: dict, stage: str, dtype: str):
        import jax
        import jax.numpy as jnp

        from benchmarks.stage_bytes import kept_bytes, stage_operands, tree_bytes
        from orchestrator.core.model.policy import with_compute_dtype
        from orchestrator.core.model.registry import build_model, build_spec
        from stages.program import StageProgram, make_optimizer

        n = dims["layers"]
        blocks = 2 * n if stage == "last" else 3 * n
        args = {k: dims[k] for k in ("vocab", "d_model", "heads", "d_mlp")} | {"blocks": blocks}
        spec = with_compute_dtype(build_spec("gpt", args, dims["seq"]), dtype)
        self.model = build_model(spec.factory, spec.args)
        start, stop = (1 + n, 2 + 2 * n) if stage == "last" else (1 + n, 1 + 2 * n)
        self.prog = prog = StageProgram(spec, self.model, start, stop, microbatches=1,
                                        optimizer=make_optimizer("sgd", {"learning_rate": 0.1}))
        self.dtype, self.layers = dtype, [start, stop]
        self.params_s, xs_s, self.labels_s = stage_operands(prog, dims["mbs"], dims["seq"], dims["d_model"])
        self.x_s = xs_s[0]
        self.kept = kept_bytes(prog, self.params_s, xs_s, self.labels_s)     # traces F (sets its VJP layout)
        y_s, self.res_s = jax.eval_shape(prog.fwd, self.params_s, xs_s, self.labels_s)[:2]
        self.y_s = y_s
        self.dys_s = None if prog.last else [y_s[i] for i in prog.out_diff]
        self.zb = zb = prog.zero_bubble(self.params_s, self.res_s, self.dys_s)
        _, carried_s = jax.eval_shape(zb.split.run_i, self.params_s, self.res_s, self.dys_s)
        self.carried_s = carried_s
        self.held_s = zb.split.held(self.res_s, self.dys_s, carried_s)
        self.param_bytes = tree_bytes(self.params_s)
        self.tree_bytes = tree_bytes
        self.jnp = jnp

    def objective(self):
        """The stage as a plain function, (params, x, labels or dy) -> scalar, with the precision
        policy's casts (`stages.program`): params and input in the compute dtype, each part's
        output in it; the last stage's loss in float32, a middle stage's <output, dy>."""
        import jax
        import jax.numpy as jnp

        compute = jnp.dtype(self.dtype)

        def cast(tree):
            return jax.tree.map(lambda a: a.astype(compute) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)

        parts, last, loss = self.prog.parts, self.prog.last, self.model.loss

        def f(params, x, other):
            z = cast(x)
            for part, p in zip(parts, params):
                z = cast(part.apply(cast(p), z, rng=None, train=True))
            if last:
                return loss(z.astype(jnp.float32), other).astype(jnp.float32)
            return jnp.sum(z.astype(jnp.float32) * other.astype(jnp.float32))
        return f

    def jitted(self) -> dict:
        """Per program: (jitted function, argument shapes)."""
        import jax

        prog, p, x, lab = self.prog, self.params_s, [self.x_s], self.labels_s
        acc = self.params_s
        other = lab if prog.last else self.dys_s[0]
        out = {"F": (prog.jitted_fwd(), (p, x, lab, None)),
               "B": (prog.bwd_acc, (p, self.res_s, self.dys_s, acc)),
               "I": (self.zb.jit_i, (p, self.res_s, self.dys_s)),
               "W": (self.zb.jit_w_acc, (p, self.held_s, acc)),
               "ref": (jax.jit(jax.value_and_grad(self.objective(), argnums=(0, 1))), (p, self.x_s, other))}
        if prog.last:
            out["FB"] = (prog.fwd_bwd_acc, (p, x, lab, None, acc))
        return out

    def predicted_retained(self, name: str) -> int:
        """Bytes a program's outputs add while its inputs stay alive (their shapes)."""
        k = self.kept
        return {"F": k["F"] + k["output"], "B": k["dx"] + self.param_bytes,
                "I": k["dx"] + self.tree_bytes(self.carried_s), "W": self.param_bytes,
                "FB": k["dx"] + 4, "ref": 4 + self.param_bytes + self.tree_bytes(self.x_s)}.get(name)


def zeros(tree):
    """Device arrays of zeros shaped as `tree` (shape structs), made on the device in one program."""
    import jax
    import jax.numpy as jnp

    leaves, treedef = jax.tree.flatten(tree)
    made = jax.jit(lambda: [jnp.zeros(s.shape, s.dtype) for s in leaves])()
    return jax.block_until_ready(jax.tree.unflatten(treedef, made))


# ----------------------------------------------------------------------------- phases

def compile_all(stages: dict, record: dict, threads: int) -> dict:
    """AOT-compile every program of every dtype: traced and lowered here, compiled in `threads`
    threads (XLA compiles without holding the GIL; on GPU its autotuner times kernels on the
    device, so there one at a time, lest concurrent compiles skew its choices)."""
    lowered = {}
    for dtype, st in stages.items():
        for name, (fn, args) in st.jitted().items():
            t = time.perf_counter()
            lowered[(dtype, name)] = (fn.lower(*args), time.perf_counter() - t)

    def one(item):
        low, trace_s = item
        t = time.perf_counter()
        return low.compile(), trace_s, time.perf_counter() - t

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        done = dict(zip(lowered, pool.map(one, lowered.values())))
    for (dtype, name), (compiled, trace_s, compile_s) in done.items():
        record[dtype].setdefault("lower_s", {})[name] = round(trace_s, 3)
        record[dtype].setdefault("compile_s", {})[name] = round(compile_s, 3)
        record[dtype].setdefault("memory", {})[name] = {"xla": xla_memory(compiled)}
    return {key: compiled for key, (compiled, _, _) in done.items()}


def memory_pass(stages: dict, compiled: dict, mem: DeviceMemory, params, record: dict) -> None:
    """Each program once, inputs fresh, in the order of XLA's estimated peak (module docstring)."""
    import jax

    order = sorted(compiled, key=lambda k: record[k[0]]["memory"][k[1]]["xla"].get("peak_estimate", 0))
    for n, (dtype, name) in enumerate(order):
        st, rec = stages[dtype], record[dtype]["memory"][name]
        _, args_s = st.jitted()[name]
        args = [params] + [zeros(a) if a is not None else None for a in args_s[1:]]
        before, high = mem.in_use(), mem.peak()
        out = jax.block_until_ready(compiled[(dtype, name)](*args))
        after, peak = mem.in_use(), mem.peak()
        resolved = peak is not None and peak > high
        rec.update({"order": n, "source": mem.source, "in_use_before": before, "in_use_after": after,
                    "retained": after - before, "predicted_retained": st.predicted_retained(name),
                    "high_water_before": high, "peak_after": peak, "peak_resolved": resolved,
                    "peak_above_inputs": peak - before if resolved else None})
        if name == "I":     # drop the residuals as the worker does: what is left is what W reads (+ dx)
            base = before - st.tree_bytes(args[1:])                 # params (+ anything persistent)
            held = st.zb.split.held(args[1], args[2], out[1])
            dx = out[0]
            del args, out
            rec.update({"held_after_release": mem.in_use() - base, "predicted_held": st.kept["I"] + st.kept["dx"],
                        "held_leaves": len(held)})
            del held, dx
        else:
            del args, out


def compare(a, b) -> dict:
    """Leaf by leaf on the device: worst max |a − b| ÷ max |b|, and whether all are bit-equal."""
    import jax
    import jax.numpy as jnp

    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    if [x.shape for x in la] != [x.shape for x in lb]:
        return {"max_rel_err": float("inf"), "bit_exact": False, "note": "shapes differ"}

    @jax.jit
    def stats(la, lb):
        out = []
        for u, v in zip(la, lb):
            u32, v32 = u.astype(jnp.float32), v.astype(jnp.float32)
            out.append((jnp.max(jnp.abs(u32 - v32)), jnp.max(jnp.abs(v32)), jnp.all(u == v)))
        return out

    worst, exact = 0.0, True
    for diff, scale, eq in jax.device_get(stats(la, lb)):
        diff, scale = float(diff), float(scale)
        worst = max(worst, diff / scale if scale else (0.0 if diff == 0 else float("inf")))
        exact = exact and bool(eq)
    return {"max_rel_err": worst, "bit_exact": exact}


def time_and_check(st, compiled: dict, params, reps: int, warmup: int, rec: dict) -> None:
    """One dtype: real (random) inputs; each program `warmup` + `reps` times, median seconds; then
    the gradients of B, I+W, FB and ref compared (module docstring)."""
    import jax
    import numpy as np

    rng = np.random.default_rng(0)
    prog, dtype = st.prog, st.dtype
    x = jax.device_put(rng.standard_normal(st.x_s.shape).astype(st.x_s.dtype))
    lab = (jax.device_put(rng.integers(0, prog.spec.args["vocab"], st.labels_s.shape).astype(np.int32))
           if prog.last else None)
    dys = None if prog.last else [jax.device_put(rng.standard_normal(s.shape).astype(s.dtype)) for s in st.dys_s]
    other = lab if prog.last else dys[0]
    zero = zeros(st.params_s)
    c = {name: compiled[(dtype, name)] for name in PROGRAMS if (dtype, name) in compiled}
    res = c["F"](params, [x], lab, None)[1]
    dx_i, carried = c["I"](params, res, dys)
    held = st.zb.split.held(res, dys, carried)
    del carried
    calls = {"F": lambda: c["F"](params, [x], lab, None), "B": lambda: c["B"](params, res, dys, zero),  # noqa: F821
             "I": lambda: c["I"](params, res, dys), "W": lambda: c["W"](params, held, zero),  # noqa: F821
             "ref": lambda: c["ref"](params, x, other)}
    if "FB" in c:
        acc = [zeros(st.params_s)]

        def fb():
            loss, dx, acc[0] = c["FB"](params, [x], lab, None, acc[0])
            return loss, dx, acc[0]
        calls["FB"] = fb
    times, keep = {}, {}
    for name, call in calls.items():
        ts, out = [], None
        for i in range(warmup + reps):
            out = None
            t = time.perf_counter()
            out = jax.block_until_ready(call())
            if i >= warmup:
                ts.append(time.perf_counter() - t)
        times[name] = statistics.median(ts)
        if name in ("B", "W", "ref"):
            keep[name] = out
        del out
    del res, held, calls
    rec["time_s"] = times
    rec["ratios"] = {"IW_over_B": (times["I"] + times["W"]) / times["B"]}
    if "FB" in times:
        rec["ratios"]["FB_over_F_plus_B"] = times["FB"] / (times["F"] + times["B"])
        del acc
        keep["FB"] = c["FB"](params, [x], lab, None, zeros(st.params_s))    # one call's gradients alone
    dx_b, g_b = keep["B"]
    g_w = keep["W"]
    ref_val, (g_ref, dx_ref) = keep["ref"]
    pairs = {"grads B vs I+W": (g_w, g_b), "grads B vs ref": (g_b, g_ref), "grads I+W vs ref": (g_w, g_ref),
             "dx I vs B": (dx_i, dx_b), "dx B vs ref": (dx_b, [dx_ref])}
    if "FB" in keep:
        loss, dx_fb, g_fb = keep["FB"]
        pairs.update({"grads FB vs ref": (g_fb, g_ref), "dx FB vs ref": (dx_fb, [dx_ref]),
                      "loss FB vs ref": (loss, ref_val)})
    tol = TOLERANCE[dtype]
    got = {what: compare(a, b) for what, (a, b) in pairs.items()}
    for r in got.values():
        r["ok"] = r["max_rel_err"] <= tol
    rec["numerics"] = {"tolerance": tol, "pairs": got, "ok": all(r["ok"] for r in got.values())}


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    deadline = t0 + args.budget_s
    path = out_path(args)
    import jax

    if args.cache_dir:
        jax.config.update("jax_compilation_cache_dir", args.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    device = jax.devices()[0]
    dtypes = args.dtypes.split(",")
    raw: dict = {
        "what": "benchmarks/gpu_stage_check.py: one stage's programs timed alone; memory; numerics",
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:], "size": args.size,
        "dims": args.dims, "stage": args.stage, "reps": args.reps, "warmup": args.warmup,
        "backend": jax.default_backend(), "device": str(getattr(device, "device_kind", device)),
        "jax": jax.__version__, "python": platform.python_version(),
        "matmul_precision": str(getattr(jax.config, "jax_default_matmul_precision", None)),
        "smoke_test": jax.default_backend() == "cpu",
        "results": {d: {} for d in dtypes}, "phases_s": {},
    }

    def save(phase: str) -> None:
        raw["phases_s"][phase] = round(time.monotonic() - t0, 2)
        raw["ray_imported"] = sys.modules.get("ray") is not None
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(raw, indent=1, default=str))
        print(f"[{time.monotonic() - t0:6.1f} s] {phase}", flush=True)

    stages = {d: Stage(args.dims, args.stage, d) for d in dtypes}
    st0 = stages[dtypes[0]]
    raw["layers"] = st0.layers
    raw["param_bytes"] = st0.param_bytes
    for d, st in stages.items():
        raw["results"][d]["predicted_bytes"] = {k: v for k, v in st.kept.items()}
    save("built")
    params = jax.block_until_ready(st0.prog.init_params(0))      # float32 in every dtype: one copy
    threads = args.compile_threads or (1 if jax.default_backend() == "gpu" else min(8, os.cpu_count() or 1))
    raw["compile_threads"] = threads
    compiled = compile_all(stages, raw["results"], threads)
    save("compiled")
    mem = DeviceMemory(device)
    raw["memory_source"] = mem.source
    if time.monotonic() < deadline:
        memory_pass(stages, compiled, mem, params, raw["results"])
        save("memory")
    for d, st in stages.items():
        if time.monotonic() > deadline:
            raw["results"][d]["skipped"] = "budget: timing and numerics"
            continue
        time_and_check(st, compiled, params, args.reps, args.warmup, raw["results"][d])
        save(f"timed and checked {d}")
    raw["ok"] = all(r.get("numerics", {}).get("ok", False) for r in raw["results"].values())
    save("done")
    for d, r in raw["results"].items():
        t = r.get("time_s", {})
        print(f"{d}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in t.items())
              + f"; ratios {json.dumps({k: round(v, 3) for k, v in r.get('ratios', {}).items()})}"
              + f"; numerics ok {r.get('numerics', {}).get('ok')}")
    print(f"wrote {path}; ray imported: {raw['ray_imported']}")
    return 0 if raw["ok"] and not raw["ray_imported"] else 1


if __name__ == "__main__":
    sys.exit(main())
