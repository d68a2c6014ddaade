"""Issue #22's "must hold": the `--auto` plan's MEASURED step against the best of EVERY legal plan, measured.

    python -m benchmarks.planner_exhaustive [--quick] [--steps 30] [--warmup 6] [--pin] [--rounds 3] [--pairs 8]

The case: the example GPT (`examples/gpt.yaml`: vocab 128, d_model 64, 4 heads, d_mlp 256,
2 blocks → 4 layers embed/block0/block1/head, seq 32, adam), global batch 16, on an
embedded local Ray with 2 simulated hosts × 2 simulated CPU devices (one placement-group
bundle per host, as `meshpipe run` places them).

The bounded space (`orchestrator.core.planner.search.legal_plans`, pure-tested in
tests/test_planner_exhaustive.py): microbatches m ∈ {2, 4} ({4} with `--quick`); schedule
1f1b (one stage: no schedule); 1 or 2 stages; every cut; every host count per stage (stages
on whole consecutive hosts from host 0, so a plan may leave host 1 idle); every mesh of a
stage's devices with a model axis ≤ 2 (data × model, both axis orders on 2 hosts); layout
rules `megatron` (heads, mlp, vocab → model); remat none. Every plan that fits device memory
and divides its batch and sharded dims is in it.

Protocol (Ray's workers at niceness 0, as benchmarks/run.py does, recorded):
  0. `meshpipe calibrate` on that cluster (the same Ray), so predictions use this machine's figures;
  1. the pure search picks the `--auto` plan (the DP + simulator replay, not exhaustive) over
     the same bounded options; `legal_plans` lists the space with each plan's prediction;
  2. `--rounds` rounds: in each, every legal plan runs `--steps` steps, in a new shuffled order
     (seed = the round); a run's figure is the median step after dropping the first `--warmup`
     (compilation, warm-up), a plan's the median of its runs — every plan measured as often and
     spread over the same stretch of time, so a drift of the machine's speed (seen here: the same
     plan 10 vs 20 ms an hour apart) does not favour the plans measured in a fast moment;
  3. head to head (`--pairs` blocks, default 8): the auto pick and the `--challengers` (2) best
     measured other plans run back to back in each block, the order rotating through their
     permutations; each block gives auto's step ÷ each challenger's, and the verdict on the 1.05
     target comes from those ratios' median and its order-statistic interval (`benchmarks.paired`):
     MET when every interval lies at or below 1.05, NOT MET when one lies above, else NOT DECIDED.
     A drift of the machine hits both runs of a block and cancels in its ratio;
  4. reported: auto ÷ best measured, auto's rank, predicted-vs-measured error of every plan
     (median |error|), each plan's run-to-run spread (the noise floor: a 1.05 target is only
     decided when it is below 5 %), load averages after each phase, the hypervisor's steal
     share, pinning and the cores read back on the actors.

Writes benchmarks/results/planner_exhaustive{.quick}.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.common import RESULTS, ROOT, cpu_times, machine_info, steal_share
from benchmarks.paired import block_order, verdict as paired_verdict
from orchestrator.core.config import check_job, check_output_dir, load_cluster, parse_job
from orchestrator.core.planner import Profiler, SearchOptions, from_cluster, search
from orchestrator.core.planner.adapter import from_job
from orchestrator.core.planner.cost import optimizer_slots
from orchestrator.core.planner.report import job_dict
from orchestrator.core.planner.search import legal_plans

WORKER = "stages.aot_profile"
HOSTS, DPH, GLOBAL_BATCH = 2, 2, 16
RULESETS = {"megatron": ("heads", "mlp", "vocab")}
TARGET = 1.05          # the auto pick's measured step ÷ the best plan's


def base_job(out_dir: str, steps: int) -> dict:
    raw = yaml.safe_load((ROOT / "examples" / "gpt.yaml").read_text())
    raw["data"]["global_batch"] = GLOBAL_BATCH
    raw["data"]["path"] = str(ROOT / raw["data"]["path"])
    raw["run"].update(steps=steps, output_dir=out_dir)
    return raw


def _niceness() -> int:
    return os.nice(0)


def describe(c) -> str:
    return (f"{len(c.stages)} stage(s), m={c.microbatches} {c.schedule}: "
            + " ; ".join(f"[{s.layers[0]},{s.layers[1]}) h{s.hosts[0]}×{s.hosts[1]} {s.choice.label()}"
                         for s in c.stages))


def write_cluster(path: Path, pin: bool) -> None:
    """The benchmark's cluster YAML: HOSTS simulated hosts × DPH CPU devices."""
    path.write_text(yaml.safe_dump({"hosts": HOSTS, "devices_per_host": DPH, "cpus_per_host": 0.5, "pin_cpus": pin}))


