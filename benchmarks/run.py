"""Pipeline benchmark: meshpipe's schedules beside their own ideal, plain JAX and torch.distributed.pipelining.

Run:  python -m benchmarks.run [--quick] [--only SECTION[,SECTION]] [--no-pin] [--render]
Writes benchmarks/results/pipeline.{md,json} and pipeline_*.png (--quick:
pipeline.quick.* — a validation run never overwrites a full one) and prints
the markdown. With --only, the other sections are kept from the existing
JSON of the same mode, so one section can be re-measured alone; --render
measures nothing and rewrites the markdown and plots from that JSON.

Sections (all in one run, on one machine, so the RATIOS are comparable):
  pipeline  meshpipe, GPT `small` and `large` (benchmarks/common.py), 2 stages
            × 1 host × 1 device, every schedule, m ∈ {4, 8}
  overhead  meshpipe, GPT `tiny` (actions ≈ free), m = 8, every runnable schedule
  executors meshpipe driven by each dispatcher (benchmarks/executors.py): `tiny` and `large`,
            1F1B, m = 8, variants in turns
  jax       plain JAX baselines (child processes: 2 cores, and 1 core for the
            split-compilation comparison)
  torch     torch.distributed.pipelining (1F1B, GPipe) on the same shapes, and
            plain torch; skipped with a note when torch is not installed
  memory    predicted peak activation memory per stage (shapes only); the measured
            peak comes with the pipeline section's records
Derived tables (efficiency, overhead, breakdown, ratios; `benchmarks/derive.py`) are computed from
whichever sections are present; the definitions are written into the markdown
(`DEFINITIONS`). Every Ray run shuts its actors down (`PipelineExecutor.shutdown`
in `finally`), the Ray session is shut down at the end, every remote wait has
a deadline, every child process has a timeout.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from benchmarks import common, formulas
from benchmarks.common import RESULTS, SCHEDULES, SIZES, fmt, md_table, run_child
from benchmarks.derive import P, derive, drop_stale
from benchmarks.derive import find as _find
from benchmarks.formulas import fb as _fb
from benchmarks.plots import BREAKDOWN_KEYS, make_plots

SECTIONS = ("pipeline", "overhead", "executors", "jax", "torch", "memory")
# OpenMP's default spin-waiting makes 2-thread plain torch 10-20x slower as soon as anything else runs on
# this 2-core machine (measured: 2.6 s vs 0.14 s per step at load 6); passive waiting removes that.
TORCH_PLAIN_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
RAY_WORKER_NICENESS = 0    # see _ray_session

MODES = {
    "full": {"sizes": ["small", "large"], "ms": [4, 8], "schedules": list(SCHEDULES), "steps": 12, "warmup": 4,
             # tiny's steps are ~5 ms: 120 of them (30 calls of 4) after 8 whose first ones are still slow
             "overhead": {"size": "tiny", "m": 8, "schedules": list(SCHEDULES), "steps": 120, "warmup": 8},
             "executors": {"runs": [
                 {"size": "tiny", "schedule": "1f1b", "m": 8, "steps": 32, "reps": 3,
                  "variants": [["step_calls", 1], ["step_calls", 4], ["compiled_graph", 1], ["compiled_graph", 4],
                               ["action_calls", 1]]},
                 {"size": "large", "schedule": "1f1b", "m": 8, "steps": 8, "reps": 1,
                  "variants": [["step_calls", 1], ["step_calls", 4], ["compiled_graph", 4], ["action_calls", 1]]}]},
             "torch_schedules": ["1f1b", "gpipe"], "jax_steps": 8},
    "quick": {"sizes": ["small"], "ms": [4], "schedules": ["1f1b", "interleaved-1f1b"],
              "steps": 4, "warmup": 2,
              "overhead": {"size": "tiny", "m": 4, "schedules": ["1f1b"], "steps": 10},
              "executors": {"runs": [{"size": "tiny", "schedule": "1f1b", "m": 4, "steps": 8, "reps": 1, "variants": [
                  ["step_calls", 4], ["compiled_graph", 4], ["action_calls", 1]]}]},
              "torch_schedules": ["1f1b", "gpipe"], "jax_steps": 3},
}

DEFINITIONS = """\
All times are medians; a run's first `warmup` steps (compilation) are dropped. p = 2 stages.

- **step** — meshpipe: the step's period — per actor, the time between its consecutive step ends on
  its own clock, the largest over actors (`StepResult.wall_s`; the driver keeps the next call queued on
  the actors, so this is the throughput period), taken per executor call: the median over the run's
  complete calls of each call's mean period (`formulas.call_period_s`), so the Ray task boundary paid
  once per call (4 steps by default) is in it — a median of single steps would drop it; torch: time between consecutive
  step ends (pipeline `step()` + adam) on rank 0; plain: one jitted / eager step.
- **action costs** — per stage and kind (F, B, I, W, OPT), from STANDALONE timings of the stage's own
  programs: meshpipe: each stage's jitted programs timed one at a time in a child process pinned to
  one core, with the operands the worker gives them, before the run's actors start
  (`benchmarks/pipeline.py` `standalone`; interleaved: F, B, I, W the mean over the stage's chunks, OPT
  their sum; where the worker runs the loss chunk's F and B as one program — 1F1B and eager-1F1B's last
  stage — F is that program and B is 0); torch: the stage module's forward (+ loss), backward and adam step timed outside the
  pipeline on both ranks. The in-run spans (meshpipe: `StepResult.spans`; torch: wrappers of
  `forward_one_chunk` / `backward_one_chunk`) are kept as a cross-check (*in-run ideal*).
