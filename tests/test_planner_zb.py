"""ZB-H1 in the planner: I and W costs from the profiled split programs, memory from `stash_timeline`. Pure."""
from __future__ import annotations

import pytest

from orchestrator.core.memory import device_bytes
from orchestrator.core.planner import profile as profile_mod
from orchestrator.core.planner.cost import MeshChoice, layer_cost, layer_request
from orchestrator.core.planner.profile import LayerProfile, Profiler, ProfileRequest, linear
from orchestrator.core.planner.search import SearchOptions, search
from orchestrator.core.schedule import generate, lower, simulate, stash_timeline
from tests.planner_fakes import FakeProfiles, fake_model
from tests.test_planner_search import topo

pytestmark = [pytest.mark.jax_min_0_10]


ZB = dict(schedules=("zb-h1",), max_model=1, remats=("none",), max_fsdp=1, top=0)


def zb_search(costs, t, gb, mb, **fake):
    model = fake_model(costs)
    prof = FakeProfiles(model, costs, **fake)
    return model, search(model, t, gb, profile=prof, options=SearchOptions(microbatches=(mb,), **ZB))


def test_zb_plan_memory_is_the_stash_timeline_peak():
    # hand-made sizes: each layer keeps 1000 B per example from F to I and 300 B from I to W
    costs = [1e6] * 4
    model, r = zb_search(costs, topo(hosts=2, dph=1), 8, 4, resid_per_example=1000, split=(0.6, 0.4),
                         held_per_example=300)
    two = [c for c in r.ranked if len(c.stages) == 2]
    assert two
    micro = 8 // 4
    low = lower(generate("zb-h1", 2, 4))
    for c in two:
        kept = [{"F": (s.layers[1] - s.layers[0]) * 1000 * micro, "I": (s.layers[1] - s.layers[0]) * 300 * micro}
                for s in c.stages]
        peaks = stash_timeline(low, kept).peak
        for s, st in enumerate(c.stages):
            params = sum(model.layers[i].param_bytes for i in range(*st.layers))
            assert st.memory_bytes == device_bytes(params, 0, peaks[s], slots=2, inflight=1, temp=0)
            assert st.held_bytes == kept[s]["I"]
        # the 1F1B-style count (in flight from F to W × F's residuals) is more on the last stage
        last = c.stages[-1]
        params1 = sum(model.layers[i].param_bytes for i in range(*last.layers))
        assert last.inflight == 2 and peaks[-1] == kept[-1]["F"] + kept[-1]["I"]
        assert last.memory_bytes < device_bytes(params1, 0, kept[-1]["F"], slots=2, inflight=2, temp=0)


def test_zb_plan_i_and_w_come_from_the_profile_not_half_of_b():
    costs = [1e6, 2e6, 1e6, 1e6]
    t = topo(hosts=2, dph=1, flops=1e9)
    _, r = zb_search(costs, t, 8, 4, split=(0.8, 0.2))
    c = next(c for c in r.ranked if len(c.stages) == 2)
    micro = 8 // 4
    over = t.action_overhead_s
    for st in c.stages:
        bwd = sum(2 * costs[i] * micro for i in range(*st.layers)) / t.flops
        assert st.i_s - over == pytest.approx(0.8 * bwd) and st.w_s - over == pytest.approx(0.2 * bwd)
        assert st.bwd_s - over == pytest.approx(bwd)
    low = lower(generate("zb-h1", 2, 4))
    edges = [e["transfer_s"] for e in c.edges]
    holds = {"send_block": [e["send_block_s"] for e in c.edges], "recv_block": [e["recv_block_s"] for e in c.edges]}
    real = [{"F": s.fwd_s, "I": s.i_s, "W": s.w_s, "OPT": s.opt_s} for s in c.stages]
    half = [{"F": s.fwd_s, "B": s.bwd_s, "OPT": s.opt_s} for s in c.stages]     # the simulator's I = W = B/2
    assert c.step_s == pytest.approx(simulate(low, real, edges, **holds).step_time)
    assert simulate(low, half, edges, **holds).step_time < 0.97 * c.step_s


