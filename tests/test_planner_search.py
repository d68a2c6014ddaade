"""Pure tests of the auto-planner's search and cost model (synthetic layer profiles, no jax)."""
from __future__ import annotations

import re

import pytest

from orchestrator.core.config import ConfigError, parse_cluster
from orchestrator.core.plan import cross_host_axes
from orchestrator.core.planner.profile import LayerProfile, linear, parse_collectives
from orchestrator.core.planner.search import PlanningError, SearchOptions, search
from orchestrator.core.planner.topology import LinkClass, Topology, collective_time, from_cluster
from tests.planner_fakes import FakeProfiles, fake_model


def topo(hosts=2, dph=2, mem=1e9, inter_gbps=10.0, host_gbps=10.0, flops=1e9, hpg=1):
    links = {"host": LinkClass("host", 1e-6, host_gbps * 1e9),
             "group": LinkClass("group", 1e-5, inter_gbps * 1e9),
             "dcn": LinkClass("dcn", 1e-5, inter_gbps * 1e9)}
    return Topology(hosts, dph, hpg, links, mem, flops, 1e12)


def run(costs, t, gb=16, **opts):
    model = fake_model(costs, **{k: opts.pop(k) for k in ("param_scale",) if k in opts})
    prof = FakeProfiles(model, costs, **{k: opts.pop(k) for k in ("act_bytes", "resid_per_example") if k in opts})
    return search(model, t, gb, profile=prof, options=SearchOptions(**opts))


def crossing(stage, dph):
    return cross_host_axes(stage.choice.mesh(), dph)


def test_memory_limit_is_respected_and_changes_the_plan():
    costs = [1e6] * 4
    free = run(costs, topo(mem=1e9), top=0, optimizer_slots=2)
    need = free.best.memory_bytes
    tight = run(costs, topo(mem=need * 0.6), top=0, optimizer_slots=2)
    assert all(c.memory_bytes <= need * 0.6 for c in tight.candidates)
    assert tight.best.memory_bytes <= need * 0.6 < free.best.memory_bytes
    for c in tight.candidates:  # the figure is the cost model's own sum, recomputed here
        for s in c.stages:
            assert s.memory_bytes > 0 and s.inflight >= 1


def test_slow_inter_host_link_moves_tensor_parallel_axes_inside_hosts():
    # two layers whose parameters only fit 4-way sharded per device; 2 hosts × 2 devices
    costs = [4e7, 4e7]
    kw = dict(gb=16, max_model=4, param_scale=64, act_bytes=65536, optimizer_slots=0)
    model = fake_model(costs, param_scale=64)
    per_layer = model.layers[0].param_bytes
    mem = per_layer * 2 * 0.55        # < a whole layer's params and accumulator: model axis ≥ 2 everywhere
    fast = run(costs, topo(mem=mem, inter_gbps=10.0, host_gbps=10.0), **kw)
    slow = run(costs, topo(mem=mem, inter_gbps=0.01, host_gbps=10.0), **kw)
    assert any("model" in crossing(s, 2) for s in fast.best.stages), fast.best
    assert all("model" not in crossing(s, 2) for s in slow.best.stages), slow.best
    assert all(s.choice.model >= 2 for s in slow.best.stages)


def test_imbalanced_model_gets_an_uneven_cut():
    costs = [1e6] * 6 + [4e6, 4e6]
    t = topo(hosts=2, dph=1, inter_gbps=1e-3)       # data parallel across hosts is ruinous: pipeline
    # one range per stage (interleaved-1f1b, which can balance it better with chunks, is tested apart)
    r = run(costs, t, gb=32, microbatches=(16,), param_scale=8, schedules=("1f1b",))
    cuts = [s.layers for s in r.best.stages]
    assert cuts == [(0, 6), (6, 8)], cuts


def test_balanced_model_gets_an_even_cut():
    r = run([1e6] * 8, topo(hosts=2, dph=1, inter_gbps=1e-3), gb=32, microbatches=(16,), param_scale=8,
            schedules=("1f1b",))
    assert [s.layers for s in r.best.stages] == [(0, 4), (4, 8)]


def test_model_that_cannot_fit_names_the_smallest_memory_it_needs():
    costs = [1e6] * 4
    with pytest.raises(PlanningError, match="does not fit") as e:
        run(costs, topo(hosts=1, dph=1, mem=1e3), optimizer_slots=0)
    need = float(re.search(r"\(([\d,]+) bytes\)", str(e.value)).group(1).replace(",", ""))
    ok = run(costs, topo(hosts=1, dph=1, mem=need), optimizer_slots=0)      # exactly that much: fits
    assert ok.best.memory_bytes <= need
    with pytest.raises(PlanningError, match="does not fit"):
        run(costs, topo(hosts=1, dph=1, mem=need * 0.999), optimizer_slots=0)


def test_cluster_without_devices():
    with pytest.raises(PlanningError, match="no devices"):
        run([1e6], topo(hosts=0, dph=2))
    with pytest.raises(ConfigError, match=r"hosts = 0: must be >= 1"):
        parse_cluster({"hosts": 0, "devices_per_host": 2})


