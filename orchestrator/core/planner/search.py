"""The search: stages, cuts, submeshes, mesh axes + layout rules, microbatches and schedule. Pure.

Basic flow of `search(model, topo, global_batch, profile=...)`:
  1. choices: for every stage size k hosts, every (data, model) factorisation of its
     k × devices_per_host devices (model ≤ `max_model`), each layout rules set
     (Mesh-TF granularity: logical axis → `model`, or replicated; batch → data),
     on several hosts both axis orders (which axis crosses hosts), and each remat
     (`none`, `full`: memory down, B up by the recomputed forward; `cost.py`);
  2. profiles: every distinct (layer signature, model size, rules, b ∈ {1, 2}) is
     profiled once (`profile`, normally the compile subprocess through the cache);
  3. cost: per (k, choice, microbatch count) and layer, `cost.layer_cost`, with the
     device figures of every host computing at once (`Topology.flops`, a pipeline's
     steady state) for every plan, one-stage plans on one host included: the figures
     with that host alone (`Topology.lone_flops`, ...) come from big probe programs whose devices
     compute side by side, while a stage's small kernels on simulated CPU devices take
     turns, so charged to those plans they predicted them far too low (the runs are in
     `docs/decisions.md`, "All-busy device figures for every plan"). On real hardware the two agree.
     Every plan on MORE than one host is charged those figures `Topology.shared_slowdown`
     times slower (`Topology.shared`: calibrate times a stage-sized program on host 0
     alone and on every host at once); a one-stage plan on one host is not;
  4. solve: for each microbatch count m, stage count p and schedule, a dynamic
     programme over (stage, first layer, first host) picks for each stage its
     layers, its hosts and its best choice under the device-memory limit (with
     the schedule's in-flight microbatches at that stage; the memory sum and the
     stage tables are `tables.py`'s, the sum plain `meshpipe plan` uses too), minimising
     Σ stage time + (m − 1) · max stage time (Alpa's stage DP: enumerate the
     bottleneck bound, minimise the sum under it; all sampled bounds in one vectorised
     pass, `_dp_many`) plus stage-edge transfers; a
     stage's time per microbatch includes the runtime's fixed cost of its F and B
     (`Topology.action_overhead_s`), an edge's the per-transfer one;
  5. the DP's three best plans per (m, p, schedule) — by its own estimate — are
     replayed by the schedule simulator (`orchestrator.core.schedule.simulate`) with
     their per-stage F/B/OPT costs and per-edge transfer times and thread holds (a blocking
     SEND holds its sender, host-to-device copies its receiver: `Topology.edge`, the
     cluster's transport); candidates are ranked
     by simulated step time. `SearchOptions.exhaustive` replays every legal plan
     instead (small spaces; the tests compare the two).

Schedules: 1f1b, gpipe, and zb-h1 where this JAX runs it (≥ 0.10, as `check_job`
requires). A zb-h1 plan is replayed with each stage's I and W from the layers' compiled
I and W programs (`cost.LayerCost.i_s`, `w_s`), and its memory is the stage's peak of
`orchestrator.core.schedule.stash_timeline` (F keeps the residuals until I, I keeps what W
reads until W: `held_bytes`); the DP before the replay still costs its stages by F + B and
counts a microbatch's residuals from F to W (an upper bound where I keeps less than F). interleaved-1f1b (v ∈ `SearchOptions.virtual_stages` chunks
per stage) is planned apart, after the DP (`interleave.py`, `_search_interleaved`):
one host count for every stage, a balanced cut into p·v virtual stages.

Meshes: (data, model), and with `max_fsdp` > 1 a third axis `fsdp` (`cost.py`); outside
`exhaustive`, axis orders beaten on every layer by another order are dropped (`_prune_orders`).

Stages take whole consecutive hosts (as `check_job` requires); with node groups
(`hosts_per_group`), a stage stays inside one group or takes whole aligned groups.
"""
from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

import numpy as np

from orchestrator.core.planner.cost import MeshChoice, fits_layer, layer_cost, layer_request, mesh_choices
from orchestrator.core.planner.model import PlanModel
from orchestrator.core.planner.profile import LayerProfile, ProfileRequest
from orchestrator.core.planner.tables import Table, fuses, layer_table, stage_memory, stage_tables
from orchestrator.core.planner.topology import Topology, aligned
from orchestrator.core.planner.transports import edge_record

__all__ = ["SearchOptions", "StageChoice", "Candidate", "SearchResult", "PlanningError", "search",
           "DEFAULT_RULESETS", "rulesets_for", "evaluate", "legal_plans", "default_schedules"]

ProfileFn = Callable[[Sequence[ProfileRequest]], Mapping[ProfileRequest, LayerProfile]]

