"""`meshpipe calibrate --cluster C.yaml [--out FILE]`: measure the cluster, write its `device:`/`links:`.

Basic flow:
  1. Load and validate the cluster; check the output path (never the input file; an
     existing file only with --force) — all before Ray starts.
  2. Connect to Ray as `meshpipe run` does (`address: null`: an embedded local Ray)
     and reserve one bundle per cluster host (the job's own placement rules: one
     placement group, each probe in its host's bundle with the backend's env).
  3. Probes (`stages.calibrate_probe`): host 0 times its devices alone (matmul FLOP/s,
     memory bandwidth, with every device of the host busy, the other hosts idle) →
     `device.lone_*`; then every host times the same programs AT ONCE (each compiles
     first, then all start at one wall-clock time the driver picks, `START_S` ahead),
     in `BUSY_WINDOWS` windows, each host's median kept →
     `device.tflops` / `memory_bandwidth_gbps`, the slowest host's figure
     (`planner.calibrate.all_busy`; each host's own and the timing windows' overlap go
     in the report). Host 0 then times its mesh's
     all-reduce / all-gather over a size sweep → `links.host`; probe pairs send
     over meshpipe's socket transport → the class the pair spans (hosts 0 and 1:
     `group` with node groups, else `dcn`; with node groups also 0 and the first
     host of the next group: `dcn`). Then, per such pair, a fresh pair of probes is
     placed as ONE 2-host stage's actors and joins one JAX world the way a multi-host
     stage does (coordinator on the first, `stages.jaxinit`; gloo on CPU), and times
     all-reduce / all-gather over both hosts' devices and over the host axis alone
     → `links.<class>.collectives`, what the cost model charges a mesh axis spanning
     those hosts. Every probe is killed and the group removed.
  4. The runtime's fixed costs: tiny real pipeline jobs (an MLP of width 8, 1F1B,
     4 microbatches, 8 steps) run on the cluster through `run_job`, in `ROUNDS`
     rounds: one 1-host stage gives the per-action overhead o (the simulator, each
     F/B/OPT costing o, replays its measured step); with two hosts, two 1-host stages
     give the per-transfer overhead (each edge at the fitted link's α-β time plus it,
     o per action) (`planner.calibrate.fit_overhead`; the tiny model's compute is
     neglected). The medians of the rounds' fits are kept (`fit_rounds`; each
     round's per-transfer fit at its own per-action one), the load average is
     recorded per round, and the per-transfer overhead is checked against the
     transfers read off the two-stage runs' SEND/RECV spans, all rounds pooled
     (`direct_transfers`, `choose_transfer`: where the fit is implausible the spans'
     figure is written, and the report says which; the spans' wall clocks are
     comparable on one machine, within clock skew across machines).
  5. Write the cluster YAML with the measured figures (`planner.calibrate`), load it
     back, and report. An embedded Ray we started is stopped.
Every remote wait has a deadline (`cluster.timeouts.init_s` to start, `CALL_S` per
measurement call).
"""
from __future__ import annotations

import os
import secrets
import statistics
import tempfile
import time
from pathlib import Path
from dataclasses import replace
from types import SimpleNamespace
from typing import Callable, Optional

import yaml

from orchestrator.core.config import check_job, load_cluster, load_job, load_raw
from orchestrator.core.config.check import StagePlan
from orchestrator.core.planner.calibrate import (CalibrationError, Sample, calibrated_raw, destination,
                                                 all_busy, choose_transfer, direct_transfers, fit_alpha_beta,
                                                 fit_per_array, fit_rounds, shared_slowdown, write_calibrated)
from orchestrator.core.planner.topology import from_cluster

__all__ = ["calibrate", "CalibrationError", "COLLECTIVE_SIZES", "SEND_SIZES", "ROUNDS"]

CALL_S = 300.0                                  # one measurement call's deadline
COLLECTIVE_SIZES = [1 << 14, 1 << 17, 1 << 20, 1 << 22]     # bytes per device
SEND_SIZES = [1 << 12, 1 << 16, 1 << 20, 1 << 22]           # bytes per send
TINY_STEPS, TINY_M = 8, 4
ROUNDS = 3                                      # rounds of the tiny runs (the medians of their fits are kept)
START_S = 1.0                                   # how far ahead the hosts' common start time is set
BUSY_WINDOWS = 3                                # all-hosts-busy timing windows (each host's median is kept)


