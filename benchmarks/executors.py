"""Section `executors` of `benchmarks.run`: the same pipeline driven by each dispatcher of
`orchestrator.driver.dispatch`, side by side in one run.

Variants (executor, steps per call): one `run_steps` Ray call per actor per step and per
4 steps, the same two as a Ray Compiled Graph, and the one-call-per-action reference.
They run in turns, `reps` rounds, so slow drift of the machine hits every variant alike;
each figure is the median over rounds, and *step ÷ default* is taken within a round
(the default = `cluster.executor`'s default) before the median.
"""
from __future__ import annotations

import time

from benchmarks.common import SIZES, fmt, md_table, median
from benchmarks.formulas import checked_efficiency, checked_overhead_ms, overhead_ms

DEFAULT = ("step_calls", 4)


def measure(ec: dict, pin: bool, warmup: int, echo) -> list[dict]:
    from benchmarks.pipeline import measure_pipeline

    out = []
    for run in ec["runs"]:
        for rep in range(run["reps"]):
            for executor, k in run["variants"]:
                t = time.perf_counter()
                rec = measure_pipeline(SIZES[run["size"]], run["schedule"], run["m"], steps=run["steps"],
                                       warmup=warmup, pin=pin, executor=executor, steps_per_call=k)
                rec["rep"] = rep
                took = time.perf_counter() - t
                if rec.get("status") == "ok":
                    over = overhead_ms(rec["step_s"], rec["ideal_s"], rec["compute_actions_per_stage"])
                    echo(f"  {run['size']:>5} {executor:<14} k={k}  step {rec['step_s'] * 1e3:7.2f} ms  "
                         f"ideal {rec['ideal_s'] * 1e3:7.2f} ms  overhead {over:.3f} ms/action  ({took:.0f} s)")
                else:
                    echo(f"  {run['size']:>5} {executor:<14} k={k}  {rec.get('status')}  ({took:.0f} s)")
                out.append(rec)
    return out


def derive(records: list[dict]) -> list[dict]:
    ok = [r for r in records if r.get("status") == "ok"]
    groups: dict = {}
    for r in ok:
        groups.setdefault((r["size"], r["schedule"], r["m"], r["executor"], r["steps_per_call"]), []).append(r)
    out = []
    for (size, sched, m, executor, k), rs in groups.items():
        ratios = []
        for r in rs:
            base = next((b for b in ok if (b["size"], b["schedule"], b["m"], b["rep"]) == (size, sched, m, r["rep"])
                         and (b["executor"], b["steps_per_call"]) == DEFAULT), None)
            if base is not None:
                ratios.append(r["step_s"] / base["step_s"])
        n = rs[0]["compute_actions_per_stage"]
        out.append({
            "key": [size, sched, m, executor, k], "rounds": len(rs),
            "step_s": median([r["step_s"] for r in rs]), "ideal_s": median([r["ideal_s"] for r in rs]),
            "efficiency": median([checked_efficiency(r["ideal_s"], r["step_s"], f"{executor} k={k}") for r in rs]),
            "overhead_ms": median([checked_overhead_ms(r["step_s"], r["ideal_s"], n, f"{executor} k={k}")
                                   for r in rs]),
            "ideal_spans_s": median([r["ideal_spans_s"] for r in rs]),
            "vs_default": median(ratios) if ratios else None,
        })
    return out


def render(records: list[dict], derived: list[dict]) -> list[str]:
    if not records:
        return []
    rows = [[size, m, sched, executor, k, d["rounds"], fmt(d["step_s"] * 1e3), fmt(d["ideal_s"] * 1e3),
             f"**{d['overhead_ms']:.3f}**", fmt(d["ideal_spans_s"] * 1e3), fmt(d["efficiency"], 3),
             fmt(d["vs_default"])]
            for d in derived for size, sched, m, executor, k in [d["key"]]]
    failed = [f"{r['size']} {r['executor']} k={r.get('steps_per_call')}: {r['status']}"
              for r in records if r.get("status") != "ok"]
    return ["## 2b. Executors side by side", "",
            ("The same schedule and model driven by each dispatcher (`cluster.executor`, `cluster.steps_per_call`; "
             "`orchestrator/driver/dispatch.py`): *step_calls* = one Ray call per actor per k steps (default, k = 4), "
             "*compiled_graph* = the same call as a Ray Compiled Graph, *action_calls* = one Ray call per action "
             "(the reference). Variants ran in turns; medians over the rounds; *step ÷ default* < 1 is faster "
             "than the default. Overhead and efficiency as in sections 1-2 (ideal from standalone costs)."), "",
            md_table(["size", "m", "schedule", "executor", "k", "rounds", "step ms", "ideal ms",
                      "overhead ms/action", "in-run ideal ms", "efficiency", "step ÷ default"], rows),
            *([f"Not measured: {'; '.join(failed)}."] if failed else []), ""]
