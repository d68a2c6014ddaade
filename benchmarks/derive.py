"""Section figures of `benchmarks.run`, derived from the raw records (pure: no ray, jax or torch).

`derive(raw)` turns the measured sections into efficiency, overhead, bounds and the loss
breakdown (formulas in `benchmarks.formulas`); it raises `formulas.ImplausibleMeasurement`
instead of returning a figure that cannot be physically true (efficiency above 1, negative
overhead), so such a run is never published. `drop_stale(raw)` removes kept sections whose
records predate standalone costs and read-back affinity.
"""
from __future__ import annotations

import os

from benchmarks import common, formulas
from benchmarks.common import sim_costs

P = 2


def find(items, size, sched, m):
    """The derived entry of (size, schedule, m), or None."""
    return next((x for x in items if x["key"] == [size, sched, m]), None)


def _jax(raw: dict, size: str, m: int | None, cores: int) -> dict | None:
    for r in raw.get("jax", {}).get("records", []):
        if r.get("status") == "ok" and r["size"] == size and r["cores"] == cores and (m is None or r["m"] == m):
            return r
    return None


def _plain_on(records: list[dict], size: str, m: int, cores: int | None) -> dict | None:
    """The plain run of this size and m on one core (`cores=1`) or on all cores (`None`)."""
    n = cores or (os.cpu_count() or 1)
    return next((r for r in records if r.get("status") == "ok" and r["size"] == size and r["m"] == m
                 and r["cores"] == n), None)


def _against_plain(d: dict, records: list[dict], size: str, m: int, step: float, schedule: str,
                   stages_fb_s: float, what: str) -> None:
    """The honest bound (perfect pipeline of the 1-core work: the plain program, or the stage
    programs' standalone F + B per microbatch `stages_fb_s` when less) and vs plain on all cores.
    The bound has the GPipe/1F1B bubble, so it is left out for the schedules that shrink it."""
    one, full = _plain_on(records, size, m, 1), _plain_on(records, size, m, None)
    if one and schedule in formulas.HONEST_BOUND_SCHEDULES:
        d["plain1_s"] = one["step_s"]
        d["honest_base_s"], d["honest_base"] = formulas.honest_base_s(one["step_s"], m, stages_fb_s)
        d["honest_bound_s"] = formulas.honest_bound_s(one["step_s"], m, P, stages_fb_s)
        d["of_honest_bound"] = formulas.checked_of_honest_bound(one["step_s"], m, P, step, stages_fb_s, what)
    if full and full is not one:
        d["plain_all_s"], d["plain_all_cores"] = full["step_s"], full["cores"]
        d["vs_plain_all"] = formulas.vs_plain(full["step_s"], step)


def _in_run_vs_standalone(in_run: list[dict], alone: list[dict]) -> list[dict]:
    """Per stage and kind, in-run median span ÷ standalone cost (a cross-check; > 1: slower in the run)."""
    return [{k: a[k] / b[k] for k in a if k in b and b[k] > 0} for a, b in zip(in_run, alone)]


def unsplit_mb_s(one: dict | None) -> float | None:
    """One microbatch's forward + backward as one unsplit program on one core: the faster of the
    plain 1-core step's share ((step − update) / m: the scanned whole step) and one microbatch's
    jitted value_and_grad timed alone. The lone microbatch is the slower one here (it allocates
    its gradients afresh on every call while the scan accumulates in place), so taking it alone
    made the split penalty come out negative."""
    if not one:
        return None
    return min(one["fused_mb_s"], (one["step_s"] - one.get("update_s", 0.0)) / one["m"])


