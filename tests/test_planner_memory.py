"""Pure tests of the auto-planner's memory sum: mutable state, tied copies, fuse_loss_chunk.

The search (`plan --auto`) and plain `meshpipe plan` (`config.limits.stage_memory`) both sum
per-device bytes with `orchestrator.core.memory.device_bytes`; synthetic profiles, no jax.
"""
from __future__ import annotations

import dataclasses
import re

import pytest

from orchestrator.core.config.limits import stage_memory as plan_stage_memory
from orchestrator.core.memory import device_bytes
from orchestrator.core.model.spec import LayerSpec, LeafSpec, ModelSpec, ParamDef
from orchestrator.core.planner.adapter import from_spec
from orchestrator.core.planner.search import PlanningError, SearchOptions, legal_plans, search
from tests.planner_fakes import FakeProfiles, fake_model
from tests.test_planner_search import topo


def with_state(model, per_layer: int):
    return dataclasses.replace(model, layers=tuple(dataclasses.replace(la, state_bytes=per_layer)
                                                   for la in model.layers))


def run(model, costs, t, gb=16, prof_kw=None, **opts):
    return search(model, t, gb, profile=FakeProfiles(model, costs, **(prof_kw or {})),
                  options=SearchOptions(**opts))


def test_state_counts_on_every_device_of_its_stage():
    costs = [1e6] * 4
    base = fake_model(costs)
    state = 10_000_000
    free = run(base, costs, topo(hosts=2, dph=2, mem=1e12), top=0, optimizer_slots=0)
    stated = run(with_state(base, state), costs, topo(hosts=2, dph=2, mem=1e12), top=0, optimizer_slots=0)
    before = {c.key(): c for c in free.ranked}
    assert set(before) == {c.key() for c in stated.ranked}
    for c in stated.ranked:         # the same plan, each stage + its layers' state (replicated, not sharded)
        for s, s0 in zip(c.stages, before[c.key()].stages):
            n = sum(b - a for a, b in (s.chunks or (s.layers,)))     # interleaved: every chunk
            assert s.state_bytes == n * state
            assert s.memory_bytes == pytest.approx(s0.memory_bytes + n * state, rel=1e-12)


def test_state_that_pushes_a_plan_over_memory_gets_another_plan_or_a_refusal():
    costs = [1e6] * 4
    base = fake_model(costs)
    t_free = topo(hosts=2, dph=1, mem=1e12)
    free = run(base, costs, t_free, optimizer_slots=0)
    whole = [s.memory_bytes for c in free.ranked for s in c.stages if s.layers == (0, 4)]
    assert whole and any(s.layers == (0, 4) for s in free.best.stages), "without state one stage holds all"
    state = 50_000_000
    limit = min(whole) + 3.5 * state    # a stage of 4 layers (+ 4 × state) cannot fit; of ≤ 3 it can
    tight = run(with_state(base, state), costs, topo(hosts=2, dph=1, mem=limit), top=0, optimizer_slots=0)
    assert tight.best.memory_bytes <= limit
    assert all(sum(b - a for a, b in (s.chunks or (s.layers,))) <= 3 for c in tight.ranked for s in c.stages), \
        [[s.layers for s in c.stages] for c in tight.ranked]
    # the state of one layer alone beyond the device: refused, the need names the state
    with pytest.raises(PlanningError, match="does not fit") as e:
        run(with_state(base, state), costs, topo(hosts=2, dph=1, mem=state * 0.9), optimizer_slots=0)
    need = float(re.search(r"\(([\d,]+) bytes\)", str(e.value)).group(1).replace(",", ""))
    assert need > state


def _spec_with_state_and_tie():
    d, v = 8, 32
    out = (LeafSpec("", (d,), "float32", ("batch", "embed")),)
    emb = LayerSpec("embed", {"w": ParamDef((v, d), ("vocab", "embed"))}, out)
    blk = LayerSpec("block0", {"w": ParamDef((d, d), ("embed", "mlp"))}, out,
                    state={"mean": ParamDef((d,), ("embed",)), "var": ParamDef((d,), ("embed",))})
    head = LayerSpec("head", {"w": ParamDef((v, d), ("vocab", "embed")), "b": ParamDef((v,), ("vocab",), "bfloat16")},
                     (LeafSpec("", (v,), "float32", ("batch", "vocab")),))
    return ModelSpec("toy", (emb, blk, head), "x:y", LeafSpec("", (), "int32", ("batch",)),
                     LeafSpec("", (), "int32", ("batch",)), ties=(((0, "w"), (2, "w")),))


