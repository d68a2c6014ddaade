"""The cost model's transport terms (pure, milliseconds): who a SEND holds, link classes per
transport, GPU/TPU device defaults, a replicated destination's fan-out, and the search's replay."""
from __future__ import annotations

import dataclasses

import pytest

from orchestrator.core.config import ConfigError, parse_cluster
from orchestrator.core.planner import SearchOptions, search
from orchestrator.core.planner.cost import MeshChoice
from orchestrator.core.planner.topology import CLASSES, LinkClass, Topology, from_cluster
from orchestrator.core.planner.transports import TRANSPORTS, EdgeLayout, edge_layout, resolve
from orchestrator.core.schedule import Kind, generate, lower, simulate
from tests.planner_fakes import FakeProfiles, fake_model

GPU = {"address": "auto", "platform": "gpu", "hosts": 2, "devices_per_host": 8, "cpus_per_host": 4}
MIB128 = 128 * 2**20
TP8 = MeshChoice(1, 8, ("data", "model"), (("heads", "model"), ("mlp", "model")), "megatron")
DP8 = MeshChoice(8, 1, ("data", "model"), (), "dp")
ACT = ("batch", None, "embed")          # a transformer block's output: replicated over a megatron `model`


def gpu(transport="socket", **extra):
    return from_cluster(parse_cluster({**GPU, **extra}), transport=transport)


# ----------------------------------------------------------------------------- the simulator


def _stage0_forwards_end(r):
    return max(t1 for a, _, t1 in r.spans if a.stage == 0 and a.kind is Kind.F)


def test_a_blocking_send_lengthens_the_senders_timeline_and_a_non_blocking_one_does_not():
    low = lower(generate("gpipe", 2, 4))
    costs = {"F": 1.0, "B": 2.0}
    free = simulate(low, costs, transfer=0.5)
    held = simulate(low, costs, transfer=0.5, send_block=0.5)
    # stage 0's four forwards run back to back when its sends return at once...
    assert _stage0_forwards_end(free) == 4.0
    # ...and each SEND_F holds the thread 0.5 s before the next forward when they block
    assert _stage0_forwards_end(held) == 4.0 + 3 * 0.5
    sends = [(t0, t1) for a, t0, t1 in held.spans if a.stage == 0 and a.kind is Kind.SEND_F]
    assert all(t1 - t0 == 0.5 for t0, t1 in sends)
    assert held.step_time > free.step_time
    # the hold is not compute: it shows as bubble on the sender
    assert held.bubble_per_stage[0] > free.bubble_per_stage[0]


def test_a_receivers_hold_follows_the_arrival_and_data_never_beats_the_senders_hold():
    low = lower(generate("gpipe", 2, 1))
    base = simulate(low, {"F": 1, "B": 1}, transfer=2).step_time           # 1 + 2 + 1 + 1 + 2 + 1
    assert base == 8
    assert simulate(low, {"F": 1, "B": 1}, transfer=2, recv_block=1).step_time == 10
    # a hold longer than the transfer delays the data too (it is sent when the hold ends)
    assert simulate(low, {"F": 1, "B": 1}, transfer=2, send_block=3).step_time == 10
    with pytest.raises(Exception, match=r"send_block\[0\]=-1"):
        simulate(low, {"F": 1, "B": 1}, send_block=[-1])


# ----------------------------------------------------------------------------- Topology.edge


def test_socket_send_holds_the_sender_for_copy_and_wire_xla_only_for_the_issue():
    sock, xla = gpu("socket"), gpu("xla")
    s = sock.edge("dcn", MIB128)
    x = xla.edge("dcn", MIB128)
    d2h = sock.host_copy.time(MIB128)
    assert s.send_block_s == pytest.approx(d2h + sock.links["dcn"].time(MIB128))
    assert x.send_block_s == TRANSPORTS["xla"].issue_s == pytest.approx(100e-6)
    assert x.send_block_s < 0.01 * s.send_block_s
    # the transfer itself still delays the receiver under xla
    assert x.transfer_s == pytest.approx(xla.links["dcn"].time(MIB128))
    # links.send_blocking / send_issue_us override the transport's figures (a non-blocking socket)
    nb = gpu("socket", links={"send_blocking": 0.0, "send_issue_us": 50})
    assert nb.edge("dcn", MIB128).send_block_s == pytest.approx(50e-6)
    assert nb.edge("dcn", MIB128).transfer_s == pytest.approx(s.transfer_s)