- **ideal** — `orchestrator.core.schedule.simulate` of the lowered schedule with the standalone costs, OPT
  included, transfers free: the step a runtime with zero orchestration, transfer and in-action cost would
  take. It cannot exceed the measured step; a run where it does (efficiency > 1, negative overhead) is
  a mis-measurement and the benchmark fails (`formulas.ImplausibleMeasurement`) instead of publishing it.
- **efficiency** = ideal ÷ step (1.0 = the runtime adds nothing to the schedule's own bubble). These
  formulas (efficiency, overhead, bounds, vs plain) are computed in `benchmarks/formulas.py` only.
- **overhead per action** = (step − ideal) ÷ N, N = compute actions (F, B, I, W, OPT) in one stage's
  list per step (2m + 1 for gpipe / 1f1b, 3m + 1 for zb-h1, 2mv + 1 interleaved); **per critical-path action**: the same
  excess ÷ the compute actions on the simulated critical path (2m + 3 for 1f1b at p = 2).
- **honest bound** = base₁ × (m + p − 1) ÷ (m · p), base₁ = the plain program's step on ONE core, plain₁,
  or m × the stage programs' standalone F + B summed over the stages when that is less (marked *(s)*):
  the step of a perfect p-stage pipeline of that 1-core work; **of honest bound** = honest bound ÷ step.
  With the minimum it is ≤ the ideal, so a figure above 1 fails the run like an efficiency above 1.
  **vs plain, all cores** = plain step on all cores ÷ pipeline step (a separate comparison, not a bound).
- **loss breakdown** of one pipelined step T (shares of T, summing to 1): *useful* = m × f₁ ÷ p, f₁ = one
  microbatch's forward+backward as one unsplit plain-JAX program on ONE core (the faster of the scanned
  step's share, (step − update) ÷ m, and one microbatch's value_and_grad timed alone); *split penalty* = m × (Σₛ(Fₛ + Bₛ) − f₁) ÷ p,
  the cost of compiling forward and backward separately per stage instead of one fused program
  (zb-h1: Bₛ = Iₛ + Wₛ; interleaved: every chunk of the stage); where the stage programs run faster than
  the unsplit one (smaller working sets), f₁ is their sum instead, as in the honest bound, and the split
  penalty is 0 (the row is marked *(s)*, `split_gain` in the JSON says by how much); *imbalance* = busiest stage's compute − mean stage compute; *bubble* =
  ideal without OPT − busiest stage's compute; *optimizer* = ideal − ideal without OPT; *transfers* = mean
  over stages of (SEND + RECV span time − the stage's idle time in the ideal schedule), clipped to
  [0, T − ideal] — RECV spans include waiting caused by the peer's own delays, so this is an upper bound
  on transfer cost; *orchestration* = T − ideal − transfers (Python between actions, Ray calls, step
  boundaries; a lower bound).
- **peak activation memory**: predicted = the peak of the schedule's stash timeline per stage
  (`orchestrator.core.schedule.stash_timeline`: F keeps its residuals until B or I, I keeps what W reads
  until W) with the bytes per microbatch taken from the stage programs' own outputs (`jax.eval_shape` of
  `StageProgram.fwd` and of the zero-bubble I, `benchmarks/stage_bytes.py`; parameters excluded) — for
  schedules without I this is peak in-flight microbatches × residual bytes; measured = the worker's peak
  bytes per device of what it holds between actions in a step (residuals; for zb-h1, from I to W, what W
  reads: per layer its inputs' residuals and output cotangents, `stages/zb_split.py`).
"""

NOTES = """\
- Niceness: Ray starts its workers at niceness 15; with other load on the machine that starved the stage
  actors (measured: large 1F1B m=4 step 1.24-1.40 s at niceness 15 vs 0.71 s at 0, torch 0.57 s, same
  load), so the harness starts its Ray with `worker_niceness` 0 and records the niceness the workers had.
  Results measured before that show "15 (Ray default)" above. meshpipe's own embedded Ray
  (`placement.connect`) keeps Ray's default.
- Pinning: the benchmark sets the product's own `cluster.pin_cpus` (host actor i → core i mod nproc, set
  before jax loads; `--no-pin` turns it off) and records each actor's affinity and thread count read back
  on its step thread (`stages/telemetry.py` `conditions`); a pinned run whose actors do not each hold one
  distinct core fails. (Results before this change said "pinned" while the actors were not: a subclass
  pinned only when the bool `pin_cpus` was None.) Torch ranks pin themselves the same way (always) and
  report their affinity and `torch.get_num_threads()`.
- interleaved-1f1b is tried as a job with 2 chunks per stage; its status is recorded as the runtime reports it.
- Memory is measured on the actors by the stage worker itself (`stages/actions.py` `Stash`: bytes per device
  of the residuals and kept output gradients, peak per step) and reported with each step's stats.
- Finer measurements would need: (a) spans for the step's boundaries (run_step entry/exit and
  `transport.flush`) so the time outside spans is attributed; (b) the SEND span split into pack /
  serialise / push, and the RECV span into wait / assemble / device_put, so *transfers* needs no
  subtraction of the ideal idle; (c) an executor option to run several schedules (or m) on the same actors,
  which would cut the benchmark's actor start-ups (most of its run time).