def _probe_checked(cluster):
    """What placement needs to place one probe per cluster host (each its own 1-host 'stage')."""
    stages = tuple(StagePlan(h, (0, 1), {"data": cluster.devices_per_host}, (h,), cluster.devices_per_host, {})
                   for h in range(cluster.hosts))
    return SimpleNamespace(cluster=cluster, stages=stages, import_dir=None)


def _probes(cluster, echo, run: str) -> dict:
    """Steps 2-3 of the module docstring: device figures and link samples per class."""
    import ray
    from ray.util.placement_group import remove_placement_group

    from orchestrator.driver import placement
    from orchestrator.driver.waiting import wait_all
    from stages.calibrate_probe import CalibrationProbe

    checked = _probe_checked(cluster)
    init_s = cluster.timeouts.init_s
    pg = placement.reserve(checked, f"{run}/pg", init_s)
    actors = []
    try:
        remote = ray.remote(CalibrationProbe)
        for st in checked.stages:
            opts = placement.actor_options(checked, st, 0, pg, run)
            opts["namespace"] = f"meshpipe-{run}"
            actors.append(remote.options(**opts).remote(st.hosts[0], cluster.pin_cpus))
        labels = [f"host {h}" for h in range(cluster.hosts)]
        infos = wait_all([a.info.remote() for a in actors], init_s, "starting calibration probes", labels)
        echo(f"probes up on {len(actors)} host(s): {infos[0]['devices']} {infos[0]['platform']} device(s) each; "
             f"cores read back per host: {[i['affinity'] for i in infos]}")
        dev = wait_all([actors[0].device.remote()], CALL_S, "timing host 0's devices", labels[:1])[0]
        busy = _all_busy(actors, labels) if len(actors) > 1 else None
        samples = {}
        coll = wait_all([actors[0].collectives.remote(COLLECTIVE_SIZES)], CALL_S, "timing host 0's collectives",
                        labels[:1])[0]
        if coll:
            samples["host"] = coll
        topo = from_cluster(cluster)
        pairs = []
        if cluster.hosts >= 2:
            pairs.append((0, 1))
            g = topo.hosts_per_group
            if 1 < g < cluster.hosts:
                pairs.append((0, g))
        for a, b in pairs:
            cls = topo.class_of_hosts([a, b])
            token = secrets.token_bytes(32)
            hosts = [a, b]
            addrs = wait_all([actors[a].open_transport.remote(0, hosts, token, CALL_S),
                              actors[b].open_transport.remote(1, hosts, token, CALL_S)], init_s,
                             "opening probe transports", [labels[a], labels[b]])
            wait_all([actors[h].connect.remote([[addrs[0]], [addrs[1]]]) for h in hosts], init_s,
                     "connecting probe transports", [labels[a], labels[b]])
            wait_all([actors[a].expect_sends.remote(1, SEND_SIZES), actors[b].expect_sends.remote(0, SEND_SIZES)],
                     init_s, "registering the probe sends", [labels[a], labels[b]])
            got = wait_all([actors[a].pingpong.remote(1, True, SEND_SIZES, 5, CALL_S),
                            actors[b].pingpong.remote(0, False, SEND_SIZES, 5, CALL_S)], CALL_S,
                           f"sends between hosts {a} and {b}", [labels[a], labels[b]])
            wait_all([actors[h].close.remote() for h in hosts], init_s, "closing probe transports",
                     [labels[a], labels[b]])
            samples[cls] = got[0]
        for a in actors:                 # their bundles' CPUs go to the 2-host worlds below
            ray.kill(a, no_restart=True)
        collectives = {}
        for j, (a, b) in enumerate(pairs):
            cls = topo.class_of_hosts([a, b])
            world = _world(checked, (a, b), cluster.hosts + j, pg, run, remote, actors)
            collectives[cls] = _world_collectives(world, f"hosts {a} and {b}", cluster)
            echo(f"collectives across hosts {a} and {b} ({cls}): {len(collectives[cls])} timings")
            for w in world:
                ray.kill(w, no_restart=True)
        return {"affinity": [i["affinity"] for i in infos], "device": dev, "all_busy": busy, "samples": samples, "collectives": collectives, "pairs": pairs,
                "probes": infos}
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)
        remove_placement_group(pg)


