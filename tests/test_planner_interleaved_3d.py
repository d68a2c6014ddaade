"""Pure tests of interleaved-1F1B and 3-D (data × fsdp × model) meshes in the planner's search
(synthetic layer profiles, no jax; the written plans go through the real `check_job`)."""
from __future__ import annotations

import dataclasses
import doctest
from pathlib import Path

import pytest
import yaml

from orchestrator.core.config import check_job, parse_cluster, parse_job
from orchestrator.core.model.registry import build_spec
from orchestrator.core.planner import interleave
from orchestrator.core.planner.adapter import from_spec
from orchestrator.core.planner.cost import MeshChoice, layer_cost, layer_request, mesh_choices
from orchestrator.core.planner.interleave import balanced_cut
from orchestrator.core.planner.report import explain, job_dict, table
from orchestrator.core.planner.search import SearchOptions, search
from orchestrator.core.planner.topology import LinkClass, Topology, collective_time
from tests.planner_fakes import FakeProfiles, fake_model

ROOT = Path(__file__).resolve().parents[1]


def topo(hosts=4, dph=1, mem=1e12, inter_gbps=10.0, flops=1e9, transfer_overhead_s=0.0):
    links = {"host": LinkClass("host", 1e-6, 10e9), "group": LinkClass("group", 1e-5, inter_gbps * 1e9),
             "dcn": LinkClass("dcn", 1e-5, inter_gbps * 1e9)}
    return Topology(hosts, dph, 1, links, mem, flops, 1e12, transfer_overhead_s=transfer_overhead_s)


def test_balanced_cut_minimises_the_heaviest_part():
    assert doctest.testmod(interleave).failed == 0
    assert balanced_cut([1] * 8, 4) == [0, 2, 4, 6, 8]
    assert balanced_cut([5, 1, 1, 1, 1, 1], 2) == [0, 1, 6]
    assert balanced_cut([1, 2, 3], 3) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="parts = 4"):
        balanced_cut([1, 1, 1], 4)


# ---- interleaved-1F1B ---------------------------------------------------------------------------

def _pipeline(inter_gbps=0.1, transfer_overhead_s=0.0, schedules=("1f1b", "interleaved-1f1b")):
    """8 equal layers on 4 hosts × 1 device, 4 microbatches: data parallel across hosts is ruinous
    (large parameters, a slow link), so the plans are pipelines, and with p = 4, m = 4 the 1F1B
    bubble is 3/7 of the step."""
    costs = [1e6] * 8
    model = fake_model(costs, param_scale=64)
    prof = FakeProfiles(model, costs, act_bytes=64)
    t = topo(inter_gbps=inter_gbps, transfer_overhead_s=transfer_overhead_s)
    opts = SearchOptions(microbatches=(4,), schedules=schedules, top=0, max_model=1, remats=("none",),
                         virtual_stages=(2,))
    return search(model, t, 16, profile=prof, options=opts)


def _best(result, schedule, p):
    return min((c for c in result.ranked if c.schedule == schedule and len(c.stages) == p), key=lambda c: c.step_s)


def test_interleaved_wins_with_many_stages_few_microbatches_and_cheap_transfers():
    r = _pipeline()
    best = r.best
    assert best.schedule == "interleaved-1f1b" and best.virtual_stages == 2 and len(best.stages) == 4, table(r)
    one = _best(r, "1f1b", 4)
    assert best.step_s < 0.85 * one.step_s and best.bubble < one.bubble
    # chunk j of stage i is virtual stage j·p + i: stage 0 holds layers [0, 1) and [4, 5)
    assert [s.chunks for s in best.stages] == [((0, 1), (4, 5)), ((1, 2), (5, 6)), ((2, 3), (6, 7)), ((3, 4), (7, 8))]
    # memory: each device holds its v chunks' parameters, and the simulator's in-flight (microbatch, chunk) pairs
    layer = fake_model([1e6] * 8, param_scale=64).layers[0]
    for s in best.stages:           # two layers' parameters × (params, accumulator, 2 optimizer slots)
        assert s.memory_bytes >= 2 * 4 * layer.param_bytes
    # in flight: Megatron's warmup (v − 1)·p + 2(p − 1 − s) + 1 (microbatch, chunk) pairs, at most m·v
    assert [s.inflight for s in best.stages] == [8, 8, 7, 5]
    assert best.stages[-1].memory_bytes < best.stages[0].memory_bytes
    # the wrap-around edge (last stage back to the first) is one of the edges it charges
    assert [e["edge"] for e in best.edges] == [[0, 1], [1, 2], [2, 3], [3, 0]]


def test_interleaved_loses_where_transfers_are_expensive():
    # a slow link (1 KiB per hop at 100 KB/s), or the runtime's fixed cost per transfer: v times the hops
    for r in (_pipeline(inter_gbps=1e-4), _pipeline(transfer_overhead_s=0.02)):
        assert r.best.schedule == "1f1b", table(r)
        assert _best(r, "1f1b", 4).step_s < _best(r, "interleaved-1f1b", 4).step_s