def test_link_classes_per_transport_nvlink_inside_a_node_group_the_network_across():
    # four hosts of 4 GPUs, two per node (an NVLink domain): hosts_per_group = 2
    c = {**GPU, "hosts": 4, "devices_per_host": 4, "links": {"hosts_per_group": 2}}
    xla = from_cluster(parse_cluster(c), transport="xla")
    sock = from_cluster(parse_cluster(c), transport="socket")
    assert xla.class_of_hosts([0, 1]) == "group" and xla.class_of_hosts([1, 2]) == "dcn"
    assert xla.links["group"].bandwidth == 450e9             # H100 NVLink, one direction
    assert xla.links["dcn"].bandwidth == 50e9                # NCCL on a 400 Gb/s NIC per GPU
    assert sock.links["group"].bandwidth == 10e9             # host memory (Unix socket + shared memory)
    assert sock.links["dcn"].bandwidth == 12.5e9             # TCP on 100 GbE
    same_node, across = xla.edge("group", MIB128).transfer_s, xla.edge("dcn", MIB128).transfer_s
    assert same_node == pytest.approx(5e-6 + MIB128 / 450e9) and across == pytest.approx(10e-6 + MIB128 / 50e9)
    # collectives inside a stage are XLA's own whatever the stage transport
    assert sock.collective_link("dcn").bandwidth == 50e9 and sock.collective_link("host").bandwidth == 450e9
    # a cluster's own link figures describe its transport's stage edges, as before; under xla (what
    # `auto`, the default, is on GPU) the stage edges ride the collectives' wires, so they stand for both
    dcn3 = {"links": {"dcn": {"bandwidth_gbps": 3, "latency_us": 40}}}
    given = from_cluster(parse_cluster({**GPU, **dcn3, "transport": "socket"}))
    assert given.links["dcn"].bandwidth == 3e9 and given.collective_link("dcn").bandwidth == 50e9
    given = from_cluster(parse_cluster({**GPU, **dcn3}))
    assert given.transport.name == "xla"
    assert given.links["dcn"].bandwidth == 3e9 and given.collective_link("dcn").bandwidth == 3e9


def test_search_puts_a_big_edge_on_nvlink_under_xla():
    """Two stages on 4 hosts (2 per NVLink domain): under xla the planner keeps the edge inside a node."""
    model = fake_model([1e6] * 4, d=65536, h=1)          # 256 KiB of activation per example
    links = {"host": LinkClass("host", 5e-6, 450e9), "group": LinkClass("group", 5e-6, 450e9),
             "dcn": LinkClass("dcn", 1e-5, 0.5e9)}
    t = Topology(4, 1, 2, links, 1e12, 1e13, 1e12, platform="gpu", transport=TRANSPORTS["xla"])
    opts = SearchOptions(microbatches=(4,), schedules=("1f1b",), top=0, max_model=1, remats=("none",))
    r = search(model, t, 16, profile=FakeProfiles(model, [1e6] * 4), options=opts)
    assert all(c.edges[0]["link"] == "group" for c in r.ranked if len(c.stages) == 2)    # the DP's own pick
    every = search(model, t, 16, profile=FakeProfiles(model, [1e6] * 4),
                   options=dataclasses.replace(opts, exhaustive=True))
    two = [c for c in every.ranked if len(c.stages) == 2]
    inside = min((c for c in two if c.edges[0]["link"] == "group"), key=lambda c: c.step_s)
    across = min((c for c in two if c.edges[0]["link"] == "dcn"), key=lambda c: c.step_s)
    assert inside.step_s < across.step_s
    assert across.edges[0]["transfer_s"] > 100 * inside.edges[0]["transfer_s"]