def _all_busy(actors: list, labels: list[str]) -> dict:
    """Every host times its devices' matmul and elementwise programs at once (module docstring, step 3)."""
    from orchestrator.driver.waiting import wait_all

    sizes = wait_all([a.prepare_device.remote() for a in actors], CALL_S, "compiling every host's device probes",
                     labels)
    got: dict = {}
    for window in range(BUSY_WINDOWS):
        for which in ("matmul", "elementwise", "kernels_short", "kernels_long", "stage_sized"):
            start = time.time() + START_S
            got.setdefault(which, []).append(wait_all([a.time_device.remote(which, start) for a in actors],
                                                      CALL_S + START_S, f"timing every host's {which} at once "
                                                      f"(window {window + 1} of {BUSY_WINDOWS})", labels))
    hosts = [{"host": h, **{w: [win[h] for win in got[w]] for w in got}} for h in range(len(actors))]
    out = all_busy(hosts, sizes[0]["matmul_n"], sizes[0]["elementwise_bytes_per_device"], sizes[0]["kernel_counts"])
    out["late_s"] = max(r["late_s"] for w in got.values() for win in w for r in win)
    return out


def _world(checked, hosts: tuple, index: int, pg, run: str, remote, actors: list) -> list:
    """Probes on `hosts` placed as the actors of one 2-host stage (index `index`, a name of its own),
    appended to `actors` (killed by the caller)."""
    from orchestrator.driver import placement

    dph = checked.cluster.devices_per_host
    stage = StagePlan(index, (0, 1), {"data": len(hosts) * dph}, tuple(hosts), dph, {})
    world = []
    for i, h in enumerate(hosts):
        opts = placement.actor_options(checked, stage, i, pg, run)
        opts["namespace"] = f"meshpipe-{run}"
        world.append(remote.options(**opts).remote(h, checked.cluster.pin_cpus))
        actors.append(world[-1])
    return world


def _world_collectives(world: list, what: str, cluster) -> list[dict]:
    """Join the probes' JAX world (as a multi-host stage's actors do) and time its collectives."""
    from orchestrator.driver.waiting import wait_all

    init_s = cluster.timeouts.init_s
    labels = [f"{what}: process {i}" for i in range(len(world))]
    coord = wait_all([world[0].coordinator_address.remote()], init_s, f"picking the coordinator of {what}",
                     labels[:1])[0]
    join_s = float(cluster.timeouts.jax_distributed_init_s)
    wait_all([w.join.remote(len(world), i, coord, join_s) for i, w in enumerate(world)], init_s + join_s,
             f"joining one JAX world across {what}", labels)
    got = wait_all([w.collectives.remote(COLLECTIVE_SIZES) for w in world], CALL_S,
                   f"timing collectives across {what}", labels)
    return got[0]