def search_options(job, microbatches: tuple, max_model: int = 2) -> SearchOptions:
    """The bounded space's options (module docstring): 1F1B, `megatron` rules, no remat, no fsdp."""
    return SearchOptions(microbatches=microbatches, schedules=("1f1b",), rulesets=RULESETS, max_model=max_model,
                         remats=("none",), max_fsdp=1,
                         optimizer_slots=optimizer_slots(job.optimizer.name, job.optimizer.args))


def start_ray(namespace: str) -> int:
    """An embedded local Ray on loopback with its workers at niceness 0 (Ray's default 15 starves the
    stage actors behind other load, as in benchmarks/run.py); the niceness a worker reads back."""
    import ray

    from orchestrator.driver.placement import loopback_only

    with loopback_only():
        ray.init(address="local", num_cpus=4, include_dashboard=False, namespace=namespace,
                 logging_level="WARNING", _system_config={"worker_niceness": 0})
    return ray.get(ray.remote(num_cpus=0)(_niceness).remote(), timeout=120)


def measure(raw: dict, cand, cluster, tag: str, warmup: int) -> dict:
    """Run one plan once; the median step after the first `warmup` steps."""
    from orchestrator.driver.runner import run_job

    job = job_dict(raw, cand)
    job["run"] = {**job["run"], "name": f"exh-{tag}"}
    checked = check_job(parse_job(job), cluster)
    check_output_dir(checked.job)
    t0 = time.perf_counter()
    summary = run_job(checked, echo=lambda s: None)
    times = summary["step_times_s"][warmup:]
    return {"median_s": statistics.median(times), "steps_timed": len(times), "wall_s": time.perf_counter() - t0,
            "conditions": summary.get("conditions")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="m ∈ {4} only (half the space)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3, help="runs of every plan, one per round")
    ap.add_argument("--recalibrate", action="store_true",
                    help="calibrate again before every round after the first and predict that round's runs from it")
    ap.add_argument("--pin", action="store_true",
                    help="cluster pin_cpus: each simulated host's actors (and calibrate's probes) on one core of its own")
    ap.add_argument("--pairs", type=int, default=8,
                    help="head-to-head blocks after the rounds: the auto pick beside each challenger (0: none)")
    ap.add_argument("--challengers", type=int, default=2,
                    help="the best measured plans other than the auto pick run head to head with it")
    ap.add_argument("--label", default="", help="a note on the conditions, written into the results")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit(f"--rounds = {args.rounds}: must be ≥ 1")
    if args.pairs < 0 or args.challengers < 1:
        raise SystemExit(f"--pairs = {args.pairs}, --challengers = {args.challengers}: need pairs ≥ 0, challengers ≥ 1")
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps = {args.steps}: must be > --warmup ({args.warmup})")
    ms = (4,) if args.quick else (2, 4)
    info = machine_info()
    loads = {"start": os.getloadavg()}
    ticks0 = cpu_times()
    import ray

    from orchestrator.driver.calibrate import calibrate

    with tempfile.TemporaryDirectory(prefix="meshpipe-planner-exhaustive-") as tmp:
        src = Path(tmp) / "cluster.yaml"
        write_cluster(src, bool(args.pin))
        try:
            info["ray_worker_niceness"] = start_ray("meshpipe-exhaustive")
            t0 = time.perf_counter()
            cal = calibrate(str(src), echo=print)
            cluster = load_cluster(cal["written"])
            loads["after_calibrate"] = os.getloadavg()
            raw = base_job(str(Path(tmp) / "runs"), args.steps)
            job = parse_job(raw)
            model = from_job(job)
            topo = from_cluster(cluster)
            prof = Profiler(WORKER, Path(tmp) / "cache", timeout_s=1800)
            opts = search_options(job, ms)
            profile = lambda reqs: prof.profile(model.source, reqs)
            t1 = time.perf_counter()
            plans = legal_plans(model, topo, GLOBAL_BATCH, profile=profile, options=opts)
            auto = search(model, topo, GLOBAL_BATCH, profile=profile, options=opts).best
            t2 = time.perf_counter()
            keys = [c.key() for c in plans]
            auto_i = keys.index(auto.key())
            print(f"{len(plans)} legal plans; auto = #{auto_i} {describe(auto)}", flush=True)
            runs: dict[int, list[dict]] = {i: [] for i in range(len(plans))}
            failed: dict[int, str] = {}
            round_s = []
            first = {k: c.step_s for k, c in zip(keys, plans)}
            calibrations = [_cal_note(cal, "before round 1")]
            for rnd in range(args.rounds):       # every plan in every round, a new order each round
                t_r = time.perf_counter()
                predicted = first
                if args.recalibrate and rnd > 0:     # this round's runs against this round's figures
                    again = calibrate(str(src), out=str(Path(tmp) / f"cluster.round{rnd + 1}.yaml"), echo=lambda _: None)
                    calibrations.append(_cal_note(again, f"before round {rnd + 1}"))
                    topo_r = from_cluster(load_cluster(again["written"]))
                    predicted = {c.key(): c.step_s for c in legal_plans(model, topo_r, GLOBAL_BATCH, profile=profile,
                                                                         options=opts)}
                order = [i for i in range(len(plans)) if i not in failed]
                random.Random(rnd).shuffle(order)
                for n, i in enumerate(order):
                    try:
                        r = measure(raw, plans[i], cluster, f"{i}-r{rnd + 1}", args.warmup)
                    except Exception as e:  # noqa: BLE001 - a legal plan that does not run is a finding, not the end
                        failed[i] = f"round {rnd + 1}: {type(e).__name__}: {e}"[:500]
                        print(f"round {rnd + 1} [{n + 1}/{len(order)}] #{i} FAILED {failed[i]}", flush=True)
                        continue
                    runs[i].append({**r, "predicted_s": predicted.get(keys[i])})
                    print(f"round {rnd + 1} [{n + 1}/{len(order)}] #{i} {r['median_s'] * 1e3:.2f} ms (predicted "
                          f"{(predicted.get(keys[i]) or float('nan')) * 1e3:.2f}) {describe(plans[i])}", flush=True)
                loads[f"after_round{rnd + 1}"] = os.getloadavg()
                round_s.append(time.perf_counter() - t_r)
            t_h = time.perf_counter()
            h2h = head_to_head(raw, plans, runs, auto_i, cluster, args) if args.pairs else None
            loads["after_head_to_head"] = os.getloadavg()
            h2h_s = time.perf_counter() - t_h
            loads["end"] = os.getloadavg()
            info["steal_share"] = steal_share(ticks0, cpu_times())
        finally:
            ray.shutdown()
    out = {"case": {"model": "gpt", "model_args": raw["model"]["args"], "seq_len": raw["data"]["seq_len"],
                    "global_batch": GLOBAL_BATCH, "hosts": HOSTS, "devices_per_host": DPH,
                    "space": {"microbatches": list(ms), "schedules": ["1f1b"], "stages": [1, 2], "max_model": 2,
                              "rulesets": {k: list(v) for k, v in RULESETS.items()}, "remats": ["none"],
                              "plans": len(plans)},
                    "protocol": {"steps": args.steps, "warmup_dropped": args.warmup, "rounds": args.rounds,
                                 "order": "every plan in every round, each round shuffled (seed = round)",
                                 "recalibrate": bool(args.recalibrate)}},
           "label": args.label, "machine": info, "pin_cpus": bool(args.pin), "probe_affinity": cal.get("affinity"), "load_avg": loads,
           "calibrated": {"device": cal["device"], "all_busy": cal.get("all_busy"), "links": {k: {kk: vv for kk, vv in v.items() if kk != "samples"}
                                                              for k, v in cal["links"].items()},
                          "collective_links": cal.get("collective_links", {}),
                          "overhead": cal.get("overhead")},
           "wall_s": {"calibrate": t1 - t0, "plan": t2 - t1, "rounds": round_s, "head_to_head": h2h_s},
           "head_to_head": h2h,
           "calibrations": calibrations, "failed": failed,
           **summarize([(describe(c), c.step_s, c.memory_bytes) for c in plans], runs, auto_i)}
    stem = "planner_exhaustive.quick" if args.quick else "planner_exhaustive"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(out, indent=1, default=str))
    md = render(out)
    (RESULTS / f"{stem}.md").write_text(md)
    print(md)
    return 0