def test_interleaved_plans_are_never_refused_but_respect_m_divisible_by_p_and_memory():
    costs = [1e6] * 8
    model = fake_model(costs)
    opts = SearchOptions(microbatches=(2, 4, 8), schedules=("interleaved-1f1b",), top=0, max_model=1)
    r = search(model, topo(hosts=4, mem=1e12), 16, profile=FakeProfiles(model, costs), options=opts)
    assert r.ranked and all(c.schedule == "interleaved-1f1b" for c in r.ranked if len(c.stages) > 1)
    for c in r.ranked:
        if len(c.stages) > 1:
            assert c.microbatches % len(c.stages) == 0 and c.virtual_stages in (2, 4)
            assert len(c.stages) * c.virtual_stages <= 8
            hosts = {s.hosts[1] for s in c.stages}
            assert len(hosts) == 1                                  # one host count for every stage
    tight = min(c.memory_bytes for c in r.ranked) * 1.0001
    r2 = search(model, topo(hosts=4, mem=tight), 16, profile=FakeProfiles(model, costs), options=opts)
    assert all(c.memory_bytes <= tight for c in r2.ranked)


# ---- 3-D meshes (data × fsdp × model) -----------------------------------------------------------

def _tight(d=64, gb=32, max_fsdp=None, fraction=0.3, exhaustive=False):
    """One host of 8 devices, 4 layers with large parameters and the model axis capped at 2:
    parameters must be cut 4 ways, so model = 2 alone does not fit."""
    costs = [1e6] * 4
    model = fake_model(costs, d=d, param_scale=64)
    params = sum(layer.param_bytes for layer in model.layers)
    t = topo(hosts=1, dph=8, mem=params * 2 * fraction)     # optimizer_slots=0: params × 2 per device
    opts = SearchOptions(microbatches=(1,), top=0, max_model=2, optimizer_slots=0, remats=("none",),
                         max_fsdp=max_fsdp, exhaustive=exhaustive)
    return search(model, t, gb, profile=FakeProfiles(model, costs, act_bytes=64), options=opts), model


def test_a_3d_mesh_wins_where_parameters_must_be_cut_more_than_the_model_axis_allows():
    r, model = _tight()
    s, = r.best.stages
    assert (s.choice.data, s.choice.fsdp, s.choice.model) == (2, 2, 2), table(r)
    assert s.choice.mesh() == {"data": 2, "fsdp": 2, "model": 2} and s.choice.fsdp_axis == "embed"
    assert s.choice.layout() == {"batch": ["data", "fsdp"], "mlp": "model", "embed": "fsdp"}
    assert r.best.memory_bytes <= r.topology.memory_bytes
    # its rivals with parameters cut ≥ 4 ways (every legal plan) pay more on the fsdp all-gathers
    every, _ = _tight(exhaustive=True)
    rivals = {}
    for c in every.ranked:
        ch = c.stages[0].choice
        key = (ch.data, ch.fsdp, ch.model)
        rivals[key] = min(rivals.get(key, float("inf")), c.step_s)
    assert {(1, 4, 2), (1, 8, 1)} <= set(rivals) and (4, 1, 2) not in rivals    # model = 2 alone: too big
    assert all(rivals[(2, 2, 2)] < v for k, v in rivals.items() if k != (2, 2, 2))
    assert "fsdp" in table(r) and "fsdp all-gathers" in explain(r, 8)
    # without the third axis nothing fits: the 3-D mesh is what makes the model trainable here
    with pytest.raises(Exception, match="does not fit"):
        _tight(max_fsdp=1)


def test_no_3d_mesh_where_an_axis_does_not_divide():
    # embed = 63: no parameter dim divides by 2 along the fsdp axis (embed, or mlp when embed → model)
    r, _ = _tight(d=63, fraction=2.0, exhaustive=True)
    assert r.ranked and all(s.choice.fsdp == 1 for c in r.ranked for s in c.stages)
    with pytest.raises(Exception, match="does not fit"):     # so the tight case has no plan at all
        _tight(d=63)
    # global batch 4 at m = 1: data × fsdp must divide 4 examples, so (2, 4, 1) and (1, 8, 1) never appear
    r, _ = _tight(gb=4, fraction=2.0, exhaustive=True)
    shards = {s.choice.data * s.choice.fsdp for c in r.ranked for s in c.stages}
    assert shards and max(shards) <= 4 and any(s.choice.fsdp > 1 for c in r.ranked for s in c.stages)


