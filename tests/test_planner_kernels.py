"""The per-kernel term (issue #22): kernel counts read from compiled HLO, calibrate's per-kernel
fit, the cluster YAML field, and the cost model charging kernels × the per-kernel time. Pure."""
from __future__ import annotations

import pytest

from orchestrator.core.config.cluster_schema import ClusterConfig
from orchestrator.core.planner.calibrate import CalibrationError, all_busy, calibrated_raw, fit_kernel_time
from orchestrator.core.planner.cost import MeshChoice, layer_cost, layer_request
from orchestrator.core.planner.profile import LayerProfile, count_kernels, linear
from orchestrator.core.planner.topology import CLASSES, LinkClass, Topology, from_cluster
from tests.planner_fakes import fake_model

HLO = """HloModule jit_f, entry_computation_layout={(f32[8,16]{1,0})->(f32[8,16]{1,0}, f32[])}

%fused_computation (param_0: f32[8,16]) -> f32[8,16] {
  %param_0 = f32[8,16]{1,0} parameter(0)
  ROOT %t = f32[8,16]{1,0} tanh(%param_0)
}

ENTRY %main.7 (x.1: f32[8,16], w.1: f32[16,16]) -> (f32[8,16], f32[]) {
  %x.1 = f32[8,16]{1,0} parameter(0), sharding={devices=[2,1]<=[2]}
  %w.1 = f32[16,16]{1,0} parameter(1)
  %constant.2 = f32[] constant(0)
  %dot.3 = f32[8,16]{1,0} dot(%x.1, %w.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %fusion = f32[8,16]{1,0} fusion(%dot.3), kind=kLoop, calls=%fused_computation
  %bitcast.1 = f32[128]{0} bitcast(%fusion)
  %all-reduce-start = f32[] all-reduce-start(%constant.2), replica_groups={{0,1}}, to_apply=%add
  %all-reduce-done = f32[] all-reduce-done(%all-reduce-start)
  %copy.4 = f32[8,16]{0,1} copy(%fusion)
  %gte = f32[8,16]{1,0} get-tuple-element(%tup), index=0
  ROOT %tuple.5 = (f32[8,16]{1,0}, f32[]) tuple(%copy.4, %all-reduce-done)
}
"""


def test_count_kernels_counts_the_entry_computations_launches_only():
    # dot, fusion, all-reduce (start/done once), copy; not parameters, constants, bitcasts,
    # tuples, or the fused computation's own instructions
    assert count_kernels(HLO) == 4
    with pytest.raises(ValueError, match="ENTRY"):
        count_kernels("HloModule m\n")


def test_fit_kernel_time_is_the_slope_and_refuses_bad_timings():
    assert fit_kernel_time([64, 256], [50e-6, 146e-6]) == pytest.approx(0.5e-6)
    assert fit_kernel_time([64, 256], [60e-6, 59e-6]) == 0.0          # noise: clamped, never negative
    for counts, secs in (([64, 64], [1e-5, 2e-5]), ([256, 64], [1e-5, 2e-5]), ([64, 256], [0.0, 1e-5]),
                         ([64, 256], [1e-5, float("nan")]), ([64], [1e-5])):
        with pytest.raises(CalibrationError, match="kernel timing"):
            fit_kernel_time(counts, secs)


def test_all_busy_takes_the_slowest_hosts_per_kernel_time():
    def t(s):
        return {"seconds": s, "start": 0.0, "end": 1.0}
    hosts = [{"host": 0, "matmul": t(1e-3), "elementwise": t(1e-3), "kernels_short": t(40e-6), "kernels_long": t(136e-6)},
             {"host": 1, "matmul": t(1e-3), "elementwise": t(1e-3), "kernels_short": t(50e-6), "kernels_long": t(242e-6)}]
    r = all_busy(hosts, 100, 8e6, [64, 256])
    assert [h["kernel_s"] for h in r["hosts"]] == pytest.approx([0.5e-6, 1e-6])
    assert r["kernel_s"] == pytest.approx(1e-6)
    assert "kernel_s" not in all_busy(hosts, 100, 8e6)


