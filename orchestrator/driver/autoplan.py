"""`meshpipe plan --auto`: load the job and cluster, search, print, write the winning job YAML.

Wires the pure planner (`orchestrator.core.planner`) to the profiling worker of the
actor runtime (`stages.aot_profile`, run in a subprocess with simulated CPU devices)
and the per-layer compile cache on disk. No Ray is started here; the CLI first makes sure
the cluster's figures are measured (`orchestrator.driver.autocal`, which may calibrate it)
and passes what it found (`calibration`): predictions from nominal figures say so.

The written job is the input job with the winner's pipeline and layout and its own
`run.name`, `<name>-auto` (so `meshpipe run` of it never mixes with the hand plan's runs);
it passes every check `meshpipe run` makes before it is reported.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

import yaml

from orchestrator.core.config import ConfigError, check_job, check_output_dir, load_cluster, load_job, load_raw
from orchestrator.core.config.overrides import apply_overrides
from orchestrator.core.config.schema import JobConfig
from orchestrator.core.planner import PlanningError, ProfileError, Profiler, SearchOptions, from_cluster, search
from orchestrator.core.planner.adapter import from_job
from orchestrator.core.planner.cost import optimizer_slots
from orchestrator.core.planner.profile import default_cache_dir
from orchestrator.core.planner.report import candidate_json, explain, job_dict, table

WORKER = "stages.aot_profile"


def auto_plan(job_path: str, cluster_path: str, overrides, *, out: Optional[str], explain_: bool, top: int,
              max_model: Optional[int], microbatches: Optional[tuple[int, ...]], target_step_ms: Optional[float],
              cache_dir: Optional[str], as_json: bool, echo: Callable[[str], None], measure: int = 0,
              measure_steps: int = 8, calibration=None) -> dict:
    """Plan JOB on CLUSTER; returns the JSON report. Raises ConfigError / PlanningError / ProfileError.

    `calibration`: `autocal.Calibration`, what the figures come from (its `cluster` is planned with
    instead of CLUSTER); None: CLUSTER's own, nominal where it gives none (`autocal.nominal`)."""
    from orchestrator.driver.autocal import Calibration, nominal

    job = load_job(job_path, overrides=list(overrides))
    if calibration is None:
        given = load_cluster(cluster_path)
        missing = nominal(given)
        calibration = Calibration("nominal" if missing else "given", cluster_path, missing)
    cluster = load_cluster(calibration.cluster)
    try:
        model = from_job(job)
    except (KeyError, ValueError, TypeError, ImportError, AttributeError) as e:
        raise ConfigError(f"model = {job.model.ref!r}: cannot build the model description for planning: {e}") from None
    topo = from_cluster(cluster)
    profiler = Profiler(WORKER, Path(cache_dir) if cache_dir else default_cache_dir())
    opts = SearchOptions(microbatches=microbatches, max_model=max_model, top=top,
                         optimizer_slots=optimizer_slots(job.optimizer.name, job.optimizer.args),
                         target_step_s=None if target_step_ms is None else target_step_ms / 1e3,
                         fuse_loss_chunk=job.pipeline.fuse_loss_chunk)
    result = search(model, topo, job.data.global_batch, profile=lambda reqs: profiler.profile(model.source, reqs),
                    options=opts, extra_rules=job.layout)
    raw = apply_overrides(load_raw(job_path), list(overrides), JobConfig)
    written = job_dict(raw, result.best)
    written["run"] = {**written["run"], "name": auto_name(written["run"]["name"])}
    dest = Path(out) if out else Path(job_path).with_name(Path(job_path).stem + ".auto.yaml")
    head = (f"# written by `meshpipe plan --auto` from {job_path} for {cluster_path}\n"
            f"# predicted{' from NOMINAL figures (the cluster was not calibrated)' if calibration.is_nominal else ''}: "
            f"{result.best.step_s * 1e3:.3f} ms per step, "
            f"{result.best.memory_bytes / 2**20:.2f} MiB per device, bubble {result.best.bubble:.3f}\n"
            f"# figures: {figures_line(calibration)}\n")
    dest.write_text(head + yaml.safe_dump(written, sort_keys=False))
    check_job(load_job(dest), cluster)       # the written plan passes every check meshpipe run makes
    st = profiler.stats
    report = {"candidates": [candidate_json(c) for c in result.candidates], "space": result.space,
              "timings": result.timings, "written": str(dest),
              "profiles": {"requested": st.requested, "cache_hits": st.cache_hits, "compiled": st.compiled,
                           "compile_s": st.compile_s, "worker_s": st.worker_s},
              "topology_notes": list(topo.notes), "calibration": calibration.to_json()}
    if measure:
        report["measured"] = measure_candidates(raw, result.candidates[:measure], cluster, dest, measure_steps,
                                                echo=(lambda s: None) if as_json else echo)
        report["median_abs_error"] = median_abs_error(report["measured"])
    if as_json:
        echo(json.dumps(report, indent=1))
        return report
    echo(f"model {model.name}: {model.num_layers} layers; cluster {topo.hosts} hosts × {topo.devices_per_host} "
         f"devices ({topo.platform}), {topo.memory_bytes / 1e9:.3g} GB per device")
    echo(f"figures: {figures_line(calibration)}")
    echo(f"search: {result.space['plans_evaluated']} plans simulated out of {result.space['stage_options']:,} "
         f"stage options; {st.requested} layer profiles ({st.cache_hits} cached, {st.compiled} compiled)")
    tm = result.timings
    echo(f"time: compile {tm['compile_s']:.2f} s, cost {tm['cost_s']:.2f} s, solve {tm['solve_s']:.2f} s")
    echo("")
    echo(table(result))
    if explain_:
        echo("")
        echo(explain(result, topo.devices_per_host))
    if measure:
        echo("")
        echo(measured_table(report["measured"]))
    echo("")
    if calibration.is_nominal:
        echo(f"WARNING: the step times above are NOMINAL (from platform defaults, not this cluster): "
             f"`meshpipe calibrate --cluster {cluster_path}` measures it, or drop --no-calibrate")
    echo(f"wrote the winning plan to {dest} as run.name {written['run']['name']!r} "
         f"(meshpipe plan {dest} / meshpipe run {dest})")
    return report