def test_fsdp_collectives_are_charged_per_axis_on_their_link_class():
    costs = [1e6]
    model = fake_model(costs, param_scale=8)
    layer = model.layers[0]
    # 2 hosts × 2 devices, mesh (fsdp=2, data=2) with fsdp outermost: the fsdp groups cross hosts
    t = topo(hosts=2, dph=2, inter_gbps=0.01)
    across = MeshChoice(2, 1, ("fsdp", "data", "model"), (), "dp", "none", 2, "embed")
    inside = MeshChoice(2, 1, ("data", "fsdp", "model"), (), "dp", "none", 2, "embed")
    assert across.groups("fsdp") == ((0, 2), (1, 3)) and inside.groups("fsdp") == ((0, 1), (2, 3))
    prof = FakeProfiles(model, costs)([layer_request(layer, inside, b) for b in (1, 2)])
    a, i = (layer_cost(layer, c, 8, t, 0, prof) for c in (across, inside))
    full = layer.param_bytes
    ag = collective_time("all-gather", full, 2, t.links["dcn"])
    rs = collective_time("reduce-scatter", full, 2, t.links["dcn"])
    assert a.fsdp_comm_s == pytest.approx(2 * ag + rs) and a.fsdp_bytes == 3 * full
    assert i.fsdp_comm_s < a.fsdp_comm_s and i.dp_comm_s > a.dp_comm_s        # the other axis crosses instead
    assert a.param_bytes == i.param_bytes == full / 2
    # 3-D choices exist only with fsdp on; their orders tell which axis crosses hosts (data or fsdp)
    rules = {"mlp": (("mlp", "model"),)}
    three = [c for c in mesh_choices(8, 2, rules, True, ("none",), 2, frozenset({"embed", "mlp"}))
             if c.fsdp > 1 and c.data > 1 and c.model > 1]
    assert {c.order[0] for c in three} == {"data", "fsdp"}     # model stays inside hosts in a 3-D mesh
    assert not [c for c in mesh_choices(8, 2, rules, True, ("none",), 1, frozenset({"embed"})) if c.fsdp > 1]


# ---- every emitted plan is a job `meshpipe run` accepts ------------------------------------------

GPT = {"vocab": 128, "d_model": 64, "heads": 4, "d_mlp": 256, "blocks": 2}


def test_every_emitted_plan_passes_check_job():
    """The example GPT: the search's candidates on 2 hosts × 4 devices (interleaved plans among
    them), and every legal one-stage plan on 1 host × 8 devices (3-D meshes among them)."""
    model = from_spec(build_spec("gpt", GPT, seq_len=32), "gpt", GPT, 32)
    costs = [1e6] * model.num_layers
    opts = SearchOptions(microbatches=(2, 4), top=0, max_model=2)
    two = search(model, topo(hosts=2, dph=4, inter_gbps=1.0), 16, profile=FakeProfiles(model, costs), options=opts)
    one = search(model, topo(hosts=1, dph=8), 16, profile=FakeProfiles(model, costs),
                 options=dataclasses.replace(opts, exhaustive=True, schedules=("1f1b",)))
    inter = [c for c in two.ranked if c.virtual_stages > 1]
    three = [c for c in one.ranked if any(s.choice.fsdp > 1 and s.choice.data > 1 and s.choice.model > 1
                                          for s in c.stages)]
    assert inter and three
    raw = yaml.safe_load((ROOT / "examples" / "gpt.yaml").read_text())
    raw["data"]["path"] = str(ROOT / raw["data"]["path"])
    for r, hosts in ((two, 2), (one, 1)):
        cluster = parse_cluster({"hosts": hosts, "devices_per_host": 8 // hosts, "cpus_per_host": 0.5})
        for c in r.ranked:
            checked = check_job(parse_job(job_dict(raw, c)), cluster)
            assert [tuple(s.chunks) for s in checked.stages] == list(c.layer_ranges())
            assert [s.mesh for s in checked.stages] == [s.choice.mesh() for s in c.stages]
            assert [s.layout for s in checked.stages] == [
                {k: tuple(v) if isinstance(v, list) else v for k, v in s.choice.layout().items()} for s in c.stages]
            assert checked.job.pipeline.virtual_stages == c.virtual_stages


def test_the_written_job_keeps_the_candidate(tmp_path):
    r, _ = _tight()
    written = job_dict({"pipeline": {"microbatches": 1, "split_at": ["x"], "stages": []}}, r.best)
    st, = written["pipeline"]["stages"]
    assert st["mesh"] == {"data": 2, "fsdp": 2, "model": 2} and st["layout"]["embed"] == "fsdp"
    assert "split_at" not in written["pipeline"]
    inter = _pipeline().best
    w = job_dict({"pipeline": {"microbatches": 1, "stages": []}}, inter)
    assert w["pipeline"]["virtual_stages"] == 2 and w["pipeline"]["stages"][0]["layers"] == [[0, 1], [4, 5]]
    assert dataclasses.replace(inter, virtual_stages=1).key() != inter.key()