def test_calibrated_yaml_carries_the_kernel_figures_into_the_topology():
    raw = calibrated_raw({"hosts": 2, "devices_per_host": 2}, tflops=0.1, memory_bandwidth_gbps=10.0,
                         action_overhead_us=300.0, links={}, kernel_overhead_us=0.9, lone_kernel_overhead_us=0.45)
    assert raw["device"]["kernel_overhead_us"] == 0.9 and raw["device"]["lone_kernel_overhead_us"] == 0.45
    topo = from_cluster(ClusterConfig.model_validate(raw))
    assert topo.kernel_overhead_s == pytest.approx(0.9e-6)
    assert topo.lone_kernel_overhead_s == pytest.approx(0.45e-6)
    with pytest.raises(CalibrationError, match="device.kernel_overhead_us"):
        calibrated_raw({"hosts": 1}, tflops=0.1, memory_bandwidth_gbps=10.0, action_overhead_us=0.0, links={},
                       kernel_overhead_us=-1.0)
    with pytest.raises(ValueError, match="kernel_overhead_us"):
        ClusterConfig.model_validate({"hosts": 1, "devices_per_host": 1, "device": {"kernel_overhead_us": -2}})


def _topo(kernel_s: float) -> Topology:
    return Topology(1, 2, 1, {c: LinkClass(c, 1e-5, 1e9) for c in CLASSES}, 1e9, 1e11, 1e10,
                    kernel_overhead_s=kernel_s)


def test_cost_model_adds_kernels_times_the_per_kernel_time_to_every_phase():
    model = fake_model([1.0, 1.0])
    layer = model.layers[0]
    choice = MeshChoice(2, 1, ("data", "model"), (), "dp")
    kernels = {"fwd": 40, "bwd": 60, "i": 35, "w": 30}
    flops = {"fwd": 1e6, "bwd": 2e6, "i": 1e6, "w": 1e6}
    profs = {layer_request(layer, choice, b): LayerProfile({k: v * b for k, v in flops.items()}, dict.fromkeys(flops, 0.0),
                                                           64.0 * b, 0.0, (), held_bytes=8.0 * b, split_temp_bytes=0.0,
                                                           kernels=kernels)
             for b in (1, 2)}
    without = layer_cost(layer, choice, 4, _topo(0.0), 0, profs)
    with_k = layer_cost(layer, choice, 4, _topo(2e-6), 0, profs)
    assert with_k.fwd_s - without.fwd_s == pytest.approx(40 * 2e-6)
    assert with_k.bwd_s - without.bwd_s == pytest.approx(60 * 2e-6)
    assert with_k.i_s - without.i_s == pytest.approx(35 * 2e-6)
    assert with_k.w_s - without.w_s == pytest.approx(30 * 2e-6)
    assert with_k.compute_s - without.compute_s == pytest.approx(100 * 2e-6)


def test_profile_kernels_survive_json_and_do_not_scale_with_the_batch():
    p1 = LayerProfile({"fwd": 1.0}, {"fwd": 0.0}, 0.0, 0.0, (), kernels={"fwd": 12, "bwd": 20})
    p2 = LayerProfile({"fwd": 2.0}, {"fwd": 0.0}, 0.0, 0.0, (), kernels={"fwd": 13, "bwd": 20})
    assert LayerProfile.from_json(p1.to_json()).kernels == {"fwd": 12, "bwd": 20}
    assert linear(p1, p2, 8).kernels == {"fwd": 13, "bwd": 20}      # batch 2's from 2 up
    assert linear(p1, p2, 1.5).kernels == {"fwd": 12, "bwd": 20}
    assert LayerProfile.from_json(LayerProfile({"fwd": 1.0}, {"fwd": 0.0}, 0.0, 0.0, ()).to_json()).kernels == {}