def head_to_head(raw: dict, plans: list, runs: dict[int, list[dict]], auto_i: int, cluster, args) -> dict:
    """The auto pick beside the best measured other plans, in blocks run back to back
    (`benchmarks.paired`): the decision on the 1.05 target that the rounds' spread cannot make."""
    measured = {i: statistics.median(r["median_s"] for r in rs) for i, rs in runs.items() if rs}
    others = sorted((i for i in measured if i != auto_i), key=measured.get)[:args.challengers]
    if auto_i not in measured or not others:
        return None
    return run_blocks(raw, plans, auto_i, others, args.pairs, cluster, args.warmup)


def run_blocks(raw: dict, plans: list, auto_i: int, others: list[int], pairs: int, cluster, warmup: int) -> dict:
    """`pairs` blocks of the auto pick and `others` run back to back, each block's order the next
    permutation (`block_order`); the verdict on the target from auto ÷ each challenger per block."""
    names = [auto_i, *others]
    blocks, failed = [], []
    for b in range(pairs):
        got, seen = {}, []
        try:
            for i in block_order(b, names):
                r = measure(raw, plans[i], cluster, f"{i}-h{b + 1}", warmup)
                got[i] = r["median_s"]
                seen.append(r.get("conditions"))
        except Exception as e:  # noqa: BLE001 - a failed block is recorded and left out, not the end
            failed.append(f"block {b + 1}: {type(e).__name__}: {e}"[:300])
            print(f"head to head, block {b + 1} FAILED {failed[-1]}", flush=True)
            continue
        blocks.append({"order": list(block_order(b, names)), "median_s": {str(i): got[i] for i in names},
                       "conditions": seen})
        print(f"head to head, block {b + 1}/{pairs}: "
              + ", ".join(f"#{i} {got[i] * 1e3:.2f} ms" for i in block_order(b, names)), flush=True)
    if not blocks:
        return {"auto": auto_i, "challengers": others, "blocks": [], "failed": failed, "overall": "NOT DECIDED",
                "line": "NOT DECIDED: every head-to-head block failed to run"}
    ratios = {f"#{c}": [blk["median_s"][str(auto_i)] / blk["median_s"][str(c)] for blk in blocks] for c in others}
    return {"auto": auto_i, "challengers": others, "blocks": blocks, "failed": failed, **paired_verdict(ratios, TARGET)}