def test_unreachable_target_step_time():
    with pytest.raises(PlanningError, match="unreachable: the fastest plan found is predicted at"):
        run([1e6] * 4, topo(), target_step_s=1e-9)
    ok = run([1e6] * 4, topo(), target_step_s=10.0)
    assert ok.best.step_s <= 10.0


def test_no_microbatch_count_divides_the_batch():
    with pytest.raises(PlanningError, match="global_batch = 7"):
        run([1e6], topo(), gb=7, microbatches=(2, 4))


def test_candidates_are_ranked_and_simulated():
    r = run([1e6] * 4, topo(hosts=4, dph=2), gb=32, top=0)
    steps = [c.step_s for c in r.candidates]
    assert steps == sorted(steps) and len(steps) > 3
    best = r.best
    assert 0 <= best.bubble < 1
    assert sum(s.hosts[1] for s in best.stages) <= 4
    assert [s.layers[0] for s in best.stages][0] == 0 and best.stages[-1].layers[1] == 4


def test_collective_time_alpha_beta():
    link = LinkClass("x", 1e-5, 1e9)
    assert collective_time("all-reduce", 1e6, 4, link) == pytest.approx(2 * 0.75 * 1e-3 + 6e-5)
    assert collective_time("all-gather", 1e6, 2, link) == pytest.approx(0.5e-3 + 1e-5)
    assert collective_time("all-reduce", 1e6, 1, link) == 0.0


def test_topology_from_cluster_links_and_defaults():
    c = parse_cluster({"hosts": 4, "devices_per_host": 2, "links": {"dcn": {"bandwidth_gbps": 2, "latency_us": 30},
                                                                    "hosts_per_group": 2},
                       "device": {"memory_gb": 3}})
    t = from_cluster(c)
    assert t.links["dcn"].bandwidth == 2e9 and t.links["dcn"].latency_s == pytest.approx(3e-5)
    assert t.memory_bytes == 3e9 and t.hosts_per_group == 2
    assert t.class_of_hosts([0, 1]) == "group" and t.class_of_hosts([1, 2]) == "dcn" and t.class_of_hosts([3]) == "host"
    assert any("links.host" in n for n in t.notes)


def test_links_section_errors_name_key_value_rule():
    with pytest.raises(ConfigError, match=r"links.dcn.bandwidth_gbps = 0: must be > 0"):
        parse_cluster({"hosts": 2, "devices_per_host": 2, "links": {"dcn": {"bandwidth_gbps": 0, "latency_us": 1}}})
    with pytest.raises(ConfigError, match=r"links.hosts_per_group = 3: must divide cluster.hosts = 2"):
        parse_cluster({"hosts": 2, "devices_per_host": 2, "links": {"hosts_per_group": 3}})
    with pytest.raises(ConfigError, match=r"links.host.bandwidth: unknown key; did you mean 'bandwidth_gbps'"):
        parse_cluster({"hosts": 2, "devices_per_host": 2, "links": {"host": {"bandwidth": 1, "latency_us": 1}}})


def test_parse_collectives_formats():
    hlo = "\n".join([
        "%a = f32[4,8]{1,0} all-reduce(%x), channel_id=1, replica_groups={{0,1},{2,3}}, to_apply=%s",
        "%b = f32[2,8]{1,0} all-gather(%y), replica_groups=[2,2]<=[2,2]T(1,0), dimensions={0}",
        "%c = f32[4,32,64]{2,1,0} all-reduce(%z), replica_groups=mesh['axis_0'=1,'axis_1'=4] {'axis_1'}, to_apply=%s",
        "%d = bf16[8]{0} reduce-scatter(%w), replica_groups={}, dimensions={0}",
        "%e = f32[16]{0} collective-permute(%v), source_target_pairs={{0,1},{1,0}}",
        "%f = f32[16]{0} add(%v, %v)",
    ])
    got = parse_collectives(hlo, 4)
    assert got[0] == ("all-reduce", 128.0, ((0, 1), (2, 3)))
    assert got[1] == ("all-gather", 64.0, ((0, 2), (1, 3)))
    assert got[2] == ("all-reduce", 4 * 32 * 64 * 4.0, ((0, 1, 2, 3),))
    assert got[3] == ("reduce-scatter", 16.0 * 4, ((0, 1, 2, 3),))
    assert got[4] == ("collective-permute", 64.0, ((0, 1), (1, 0)))
    assert len(got) == 5


def test_linear_profile_in_batch():
    g = ((0, 1),)
    p1 = LayerProfile({"fwd": 10.0, "bwd": 20.0}, {"fwd": 5.0, "bwd": 5.0}, 100.0, 8.0,
                      (("fwd", "all-reduce", 4.0, g), ("fwd", "all-reduce", 4.0, g)))
    p2 = LayerProfile({"fwd": 18.0, "bwd": 36.0}, {"fwd": 6.0, "bwd": 7.0}, 180.0, 8.0,
                      (("fwd", "all-reduce", 8.0, g), ("fwd", "all-reduce", 8.0, g)))
    p4 = linear(p1, p2, 4)
    assert p4.flops == {"fwd": 34.0, "bwd": 68.0} and p4.residual_bytes == 340.0
    assert p4.collectives == (("fwd", "all-reduce", 32.0, g),)     # both all-reduces, summed


