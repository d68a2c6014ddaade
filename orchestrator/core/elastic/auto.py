"""`replan: auto` — the `meshpipe plan --auto` search, restricted to the hosts that are left. Pure.

`plan_by_search(original, hosts, profile)` runs `orchestrator.core.planner.search` for the job's
model, optimizer and global batch on the cluster's topology with `hosts` hosts, and returns the
best-ranked candidate that, written into the job (`planner.report.job_dict`, as `plan --auto`
writes its YAML), passes `check_job`. `profile` is the planner's layer profiler (the driver passes
`Profiler(...).profile` bound to the model, as `orchestrator.driver.autoplan` does); with its cache
warm no program compiles.

The planner's figures must be the cluster's own: without `device.tflops` and
`device.memory_bandwidth_gbps` (what `meshpipe calibrate` writes) it would rank plans by the
platform's nominal guesses, so `uncalibrated(cluster)` names what is missing and the caller
falls back to the rule (`orchestrator.core.elastic.rule`) with that reason. A model with mutable
state keeps its microbatch count (its statistics are per microbatch).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from orchestrator.core.config.errors import ConfigError

__all__ = ["plan_by_search", "uncalibrated", "CALIBRATED_KEYS"]

CALIBRATED_KEYS = ("tflops", "memory_bandwidth_gbps")


def uncalibrated(cluster) -> Optional[str]:
    """Why the planner has no calibrated figures for `cluster`; None when it has them.

    Example:
        >>> from orchestrator.core.config import parse_cluster
        >>> uncalibrated(parse_cluster({"hosts": 2, "devices_per_host": 2}))
        'the cluster YAML has no device.tflops, device.memory_bandwidth_gbps (meshpipe calibrate measures them)'
        >>> uncalibrated(parse_cluster({"hosts": 2, "devices_per_host": 2,
        ...                             "device": {"tflops": 0.1, "memory_bandwidth_gbps": 10}})) is None
        True
    """
    dev = getattr(cluster, "device", None)
    missing = [k for k in CALIBRATED_KEYS if dev is None or getattr(dev, k, None) is None]
    if missing:
        return (f"the cluster YAML has no {', '.join('device.' + k for k in missing)} "
                "(meshpipe calibrate measures them)")
    return None


def plan_by_search(original, hosts: int, profile: Optional[Callable] = None, min_hosts: int = 1,
                   top: int = 5) -> tuple[Optional[Any], str, Optional[float]]:
    """The planner's best legal plan of `original`'s job on `min_hosts`..`hosts` hosts:
    (its `Checked`, what happened, the planner's predicted step in seconds), or (None, why not, None).

    The job keeps everything but `pipeline` and `layout` (and its `failure` section, `failure.elastic`
    included, on the returned `Checked.job`).
    """
    from orchestrator.core.config.check import check_plan
    from orchestrator.core.config.schema import parse_job
    from orchestrator.core.planner import PlanningError, ProfileError, SearchOptions, from_cluster, search
    from orchestrator.core.planner.adapter import from_job
    from orchestrator.core.planner.cost import optimizer_slots
    from orchestrator.core.planner.report import job_dict

    job = original.job
    why = uncalibrated(original.cluster)
    if why is not None:
        return None, why, None
    if profile is None:
        return None, "no layer profiler was given to the re-plan", None
    stateful = any(layer.state for layer in original.model.layers)
    opts = SearchOptions(microbatches=(job.pipeline.microbatches,) if stateful else None, top=top,
                         optimizer_slots=optimizer_slots(job.optimizer.name or "", job.optimizer.args),
                         fuse_loss_chunk=job.pipeline.fuse_loss_chunk)
    topo = dataclasses.replace(from_cluster(original.cluster), hosts=hosts)
    try:
        model = from_job(job)
        result = search(model, topo, job.data.global_batch, profile=profile, options=opts, extra_rules=job.layout)
    except (PlanningError, ProfileError) as e:
        return None, f"the planner found no plan on {hosts} host(s): {e}", None
    raw = job.to_dict()
    raw["failure"] = {**raw["failure"], "elastic": None}
    last = "no candidate"
    for c in result.candidates:
        if not min_hosts <= sum(s.hosts[1] for s in c.stages) <= hosts:
            continue
        try:
            checked = check_plan(parse_job(job_dict(raw, c)), original.cluster)
        except ConfigError as e:
            last = str(e)
            continue
        full = checked.job.model_copy(update={"failure": job.failure})
        checked = dataclasses.replace(checked, job=full, import_dir=original.import_dir)
        return checked, f"planner: best legal candidate of {len(result.candidates)} on {hosts} host(s)", c.step_s
    return None, f"none of the planner's {len(result.candidates)} candidate(s) passes check_job: {last}", None