# ----------------------------------------------------------------------------- device defaults


@pytest.mark.parametrize("extra, gb", [
    ({}, 60.0),                                                      # no type named: an H100 assumed
    ({"gpu": {"accelerator_type": "H100"}}, 60.0),                   # 80 GB × XLA's 0.75
    ({"gpu": {"accelerator_type": "H200"}}, 105.75),                 # 141 GB × 0.75
    ({"gpu": {"accelerator_type": "H100", "memory_fraction": 0.9}}, 72.0),
    ({"gpu": {"accelerator_type": "H100"}, "device": {"memory_gb": 40}}, 40.0),   # a given figure wins
])
def test_gpu_memory_default_is_the_data_sheet_times_xlas_memory_fraction(extra, gb):
    t = from_cluster(parse_cluster({**GPU, **extra}))
    assert t.memory_bytes == pytest.approx(gb * 1e9)
    assert t.flops == pytest.approx(494.7e12) and t.platform == "gpu"


def test_h200_and_tpu_figures_and_unknown_models_are_named_in_the_notes():
    h200 = gpu("xla", gpu={"accelerator_type": "H200"})
    assert h200.memory_bandwidth == pytest.approx(4.8e12)
    assert any("H200 data sheet" in n for n in h200.notes)
    l4 = gpu("xla", gpu={"accelerator_type": "L4"})
    assert any("L4: not in the data-sheet table, H100 figures assumed" in n for n in l4.notes)
    tpu = from_cluster(parse_cluster({"address": "auto", "platform": "tpu", "hosts": 4, "devices_per_host": 4,
                                      "placement_strategy": "SPREAD",
                                      "tpu": {"type": "v5litepod-16", "topology": "4x4"}}), transport="xla")
    assert tpu.memory_bytes == 16e9 and tpu.flops == 197e12
    assert tpu.links["group"].bandwidth == 25e9              # one ICI link, one direction: 1600 Gb/s / 8
    assert tpu.links["dcn"].bandwidth == 6.25e9


def test_cpu_defaults_are_unchanged_and_auto_resolves_per_platform():
    t = from_cluster(parse_cluster({"hosts": 2, "devices_per_host": 2}))
    assert {c: t.links[c].bandwidth for c in CLASSES} == {"host": 10e9, "group": 1e9, "dcn": 1e9}
    assert t.collective_links == {} and t.host_copy is None and t.memory_bytes == 2e9
    assert resolve("cpu", "auto") == "socket" and resolve("gpu", "auto") == resolve("tpu", None) == "xla"
    with pytest.raises(ValueError, match="transport = 'carrier-pigeon'"):
        resolve("cpu", "carrier-pigeon")


def test_new_links_keys_are_checked():
    with pytest.raises(ConfigError, match=r"links.send_blocking = 1.5"):
        parse_cluster({**GPU, "links": {"send_blocking": 1.5}})
    with pytest.raises(ConfigError, match=r"links.host_copy.bandwidth_gbps = 0"):
        parse_cluster({**GPU, "links": {"host_copy": {"bandwidth_gbps": 0, "latency_us": 1}}})
    t = gpu("socket", links={"host_copy": {"bandwidth_gbps": 25, "latency_us": 5}})
    assert t.host_copy.bandwidth == 25e9 and t.host_copy.latency_s == pytest.approx(5e-6)


# ----------------------------------------------------------------------------- fan-out