def derive_meshpipe(rec: dict, raw: dict) -> dict:
    """Efficiency, overhead, ratios and the loss breakdown of one pipelined run.

    Raises:
      formulas.ImplausibleMeasurement: efficiency above 1 / negative overhead (not published).
    """
    step, ideal, m = rec["step_s"], rec["ideal_s"], rec["m"]
    what = f"meshpipe {rec['size']} {rec['schedule']} m={m}"
    d = {"efficiency": formulas.checked_efficiency(ideal, step, what),
         "overhead_ms": formulas.checked_overhead_ms(step, ideal, rec["compute_actions_per_stage"], what),
         "overhead_cp_ms": formulas.checked_overhead_ms(step, ideal, rec["critical_path_actions"], what),
         "bound": formulas.bound(m, P)}
    costs = rec["standalone"]["stages"]
    d["in_run_vs_standalone"] = _in_run_vs_standalone(rec["costs"], costs)
    plains = raw.get("jax", {}).get("records", [])
    kinds = ("I", "W") if rec["schedule"].startswith("zb") else ("B",)
    v = max(1, len(rec["standalone"].get("chunks", [])) // P)   # chunks per stage; costs are per-chunk means
    fbs = [v * (c["F"] + sum(c[k] for k in kinds)) for c in costs]
    _against_plain(d, plains, rec["size"], m, step, rec["schedule"], sum(fbs), what)
    ref = _plain_on(plains, rec["size"], m, 1) or _plain_on(plains, rec["size"], m, None)
    if ref:
        n = min(len(ref["losses"]), len(rec["losses"]))
        d["loss_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(rec["losses"][:n], ref["losses"][:n]))
    busy = [m * x for x in fbs]
    f1 = unsplit_mb_s(_plain_on(plains, rec["size"], m, 1) or _jax(raw, rec["size"], None, 1))
    fb_sum = sum(fbs)
    idle = [ideal - b - c.get("OPT", 0.0) for b, c in zip(busy, costs)]
    comm = [sum(v for k, v in t.items() if k.startswith(("SEND", "RECV"))) for t in rec["totals"]]
    excess = sum(c - i for c, i in zip(comm, idle)) / len(comm)
    transfers = min(max(0.0, excess), step - ideal)
    # the unsplit work per microbatch: the faster of the 1-core plain program and the stages' own
    # programs, chosen as the honest bound's base is — two stage programs can run faster than the whole
    # (smaller working sets: 105.8 against 110.7 ms per microbatch at `large` m = 4), so split ≥ 0
    base, which = formulas.honest_base_s(f1, 1, fb_sum) if f1 else (None, None)
    parts = {
        "useful": m * base / P if base else None,
        "split": m * (fb_sum - base) / P if base else None,
        "compute": m * fb_sum / P,
        "imbalance": max(busy) - sum(busy) / len(busy),
        "bubble": rec["ideal_no_opt_s"] - max(busy),
        "optimizer": ideal - rec["ideal_no_opt_s"],
        "transfers": transfers,
        "orchestration": step - ideal - transfers,
    }
    if f1:
        d["unsplit_base"] = which
        d["split_gain"] = (f1 - base) / f1    # how much faster the stages ran than the whole (0: they did not)
    d["breakdown_s"] = parts
    d["breakdown_share"] = {k: (v / step if v is not None else None) for k, v in parts.items()}
    d["fused_mb_1core_s"], d["split_fb_sum_s"] = f1, fb_sum
    return d


def derive_torch(rec: dict, raw: dict) -> dict:
    """Torch's figures the same way: the ideal from its standalone F, B, OPT per rank.

    Raises:
      formulas.ImplausibleMeasurement: efficiency above 1 / negative overhead (not published).
    """
    from orchestrator.core.schedule import generate, lower, simulate

    low = lower(generate(rec["schedule"], P, rec["m"]))
    sim = simulate(low, sim_costs(rec["standalone"]))
    step = rec["step_s"]
    what = f"torch {rec['size']} {rec['schedule']} m={rec['m']}"
    n = common.compute_actions_per_stage(low)
    d = {"ideal_s": sim.step_time, "efficiency": formulas.checked_efficiency(sim.step_time, step, what),
         "overhead_ms": formulas.checked_overhead_ms(step, sim.step_time, n, what),
         "overhead_cp_ms": formulas.checked_overhead_ms(step, sim.step_time,
                                                        common.critical_path_actions(sim, low), what),
         "ideal_spans_s": simulate(low, sim_costs(rec["costs"])).step_time,
         "in_run_vs_standalone": _in_run_vs_standalone(rec["costs"], rec["standalone"]),
         "bound": formulas.bound(rec["m"], P)}
    _against_plain(d, raw.get("torch", {}).get("plain", []), rec["size"], rec["m"], step, rec["schedule"],
                   sum(formulas.fb(c) for c in rec["standalone"]), what)
    return d


def derive(raw: dict) -> dict:
    out: dict = {"pipeline": [], "overhead": [], "torch": []}
    for sec in ("pipeline", "overhead"):
        for r in raw.get(sec, {}).get("records", []):
            if r.get("status") == "ok":
                out[sec].append({"key": [r["size"], r["schedule"], r["m"]], **derive_meshpipe(r, raw)})
    for r in raw.get("torch", {}).get("pipe", []):
        if r.get("status") == "ok":
            out["torch"].append({"key": [r["size"], r["schedule"], r["m"]], **derive_torch(r, raw)})
    from benchmarks import executors

    out["executors"] = executors.derive(raw.get("executors", {}).get("records", []))
    return out


def drop_stale(raw: dict) -> list[str]:
    """Remove (and name) the kept sections whose records predate standalone costs and read-back
    affinity: their ideal came from in-run spans, which this benchmark no longer publishes."""
    stale = [sec for sec in ("pipeline", "overhead", "executors")
             if any(r.get("status") == "ok" and "standalone" not in r for r in raw.get(sec, {}).get("records", []))]
    if any(r.get("status") == "ok" and "observed" not in r for r in raw.get("torch", {}).get("pipe", [])):
        stale.append("torch")
    for sec in stale:
        del raw[sec]
    return stale