# Candidate layout rules (logical axis → the `model` mesh axis); anything unnamed is replicated.
DEFAULT_RULESETS: Mapping[str, tuple[str, ...]] = {
    "megatron": ("heads", "mlp", "vocab"),   # attention heads, MLP hidden and vocabulary split
    "heads+mlp": ("heads", "mlp"),           # the same, vocabulary replicated
    "mlp": ("mlp",),                         # only the MLP hidden dim split
    "embed": ("embed",),                     # the model dim split (Mesh-TF's "model" on d_model)
}


class PlanningError(ValueError):
    """No plan satisfies the constraints; the message says which and by how much."""


@dataclass(frozen=True)
class SearchOptions:
    """Bounds of the search space (None: defaults in `search`)."""

    microbatches: Optional[tuple[int, ...]] = None
    schedules: Optional[tuple[str, ...]] = None     # None: `default_schedules()`
    remats: tuple[str, ...] = ("none", "full")
    max_model: Optional[int] = None
    rulesets: Optional[Mapping[str, tuple[str, ...]]] = None
    optimizer_slots: int = 2
    top: int = 5
    target_step_s: Optional[float] = None
    thresholds: int = 8
    exhaustive: bool = False       # simulate every legal plan instead of the DP's (small spaces only)
    fuse_loss_chunk: bool = False  # the job's pipeline.fuse_loss_chunk: the loss layer's F+B one program (`tables`)
    virtual_stages: tuple[int, ...] = (2, 4)   # chunks per stage tried for interleaved-1f1b
    max_fsdp: Optional[int] = None  # largest fsdp axis (None: devices_per_host; 1: no fsdp, meshes ≤ 2-D)


@dataclass(frozen=True)
class StageChoice:
    """One stage of a candidate: layers [start, stop), hosts [first, first + count), mesh/layout and costs."""

    layers: tuple[int, int]
    hosts: tuple[int, int]
    choice: MeshChoice
    fwd_s: float
    bwd_s: float
    opt_s: float
    compute_s: float
    tp_comm_s: float
    dp_comm_s: float
    memory_bytes: float
    inflight: int
    tp_bytes: float
    dp_bytes: float
    overhead_s: float = 0.0     # the runtime's fixed cost per action, included in fwd_s, bwd_s and opt_s
    state_bytes: float = 0.0    # the layers' mutable state, in memory_bytes (replicated on every device)
    fused: bool = False         # the loss layer's F+B as one program (fuse_loss_chunk), in memory_bytes
    chunks: tuple[tuple[int, int], ...] = ()    # interleaved: the stage's layer ranges (layers = chunks[0])
    fsdp_comm_s: float = 0.0    # the fsdp axis's all-gathers and reduce-scatter per microbatch (in fwd_s, bwd_s)
    fsdp_bytes: float = 0.0
    i_s: float = 0.0            # zero-bubble I and W per microbatch (with the per-action overhead)
    w_s: float = 0.0
    held_bytes: float = 0.0     # what I keeps for W per microbatch