def test_edge_layouts_of_replicated_sharded_and_two_host_stages():
    assert edge_layout(TP8, TP8, ACT, 8) == EdgeLayout(1.0, 1.0, 1, 8)
    assert edge_layout(TP8, DP8, ACT, 8) == EdgeLayout(1.0, 1.0, 8, 1)
    # the output's embed dim split over `model` (rules name it): 8 pieces, no copies
    emb = MeshChoice(1, 8, ("data", "model"), (("embed", "model"),), "embed")
    assert edge_layout(TP8, emb, ACT, 8) == EdgeLayout(1.0, 1.0, 8, 1)
    # a 2-host stage of 4 devices each: data=2 across hosts (row-major, data outer), model=4 inside
    two = MeshChoice(2, 4, ("data", "model"), (("mlp", "model"),), "mlp")
    assert edge_layout(TP8, two, ACT, 4) == EdgeLayout(0.5, 1.0, 1, 4)
    # model outer: each host holds both batch halves, 2 devices per half
    flipped = MeshChoice(2, 4, ("model", "data"), (("mlp", "model"),), "mlp")
    assert edge_layout(TP8, flipped, ACT, 4) == EdgeLayout(1.0, 1.0, 2, 2)


def test_a_replicated_destination_pays_its_fan_out():
    sock, xla = gpu("socket"), gpu("xla")
    rep, split = edge_layout(TP8, TP8, ACT, 8), edge_layout(TP8, DP8, ACT, 8)
    # socket today: one host → device copy per device holding the array, on the receiver's thread
    one = sock.host_copy.time(MIB128)
    assert sock.edge("dcn", MIB128, rep).recv_block_s == pytest.approx(8 * one)
    assert sock.edge("dcn", MIB128, split).recv_block_s == pytest.approx(sock.host_copy.time(MIB128))
    # once per host, then a broadcast on device over the host class (the issue's fix)
    once = dataclasses.replace(sock, transport=dataclasses.replace(TRANSPORTS["socket"], h2d_per_device=False))
    e = once.edge("dcn", MIB128, rep)
    assert e.h2d_s == pytest.approx(one) and e.fanout_s == pytest.approx(once.collective_link("host").time(MIB128))
    assert e.recv_block_s < 0.2 * sock.edge("dcn", MIB128, rep).recv_block_s
    # xla: the array crosses once, then fans out over NVLink; split pieces cross in parallel lanes
    xr, xs = xla.edge("dcn", MIB128, rep), xla.edge("dcn", MIB128, split)
    assert xr.fanout_s == pytest.approx(xla.collective_link("host").time(MIB128)) and xr.recv_block_s == 0
    assert xs.fanout_s == 0 and xs.wire_s == pytest.approx(xla.links["dcn"].time(MIB128 / 8))


def test_search_replays_each_plan_with_its_edges_holds():
    """The same plans under socket and xla: socket's blocking sends and H2D copies cost steps."""
    model = fake_model([1e6] * 4, d=65536, h=1)
    opts = SearchOptions(microbatches=(4,), schedules=("1f1b",), top=0, max_model=1, remats=("none",))
    links = {c: LinkClass(c, 1e-5, 1e9) for c in CLASSES}
    base = Topology(2, 1, 1, links, 1e12, 1e12, 1e12, platform="gpu", host_copy=LinkClass("copy", 1e-5, 2e9))
    by = {}
    for name in ("socket", "xla"):
        t = dataclasses.replace(base, transport=TRANSPORTS[name])
        by[name] = {c.key(): c for c in search(model, t, 16, profile=FakeProfiles(model, [1e6] * 4),
                                               options=opts).ranked}
    two = [k for k, c in by["socket"].items() if len(c.stages) == 2]
    assert two
    for k in two:
        s, x = by["socket"][k], by["xla"][k]
        e = s.edges[0]
        assert e["send_block_s"] == pytest.approx(e["d2h_s"] + e["wire_s"]) and e["recv_block_s"] > 0
        assert x.edges[0]["send_block_s"] == pytest.approx(100e-6) and x.edges[0]["recv_block_s"] == 0
        low = lower(generate("1f1b", 2, 4))
        costs = [{"F": st.fwd_s, "B": st.bwd_s, "OPT": st.opt_s} for st in s.stages]
        assert s.step_s == pytest.approx(simulate(low, costs, e["transfer_s"], send_block=e["send_block_s"],
                                                  recv_block=e["recv_block_s"]).step_time)
        assert s.step_s > x.step_s