def test_adapter_counts_state_tied_copies_and_dtypes_as_plain_plan_does():
    spec = _spec_with_state_and_tie()
    model = from_spec(spec, "toy", {}, None)
    assert [la.state_bytes for la in model.layers] == [0, 2 * 8 * 4, 0]
    assert model.layers[2].param_bytes == 32 * 8 * 4 + 32 * 2     # the tie's copy, bf16 bias at 2 bytes
    for a, b in ((0, 1), (1, 2), (2, 3), (0, 3)):        # one device: plain plan's params / state are ours
        mem = plan_stage_memory(spec, ((a, b),), {}, {}, 1)
        assert mem["params"] == sum(la.param_bytes for la in model.layers[a:b])
        assert mem["state"] == sum(la.state_bytes for la in model.layers[a:b])
        assert mem["per_device"] == device_bytes(mem["params"], mem["state"], mem["activations"])
    assert model.layers[1].signature != from_spec(dataclasses.replace(spec, layers=(
        spec.layers[0], dataclasses.replace(spec.layers[1], state={}), spec.layers[2])), "toy", {}, None
    ).layers[1].signature      # a stateful layer compiles another program


def _two_stage(sched, fuse, prof_kw, gb=8):
    costs = [1e6] * 4
    model = fake_model(costs)
    t = topo(hosts=2, dph=1, mem=1e12, inter_gbps=1e-3)      # data parallel across hosts ruinous: 2 stages
    r = run(model, costs, t, gb=gb, prof_kw=prof_kw, top=0, optimizer_slots=0, microbatches=(4,),
            schedules=(sched,), remats=("none",), max_model=1, fuse_loss_chunk=fuse)
    return {tuple(s.layers for s in c.stages): c for c in r.ranked if len(c.stages) == 2}


def test_fuse_loss_chunk_lowers_the_head_stage_by_the_logits_it_keeps_no_longer():
    logits, fused_temp = 40_000, 15_000       # per example: the head's residuals, its fused program's temp
    kw = {"head_resid_per_example": logits, "head_fused_temp_per_example": fused_temp}
    apart, fused = _two_stage("1f1b", False, kw), _two_stage("1f1b", True, kw)
    assert apart.keys() == fused.keys() and apart
    micro = 8 // 4
    for cut, c in fused.items():
        a = apart[cut]
        head, head0 = c.stages[-1], a.stages[-1]
        assert head.fused and not head0.fused and not c.stages[0].fused
        # 1F1B's last stage holds one microbatch: its logits go, the fused program's temp comes
        assert head.inflight == 1
        assert head0.memory_bytes - head.memory_bytes == pytest.approx(micro * (logits - fused_temp), rel=1e-12)
        assert c.stages[0].memory_bytes == a.stages[0].memory_bytes
        assert c.step_s == a.step_s        # time is not modelled differently


def test_fuse_loss_chunk_changes_nothing_where_the_schedule_does_not_fuse_or_xla_gave_no_figure():
    kw = {"head_resid_per_example": 40_000, "head_fused_temp_per_example": 15_000}
    g0, g1 = _two_stage("gpipe", False, kw), _two_stage("gpipe", True, kw)      # GPipe: F and B apart
    assert g0 and all(g1[k].memory_bytes == c.memory_bytes and not any(s.fused for s in g1[k].stages)
                      for k, c in g0.items())
    # no compiled figure: the residuals live inside the one program next to the temporaries — no saving claimed
    kw = {"head_resid_per_example": 40_000}
    a0, a1 = _two_stage("1f1b", False, kw), _two_stage("1f1b", True, kw)
    assert a0 and all(a1[k].memory_bytes == pytest.approx(c.memory_bytes, rel=1e-12) for k, c in a0.items())


def test_fuse_loss_chunk_can_make_a_plan_fit():
    logits, fused_temp = 400_000, 10_000
    kw = {"head_resid_per_example": logits, "head_fused_temp_per_example": fused_temp}
    costs = [1e6] * 4
    model = fake_model(costs)
    opts = dict(top=0, optimizer_slots=0, microbatches=(4,), schedules=("1f1b",), remats=("none",), max_model=1)
    every = legal_plans(model, topo(hosts=2, dph=1, mem=1e12), 8, profile=FakeProfiles(model, costs, **kw),
                        options=SearchOptions(**opts))
    limit = 0.9 * min(c.memory_bytes for c in every)      # no legal plan fits with the logits kept
    t = topo(hosts=2, dph=1, mem=limit, inter_gbps=1e-3)
    with pytest.raises(PlanningError, match="does not fit"):
        run(model, costs, t, gb=8, prof_kw=kw, **opts)
    ok = run(model, costs, t, gb=8, prof_kw=kw, fuse_loss_chunk=True, **opts)
    assert ok.best.memory_bytes <= limit and ok.best.stages[-1].fused