"""

# ----------------------------------------------------------------------------- measuring

def _ray_session(raw: dict) -> bool:
    """Start the embedded Ray all pipelined runs share; True if we started it (and must stop it).

    Ray starts worker processes at niceness 15 (`worker_niceness`) by default: on a machine where
    anything else runs, the stage actors then get a fraction of the CPU that the torch ranks and the
    plain baselines (niceness 0) get, which measured the actors 2-3x slower under load. The benchmark
    compares runtimes, so its actors run at niceness 0; the niceness they really had is recorded.
    """
    import ray

    if ray.is_initialized():
        return False
    # more logical CPUs than cores: the 2 stage bundles take 1 each, the driver needs none
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level=logging.WARNING,
             namespace="meshpipe-bench", _system_config={"worker_niceness": RAY_WORKER_NICENESS})
    from orchestrator.driver.waiting import wait_all

    try:
        raw["ray_worker_niceness"] = wait_all([ray.remote(num_cpus=0)(_niceness).remote()], 60, "niceness probe")[0]
    except Exception:
        ray.shutdown()
        raise
    return True


def _niceness() -> int:
    return os.nice(0)


def measure_pipeline(cfg: dict, pin: bool, echo) -> list[dict]:
    from benchmarks.pipeline import measure_pipeline as one

    out = []
    for size in cfg["sizes"]:
        for m in cfg["ms"]:
            for sched in cfg["schedules"]:
                t = time.perf_counter()
                rec = one(SIZES[size], sched, m, steps=cfg["steps"], warmup=cfg["warmup"], pin=pin)
                echo(_progress(rec, time.perf_counter() - t))
                out.append(rec)
    _second_pass(out, cfg["steps"], cfg["warmup"], echo)
    return out


def _second_pass(out: list[dict], steps: int, warmup: int, echo) -> None:
    from benchmarks.pipeline import second_pass

    t = time.perf_counter()
    second_pass(out, steps, warmup)
    echo(f"  standalone costs timed again, the smaller median kept ({time.perf_counter() - t:.0f} s):")
    for rec in out:
        echo(_progress(rec, 0.0))


def measure_overhead(cfg: dict, pin: bool, echo) -> list[dict]:
    from benchmarks.pipeline import measure_pipeline as one

    oc, out = cfg["overhead"], []
    for sched in oc["schedules"]:
        t = time.perf_counter()
        rec = one(SIZES[oc["size"]], sched, oc["m"], steps=oc["steps"], warmup=oc.get("warmup", cfg["warmup"]),
                  pin=pin)
        echo(_progress(rec, time.perf_counter() - t))
        out.append(rec)
    _second_pass(out, oc["steps"], oc.get("warmup", cfg["warmup"]), echo)
    return out


def _progress(rec: dict, took: float) -> str:
    head = f"  {rec['size']:>5} {rec['schedule']:<16} m={rec['m']}"
    if rec.get("status") != "ok":
        return f"{head}  {rec.get('status')}  ({took:.0f} s)"
    return (f"{head}  step {rec['step_s'] * 1e3:7.1f} ms  ideal {rec['ideal_s'] * 1e3:7.1f} ms  "
            f"eff {rec['ideal_s'] / rec['step_s']:.2f}  affinity {_affinity(rec['observed'], ' | ')}  ({took:.0f} s)")


def measure_jax(cfg: dict, echo) -> list[dict]:
    out = []
    for size in cfg["sizes"]:
        for m in cfg["ms"]:
            for cpus in _core_sets():
                rec = _child(["benchmarks.pipeline", "plain-jax", size, str(m), str(cfg["jax_steps"])], cpus, echo)
                out.append({**rec, "size": size, "m": m})
    return out


def _core_sets() -> list[list[int]]:
    """All cores, then one core (the 1-core run also gives the breakdown's fused f₁)."""
    n = os.cpu_count() or 1
    return [list(range(n))] + ([[0]] if n > 1 else [])


def _child(args: list[str], cpus: list[int], echo, timeout: float = 600, env: dict | None = None) -> dict:
    t = time.perf_counter()
    try:
        rec = run_child(args, timeout, cpus, env)
        rec["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - a failed baseline is reported, not fatal
        rec = {"status": f"failed: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else e!r}"}
    rec["cores"] = len(cpus)
    echo(f"  {' '.join(args[1:]):<32} on {len(cpus)} core(s): "
         + (f"step {rec['step_s'] * 1e3:.1f} ms" if rec["status"] == "ok" else rec["status"])
         + f"  ({time.perf_counter() - t:.0f} s)")
    return rec


def measure_torch(cfg: dict, echo) -> dict:
    from benchmarks import torch_pipe

    if not torch_pipe.available():
        return {"status": "skipped: torch is not installed (optional: .venv/bin/pip install torch==2.13.0)"}
    oc = cfg["overhead"]
    runs = [f"{size}:{','.join(map(str, cfg['ms']))}:{cfg['steps']}" for size in cfg["sizes"]]
    runs.append(f"{oc['size']}:{oc['m']}:{oc['steps']}")
    t = time.perf_counter()
    try:
        pipe = run_child(["benchmarks.torch_pipe", "pipe", ",".join(cfg["torch_schedules"]), str(cfg["warmup"]),
                          *runs], timeout=900)
        for r in pipe:
            r["status"] = "ok"
            echo(f"  torch {r['size']:>5} {r['schedule']:<6} m={r['m']}  step {r['step_s'] * 1e3:7.1f} ms")
    except Exception as e:  # noqa: BLE001 - reported in the markdown
        echo(f"  torch pipeline failed: {e}")
        pipe = [{"status": f"failed: {str(e)[-300:]}"}]
    echo(f"  ({time.perf_counter() - t:.0f} s)")
    plain = []
    for size in cfg["sizes"]:
        for m in cfg["ms"]:
            for cpus in _core_sets():
                rec = _child(["benchmarks.torch_pipe", "plain", size, str(m), str(cfg["jax_steps"])], cpus, echo,
                             env=TORCH_PLAIN_ENV)
                plain.append({**rec, "size": size, "m": m})
    return {"status": "ok", "pipe": pipe, "plain": plain}


def measure_memory(cfg: dict) -> list[dict]:
    from benchmarks.pipeline import residual_bytes
    from orchestrator.core.schedule import generate, lower, simulate, stash_timeline

    out = []
    for size in cfg["sizes"]:
        stages = residual_bytes(SIZES[size])
        kept = [{"F": st["residual_bytes"], "I": st["held_bytes"]} for st in stages]
        for m in cfg["ms"]:
            for sched in ("gpipe", "1f1b", "eager-1f1b", "zb-h1"):
                low = lower(generate(sched, P, m))
                peak = simulate(low, {"F": 1, "B": 2}).peak_inflight
                stash = stash_timeline(low, kept)      # zb-h1: from I to W only what W reads
                for s, st in enumerate(stages):
                    out.append({"size": size, "m": m, "schedule": sched, "stage": s, "peak_inflight": peak[s],
                                **st, "peak_activation_bytes": stash.peak[s],
                                "inflight_x_residual_bytes": peak[s] * st["residual_bytes"]})
    return out


def measure_section(sec: str, cfg: dict, pin: bool, echo) -> dict:
    if sec == "pipeline":
        return {"records": measure_pipeline(cfg, pin, echo)}
    if sec == "overhead":
        return {"records": measure_overhead(cfg, pin, echo)}
    if sec == "executors":
        from benchmarks import executors

        return {"records": executors.measure(cfg["executors"], pin, cfg["warmup"], echo)}
    if sec == "jax":
        return {"records": measure_jax(cfg, echo)}
    if sec == "torch":
        return measure_torch(cfg, echo)
    return {"records": measure_memory(cfg)}


# ----------------------------------------------------------------------------- rendering

def render(raw: dict, der: dict, mode: str, plots: list[str]) -> str:
    mi = raw["machine"]
    loads = f"load average at start {_load(mi['load_start'])}"
    if raw.get("load_end"):
        loads += f", at end {_load(raw['load_end'])}"
    sizes = sorted({r["size"] for sec in ("pipeline", "overhead") for r in raw.get(sec, {}).get("records", [])},
                   key=list(SIZES).index)
    machine = (f"{mi['when']}; {mi['cpu']}, nproc {mi['nproc']}, {mi['mem_gib']} GiB; python {mi['python']}, "
               f"jax {mi['jax']} (jaxlib {mi['jaxlib']}), ray {mi['ray']}, optax {mi['optax']}, "
               f"torch {mi['torch']}; {loads}. Pinning requested: {raw.get('pinned', True)}; observed "
               f"(read back in each process): {_observed_summary(raw)}; Ray worker niceness "
               f"{raw.get('ray_worker_niceness', '15 (Ray default)')}.")
    noise = ("> Numbers from a shared, loaded machine are noisy (see *spread* = (p90 − p10) ÷ median of the "
             "step times): compare ratios measured in the same run, and rerun on a quiet machine before "
             "quoting digits.")
    models = ("Models: " + "; ".join(f"`{n}` = {SIZES[n].describe()}" for n in sizes)
              + ". Stage 0 = embed + first half of the blocks, stage 1 = the other blocks + head; "
              "global batch = m × microbatch.")
    measured = ", ".join(f"{sec} at {raw[sec]['when']} (load {raw[sec]['load'][0]:.1f})"
                         for sec in SECTIONS if sec in raw and "when" in raw[sec])
    failed = [f"**{sec}** {raw[sec]['status']}" for sec in SECTIONS
              if sec in raw and str(raw[sec].get("status", "")).startswith("failed")]
    lines = [f"# Pipeline benchmark ({mode})", "", machine, f"Sections measured: {measured}.", "", noise, "",
             *([f"Failed sections: {'; '.join(failed)}.", ""] if failed else []), models, "",
             "## Definitions", "", DEFINITIONS]
    lines += _render_efficiency(raw, der)
    lines += _render_overhead(raw, der)
    from benchmarks import executors

    lines += executors.render(raw.get("executors", {}).get("records", []), der.get("executors", []))
    lines += _render_breakdown(raw, der)
    lines += _render_plain(raw, der)
    lines += _render_torch(raw, der)
    lines += _render_memory(raw)
    lines += ["## Notes", "", NOTES]
    if plots:
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    return "\n".join(lines)


def _affinity(obs: list[dict], sep: str = " \\| ") -> str:
    """'{0} | {1}': each stage's (host 0's) CPU affinity read back on the actor."""
    return sep.join("{" + ",".join(map(str, o["affinity"])) + "}" for o in obs if o.get("host", 0) == 0) or "–"


def _observed_summary(raw: dict) -> str:
    """The distinct affinities / thread counts the measured processes reported."""
    seen = set()
    for sec in ("pipeline", "overhead"):
        for r in raw.get(sec, {}).get("records", []):
            for o in r.get("observed", []):
                seen.add(f"meshpipe stage {o['stage']} on {{{','.join(map(str, o['affinity']))}}}")
            alone = r.get("standalone", {}).get("observed")
            if alone:
                seen.add(f"standalone timings on {{{','.join(map(str, alone['affinity']))}}}")
    for r in raw.get("torch", {}).get("pipe", []):
        for rank, o in enumerate(r.get("observed", [])):
            seen.add(f"torch rank {rank} on {{{','.join(map(str, o['affinity']))}}} with {o['threads']} thread(s)")
    return "; ".join(sorted(seen)) or "not recorded"


def _load(avg) -> str:
    return "/".join(f"{x:.1f}" for x in avg)


def _render_efficiency(raw, der) -> list[str]:
    recs = raw.get("pipeline", {}).get("records", [])
    if not recs:
        return []
    rows = []
    for r in recs:
        d = _find(der["pipeline"], r["size"], r["schedule"], r["m"])
        if r.get("status") != "ok":
            rows.append([r["size"], r["m"], r["schedule"], "–", "–", "–", "–", "–", "–", "–", r["status"]])
            continue
        fb = " / ".join(f"{x.get('F', 0) * 1e3:.1f}" for x in r["standalone"]["stages"])
        rows.append([r["size"], r["m"], r["schedule"], fb, fmt(r["step_s"] * 1e3, 1), fmt(r["ideal_s"] * 1e3, 1),
                     f"**{d['efficiency']:.3f}**", fmt(r["ideal_spans_s"] * 1e3, 1), _affinity(r["observed"]),
                     fmt(r["step_spread"]), "ok"])
    for d, r in _torch_pairs(raw, der):
        if r["size"] == "tiny":
            continue
        fb = " / ".join(f"{x['F'] * 1e3:.1f}" for x in r["standalone"])
        rows.append([r["size"], r["m"], f"torch {r['schedule']}", fb, fmt(r["step_s"] * 1e3, 1),
                     fmt(d["ideal_s"] * 1e3, 1), f"**{d['efficiency']:.3f}**", fmt(d["ideal_spans_s"] * 1e3, 1),
                     _affinity([{**o, "host": 0} for o in r.get("observed", [])]), fmt(r["step_spread"]), "ok"])
    rows.sort(key=lambda x: (list(SIZES).index(x[0]), x[1]))
    split = {}
    for r in recs:      # the zero-bubble split's work, standalone: (I + W) ÷ B per stage (target ≤ 1.1)
        if r.get("status") == "ok" and r["schedule"] == "zb-h1" and r["size"] not in split:
            split[r["size"]] = " / ".join(fmt((c["I"] + c["W"]) / c["B"]) for c in r["standalone"]["stages"])
    zb = ("Zero-bubble split, standalone (I + W) ÷ B per stage (stage 0 / stage 1; target ≤ 1.1): "
          + "; ".join(f"`{k}` {v}" for k, v in split.items()) + ".") if split else ""
    return ["## 1. Pipeline efficiency", "", *([zb, ""] if zb else []),
            ("Target ≥ 0.95 at `large`. F = standalone forward per stage (stage 0 / stage 1); *ideal* from the "
             "standalone costs (≤ step by construction; a run above 1 fails instead of appearing here); *in-run "
             "ideal* = the same simulation from the in-run spans (a cross-check); *affinity* = each stage's "
             "CPUs read back in the process."), "",
            md_table(["size", "m", "schedule", "F ms", "step ms", "ideal ms", "efficiency", "in-run ideal ms",
                      "affinity", "spread", "status"], rows, "lrlrrrrrlrl"), ""]


def _torch_pairs(raw, der):
    for r in raw.get("torch", {}).get("pipe", []):
        if r.get("status") == "ok":
            yield _find(der["torch"], r["size"], r["schedule"], r["m"]), r


def _fb_ms(costs: list[dict]) -> str:
    """'F/B' ms per stage (B = I + W when split), stages joined by ' | '."""
    return " \\| ".join(f"{c.get('F', 0) * 1e3:.2f}/{(_fb(c) - c.get('F', 0)) * 1e3:.2f}" for c in costs)


def _per_send_ms(rec: dict) -> str:
    """Mean SEND span per send, over both stages (the sender's cut, pack and push), ms."""
    total = sum(v for t in rec["totals"] for k, v in t.items() if k.startswith("SEND"))
    sends = sum(1 for s in rec["example_spans"] if "SEND" in s[2])
    return fmt(total / sends * 1e3) if sends else "–"


def _render_overhead(raw, der) -> list[str]:
    recs = raw.get("overhead", {}).get("records", [])
    if not recs:
        return []
    rows = []
    for r in recs:
        if r.get("status") != "ok":
            rows.append([f"meshpipe {r['schedule']}", r["m"], "–", "–", "–", "–", "–", "–", "–", "–", r["status"]])
            continue
        d = _find(der["overhead"], r["size"], r["schedule"], r["m"])
        rows.append([f"meshpipe {r['schedule']}", r["m"], fmt(r["step_s"] * 1e3), fmt(r["ideal_s"] * 1e3),
                     r["compute_actions_per_stage"], f"**{d['overhead_ms']:.3f}**",
                     fmt(r["ideal_spans_s"] * 1e3), fmt(d["overhead_cp_ms"], 3),
                     _fb_ms(r["costs"]), _per_send_ms(r), fmt(r["step_spread"])])
    for d, r in _torch_pairs(raw, der):
        if r["size"] == "tiny":
            from orchestrator.core.schedule import generate, lower

            n = common.compute_actions_per_stage(lower(generate(r["schedule"], P, r["m"])))
            rows.append([f"torch {r['schedule']}", r["m"], fmt(r["step_s"] * 1e3), fmt(d["ideal_s"] * 1e3), n,
                         f"**{d['overhead_ms']:.3f}**", fmt(d["ideal_spans_s"] * 1e3),
                         fmt(d["overhead_cp_ms"], 3), _fb_ms(r["costs"]), "–", fmt(r["step_spread"])])
    return ["## 2. Orchestration overhead per action", "",
            ("GPT `tiny`: every action is almost free, so step − ideal is the runtime's own cost between "
             "actions. Target ≤ 0.2 ms per action for 1f1b. The ideal comes from standalone timings of each stage "
             "program (`benchmarks/pipeline.py` `standalone`), so everything the runtime adds inside an action "
             "(operand handling, dispatch, accumulation calls) counts as overhead, not as compute. *in-run ideal* "
             "is the simulation from the in-run spans (a cross-check; the gap to *ideal* is the runtime's cost "
             "inside actions); *F/B ms* shows the in-run spans per stage; *SEND ms* is meshpipe's mean SEND "
             "span (plan lookup, pack, push)."),
            "",
            md_table(["runtime", "m", "step ms", "ideal ms", "N", "overhead ms/action",
                      "in-run ideal ms", "ms/critical-path action",
                      "F/B ms (stage 0 \\| 1)", "SEND ms", "spread"], rows), ""]


def _render_breakdown(raw, der) -> list[str]:
    rows = []
    for d in der["pipeline"]:
        size, sched, m = d["key"]
        if sched != "1f1b":
            continue
        s = d["breakdown_share"]
        mark = " (s)" if d.get("unsplit_base") == "stages" else ""
        rows.append([size, m, sched] + [fmt(s[k]) + (mark if k == "split" else "") if s.get(k) is not None else "–"
                                        for k in BREAKDOWN_KEYS] + [fmt(d.get("of_honest_bound"))])
    if not rows:
        return []
    note = ("" if any(d.get("fused_mb_1core_s") for d in der["pipeline"]) else
            " (*useful* and *split* need the `jax` section's 1-core run; missing here.)")
    return ["## 3. Where a pipelined step goes (1F1B)", "",
            "Shares of the measured step T; they sum to 1 (action costs: standalone). *of honest bound* as in "
            "section 4, for scale." + note,
            "", md_table(["size", "m", "schedule", "useful", "split penalty", "imbalance", "bubble", "optimizer",
                          "transfers", "orchestration", "of honest bound"], rows, "lrl" + "r" * 8), ""]


def _render_plain(raw, der) -> list[str]:
    recs = raw.get("jax", {}).get("records", [])
    if not recs:
        return []
    rows = []
    for d in der["pipeline"]:
        size, sched, m = d["key"]
        if "plain1_s" not in d and "vs_plain_all" not in d:
            continue
        rec = next(r for r in raw["pipeline"]["records"] if r.get("status") == "ok"
                   and [r["size"], r["schedule"], r["m"]] == [size, sched, m])
        rows.append([size, m, sched, fmt(rec["step_s"] * 1e3, 1), fmt(_ms(d.get("plain1_s")), 1),
                     fmt(_ms(d.get("honest_bound_s")), 1), f"**{_of_bound(d)}**",
                     f"{fmt(_ms(d.get('plain_all_s')), 1)} ({d.get('plain_all_cores', '–')})",
                     fmt(d.get("vs_plain_all"), 3), f"{d['loss_rel_diff']:.1e}" if "loss_rel_diff" in d else "–"])
    base = []
    for r in recs:
        if r.get("status") == "ok":
            base.append([r["size"], r["m"], r["cores"], fmt(r["step_s"] * 1e3, 1), fmt(r["fused_mb_s"] * 1e3, 2),
                         fmt(r["update_s"] * 1e3, 2), fmt(r["step_spread"])])
        else:
            base.append([r.get("size"), r.get("m"), r.get("cores"), r["status"], "", "", ""])
    out = ["## 4. meshpipe vs plain JAX", "",
           ("Plain JAX: the whole model, same global batch and microbatches, `lax.scan` of `value_and_grad` + "
           "adam in ONE jit, in a child process whose CPU affinity is the given cores (XLA sizes its thread "
           "pool from it), on one core and on all cores. *honest bound* = base₁ × (m + p − 1) ÷ (m · p), the "
           "step of a perfect p-stage pipeline of the 1-core work (base₁ = plain₁, or the stage programs' "
           "standalone F + B × m when less, marked *(s)*); *of honest bound* = honest bound ÷ "
           "pipeline step (target ≥ 0.9 at `large`, m = 8). *vs plain, all cores* = plain step on all cores ÷ "
           "pipeline step, a separate comparison, not a bound (plain JAX does not scale perfectly to p cores). "
           "*loss Δ*: the largest relative difference between the pipeline's and plain JAX's (1 core) per-step "
           "losses (same init, data and optimizer; float32, so ~1e-6 is agreement)."), ""]
    if rows:
        out += [md_table(["size", "m", "schedule", "pipeline ms", "plain₁ ms", "honest bound ms", "of honest bound",
                          "plain ms, all cores (n)", "vs plain, all cores", "loss Δ"], rows, "lrl" + "r" * 7), ""]
    out += [("Baselines (step = whole jitted step; fused mb = one microbatch's jitted forward+backward; update = adam "
            "alone):"), "", md_table(["size", "m", "cores", "step ms", "fused mb ms", "update ms", "spread"], base), ""]
    return out


def _ms(x):
    return None if x is None else x * 1e3


def _render_torch(raw, der) -> list[str]:
    t = raw.get("torch")
    if not t:
        return []
    if t.get("status") != "ok":
        return ["## 5. vs torch.distributed.pipelining", "", f"Skipped: {t['status']}", ""]
    rows = []
    for d, r in _torch_pairs(raw, der):
        if r["size"] == "tiny":
            continue
        mp = _find(der["pipeline"], r["size"], r["schedule"], r["m"])
        rec = next((x for x in raw.get("pipeline", {}).get("records", []) if x.get("status") == "ok"
                    and [x["size"], x["schedule"], x["m"]] == [r["size"], r["schedule"], r["m"]]), None)
        rows.append([r["size"], r["m"], r["schedule"], fmt(mp["efficiency"], 3) if mp else "–",
                     fmt(d["efficiency"], 3), fmt(mp["overhead_cp_ms"], 3) if mp else "–",
                     fmt(d["overhead_cp_ms"], 3), _of_bound(mp) if mp else "–", _of_bound(d),
                     fmt(rec["step_s"] * 1e3, 1) if rec else "–", fmt(r["step_s"] * 1e3, 1),
                     fmt(rec["step_s"] / r["step_s"], 2) if rec else "–",
                     " / ".join(f"{c['F'] * 1e3:.1f}÷{a['F'] * 1e3:.1f}, {c['B'] * 1e3:.1f}÷{a['B'] * 1e3:.1f}"
                                for c, a in zip(r["costs"], r["standalone"]))])
    failed = [r for r in t["pipe"] if r.get("status") != "ok"]
    out = ["## 5. vs torch.distributed.pipelining", "",
           ("torch 2 ranks (gloo, `torch.set_num_threads(1)`, pinned one per core; affinity and threads read "
           "back per rank, see the header), same GPT shapes (same FLOPs, not the same parameters). Both "
           "runtimes' ideals come from standalone stage timings (torch: its stage modules timed outside the "
           "pipeline, one rank at a time with the other core idle, as meshpipe's; a torch backward needs its own "
           "forward, so its B reads fresh activations, while meshpipe's B is timed again and again on one set of "
           "residuals, which ran it 3-13 % faster at `large` than right after its F: meshpipe's ideal is the "
           "stricter). *of honest bound* uses each framework's own 1-core work: its plain "
           "run (plain torch: Python microbatch loop + adam, one thread per core given, OMP_WAIT_POLICY=PASSIVE), "
           "or its stage programs' standalone F + B × m when less, marked *(s)*. "
           "*meshpipe ÷ torch step* < 1 means meshpipe is faster in absolute terms (kernels differ: XLA vs "
           "ATen). *in-run÷standalone F, B*: torch's in-pipeline F and B vs the same timed standalone, per rank "
           "(stage 0 / stage 1), ms."), ""]
    if rows:
        out += [md_table(["size", "m", "schedule", "meshpipe eff", "torch eff", "meshpipe ms/cp action",
                          "torch ms/cp action", "meshpipe of honest bound", "torch of honest bound",
                          "meshpipe step ms", "torch step ms", "meshpipe ÷ torch step",
                          "in-run÷standalone F, B"], rows, "lrl" + "r" * 10), ""]
    plain = [[r["size"], r["m"], r.get("threads", "–"), fmt(r["step_s"] * 1e3, 1), fmt(r.get("step_spread"))]
             for r in t["plain"] if r.get("status") == "ok"]
    if plain:
        out += ["Plain torch:", "", md_table(["size", "m", "threads", "step ms", "spread"], plain), ""]
    out += [f"torch run failed: {r['status']}" for r in failed]
    return out


def _render_memory(raw) -> list[str]:
    recs = raw.get("memory", {}).get("records", [])
    if not recs:
        return []
    measured = {(r["size"], r["m"], r["schedule"]): r for r in raw.get("pipeline", {}).get("records", [])
                if r.get("status") == "ok" and r.get("stash_peak_bytes")}
    rows = []
    for r in recs:
        got = measured.get((r["size"], r["m"], r["schedule"]))
        peak = got["stash_peak_bytes"][r["stage"]] if got else None
        items = got["stash_peak_items"][r["stage"]] if got else None
        pred = r["peak_activation_bytes"]
        live = (got.get("live_peak_bytes") or [None] * (r["stage"] + 1))[r["stage"]] if got else None
        live_pred = 4 * r["param_bytes"] + pred        # params, adam's two moments, the gradient sum, residuals
        rows.append([r["size"], r["m"], r["schedule"], r["stage"], r["peak_inflight"],
                     items if items is not None else "–", fmt(r["residual_bytes"] / 2**20, 2),
                     fmt(pred / 2**20, 1), fmt(peak / 2**20, 1) if peak is not None else "–",
                     fmt(peak / pred, 2) if peak is not None and pred else "–", fmt(r["param_bytes"] / 2**20, 1),
                     fmt(live_pred / 2**20, 1), fmt(live / 2**20, 1) if live else "–",
                     fmt(live / live_pred, 2) if live else "–"])
    return ["## 6. Peak activation memory per stage: predicted and measured on the actors", "",
            ("predicted = the peak of the schedule's stash timeline (`stash_timeline`: F keeps its residuals "
             "until B or I, I keeps what W reads until W; without I, peak in-flight microbatches × residual "
             "bytes per microbatch), sizes from `jax.eval_shape` of the stage's forward and zero-bubble I. "
             "measured = on the actor, the peak over a step of the "
             "bytes per device held between actions — forward residuals, and for zb-h1 from I to W what W "
             "reads (per layer: layer inputs and output cotangents) — counted from the arrays themselves (shard "
             "shape × itemsize); "
             "the largest over the measured steps. *live* = every live device buffer the runtime lists "
             "(`jax.live_arrays()`, each counted by its shard on each device) at the moments the kept bytes "
             "reach a new high, busiest device; predicted live = 4 × params (parameters, adam's two moments, "
             "the gradient sum) + predicted activations. XLA:CPU reports no allocator statistics, so neither "
             "counts XLA's temporaries or allocator slack."), "",
            md_table(["size", "m", "schedule", "stage", "predicted in-flight", "measured in-flight",
                      "residual MiB/mb", "predicted MiB", "measured MiB", "measured ÷ predicted", "params MiB",
                      "predicted live MiB", "live MiB", "live ÷ predicted"],
                     rows, "lrlrrrrrrrrrrr"), ""]


# ----------------------------------------------------------------------------- main

def measure(raw: dict, only: list[str], cfg: dict, pin: bool) -> None:
    """Measure the sections in `only` into `raw` (one Ray session for the pipelined ones)."""
    def echo(msg: str) -> None:
        print(msg, flush=True)

    t0 = time.perf_counter()
    started = False
    try:
        if {"pipeline", "overhead", "executors"} & set(only):
            started = _ray_session(raw)
        for sec in only:
            echo(f"[{sec}] {time.perf_counter() - t0:.0f} s")
            when = {"when": time.strftime("%H:%M:%S"), "load": os.getloadavg()}
            try:
                raw[sec] = {**when, **measure_section(sec, cfg, pin, echo)}
            except Exception as e:  # noqa: BLE001 - one broken section must not lose the others
                import traceback

                traceback.print_exc()
                raw[sec] = {**when, "status": f"failed: {type(e).__name__}: {str(e).strip()[:300]}"}
                echo(f"  section {sec} {raw[sec]['status']}")
    finally:
        if started:
            import ray

            ray.shutdown()
    raw["load_end"] = os.getloadavg()
    raw["elapsed_s"] = time.perf_counter() - t0


def _of_bound(d: dict) -> str:
    """*of honest bound*, marked (s) where its base is the stage programs' F + B (`formulas.honest_base_s`)."""
    r = fmt(d.get("of_honest_bound"), 3)
    return f"{r} (s)" if d.get("honest_base") == "stages" else r


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="validation: small size, m=4, 2 schedules, few steps (< 3 min on a quiet machine)")
    ap.add_argument("--only", default="", help=f"comma-separated sections of {','.join(SECTIONS)}")
    ap.add_argument("--no-pin", action="store_true", help="do not pin stage actors / torch ranks to cores")
    ap.add_argument("--render", action="store_true",
                    help="measure nothing: rewrite the markdown and plots from the existing JSON of this mode")
    args = ap.parse_args(argv)
    mode = "quick" if args.quick else "full"
    only = [s for s in args.only.split(",") if s] or list(SECTIONS)
    bad = set(only) - set(SECTIONS)
    if bad:
        ap.error(f"--only: unknown section(s) {sorted(bad)}; choose from {', '.join(SECTIONS)}")
    cfg, pin = MODES[mode], not args.no_pin
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "pipeline" if mode == "full" else "pipeline.quick"
    suffix = "" if mode == "full" else ".quick"
    json_path = RESULTS / f"{stem}.json"
    if args.render:
        if not json_path.exists():
            ap.error(f"--render: no {json_path} to render; measure first")
        raw = json.loads(json_path.read_text())["raw"]
        for sec in drop_stale(raw):
            print(f"not rendering section {sec} of {json_path.name}: measured before standalone costs and "
                  f"read-back affinity (rerun it)", flush=True)
    else:
        raw = json.loads(json_path.read_text()).get("raw", {}) if args.only and json_path.exists() else {}
        for sec in [s for s in drop_stale(raw) if s not in only]:
            print(f"dropped section {sec} of {json_path.name}: measured before standalone costs and read-back "
                  f"affinity (rerun it)", flush=True)
        raw.update({"machine": common.machine_info(), "mode": mode, "pinned": pin, "config": cfg})
        measure(raw, only, cfg, pin)
    try:
        der = derive(raw)
    except formulas.ImplausibleMeasurement as e:
        rejected = RESULTS / f"{stem}.rejected.json"
        rejected.write_text(json.dumps(common.to_jsonable({"raw": raw, "rejected": str(e)}), indent=1))
        raise SystemExit(f"benchmark rejected, nothing published: {e}\n(raw measurements in {rejected})") from e
    plots = make_plots(raw, der, suffix)
    md = render(raw, der, mode, plots)
    (RESULTS / f"{stem}.md").write_text(md + "\n")
    json_path.write_text(json.dumps(common.to_jsonable({"raw": raw, "derived": der}), indent=1))
    print(md)
    print(f"wrote {RESULTS / (stem + '.md')}, {json_path} and {len(plots)} plot(s); measuring took "
          f"{raw.get('elapsed_s', 0):.0f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
