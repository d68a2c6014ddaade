"""`replan: rule` — the job's own plan, shrunk onto fewer hosts by a fixed rule. Pure.

`plan_by_rule(original, capacity, min_hosts)` returns the first legal plan of this search, always
derived from the job's ORIGINAL plan (so a plan depends only on the host count, never on the
re-plans before it: losing 2 hosts at once or one after the other gives the same plan):

  for t = capacity, capacity − 1, …, min_hosts        (use as many of the hosts left as a legal plan can)
    A. fewer data-parallel replicas, same stages: one host at a time is taken from a stage that
       has several, its batch axes (the mesh axes the stage's layout maps `batch` to; the
       outermost that can absorb the factor) shrinking with its devices and every other axis
       kept; the stage given up is the one whose load per host (its layers' FLOPs ÷ its hosts)
       is smallest afterwards (ties: the later stage).
    B. p' = min(p, t), …, 1 stages: the layers cut into p' (× v virtual) ranges by the
       cost-balanced cut (`orchestrator.core.model.balance.balanced_ranges`), the t hosts given
       one at a time to the stage with the most FLOPs per host (ties: the earlier stage); each
       stage's mesh that of the original stage holding most of its FLOPs, batch axes rescaled to
       its devices (then the other original stages' meshes), else every stage all data-parallel
       over one batch axis. Interleaved schedules keep v where p'·v layers exist, else 1F1B.
  For every candidate, microbatch counts are tried in this order: the job's own; its multiples
  dividing the global batch (smaller microbatches: more accumulation); the global batch's other
  divisors, nearest the job's own first (by ratio; ties: the larger).
  A model with mutable state (BatchNorm statistics: computed per microbatch) keeps its own.
  The first candidate that passes `check_job` — the checks a user's job passes — and fits
  `cluster.device.memory_gb` (when the cluster gives it) is the plan.

The global batch, the data, the optimizer and the precision are the job's; only the pipeline
section changes. Invariant: the result is a `Checked` of the job with the new pipeline whose
`job` still carries `failure.elastic` (it is checked with that section removed, so that a
`check_job` that checks re-planning cannot recurse).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional, Sequence

from orchestrator.core.config.errors import ConfigError

__all__ = ["plan_by_rule", "checked_plan", "microbatch_order", "rescale_mesh", "Draft"]

MAX_CHECKS_PER_DRAFT = 6      # check_job calls per drafted layout (one per microbatch count tried)


@dataclass(frozen=True)
class Draft:
    """One stage of a plan being drafted (what `pipeline.stages[i]` will say)."""

    chunks: tuple[tuple[int, int], ...]
    mesh: tuple[tuple[str, int], ...]      # ordered (axis, size)
    hosts: int
    layout: Optional[Mapping[str, Any]] = None
    remat: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        layers = [list(c) for c in self.chunks] if len(self.chunks) > 1 else list(self.chunks[0])
        out: dict[str, Any] = {"layers": layers, "mesh": dict(self.mesh), "hosts": self.hosts}
        if self.layout:
            out["layout"] = dict(self.layout)
        if self.remat is not None:
            out["remat"] = self.remat
        return out


def rescale_mesh(mesh: Mapping[str, int], batch_axes: Sequence[str], devices: int) -> Optional[dict[str, int]]:
    """`mesh` resized to `devices`: every axis not in `batch_axes` kept, the outermost batch axis
    (mesh order) that can absorb the change resized; None when no batch axis can.

    Example:
        >>> rescale_mesh({"data": 2, "model": 2}, ["data"], 2)
        {'data': 1, 'model': 2}
        >>> rescale_mesh({"data": 4}, ["data"], 6), rescale_mesh({"model": 4}, [], 2)
        ({'data': 6}, None)
    """
    rest = math.prod(v for a, v in mesh.items() if a not in batch_axes)
    if devices % rest:
        return None
    want = devices // rest
    axes = [a for a in mesh if a in batch_axes]
    if math.prod(mesh[a] for a in axes) == want:
        return dict(mesh)
    for a in axes:
        inner = math.prod(mesh[b] for b in axes if b != a)
        if want % inner == 0:
            return {**mesh, a: want // inner}
    return None


def microbatch_order(job, stateful: bool) -> list[int]:
    """The microbatch counts a re-plan tries, in order (module docstring).

    Example:
        >>> from orchestrator.core.config import load_job
        >>> microbatch_order(load_job("examples/gpt.yaml"), False)      # global batch 16, m = 4
        [4, 8, 16, 2, 1]
        >>> microbatch_order(load_job("examples/gpt.yaml", overrides=["data.global_batch=12",
        ...                                                           "pipeline.microbatches=2"]), False)
        [2, 4, 6, 12, 3, 1]
    """
    gb, m = job.data.global_batch, job.pipeline.microbatches
    if stateful:
        return [m]
    more = [m * k for k in range(2, gb // m + 1) if gb % (m * k) == 0]
    rest = [d for d in range(1, gb + 1) if gb % d == 0 and d != m and d not in more]
    return [m] + more + sorted(rest, key=lambda d: (abs(math.log(d / m)), -d))


def _batch_axes(layout: Mapping[str, Any]) -> tuple[str, ...]:
    from orchestrator.core.model.layout import rule_axes

    return rule_axes(layout.get("batch"))


def _batch_shards(job, draft: Draft) -> Optional[int]:
    """How many pieces `batch` is cut into on the drafted stage (None: decided by check_job)."""
    from orchestrator.core.model.layout import FirstOf, rule_axes, stage_layout

    layout = stage_layout(job.layout, draft.layout, dict(draft.mesh))
    rule = layout.get("batch")
    if isinstance(rule, FirstOf):
        return None
    return math.prod(dict(draft.mesh)[a] for a in rule_axes(rule))


def _stateful(model) -> bool:
    return any(layer.state for layer in model.layers)


def _json_rule(rule) -> Any:
    from orchestrator.core.model.layout import FirstOf

    if isinstance(rule, FirstOf):
        return {"first": [_json_rule(o) for o in rule.first]}
    return list(rule) if isinstance(rule, tuple) else rule


def _kept_layout(layout: Mapping[str, Any], axes: set[str]) -> dict[str, Any]:
    """The job's `layout` restricted to mesh axes some drafted stage has (a rule naming an axis no
    stage has is an error of its own; per stage such axes are skipped anyway, so nothing changes)."""
    from orchestrator.core.model.layout import FirstOf, rule_axes

    out = {}
    for logical, rule in layout.items():
        if isinstance(rule, FirstOf):
            options = [o for o in rule.first if all(a in axes for a in rule_axes(o))]
            if any(o is not None for o in options):
                out[logical] = {"first": [_json_rule(o) for o in options]}
            continue
        kept = [a for a in rule_axes(rule) if a in axes]
        if kept:
            out[logical] = kept[0] if len(kept) == 1 else kept
    return out


def _job_with(original, drafts: Sequence[Draft], m: int, schedule: str, v: int):
    """The original job with this pipeline and without failure.elastic (parse_job validates it)."""
    from orchestrator.core.config.schema import parse_job

    raw = original.job.to_dict()
    raw["pipeline"] = {**raw["pipeline"], "schedule": schedule, "microbatches": m, "virtual_stages": v,
                       "split_at": None, "stages": [d.to_dict() for d in drafts]}
    raw["layout"] = _kept_layout(original.job.layout, {a for d in drafts for a, _ in d.mesh})
    raw["failure"] = {**raw["failure"], "elastic": None}
    return parse_job(raw)


def _fits_device(checked) -> Optional[str]:
    """Why the plan does not fit `cluster.device.memory_gb` (the lower bound `meshpipe plan` prints)."""
    from orchestrator.core.config.limits import stage_memory

    dev = getattr(checked.cluster, "device", None)
    cap = getattr(dev, "memory_gb", None) if dev is not None else None
    if cap is None:
        return None
    for s in checked.stages:
        need = stage_memory(checked.model, s.chunks, dict(s.mesh), s.layout, checked.microbatch_size)["per_device"]
        if need > cap * 1e9:
            return f"stage {s.index} needs at least {need / 1e9:.3g} GB per device, more than device.memory_gb = {cap:g}"
    return None


def checked_plan(original, drafts: Sequence[Draft], schedule: str, v: int,
                 why: list[str]) -> Optional[Any]:
    """The first microbatch count (`microbatch_order`) for which the drafted pipeline passes
    `check_job` and fits the device memory, as a `Checked` whose job carries the original
    `failure` section; None (and the last reason appended to `why`) when none does."""
    from orchestrator.core.config.check import check_plan
    from orchestrator.core.schedule import ScheduleError, check_params

    job, p = original.job, len(drafts)
    tried = 0
    for m in microbatch_order(job, _stateful(original.model)):
        try:
            check_params(schedule, p, m, v)
        except ScheduleError:
            continue
        mb = job.data.global_batch // m
        if any((n := _batch_shards(job, d)) is not None and mb % n for d in drafts):
            continue
        if tried == MAX_CHECKS_PER_DRAFT:
            break
        tried += 1
        try:
            checked = check_plan(_job_with(original, drafts, m, schedule, v), original.cluster)
        except ConfigError as e:
            why.append(str(e))
            continue
        too_big = _fits_device(checked)
        if too_big:
            why.append(too_big)
            continue
        full = checked.job.model_copy(update={"failure": job.failure})
        return dataclasses.replace(checked, job=full, import_dir=original.import_dir)
    if not tried:
        why.append(f"no microbatch count dividing data.global_batch = {job.data.global_batch} suits "
                   f"{p} stage(s) of schedule {schedule!r} with these meshes")
    return None


def _drafts_of(original) -> list[Draft]:
    out = []
    for s, st in zip(original.stages, original.job.pipeline.stages):
        out.append(Draft(tuple(s.chunks), tuple(s.mesh.items()), len(s.hosts), st.layout, st.remat))
    return out


def _costs(original) -> list[float]:
    from orchestrator.core.elastic.predict import layer_flops

    return list(layer_flops(original.model))


def _shrink_replicas(original, t: int, costs: Sequence[float]) -> Optional[list[Draft]]:
    """Phase A: the job's stages, one host at a time given up by a stage with several (module doc);
    None when the hosts cannot come down to exactly `t` that way."""
    drafts = _drafts_of(original)
    dph = original.cluster.devices_per_host
    job = original.job
    load = [sum(sum(costs[a:b]) for a, b in d.chunks) for d in drafts]
    while sum(d.hosts for d in drafts) > t:
        over = sum(d.hosts for d in drafts) - t
        options = []
        for i, (d, s) in enumerate(zip(drafts, original.stages)):
            for h in range(d.hosts - 1, max(0, d.hosts - over - 1), -1):
                mesh = rescale_mesh(dict(d.mesh), _batch_axes(s.layout), h * dph)
                if mesh is None:
                    continue
                cand = dataclasses.replace(d, mesh=tuple(mesh.items()), hosts=h)
                n = _batch_shards(job, cand)
                if n is not None and not any((job.data.global_batch // m) % n == 0
                                             for m in microbatch_order(job, _stateful(original.model))):
                    continue
                options.append((load[i] / h, -i, i, cand))
                break
        if not options:
            return None
        _, _, i, cand = min(options, key=lambda o: o[:2])
        drafts[i] = cand
    return drafts


def _host_split(loads: Sequence[float], t: int) -> list[int]:
    """`t` hosts over stages with these loads: one each, then one at a time to the most loaded per host."""
    hosts = [1] * len(loads)
    for _ in range(t - len(loads)):
        i = max(range(len(loads)), key=lambda k: (loads[k] / hosts[k], -k))
        hosts[i] += 1
    return hosts


def _merged(original, t: int, p2: int, costs: Sequence[float]) -> Iterator[tuple[list[Draft], str, int]]:
    """Phase B drafts for `p2` stages on `t` hosts: (drafts, schedule, v) — templates first, then all data."""
    from orchestrator.core.model.balance import balanced_ranges

    job, L = original.job, original.model.num_layers
    schedule, v = job.pipeline.schedule, job.pipeline.virtual_stages
    if p2 * v > L:
        schedule, v = ("1f1b", 1) if v > 1 else (schedule, v)
    if p2 > L:
        return
    ranges = balanced_ranges(costs, p2 * v)
    chunks = [tuple(ranges[j * p2 + i] for j in range(v)) for i in range(p2)]
    loads = [sum(sum(costs[a:b]) for a, b in c) for c in chunks]
    hosts = _host_split(loads, t)
    dph = original.cluster.devices_per_host
    originals = list(zip(original.stages, job.pipeline.stages))

    def share(c, s) -> float:      # FLOPs of chunks `c` that original stage `s` held
        return sum(costs[i] for a, b in c for i in range(a, b) if any(x <= i < y for x, y in s.chunks))

    templated = []
    for c, h in zip(chunks, hosts):
        ranked = sorted(range(len(originals)), key=lambda k: (-share(c, originals[k][0]), k))
        for k in ranked:
            s, st = originals[k]
            mesh = rescale_mesh(s.mesh, _batch_axes(s.layout), h * dph)
            if mesh is not None:
                templated.append(Draft(c, tuple(mesh.items()), h, st.layout, st.remat))
                break
        else:
            templated.append(None)
    if all(d is not None for d in templated):
        yield templated, schedule, v
    axis = next(iter(_batch_axes(job.layout)), None) or "data"
    override = None if axis in _batch_axes(job.layout) else {"batch": axis}
    plain = [Draft(c, ((axis, h * dph),), h, override, None) for c, h in zip(chunks, hosts)]
    if plain != templated:
        yield plain, schedule, v


def plan_by_rule(original, capacity: int, min_hosts: int = 1) -> tuple[Optional[Any], str]:
    """The rule's plan of `original` (a `Checked`: the job's own plan) for at most `capacity`
    hosts and at least `min_hosts`: (the plan's `Checked`, how it was found), or (None, why not).

    Example:
        >>> from orchestrator.core.config import load_job, load_cluster, check_job
        >>> job = load_job("examples/gpt.yaml", overrides=["checkpoint={dir: /tmp/c, every_steps: 2}",
        ...                                                "failure={max_restarts: 1, elastic: {}}"])
        >>> original = check_job(job, load_cluster("cluster_configs/local.yaml"))
        >>> plan, how = plan_by_rule(original, 1)
        >>> [(s.chunks, s.mesh, s.hosts) for s in plan.stages], plan.job.pipeline.microbatches
        ([(((0, 4),), {'model': 2}, (0,))], 4)
    """
    costs = _costs(original)
    why: list[str] = []
    for t in range(capacity, min_hosts - 1, -1):
        drafts = _shrink_replicas(original, t, costs)
        job = original.job
        if drafts is not None and sum(d.hosts for d in drafts) == t:
            got = checked_plan(original, drafts, job.pipeline.schedule, job.pipeline.virtual_stages, why)
            if got is not None:
                return got, f"rule A: fewer data-parallel replicas ({len(drafts)} stages kept) on {t} hosts"
        for p2 in range(min(len(original.stages), t), 0, -1):
            for drafts, schedule, v in _merged(original, t, p2, costs):
                got = checked_plan(original, drafts, schedule, v, why)
                if got is not None:
                    return got, f"rule B: {p2} stage(s), cost-balanced cut, on {t} hosts"
    last = why[-1] if why else "no candidate"
    return None, (f"no legal plan of this job on {min_hosts}..{capacity} host(s) by the re-plan rule; "
                  f"the last candidate failed: {last}")