def summarize(plans: list[tuple[str, float, float]], runs: dict[int, list[dict]], auto_i: int) -> dict:
    """Ratio, ranks, errors and noise from (description, predicted s, memory) per plan (best
    predicted first) and each plan's runs ({"median_s": ..}); pure."""
    measured = {i: statistics.median(r["median_s"] for r in rs) for i, rs in runs.items() if rs}
    if auto_i not in measured:
        raise RuntimeError(f"the auto pick (plan #{auto_i}) did not run; nothing to compare")
    by_measured = sorted(measured, key=measured.get)
    best_i = by_measured[0]
    spreads = {i: (max(r["median_s"] for r in rs) - min(r["median_s"] for r in rs)) / measured[i]
               for i, rs in runs.items() if len(rs) > 1}
    rows = [{"plan": i, "describe": d, "predicted_s": pred, "measured_s": measured[i],
             "runs_s": [r["median_s"] for r in runs[i]], "error": (pred - measured[i]) / measured[i],
             "predicted_rank": i + 1, "measured_rank": by_measured.index(i) + 1, "memory_bytes": mem,
             "conditions": [c for r in runs[i] for c in (r.get("conditions") or [])],
             "error_each_round": _round_error(runs[i])}
            for i, (d, pred, mem) in enumerate(plans) if i in measured]
    ratio = measured[auto_i] / measured[best_i]
    max_spread = max(spreads.values()) if spreads else float("nan")
    if not max_spread <= 0.05:
        verdict = (f"NOT DECIDED: the plans' run-to-run spread is up to {max_spread * 100:.0f} % "
                   f"(> 5 %) on this machine, so a ratio of {ratio:.3f} can neither confirm nor refute the 1.05 target")
    else:
        verdict = (f"{'MET' if ratio <= 1.05 else 'NOT MET'}: auto ÷ best measured = {ratio:.3f} "
                   f"(every plan's run-to-run spread ≤ {max_spread * 100:.1f} %)")
    return {"auto": {"plan": auto_i, "describe": plans[auto_i][0], "predicted_s": plans[auto_i][1],
                     "measured_s": measured[auto_i], "measured_rank": by_measured.index(auto_i) + 1,
                     "predicted_rank_in_space": auto_i + 1},
            "best_measured": {"plan": best_i, "describe": plans[best_i][0], "measured_s": measured[best_i],
                              "predicted_rank": best_i + 1},
            "ratio_auto_over_best": ratio, "target": 1.05,
            "median_abs_error": statistics.median(abs(r["error"]) for r in rows),
            "median_abs_error_each_round": (statistics.median(abs(r["error_each_round"]) for r in rows)
                                            if all(r["error_each_round"] is not None for r in rows) else None),
            "plans_measured": len(measured),
            "repeated_spread": {"max": max_spread,
                                "median": statistics.median(spreads.values()) if spreads else None,
                                "per_plan": spreads},
            "verdict": verdict, "rows": rows}