def test_batched_stage_dp_finds_the_brute_force_optimum_under_every_bound():
    # the DP over (stage, first layer, first host), all bounds in one pass, against enumerating every plan
    import itertools

    import numpy as np

    from orchestrator.core.planner.search import _dp_many

    rng = np.random.default_rng(0)
    L, H, p = 6, 4, 3
    t = topo(hosts=H, dph=1, hpg=2)
    tab = {}
    c = np.concatenate([[0], np.cumsum(rng.uniform(1, 5, L))])
    for k in (1, 2, 3, 4):       # a range's time: its layers' sum, faster on more hosts, plus noise
        T = (c[None, :] - c[:, None]) * (1 + 0.3 * k) / k + rng.uniform(0, 1, (L + 1, L + 1))
        T = np.where(np.triu(np.ones((L + 1, L + 1), bool), 1), T, np.inf)
        tab[(k, 1)] = (T, np.zeros((L + 1, L + 1), int), T)
    edge = rng.uniform(0, 2, (L + 1, H + 1))

    def brute(bound):
        best = np.inf
        for cuts in itertools.combinations(range(1, L), p - 1):
            b = (0, *cuts, L)
            for ks in itertools.product((1, 2, 3, 4), repeat=p):
                starts = np.concatenate([[0], np.cumsum(ks)[:-1]])
                if sum(ks) > H or not all((h % 2 + k <= 2) if k <= 2 else (k % 2 == 0 and h % 2 == 0)
                                          for h, k in zip(starts, ks)):
                    continue
                ts = [tab[(ks[s], 1)][0][b[s], b[s + 1]] for s in range(p)]
                if max(ts) <= bound:
                    best = min(best, sum(ts) + sum(edge[b[s + 1], starts[s] + ks[s]] for s in range(p - 1)))
        return best

    bounds = [np.inf, *np.linspace(10, 3, 15)]
    plans = _dp_many(tab, edge, [1] * p, L, H, t, bounds)
    wants = [brute(b) for b in bounds]
    assert len({w for w in wants if np.isfinite(w)}) >= 3 and not np.isfinite(wants[-1])    # bounds that bind
    for bound, plan, want in zip(bounds, plans, wants):
        if not np.isfinite(want):
            assert plan is None
            continue
        got = sum(tab[(k, 1)][0][i, j] for i, j, h, k, _ in plan) + sum(edge[j, h + k] for i, j, h, k, _ in plan[:-1])
        assert got == pytest.approx(want, rel=1e-12), (bound, plan)
        assert [s[0] for s in plan] == [0] + [s[1] for s in plan[:-1]] and plan[-1][1] == L


def test_adapter_sizes_stage_edges_in_the_jobs_compute_dtype():
    """bfloat16 compute: floating activations cross stage edges at 2 bytes, so every edge's bytes
    halve and the programs get signatures of their own; integer outputs keep their itemsize."""
    from orchestrator.core.model.policy import with_compute_dtype

    spec = _spec_with_state_and_tie()
    f32, bf16 = from_spec(spec, "toy", {}, None), from_spec(with_compute_dtype(spec, "bfloat16"), "toy", {}, None)
    assert [la.out_itemsize for la in f32.layers] == [4, 4, 4]
    assert [la.out_itemsize for la in bf16.layers] == [2, 2, 2]
    assert [b.out_bytes(16) * 2 for b in bf16.layers] == [a.out_bytes(16) for a in f32.layers]
    assert all(a.signature != b.signature for a, b in zip(f32.layers, bf16.layers))
    ints = dataclasses.replace(spec, layers=(dataclasses.replace(spec.layers[0], outputs=(
        LeafSpec("", (8,), "int32", ("batch", "embed")),)),) + spec.layers[1:])
    assert from_spec(with_compute_dtype(ints, "bfloat16"), "toy", {}, None).layers[0].out_itemsize == 4


@pytest.mark.needs_models
def test_a_factory_model_plans_in_the_jobs_compute_dtype():
    """The same through a job naming a factory model (examples/llama.yaml, flax.nnx: the models
    extra): every edge at 2 bytes under bfloat16, and the worker told to compile in bfloat16."""
    from pathlib import Path

    from orchestrator.core.config import load_job
    from orchestrator.core.planner.adapter import from_job

    ROOT = Path(__file__).resolve().parent.parent
    plain = from_job(load_job(ROOT / "examples" / "llama.yaml"))      # a factory model (flax.nnx)
    half = from_job(load_job(ROOT / "examples" / "llama.yaml", overrides=["precision.compute=bfloat16"]))
    assert [la.out_itemsize for la in plain.layers] == [4] * len(plain.layers)
    assert [la.out_itemsize for la in half.layers] == [2] * len(half.layers)
    assert half.source["compute"] == "bfloat16" and "compute" not in plain.source   # the worker compiles bf16
    assert plain.source["name"] == "examples.llama_model:pipeline"