def _tiny_job(cluster, workdir: Path, p: int) -> Path:
    """A tiny MLP pipeline job of p 1-host stages on this cluster (module docstring, step 4)."""
    dph = cluster.devices_per_host
    stages = [{"layers": [0, 2], "mesh": {"data": dph}, "hosts": 1},
              {"layers": [2, 4], "mesh": {"data": dph}, "hosts": 1}] if p == 2 else \
             [{"layers": [0, 4], "mesh": {"data": dph}, "hosts": 1}]
    job = {"run": {"name": f"calibrate-overhead-{p}", "steps": TINY_STEPS, "seed": 0, "output_dir": str(workdir)},
           "model": {"name": "mlp", "args": {"d_in": 4, "d_model": 8, "d_mlp": 8, "d_out": 2, "blocks": 2}},
           "data": {"source": "synthetic", "global_batch": TINY_M * dph},
           "optimizer": {"name": "sgd", "args": {"learning_rate": 0.01}},
           "pipeline": {"schedule": "1f1b", "microbatches": TINY_M, "stages": stages},
           "layout": {"batch": "data"}}
    path = workdir / f"calibrate-overhead-{p}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def _tiny_run(cluster, p: int, echo) -> dict:
    """Run the tiny p-stage job: its step times, the median of their second half, the microbatch
    size and the last step's spans (stage, host, action, start, end)."""
    from orchestrator.driver.runner import run_job

    with tempfile.TemporaryDirectory(prefix="meshpipe-calibrate-") as tmp:
        checked = check_job(load_job(_tiny_job(cluster, Path(tmp), p)), cluster)
        echo(f"timing the runtime: a tiny {p}-stage job, {TINY_M} microbatches, {TINY_STEPS} steps ...")
        summary = run_job(checked, echo=lambda s: None)
    times = summary["step_times_s"]
    return {"step_times_s": times, "measured_step_s": statistics.median(times[TINY_STEPS // 2:]),
            "micro": checked.microbatch_size, "spans": summary.get("last_step_spans") or []}


def _overhead(cluster, cross, echo, rounds: int = ROUNDS) -> dict:
    """Step 4: the per-action overhead (one stage) and the per-transfer overhead (two stages), each
    the median of `rounds` rounds' fits (`fit_rounds`), the latter checked against the transfers
    read off the two-stage runs' spans (`choose_transfer`: the spans' figure where the fit is implausible)."""
    from orchestrator.core.schedule import generate, lower, simulate

    low1, low2 = lower(generate("1f1b", 1, TINY_M)), lower(generate("1f1b", 2, TINY_M))
    two = cluster.hosts >= 2 and cross is not None
    runs = []
    for r in range(rounds):
        load0 = os.getloadavg()[0]
        one = _tiny_run(cluster, 1, echo)
        pair = _tiny_run(cluster, 2, echo) if two else None
        runs.append({"one_stage": one, "two_stage": pair, "load_avg": [load0, os.getloadavg()[0]]})
    micro = runs[0]["two_stage"]["micro"] if two else 0
    link = cross.latency_s + micro * 8 * 4 / cross.bandwidth if two else 0.0  # the activation: micro × d_model f32

    def sim_one(x: float) -> float:
        return float(simulate(low1, {"F": x, "B": x, "OPT": x}).step_time)

    def sim_two(o: float, e: float) -> float:
        return float(simulate(low2, [{"F": o, "B": o, "OPT": o}] * 2, [link + e]).step_time)

    fit = fit_rounds([r["one_stage"]["measured_step_s"] for r in runs],
                     [r["two_stage"]["measured_step_s"] for r in runs] if two else [], sim_one, sim_two)
    o, e = fit["action_overhead_s"], fit["transfer_overhead_s"]
    out = {"microbatches": TINY_M, "rounds": [], "action_overhead_s": o, "transfer_overhead_s": e,
           "estimator": "median of the rounds' fits"}
    for r, (run, f) in enumerate(zip(runs, fit["rounds"])):
        rec = {"load_avg": run["load_avg"], **f,
               "one_stage": {**{k: run["one_stage"][k] for k in ("step_times_s", "measured_step_s")},
                             "simulated_at_fit_s": sim_one(f["action_overhead_s"])}}
        if two:
            rec["two_stage"] = {**{k: run["two_stage"][k] for k in ("step_times_s", "measured_step_s")},
                                "simulated_at_fit_s": sim_two(f["action_overhead_s"], f["transfer_overhead_s"])}
            rec["two_stage"]["direct_transfers_s"] = direct_transfers(run["two_stage"]["spans"])
        out["rounds"].append(rec)
    mid1 = statistics.median_low([m["one_stage"]["measured_step_s"] for m in runs])
    out["one_stage"] = {"measured_step_s": mid1, "simulated_at_fit_s": sim_one(o)}
    if two:
        mid2 = statistics.median_low([m["two_stage"]["measured_step_s"] for m in runs])
        out["two_stage"] = {"measured_step_s": mid2, "simulated_at_fit_s": sim_two(o, e)}
        pooled = [t for rec in out["rounds"] for t in rec["two_stage"]["direct_transfers_s"]]
        choice = choose_transfer(e, pooled, link)
        out["transfer_overhead_s"] = choice["transfer_overhead_s"]
        out["transfer_source"] = choice["source"]
        if pooled:
            out["direct"] = {k: choice[k] for k in ("transfer_s", "link_alpha_beta_s", "overhead_s", "agrees",
                                                    "check")}
    return out


def _samples(records: list[dict]) -> list[Sample]:
    """A probe's timing records (which may say more, e.g. the mesh axis) as α-β fit samples; the
    combined all-reduces of several arrays (`arrays`) are fitted on their own (`fit_per_array`)."""
    return [Sample(r["kind"], r["k"], r["nbytes"], r["seconds"]) for r in records if "arrays" not in r]


def calibrate(cluster_path: str, *, out: Optional[str] = None, force: bool = False,
              echo: Callable[[str], None] = print, rounds: int = ROUNDS) -> dict:
    """Measure the cluster and write the calibrated YAML (module docstring); returns the report.

    `rounds`: rounds of the tiny runs that fit the runtime's overheads (the medians of their fits are kept).

    Raises:
      ConfigError: the cluster YAML is invalid.
      CalibrationError: the output path is refused or a figure could not be fitted.
      PlacementError / TimeoutError / RuntimeError: Ray could not place or run the probes.
    """
    raw = load_raw(cluster_path)
    cluster = load_cluster(cluster_path)
    dest = destination(cluster_path, out, force)
    t0 = time.perf_counter()
    load0 = os.getloadavg()
    probe, fits, coll, over = _measure(cluster, echo, rounds)
    dev, busy = probe["device"], probe["all_busy"] or probe["device"]    # one host: all hosts busy = host 0
    new = calibrated_raw(raw, tflops=busy["flops_per_device"] / 1e12,
                         memory_bandwidth_gbps=busy["bandwidth_per_device"] / 1e9,
                         lone_tflops=dev["flops_per_device"] / 1e12,
                         lone_memory_bandwidth_gbps=dev["bandwidth_per_device"] / 1e9,
                         action_overhead_us=over["action_overhead_s"] * 1e6, links=fits,
                         transfer_overhead_us=None if over["transfer_overhead_s"] is None
                         else over["transfer_overhead_s"] * 1e6, collective_links=coll,
                         kernel_overhead_us=busy["kernel_s"] * 1e6, lone_kernel_overhead_us=dev["kernel_s"] * 1e6,
                         shared_slowdown=shared_slowdown(dev, probe["all_busy"]))
    load1 = os.getloadavg()
    loads = " ".join(f"{a:.1f}->{b:.1f}" for a, b in (r["load_avg"] for r in over["rounds"]))
    header = _header(cluster_path, cluster, probe, fits, coll, over, f"{load0[0]:.1f} -> {load1[0]:.1f}", loads)
    path = write_calibrated(new, cluster_path, dest, force=force, header=header)
    report = {"written": str(path), "affinity": probe["affinity"], "device": dev, "all_busy": probe["all_busy"],
              "links": {c: _fit_report(f) for c, f in fits.items()},
              "collective_links": {c: _fit_report(f) for c, f in coll.items()},
              "samples": probe["samples"], "collective_samples": probe["collectives"], "pairs": probe["pairs"],
              "overhead": over, "load_avg": [load0[0], load1[0]], "wall_s": time.perf_counter() - t0}
    _echo_figures(echo, probe, fits, coll, over)
    echo(f"wrote {path} (load average {load0[0]:.1f} -> {load1[0]:.1f}; per overhead round {loads})")
    return report


def _measure(cluster, echo: Callable[[str], None], rounds: int) -> tuple[dict, dict, dict, dict]:
    """(the probes' results, the links' α-β fits, the collectives' fits, the runtime overheads), on a
    Ray connected here for the purpose (and shut down after, when this started it)."""
    import ray

    from orchestrator.driver import placement
    from orchestrator.driver.quiet import filter_worker_logs

    run = f"calibrate-{secrets.token_hex(3)}"
    started = placement.connect(cluster, namespace=f"meshpipe-{run}")
    filter_worker_logs()   # Gloo's connection lines from the 2-host worlds (unless `meshpipe -v`)
    try:
        probe = _probes(cluster, echo, run)
        fits = {cls: replace(fit_alpha_beta(_samples(ss), what=f"links.{cls}"), per_array_s=fit_per_array(ss))
                for cls, ss in probe["samples"].items()}
        coll = {cls: replace(fit_alpha_beta(_samples(ss), what=f"links.{cls}.collectives"),
                             per_array_s=fit_per_array(ss))
                for cls, ss in probe["collectives"].items()}
        cross = next((fits[c] for c in ("group", "dcn") if c in fits), None)
        return probe, fits, coll, _overhead(cluster, cross, echo, rounds)
    finally:
        if started:
            ray.shutdown()


def _fit_report(f) -> dict:
    return {**f.link(), "samples": f.samples, "max_rel_residual": f.max_rel_residual}


def _header(cluster_path: str, cluster, probe: dict, fits: dict, coll: dict, over: dict, load: str, loads: str) -> str:
    """The calibrated file's header: what was measured how, and under what load."""
    dev = probe["device"]
    coll_note = "".join(f"; links.{c}.collectives: one JAX world across hosts" for c in coll)
    return (f"written by `meshpipe calibrate --cluster {cluster_path}` on {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n"
            f"measured: device.tflops/memory_bandwidth_gbps on all {cluster.hosts} host(s) at once (the slowest "
            f"host's; {dev['devices']} devices each), device.lone_* on host 0 alone, links.{{{','.join(fits)}}} "
            f"(α-β fits{coll_note}), "
            f"device.*kernel_overhead_us (chains of tiny kernels, the same two ways), device.shared_slowdown "
            f"(a stage-sized program, all hosts ÷ host 0 alone), "
            f"device.action/transfer_overhead_us (tiny real runs, medians of {len(over['rounds'])} rounds' fits"
            f"{'; transfer from the ' + over['transfer_source'] if 'transfer_source' in over else ''})\n"
            f"load average {load} (1 min; per overhead round {loads}); figures measured "
            "under load are lower bounds of what the cluster can do")


def _echo_figures(echo: Callable[[str], None], probe: dict, fits: dict, coll: dict, over: dict) -> None:
    """The measured figures, a line each, for people."""
    dev = probe["device"]
    echo(f"device, host 0 alone: {dev['flops_per_device'] / 1e9:.3g} GFLOP/s per device (one device alone "
         f"{dev['single_device_flops'] / 1e9:.3g}), {dev['bandwidth_per_device'] / 1e9:.3g} GB/s, "
         f"{dev['kernel_s'] * 1e6:.2f} µs per kernel")
    if probe["all_busy"]:
        ab = probe["all_busy"]
        echo(f"device, all {len(ab['hosts'])} hosts at once (slowest host): {ab['flops_per_device'] / 1e9:.3g} "
             f"GFLOP/s, {ab['bandwidth_per_device'] / 1e9:.3g} GB/s per device, {ab['kernel_s'] * 1e6:.2f} µs per "
             f"kernel (timing windows overlapped "
             f"{ab['overlap']['matmul']:.0%} / {ab['overlap']['elementwise']:.0%}); a stage-sized program "
             f"{ab['stage_sized_s'] * 1e3:.3g} ms against {dev['stage_sized_s'] * 1e3:.3g} ms alone: "
             f"device.shared_slowdown {shared_slowdown(dev, ab):.3g}")
    for name, table in (("", fits), (".collectives", coll)):
        for c, f in table.items():
            echo(f"links.{c}{name}: {f.bandwidth / 1e9:.3g} GB/s, {f.latency_s * 1e6:.3g} µs"
                 + ("" if f.per_array_s is None else f", {f.per_array_s * 1e6:.3g} µs per further array combined")
                 + f" ({f.samples} samples, largest residual {f.max_rel_residual:.0%})")
    echo(f"per-action overhead: {over['action_overhead_s'] * 1e6:.0f} µs (tiny 1-stage run: "
         f"{over['one_stage']['measured_step_s'] * 1e3:.2f} ms per step; median of {len(over['rounds'])} rounds' fits)")
    if over["transfer_overhead_s"] is not None:
        echo(f"per-transfer overhead: {over['transfer_overhead_s'] * 1e6:.0f} µs from the {over['transfer_source']} "
             f"(tiny 2-stage run: {over['two_stage']['measured_step_s'] * 1e3:.2f} ms per step; median of "
             f"{len(over['rounds'])} rounds' fits)")
        if "direct" in over:
            spans = over["transfer_source"] == "spans"
            echo(("WARNING: " if spans else "") + over["direct"]["check"]
                 + ("; the machine was probably busy: calibrate again when it is quiet" if spans else ""))