def _busy(ab) -> str:
    """The all-hosts-busy device figures in one phrase (calibrate's `all_busy`)."""
    if not ab:
        return "not measured"
    return (f"{ab['flops_per_device'] / 1e9:.3g} GFLOP/s, {ab['bandwidth_per_device'] / 1e9:.3g} GB/s per device "
            f"(slowest host; windows overlapped {ab['overlap']['matmul']:.0%} / {ab['overlap']['elementwise']:.0%})")


def _round_error(runs: list[dict]) -> float | None:
    """A plan's error against the figures calibrated before each of its runs: the median over its
    runs of (that run's prediction − its measured step) ÷ its measured step; None without them."""
    if not runs or any(r.get("predicted_s") is None for r in runs):
        return None
    return statistics.median((r["predicted_s"] - r["median_s"]) / r["median_s"] for r in runs)


def _cal_note(cal: dict, when: str) -> dict:
    """What one calibration measured, for the record (the device figures all hosts busy, the overheads)."""
    ab = cal.get("all_busy") or cal["device"]
    over = cal.get("overhead") or {}
    return {"when": when, "flops_per_device": ab["flops_per_device"], "bandwidth_per_device": ab["bandwidth_per_device"],
            "action_overhead_s": over.get("action_overhead_s"), "transfer_overhead_s": over.get("transfer_overhead_s")}


def _pct(x) -> str:
    return "not read" if x is None else f"{x * 100:.2f} %"


def _cores(out: dict) -> str:
    """The cores the stage actors read back, per cluster host, over every measured run."""
    seen: dict[str, set] = {}
    for r in out["rows"]:
        for c in r.get("conditions") or []:
            seen.setdefault(f"s{c['stage']}h{c['host']}", set()).add(tuple(c["affinity"] or ()))
    return "; ".join(f"{k} {sorted(v)}" for k, v in sorted(seen.items())) or "not recorded"


def _us(seconds) -> str:
    return "?" if seconds is None else f"{seconds * 1e6:.0f}"