def test_layer_cost_split_terms_and_remat():
    layer = fake_model([1e6]).layers[0]
    t = topo(hosts=1, dph=1, flops=1e9)
    prof = LayerProfile({"fwd": 1e6, "bwd": 2e6, "i": 1.5e6, "w": 0.7e6}, {"fwd": 0, "bwd": 0, "i": 0, "w": 0},
                        500.0, 64.0, (), held_bytes=200.0, split_temp_bytes=32.0)
    for remat, extra in (("none", 0.0), ("full", 1e-3)):
        choice = MeshChoice(1, 1, ("data", "model"), (), "dp", remat)
        profiles = {layer_request(layer, choice, b): prof for b in (1, 2)}
        c = layer_cost(layer, choice, 1, t, 0, profiles)
        assert c.i_s == pytest.approx(1.5e-3 + extra) and c.w_s == pytest.approx(0.7e-3)
        assert c.held_bytes == 200.0
        assert c.split_temp_bytes == (32.0 if remat == "none" else 500.0)
    # a profile without the split (older, or synthetic): half of B each, F's residuals held
    plain = LayerProfile({"fwd": 1e6, "bwd": 2e6}, {"fwd": 0, "bwd": 0}, 500.0, 64.0, ())
    choice = MeshChoice(1, 1, ("data", "model"), (), "dp")
    c = layer_cost(layer, choice, 1, t, 0, {layer_request(layer, choice, b): plain for b in (1, 2)})
    assert c.i_s == c.w_s == pytest.approx(1e-3) and c.held_bytes == 500.0


def test_split_profile_round_trips_and_interpolates():
    p1 = LayerProfile({"fwd": 1.0, "bwd": 2.0, "i": 1.2, "w": 0.8}, {"fwd": 0, "bwd": 0, "i": 0, "w": 0}, 10.0, 1.0,
                      (("i", "all-reduce", 8.0, ((0, 1),)),), held_bytes=4.0, split_temp_bytes=2.0)
    p2 = LayerProfile({"fwd": 2.0, "bwd": 4.0, "i": 2.4, "w": 1.6}, {"fwd": 0, "bwd": 0, "i": 0, "w": 0}, 20.0, 1.0,
                      (("i", "all-reduce", 16.0, ((0, 1),)),), held_bytes=8.0, split_temp_bytes=3.0)
    back = LayerProfile.from_json(p1.to_json())
    assert back == p1 and back.split
    est = linear(p1, p2, 4)
    assert est.split and est.held_bytes == 16.0 and est.split_temp_bytes == 5.0 and est.flops["i"] == pytest.approx(4.8)
    assert est.collectives == (("i", "all-reduce", 32.0, ((0, 1),)),)
    assert not LayerProfile({"fwd": 1.0, "bwd": 2.0}, {}, 1.0, 0.0, ()).split


def test_profile_cache_key_changes_with_the_protocol(tmp_path, monkeypatch):
    # protocol 3 added the I/W phases and held_bytes, 4 the kernel counts: a record cached by an
    # older protocol lacks them and must not be read
    assert profile_mod.PROTOCOL == 4
    src, req = {"kind": "fake"}, ProfileRequest("s", 0, 1, (), 1)
    monkeypatch.setattr(profile_mod, "PROTOCOL", 3)
    old = Profiler("tests.planner_fake_worker", tmp_path)
    old.profile(src, [req])
    assert old.stats.compiled == 1
    monkeypatch.setattr(profile_mod, "PROTOCOL", 4)
    new = Profiler("tests.planner_fake_worker", tmp_path)
    new.profile(src, [req])
    assert new.stats.compiled == 1 and new.stats.cache_hits == 0
    again = Profiler("tests.planner_fake_worker", tmp_path)
    again.profile(src, [req])
    assert again.stats.cache_hits == 1