def test_parse_collectives_mesh_groups_with_device_ids():
    line = ("%r = f32[2,4]{1,0} all-reduce(%x), channel_id=3, replica_groups=mesh['axis_0'=2,'axis_1'=2,"
            "'axis_2'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_1'}, use_global_device_ids=true, to_apply=%r")
    # ids[a0, a1, a2] = arange(8).reshape(2,2,2).transpose(0,2,1): ids[a0, a1, a2] = 4·a0 + a1 + 2·a2
    (kind, nbytes, groups), = parse_collectives(line, 8)
    assert kind == "all-reduce" and nbytes == 32.0
    assert groups == ((0, 1), (2, 3), (4, 5), (6, 7))


def test_written_job_for_a_real_model_loads_checks_and_plans():
    from orchestrator.core.config import check_job, load_cluster, load_raw, parse_job
    from orchestrator.core.model.registry import build_spec
    from orchestrator.core.plan import make_plan
    from orchestrator.core.planner.adapter import from_spec
    from orchestrator.core.planner.report import explain, job_dict, table
    from tests.conftest import ROOT

    raw = load_raw(ROOT / "examples" / "mlp.yaml")
    spec = build_spec("mlp", raw["model"]["args"])
    model = from_spec(spec, "mlp", raw["model"]["args"], None)
    assert model.layers[1].signature == model.layers[2].signature != model.layers[0].signature
    cluster = load_cluster(ROOT / "cluster_configs" / "local.yaml")
    t = from_cluster(cluster)
    costs = [1e5 * (i + 1) for i in range(model.num_layers)]
    r = search(model, t, raw["data"]["global_batch"], profile=FakeProfiles(model, costs), options=SearchOptions(top=0))
    assert len(r.candidates) > 5
    for c in r.candidates[:10]:            # every candidate, not only the winner, is a runnable job
        checked = check_job(parse_job(job_dict(raw, c)), cluster)
        plan = make_plan(checked)
        assert [s.layers for s in checked.stages] == [s.layers for s in c.stages]
        assert plan.schedule.m == c.microbatches
    text = table(r)
    assert "step ms" in text and "edges" in text
    why = explain(r, t.devices_per_host)
    assert "winner:" in why and "model axis inside hosts vs across hosts" in why


def test_profiler_subprocess_cache_errors_and_deadline(tmp_path):
    from orchestrator.core.planner.profile import ProfileError, ProfileRequest, Profiler

    src = {"kind": "fake"}
    good = [ProfileRequest("s", 0, 4, (), b) for b in (1, 2)]
    p = Profiler("tests.planner_fake_worker", tmp_path)
    got = p.profile(src, good)
    assert p.stats.compiled == 2 and got[good[1]].flops["bwd"] == 4.0
    assert p.profile(src, good)[good[0]].cached and p.stats.cache_hits == 2
    bad = ProfileRequest("s", 0, 4, (("bad", "model"),), 1)
    new = ProfileRequest("s", 1, 2, (), 3)
    with pytest.raises(ProfileError, match=r"could not compile layer 0 on model=4 rules \{'bad': 'model'\}"):
        p.profile(src, [new, bad])
    assert Profiler("tests.planner_fake_worker", tmp_path).profile(src, [new])[new].cached   # kept anyway
    slow = Profiler("tests.planner_fake_worker", tmp_path, timeout_s=3)
    with pytest.raises(ProfileError, match="ran past 3 s; 1 of 2 layer programs done"):
        slow.profile(src, [ProfileRequest("s", 0, 2, (), 5), ProfileRequest("s", 0, 2, (), 99)])
    assert slow.profile(src, [ProfileRequest("s", 0, 2, (), 5)])[ProfileRequest("s", 0, 2, (), 5)].cached


@pytest.mark.slow
@pytest.mark.parametrize("case", ["balanced", "imbalanced", "tight-memory", "slow-dcn"])
def test_search_is_within_5_percent_of_exhaustive_simulation(case):
    """The DP's winner vs every legal plan replayed in the simulator (bounded space: 4 layers, 3 hosts × 2)."""
    costs = {"balanced": [1e6] * 4, "imbalanced": [1e6, 3e6, 1e6, 5e5]}.get(case, [2e6, 1e6, 1e6, 2e6])
    t = topo(hosts=3, dph=2, inter_gbps=0.05 if case == "slow-dcn" else 10.0,
             mem=4.5e5 if case == "tight-memory" else 1e9)
    kw = dict(gb=16, microbatches=(2, 4, 8), max_model=4, act_bytes=8192, optimizer_slots=2)
    dp = run(costs, t, top=0, **kw)
    ex = run(costs, t, top=0, exhaustive=True, **kw)
    assert len(ex.candidates) > len(dp.candidates) > 0
    assert dp.best.step_s <= 1.05 * ex.best.step_s, (dp.best, ex.best)
    assert all(c.memory_bytes <= t.memory_bytes for c in ex.candidates)