def render(out: dict) -> str:
    """The result (`planner_exhaustive.json`) as the markdown page."""
    case, info, la = out["case"], out["machine"], out["load_avg"]
    load = lambda t: "/".join(f"{x:.1f}" for x in t)
    sp = case["space"]
    md = [f"# `--auto` vs every legal plan, measured ({info['when']})", "",
          f"GPT {case['model_args']} seq {case['seq_len']}, global batch {case['global_batch']}, on "
          f"{case['hosts']} simulated hosts × {case['devices_per_host']} simulated CPU devices (embedded local Ray, "
          "one placement-group bundle per host), after `meshpipe calibrate` on the same Ray.", "",
          f"bounded space ({sp['plans']} legal plans): m ∈ {sp['microbatches']}, schedules {sp['schedules']}, "
          f"stages {sp['stages']}, every cut and host count, meshes with model axis ≤ {sp['max_model']} (both axis "
          f"orders across hosts), rules {sp['rulesets']}, remat {sp['remats']}.", "",
          f"protocol: {case['protocol']['steps']} steps per run, first {case['protocol']['warmup_dropped']} dropped, "
          f"median of the rest; {case['protocol']['rounds']} rounds ({case['protocol']['order']}); "
          "a plan's figure = median of its runs.", "",
          f"machine: {info['cpu']}, {info['nproc']} CPUs, affinity {info['affinity']} cores, Ray worker niceness "
          f"{info.get('ray_worker_niceness', '?')}; hypervisor steal {_pct(info.get('steal_share'))} of CPU time; pin_cpus {out.get('pin_cpus', False)}: cores read back on "
          f"calibrate's probes {out.get('probe_affinity')}, on the stage actors {_cores(out)}; load average "
          + ", ".join(f"{k} {load(v)}" for k, v in la.items())
          + (f". {out['label']}" if out.get("label") else ""), "",
          f"calibrated: device {out['calibrated']['device']}, links {out['calibrated']['links']}, collectives across "
          f"hosts {out['calibrated'].get('collective_links', {})}, per-action / per-transfer overhead "
          f"{_us((out['calibrated'].get('overhead') or {}).get('action_overhead_s'))} / "
          f"{_us((out['calibrated'].get('overhead') or {}).get('transfer_overhead_s'))} µs (transfer from the "
          f"{(out['calibrated'].get('overhead') or {}).get('transfer_source', 'fit')}); all hosts busy at once: "
          + _busy(out['calibrated'].get('all_busy')), "",
          *([f"**head to head: {out['head_to_head']['line']}**", "",
             f"(auto #{out['head_to_head']['auto']} beside the best measured other plans "
             f"{', '.join('#' + str(c) for c in out['head_to_head']['challengers'])}, in "
             f"{len(out['head_to_head']['blocks'])} blocks run back to back, each block's order one permutation in "
             "turn; one ratio per block: auto's median step ÷ the challenger's; `benchmarks/paired.py`)"
             + (f"; {len(out['head_to_head']['failed'])} block(s) failed: {out['head_to_head']['failed']}"
                if out['head_to_head'].get('failed') else ""), ""]
            if out.get("head_to_head") else []),
          f"rounds alone: **{out['verdict']}**", "",
          f"auto pick: #{out['auto']['plan']} {out['auto']['describe']} — measured {out['auto']['measured_s'] * 1e3:.2f} ms, "
          f"rank {out['auto']['measured_rank']} of {out['plans_measured']} measured", "",
          f"best measured: #{out['best_measured']['plan']} {out['best_measured']['describe']} — "
          f"{out['best_measured']['measured_s'] * 1e3:.2f} ms (rank {out['best_measured']['predicted_rank']} by prediction)", "",
          f"prediction error: median |error| {out['median_abs_error'] * 100:.1f} % over {out['plans_measured']} plans "
          "(target ≤ 15 %)" + (f"; {len(out['failed'])} plan(s) failed to run: {out['failed']}" if out.get("failed") else ""), "",
          *([f"with each run predicted from the calibration taken just before its round (`--recalibrate`): median "
             f"|error| {out['median_abs_error_each_round'] * 100:.1f} %; the calibrations: "
             + "; ".join(f"{c['when']}: {c['flops_per_device'] / 1e9:.3g} GFLOP/s, {c['bandwidth_per_device'] / 1e9:.3g} "
                         f"GB/s per device, overheads {_us(c['action_overhead_s'])} / {_us(c['transfer_overhead_s'])} µs"
                         for c in out.get("calibrations", [])), ""]
            if out["case"]["protocol"].get("recalibrate") and out.get("median_abs_error_each_round") is not None else []),
          "| # (by prediction) | plan | predicted ms | measured ms | runs ms | error | measured rank |",
          "|---:|---|---:|---:|---|---:|---:|"]
    for r in out["rows"]:
        runs = ", ".join(f"{x * 1e3:.1f}" for x in r["runs_s"])
        mark = " **auto**" if r["plan"] == out["auto"]["plan"] else ""
        md.append(f"| {r['plan']}{mark} | {r['describe']} | {r['predicted_s'] * 1e3:.2f} | {r['measured_s'] * 1e3:.2f} | "
                  f"{runs} | {r['error'] * 100:+.1f}% | {r['measured_rank']} |")
    ws = out["wall_s"]
    md += ["", f"wall: calibrate {ws['calibrate']:.0f} s, plan {ws['plan']:.0f} s, rounds "
           + ", ".join(f"{x:.0f} s" for x in ws["rounds"])
           + (f", head to head {ws['head_to_head']:.0f} s" if ws.get("head_to_head") else "")]
    return "\n".join(md) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