@dataclass(frozen=True)
class Candidate:
    """A whole plan with its simulated step, bubble, memory and communication."""

    stages: tuple[StageChoice, ...]
    microbatches: int
    schedule: str
    step_s: float
    bubble: float
    edges: tuple[dict, ...]
    virtual_stages: int = 1

    def layer_ranges(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per stage its layer ranges (one, or its v chunks)."""
        return tuple(s.chunks or (s.layers,) for s in self.stages)

    @property
    def memory_bytes(self) -> float:
        return max(s.memory_bytes for s in self.stages)

    def key(self) -> tuple:
        return (self.schedule, self.microbatches, self.virtual_stages,
                tuple((s.chunks or s.layers, s.hosts, s.choice) for s in self.stages))


@dataclass
class SearchResult:
    """Ranked candidates (best first) and what the search did."""

    candidates: list[Candidate]
    space: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    topology: Optional[Topology] = None
    ranked: list[Candidate] = field(default_factory=list)   # every plan evaluated, best first

    @property
    def best(self) -> Candidate:
        return self.candidates[0]


SEARCHABLE_SCHEDULES = ("1f1b", "gpipe", "zb-h1", "interleaved-1f1b")


def default_schedules() -> tuple[str, ...]:
    """1f1b, gpipe, interleaved-1f1b, and zb-h1 where the installed JAX can run it (`check_job`'s rule)."""
    from orchestrator.core.config.check import ZB_MIN_JAX, _jax_version

    return ("1f1b", "gpipe") + (("zb-h1",) if _jax_version() >= ZB_MIN_JAX else ()) + ("interleaved-1f1b",)


def _schedules(options: SearchOptions) -> tuple[str, ...]:
    """The schedules to search, refusing those the planner cannot (yet) plan or this JAX cannot run."""
    from orchestrator.core.config.check import ZB_MIN_JAX, _jax_version

    if options.schedules is None:
        return default_schedules()
    if not options.schedules:
        raise PlanningError("schedules = []: name at least one of " + ", ".join(SEARCHABLE_SCHEDULES))
    for s in options.schedules:
        if s not in SEARCHABLE_SCHEDULES:
            raise PlanningError(f"schedules: {s!r} is not a schedule the planner searches; use "
                                + ", ".join(SEARCHABLE_SCHEDULES))
        if s == "zb-h1" and _jax_version() < ZB_MIN_JAX:
            raise PlanningError(f"schedules: zb-h1 needs JAX >= {'.'.join(map(str, ZB_MIN_JAX))} (its I/W split "
                                f"reads jaxpr internals older JAX lacks); this is JAX "
                                f"{'.'.join(map(str, _jax_version()))}: leave zb-h1 out")
    return tuple(options.schedules)


def rulesets_for(model: PlanModel, extra: Optional[Mapping[str, object]] = None,
                 rulesets: Optional[Mapping[str, tuple[str, ...]]] = None) -> dict[str, tuple[tuple[str, str], ...]]:
    """The rules sets that name at least one of the model's logical axes, deduplicated.

    `extra` (e.g. the job's own layout) adds one more set: its non-batch rules, onto `model`.
    """
    names = model.logical_axes() - {"batch"}
    out: dict[str, tuple[tuple[str, str], ...]] = {}
    seen: set = set()
    sets = dict(rulesets or DEFAULT_RULESETS)
    if extra:
        sets["job"] = tuple(k for k, v in extra.items() if k != "batch" and v)
    for name, axes in sets.items():
        rules = tuple(sorted((a, "model") for a in axes if a in names))
        if rules and rules not in seen:
            seen.add(rules)
            out[name] = rules
    return out


@functools.lru_cache(maxsize=512)
def _lowered(schedule: str, p: int, m: int, v: int = 1):
    from orchestrator.core.schedule import ScheduleError, generate, lower

    try:
        return lower(generate(schedule, p, m, v))
    except ScheduleError:
        return None


@functools.lru_cache(maxsize=512)
def _inflight(schedule: str, p: int, m: int, v: int = 1) -> Optional[tuple[int, ...]]:
    from orchestrator.core.schedule import simulate

    low = _lowered(schedule, p, m, v)
    return None if low is None else tuple(simulate(low, {"F": 1, "B": 2}).peak_inflight)


def search(model: PlanModel, topo: Topology, global_batch: int, *, profile: ProfileFn,
           options: SearchOptions = SearchOptions(), extra_rules: Optional[Mapping[str, object]] = None) -> SearchResult:
    """Find the best plans (see the module docstring). Raises `PlanningError` when none fits."""
    t0 = time.perf_counter()
    if topo.hosts < 1 or topo.devices_per_host < 1:
        raise PlanningError(f"the cluster has no devices (hosts = {topo.hosts}, devices_per_host = "
                            f"{topo.devices_per_host}); nothing to plan on")
    if model.num_layers < 1:
        raise PlanningError(f"model {model.name!r} has no layers; nothing to plan")
    L, H, dph = model.num_layers, topo.hosts, topo.devices_per_host
    schedules = _schedules(options)
    bad = [r for r in options.remats if r not in ("none", "full")]
    if bad or not options.remats:
        raise PlanningError(f"remats = {list(options.remats)}: the planner models 'none' and 'full' (give at least one)")
    max_model = options.max_model or dph * max(1, min(topo.hosts_per_group, H))
    rulesets = rulesets_for(model, extra_rules, options.rulesets)
    ms = options.microbatches or tuple(m for m in (1, 2, 4, 8, 16, 32, 64) if global_batch % m == 0)
    ms = tuple(m for m in ms if global_batch % m == 0)
    if not ms:
        raise PlanningError(f"no microbatch count divides data.global_batch = {global_batch} "
                            f"(tried {list(options.microbatches or ())})")
    max_fsdp = dph if options.max_fsdp is None else options.max_fsdp
    param_axes = frozenset(a for layer in model.layers for prm in layer.params for a in prm.axes if a)
    choices = {k: mesh_choices(k * dph, max_model, rulesets, k > 1, tuple(dict.fromkeys(options.remats)),
                               max_fsdp, param_axes)
               for k in range(1, H + 1)}
    vs = tuple(sorted({v for v in options.virtual_stages if v > 1}))
    # 2. profiles (one per distinct program; equal layers share)
    reqs = []
    reps = list({layer.signature: layer for layer in model.layers}.values())   # one layer per program
    for k, cs in choices.items():
        for c in cs:
            for layer in reps:
                if fits_layer(layer, c):          # a dim the rules shard must divide by the model axis
                    reqs += [layer_request(layer, c, b) for b in (1, 2)]
    reqs = list(dict.fromkeys(reqs))
    t1 = time.perf_counter()
    profiles = profile(reqs)
    t2 = time.perf_counter()
    # 3. cost tables
    slots = options.optimizer_slots
    tables: dict[tuple[int, int, int], Table] = {}
    _cost_tables(model, topo.shared(), choices, ms, global_batch, profiles, slots, tables)
    n_choices = sum(len(v) for v in choices.values())
    if not options.exhaustive:
        choices, tables = _prune_orders(choices, tables, ms)
    # a one-stage plan on ONE host computes while the other hosts idle: its tables take the
    # unshared figures; every other plan has more than one host computing (`Topology.shared`)
    tables_one = tables
    if topo.shared_slowdown != 1.0:
        tables_one = dict(tables)
        _cost_tables(model, topo, {1: choices[1]}, ms, global_batch, profiles, slots, tables_one)
    t3 = time.perf_counter()
    # 4. solve
    found: dict[tuple, Candidate] = {}
    min_memory = float("inf")
    space = {"layers": L, "hosts": H, "devices_per_host": dph, "microbatch_counts": list(ms),
             "schedules": list(schedules), "remats": list(dict.fromkeys(options.remats)), "rulesets": {k: [a for a, _ in v] for k, v in rulesets.items()},
             "mesh_choices": n_choices, "mesh_choices_kept": sum(len(v) for v in choices.values()),
             "profiles": len(reqs),
             "max_fsdp": max_fsdp, "virtual_stages": list(vs)}
    plans_considered = 0
    stage_memo: dict = {}
    stage_memo_one: dict = {}
    plain = tuple(s for s in schedules if s != "interleaved-1f1b")
    for m in ms:
        micro = global_batch // m
        for p in range(1, min(H, L) + 1):
            for sched in (plain if p > 1 else plain[:1]):  # one stage: no schedule choice
                infl = _inflight(sched, p, m)
                if infl is None:
                    continue
                fused = options.fuse_loss_chunk and fuses(sched, p, m)
                tabs, smemo = (tables_one, stage_memo_one) if p == 1 else (tables, stage_memo)
                stage_tab = stage_tables(model, topo, choices, tabs, m, sorted(set(infl)), slots, smemo, fused)
                edge = _edge_times(model, topo, micro)
                if options.exhaustive:
                    plans = _enumerate(choices, tabs, m, L, H, topo, p)
                    mem_need = _min_memory(stage_tab, infl, L, H, topo)
                else:
                    plans, mem_need = _solve(stage_tab, edge, infl, m, L, H, topo, options.thresholds)
                min_memory = min(min_memory, mem_need)
                for stages in plans:
                    plans_considered += 1
                    cand = evaluate(model, topo, choices, tabs, stages, m, sched, infl, global_batch, slots, fused)
                    if cand.memory_bytes <= topo.memory_bytes:
                        found.setdefault(cand.key(), cand)
    if "interleaved-1f1b" in schedules and vs:
        n, mem_need = _search_interleaved(model, topo, choices, tables, ms, vs, global_batch, slots, stage_memo,
                                          found, options.top)
        plans_considered += n
        min_memory = min(min_memory, mem_need)
    t4 = time.perf_counter()
    space["stage_options"] = sum(L * (L + 1) // 2 * len(cs) for cs in choices.values()) * len(ms)
    space["plans_from_dp"] = plans_considered
    space["plans_evaluated"] = len(found)
    timings = {"compile_s": t2 - t1, "cost_s": t3 - t2, "solve_s": t4 - t3, "setup_s": t1 - t0}
    if not found:
        if math.isinf(min_memory):
            raise PlanningError(f"no legal plan for model {model.name!r} on {H} hosts × {dph} devices with "
                                f"global batch {global_batch}: no stage layout divides the batch and the "
                                "sharded dims (try other data.global_batch or --max-model)")
        raise PlanningError(f"model {model.name!r} does not fit: every plan needs more than the "
                            f"{topo.memory_bytes / 1e9:.3g} GB per device the cluster offers; the smallest "
                            f"needs {min_memory / 1e9:.3g} GB per device ({min_memory:,.0f} bytes) — raise "
                            "device.memory_gb, add hosts, or shrink the model / global batch")
    ranked = sorted(found.values(), key=lambda c: (c.step_s, c.memory_bytes))
    if options.target_step_s is not None and ranked[0].step_s > options.target_step_s:
        raise PlanningError(f"target step time {options.target_step_s:g} s is unreachable: the fastest "
                            f"plan found is predicted at {ranked[0].step_s:.4g} s "
                            f"({len(ranked[0].stages)} stages, m={ranked[0].microbatches}, {ranked[0].schedule})")
    return SearchResult(ranked[: max(options.top, 1)] if options.top else ranked, space, timings, topo, ranked)


def _search_interleaved(model, topo, choices, tables, ms, vs, global_batch, slots, memo, found, top):
    """Add interleaved-1f1b candidates to `found` (`interleave.py`); returns (plans replayed, least memory).

    A plan whose lower bound (m × its slowest stage) is above the `top`-th best step found so far
    cannot enter the table and is not replayed."""
    from orchestrator.core.planner.interleave import balanced_cut, interleaved_plans

    L, replayed, min_mem = model.num_layers, 0, float("inf")
    for m in ms:
        micro = global_batch // m
        ref = next((t for (k, ci, mm), t in tables.items() if mm == m and np.isfinite(t.fwd + t.bwd).all()), None)
        if ref is None:
            continue
        for p in range(2, min(topo.hosts, L) + 1):
            for v in vs:
                if p * v > L or m % p:
                    continue
                cut = balanced_cut(ref.fwd + ref.bwd, p * v)
                steps = sorted(c.step_s for c in found.values())
                bound = steps[top - 1] if top and len(steps) >= top else float("inf")
                infl_fn = functools.partial(_inflight, "interleaved-1f1b", p, m, v)
                plans, need = interleaved_plans(model, topo, choices, tables, m, p, v, infl_fn, slots, memo, cut,
                                                micro, bound=bound)
                infl = infl_fn() if plans else None
                min_mem = min(min_mem, need)
                for _, low, plan in plans:
                    if low > bound:
                        continue
                    replayed += 1
                    cand = evaluate_interleaved(model, topo, choices, tables, plan, m, v, infl, global_batch, slots)
                    if cand.memory_bytes <= topo.memory_bytes:
                        found.setdefault(cand.key(), cand)
    return replayed, min_mem


def _cost_tables(model, topo, choices, ms, global_batch, profiles, slots, tables) -> None:
    """Fill `tables[(k, ci, m)]` for every choice of `choices` ({k: [MeshChoice]}) with `topo`'s figures."""
    memo: dict = {}
    for k, cs in choices.items():
        for ci, c in enumerate(cs):
            for m in ms:
                micro = global_batch // m
                cols = []
                for layer in model.layers:      # equal layers (same signature) cost the same
                    key = (layer.signature, c, micro)
                    if key not in memo:     # the signature covers the input's shape too
                        in_bytes = model.layers[layer.index - 1].out_bytes(1) if layer.index else 0.0
                        memo[key] = layer_cost(layer, c, micro, topo, 0, profiles, in_bytes)
                    cols.append(memo[key])
                tables[(k, ci, m)] = layer_table(cols, slots, topo.memory_bandwidth)


def _prune_orders(choices, tables, ms):
    """Drop each choice that another axis order of the same mesh, rules and remat beats or ties on
    every layer's F and B at every microbatch count (memory does not depend on the order), so the
    stage tables carry fewer choices; the DP's optimum is unchanged."""
    out_c, out_t = {}, {}
    for k, cs in choices.items():
        keep: list[int] = []
        groups: dict = {}
        for ci, c in enumerate(cs):
            groups.setdefault((c.data, c.fsdp, c.model, c.rules, c.remat), []).append(ci)
        for members in groups.values():
            times = {ci: np.stack([np.concatenate([tables[(k, ci, m)].fwd, tables[(k, ci, m)].bwd]) for m in ms])
                     for ci in members}
            for ci in members:
                beaten = any(o != ci and np.all(times[o] <= times[ci]) and (o < ci or np.any(times[o] < times[ci]))
                             for o in members)
                if not beaten:
                    keep.append(ci)
        keep.sort()
        out_c[k] = [cs[ci] for ci in keep]
        for new, ci in enumerate(keep):
            for m in ms:
                out_t[(k, new, m)] = tables[(k, ci, m)]
    return out_c, out_t


def legal_plans(model: PlanModel, topo: Topology, global_batch: int, *, profile: ProfileFn,
                options: SearchOptions, extra_rules: Optional[Mapping[str, object]] = None) -> list[Candidate]:
    """Every legal plan of the bounded space `options` describes, each simulated, best predicted first.

    Legal: consecutive layer ranges covering the model; each stage on whole consecutive
    hosts from host 0 (hosts may be left unused at the end; node-group alignment kept);
    a mesh choice per stage that divides its microbatch and the dims its rules shard;
    within device memory; a schedule that lowers (one schedule when there is one stage).
    The space: `options.microbatches` × `schedules` × stage counts 1..min(hosts, layers)
    × cuts × host counts × mesh choices (`max_model`, `rulesets`, `remats`).
    `benchmarks/planner_exhaustive.py` measures each of them.
    """
    import dataclasses

    opts = dataclasses.replace(options, exhaustive=True, top=0)
    return search(model, topo, global_batch, profile=profile, options=opts, extra_rules=extra_rules).ranked


def _edge_times(model, topo, micro):
    """E[j, h]: seconds to move the activation leaving layer j-1, and its gradient back, from host h-1 to host h."""
    L, H = model.num_layers, topo.hosts
    times = np.zeros((L + 1, H + 1))
    for h in range(1, H):
        cls = topo.class_of_hosts([h - 1, h])
        for j in range(1, L):
            times[j, h] = 2 * topo.edge_time(cls, model.layers[j - 1].out_bytes(micro))
    return times


def _solve(stage_tab, edge, infl, m, L, H, topo, n_thresholds, keep=3):
    """Plans (lists of (i, j, h, k, choice index)) from the bottleneck-bounded DP; and the least memory any plan needs."""
    ks = sorted({k for k, _ in stage_tab})
    finite = np.concatenate([stage_tab[(k, infl[0])][0][np.isfinite(stage_tab[(k, infl[0])][0])] for k in ks]
                            + [np.zeros(0)])
    if finite.size == 0:
        return [], _min_memory(stage_tab, infl, L, H, topo)
    # the least bottleneck any plan reaches, then bounds above it (Alpa enumerates every value; we sample)
    t_star = _min_max(stage_tab, infl, L, H, topo, index=0)
    if not np.isfinite(t_star):
        return [], _min_memory(stage_tab, infl, L, H, topo)
    above = finite[finite >= t_star]
    qs = np.unique(np.quantile(above, np.linspace(0, 1, n_thresholds))) if above.size else np.zeros(0)
    bounds = [t_star * (1 + 1e-9)] + list(qs) + [np.inf]
    plans, seen = [], set()
    for plan in _dp_many(stage_tab, edge, infl, L, H, topo, bounds):
        if plan is not None and tuple(plan) not in seen:
            seen.add(tuple(plan))
            plans.append(plan)
    if not plans:
        return [], _min_memory(stage_tab, infl, L, H, topo)

    def objective(plan):     # the DP's estimate: Σ stage + (m − 1) · bottleneck + edges
        ts = [stage_tab[(k, infl[s])][0][i, j] for s, (i, j, h, k, _) in enumerate(plan)]
        edges = sum(edge[j, h + k] for i, j, h, k, _ in plan[:-1])
        return sum(ts) + (m - 1) * max(ts) + edges

    return sorted(plans, key=objective)[:keep], 0.0


def _dp(stage_tab, edge, infl, L, H, topo, bound):
    """The least Σ stage time plan with every stage ≤ bound: [(i, j, h, k, choice index)] per stage, or None."""
    return _dp_many(stage_tab, edge, infl, L, H, topo, [bound])[0]


@functools.lru_cache(maxsize=256)
def _starts(k: int, hpg: int, H: int) -> np.ndarray:
    """First hosts a stage of k hosts may take (whole aligned node groups)."""
    return np.array([h for h in range(H - k + 1) if aligned(h, k, hpg, H)], dtype=np.int64)


def _dp_many(stage_tab, edge, infl, L, H, topo, bounds):
    """`_dp` for every bound at once (one vectorised pass over a leading bounds axis)."""
    p, nb = len(infl), len(bounds)
    inf = np.inf
    bnd = np.asarray(bounds, dtype=float)[:, None, None]
    ks = sorted({k for k, _ in stage_tab})
    # nxt[b, i, h]: least Σ time of stages s+1.. starting at layer i, host h (all fitting and ≤ bounds[b])
    nxt = np.full((nb, L + 1, H + 1), inf)
    nxt[:, L, :] = 0.0
    back = []
    for s in range(p - 1, -1, -1):
        n = infl[s]
        # stage s starts at layer i ∈ [s, L - (p - s)] and host h ≥ s (every stage takes ≥ 1 of each);
        # entries outside are unreachable from (0, 0), so they are left at inf
        lo, hi = s, L - (p - s) + 1
        vals = np.full((len(ks), nb, L + 1, H + 1), inf)
        js = np.zeros((len(ks), nb, L + 1, H + 1), dtype=np.int64)
        for ki, k in enumerate(ks):
            if (k, n) not in stage_tab:
                continue
            hs = _starts(k, topo.hosts_per_group, H)
            hs = hs[(hs >= s) & (hs <= (0 if s == 0 else H))]
            if hs.size == 0 or hi <= lo:
                continue
            t = stage_tab[(k, n)][0][lo:hi]
            t = np.where(t[None] <= bnd, t[None], inf)                           # (b, i, j)
            tail = nxt[:, :, hs + k] + (edge[None, :, hs + k] if s < p - 1 else 0.0)   # (b, j, h)
            tot = t[:, :, :, None] + tail[:, None, :, :]                         # (b, i, j, h)
            j = tot.argmin(axis=2)
            vals[ki][:, lo:hi, hs] = np.take_along_axis(tot, j[:, :, None, :], 2)[:, :, 0, :]
            js[ki][:, lo:hi, hs] = j
        kbest = vals.argmin(axis=0)
        back.append((kbest, js))
        nxt = vals.min(axis=0)
    back.reverse()
    plans = []
    for b in range(nb):
        if not np.isfinite(nxt[b, 0, 0]):
            plans.append(None)
            continue
        plan, i, h = [], 0, 0
        for s in range(p):
            kbest, js = back[s]
            ki = int(kbest[b, i, h])
            k, j = ks[ki], int(js[ki, b, i, h])
            c = int(stage_tab[(k, infl[s])][1][i, j])
            plan.append((i, j, h, k, c))
            i, h = j, h + k
        plans.append(plan)
    return plans


def _enumerate(choices, tables, m, L, H, topo, p, limit=200_000):
    """Every legal plan with p stages (cuts × host counts × one choice per stage), for `exhaustive`."""
    import itertools

    count = 0
    for cuts in itertools.combinations(range(1, L), p - 1):
        bounds = (0, *cuts, L)
        for ks in itertools.product(range(1, H + 1), repeat=p):
            if sum(ks) > H:
                continue
            starts = np.concatenate([[0], np.cumsum(ks)[:-1]]).astype(int)
            if not all(aligned(int(h), k, topo.hosts_per_group, H) for h, k in zip(starts, ks)):
                continue
            options = []
            for s in range(p):
                i, j, k = bounds[s], bounds[s + 1], ks[s]
                options.append([ci for ci in range(len(choices[k]))
                                if np.isfinite(tables[(k, ci, m)].fwd[i:j]).all()
                                and np.isfinite(tables[(k, ci, m)].bwd[i:j]).all()])
            for cis in itertools.product(*options):
                count += 1
                if count > limit:
                    raise PlanningError(f"exhaustive search: more than {limit:,} plans; narrow the space")
                yield [(bounds[s], bounds[s + 1], int(starts[s]), ks[s], cis[s]) for s in range(p)]


def _min_max(stage_tab, infl, L, H, topo, index):
    """The least max-over-stages of `stage_tab[..][index]` (0: time under the memory limit, 2: memory) of any plan."""
    p = len(infl)
    nxt = np.full((L + 1, H + 1), np.inf)
    nxt[L, :] = 0.0
    for s in range(p - 1, -1, -1):
        cur = np.full((L + 1, H + 1), np.inf)
        for k in sorted({k for k, _ in stage_tab}):
            if (k, infl[s]) not in stage_tab:
                continue
            val = stage_tab[(k, infl[s])][index]
            for h in range(0, H - k + 1):
                if aligned(h, k, topo.hosts_per_group, H):
                    cur[:, h] = np.minimum(cur[:, h], np.maximum(val, nxt[None, :, h + k]).min(axis=1))
        nxt = cur
    return float(nxt[0, 0])


def _min_memory(stage_tab, infl, L, H, topo):
    """The least max-over-stages memory per device of any plan with this many stages (memory limit ignored)."""
    return _min_max(stage_tab, infl, L, H, topo, index=2)


def evaluate(model, topo, choices, tables, stages, m, sched, infl, global_batch, slots, fused=False) -> Candidate:
    """Replay one plan in the schedule simulator: per-stage F/B/OPT and per-edge transfer times.

    Every F, B, I, W and OPT action of every stage costs `topo.action_overhead_s` on top of its
    device time, and every stage-edge transfer `topo.transfer_overhead_s` on top of its
    link's α-β time (the runtime's fixed costs, `meshpipe calibrate`). Each edge is costed under
    the cluster's transport on the two stages' layouts (`Topology.edge`): its transfer, how long
    its SEND holds the sender and its RECV the receiver, all played by the simulator. Memory per device is
    `tables.stage_memory` (`fused`: the loss layer's F+B as one program on the last stage;
    zero-bubble: the stage's `stash_timeline` peak of F residuals and I's held-for-W bytes).
    """
    from orchestrator.core.schedule import simulate, stash_timeline

    micro = global_batch // m
    over = topo.action_overhead_s
    low = _lowered(sched, len(stages), m)
    parts = [tables[(k, ci, m)].parts[i:j] for i, j, h, k, ci in stages]
    stash = [None] * len(stages)
    if sched == "zb-h1":
        stash = stash_timeline(low, [{"F": sum(c.residual_bytes for c in cols), "I": sum(c.held_bytes for c in cols)}
                                     for cols in parts]).peak
    out = []
    for s, (i, j, h, k, ci) in enumerate(stages):
        t = tables[(k, ci, m)]
        cols = parts[s]
        fuse_here = fused and j == model.num_layers
        mem = stage_memory(cols, slots, infl[s], fuse_here, stash[s])
        out.append(StageChoice((i, j), (h, k), choices[k][ci], float(t.fwd[i:j].sum()) + over,
                               float(t.bwd[i:j].sum()) + over, float(t.opt[i:j].sum()) + over,
                               sum(c.compute_s for c in cols),
                               sum(c.tp_comm_s for c in cols), sum(c.dp_comm_s for c in cols), mem, infl[s],
                               sum(c.tp_bytes for c in cols), sum(c.dp_bytes for c in cols), over,
                               sum(c.state_bytes for c in cols), fuse_here, (),
                               sum(c.fsdp_comm_s for c in cols), sum(c.fsdp_bytes for c in cols),
                               sum(c.i_s for c in cols) + over, sum(c.w_s for c in cols) + over,
                               sum(c.held_bytes for c in cols)))
    edges = [edge_record(model, topo, e, a, b, micro) for e, (a, b) in enumerate(zip(out, out[1:]))]
    costs = [{"F": st.fwd_s, "B": st.bwd_s, "I": st.i_s, "W": st.w_s, "OPT": st.opt_s} for st in out]
    sim = simulate(low, costs, [e["transfer_s"] for e in edges] or 0.0,
                   send_block=[e["send_block_s"] for e in edges] or 0.0,
                   recv_block=[e["recv_block_s"] for e in edges] or 0.0)
    return Candidate(tuple(out), m, sched, float(sim.step_time), float(sim.bubble_fraction), tuple(edges))


def evaluate_interleaved(model, topo, choices, tables, plan, m, v, infl, global_batch, slots) -> Candidate:
    """Replay one interleaved plan ([(chunks, first host, hosts, choice index)] per stage) in the simulator.

    Each stage's F / B action costs its mean chunk plus the per-action overhead; memory per
    device is its chunks' parameters and state, the simulator's peak (microbatch, chunk) pairs
    × its largest chunk's residuals, and its largest temporary (`interleave.py`).
    """
    from orchestrator.core.memory import device_bytes
    from orchestrator.core.planner.interleave import edge_costs
    from orchestrator.core.schedule import simulate

    micro = global_batch // m
    over = topo.action_overhead_s
    p = len(plan)
    out = []
    for s, (chunks, h, k, ci) in enumerate(plan):
        t = tables[(k, ci, m)]
        idx = [i for a, b in chunks for i in range(a, b)]
        cols = [t.parts[i] for i in idx]
        resid = max(sum(t.parts[i].residual_bytes for i in range(a, b)) for a, b in chunks)
        mem = device_bytes(sum(c.param_bytes for c in cols), sum(c.state_bytes for c in cols), resid,
                           slots=slots, inflight=infl[s], temp=max(c.temp_bytes for c in cols))
        out.append(StageChoice(chunks[0], (h, k), choices[k][ci], float(t.fwd[idx].sum()) + v * over,
                               float(t.bwd[idx].sum()) + v * over, float(t.opt[idx].sum()) + over,
                               sum(c.compute_s for c in cols), sum(c.tp_comm_s for c in cols),
                               sum(c.dp_comm_s for c in cols), mem, infl[s], sum(c.tp_bytes for c in cols),
                               sum(c.dp_bytes for c in cols), over, sum(c.state_bytes for c in cols), False,
                               tuple(chunks), sum(c.fsdp_comm_s for c in cols), sum(c.fsdp_bytes for c in cols)))
    k = plan[0][2]
    cut = [a for a, _ in (ch for i in range(v) for ch in (plan[s][0][i] for s in range(p)))] + [model.num_layers]
    parts = edge_costs(model, topo, cut, p, k, micro, [st.choice for st in out])
    edges = []
    for e, part in enumerate(parts):
        src, dst = e * k + k - 1, ((e + 1) % p) * k
        bounds = [cut[q] for q in range(1, len(cut) - 1) if (q - 1) % p == e]
        delay = max(part["transfer_s"], part["send_block_s"]) + part["recv_block_s"]
        edges.append({"edge": [e, (e + 1) % p], "bytes": max(model.layers[b - 1].out_bytes(micro) for b in bounds),
                      "link": topo.class_of_hosts([src, dst]), "transport": topo.transport.name, "time_s": delay,
                      **part, "boundaries": bounds})
    costs = [{"F": st.fwd_s / v, "B": st.bwd_s / v, "OPT": st.opt_s} for st in out]
    sim = simulate(_lowered("interleaved-1f1b", p, m, v), costs, [x["transfer_s"] for x in parts],
                   send_block=[x["send_block_s"] for x in parts], recv_block=[x["recv_block_s"] for x in parts])
    return Candidate(tuple(out), m, "interleaved-1f1b", float(sim.step_time), float(sim.bubble_fraction),
                     tuple(edges), v)