def auto_name(name: str, suffix: str = "") -> str:
    """The written plan's `run.name`: the job's with `-auto` (and `suffix`), cut to fit run.name's
    64 characters.

    >>> auto_name("gpt-tiny"), auto_name("gpt-tiny", "-measure0"), len(auto_name("x" * 64, "-measure9"))
    ('gpt-tiny-auto', 'gpt-tiny-auto-measure0', 64)
    """
    return f"{name[:64 - len('-auto') - len(suffix)]}-auto{suffix}"


def figures_line(calibration) -> str:
    """Where the cost model's figures came from, in one line."""
    if calibration.source == "given":
        return f"the cluster file's own ({calibration.cluster})"
    if calibration.source == "nominal":
        return f"NOMINAL platform defaults for {', '.join(calibration.missing)} (not calibrated: --no-calibrate)"
    return f"measured by meshpipe calibrate {calibration.measured_at} ({calibration.cluster})"


def measure_candidates(raw: dict, candidates, cluster, dest: Path, steps: int, echo) -> list[dict]:
    """Run each candidate for `steps` steps on the cluster (Ray); predicted vs measured step time.

    Measured = median step time of the second half of the steps (the first ones compile).
    """
    import statistics

    from orchestrator.driver.runner import run_job

    rows = []
    for i, c in enumerate(candidates):
        job = job_dict(raw, c)
        job["run"] = {**job.get("run", {}), "name": auto_name(job['run']['name'], f"-measure{i}"), "steps": steps}
        path = dest.with_name(f"{dest.stem}.measure{i}.yaml")
        path.write_text(yaml.safe_dump(job, sort_keys=False))
        checked = check_job(load_job(path), cluster)
        check_output_dir(checked.job)
        echo(f"measuring candidate #{i} ({steps} steps) ...")
        summary = run_job(checked, echo=lambda s: None)
        times = summary["step_times_s"][steps // 2:]
        measured = statistics.median(times)
        rows.append({"candidate": i, "predicted_s": c.step_s, "measured_s": measured,
                     "error": (c.step_s - measured) / measured, "job": str(path), "steps_timed": len(times)})
    return rows


def median_abs_error(rows: list[dict]) -> float:
    """Median over candidates of |predicted − measured| / measured."""
    import statistics

    return statistics.median(abs(r["error"]) for r in rows) if rows else float("nan")


def measured_table(rows: list[dict]) -> str:
    """Predicted vs measured step per candidate, and the median absolute error."""
    lines = [f"{'#':>2} {'predicted ms':>12} {'measured ms':>12} {'error':>7}"]
    for r in rows:
        lines.append(f"{r['candidate']:>2} {r['predicted_s'] * 1e3:>12.3f} {r['measured_s'] * 1e3:>12.3f} "
                     f"{r['error'] * 100:>6.1f}%")
    if rows:
        lines.append(f"median |error| {median_abs_error(rows) * 100:.1f}% over {len(rows)} "
                     "candidate(s); ranking agrees with measurement: "
                     + str([r["candidate"] for r in sorted(rows, key=lambda r: r["measured_s"])]
                           == [r["candidate"] for r in rows]))
    return "\n".join(lines)


__all__ = ["auto_plan", "auto_name", "figures_line", "measure_candidates", "measured_table", "median_abs_error",
           "PlanningError", "ProfileError"]
