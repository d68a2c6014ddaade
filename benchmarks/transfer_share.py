"""The transfer share of a pipelined step, FROM THE COST MODEL: a model, not a measurement.

The issue's example (#37): Llama-3-8B on 2 stages, each one node of 8 H100s, tensor-parallel
over its 8 GPUs (the residual stream between blocks replicated over them), 4 × 4096 tokens per
microbatch, so one 4 × 4096 × 4096 bf16 activation = 128 MiB per edge per microbatch (and
its gradient back), about 130 ms of compute per microbatch per stage (F + B, B = 2 F), 1F1B.

For each scenario this builds the planner's `Topology` (`orchestrator.core.planner`:
`from_cluster` on an H100 cluster under the transport, link figures overridden where the
scenario says), costs the edge with `Topology.edge` on the two stages' layout
(`transports.edge_layout`: replicated → replicated, one piece crossing, 8 copies per host),
plays the step in the schedule simulator with the edge's transfer and the threads it holds,
and reports

  share = 1 − step(transfers free) / step(with the transport)

i.e. the part of the step the transport adds. Scenarios:
  socket-today       TCP on 100 GbE at line rate, the SEND blocking for D2H + wire, one
                     pageable H2D per GPU on the receiver's compute thread (what the code does)
  socket-today-slow  the same with one TCP stream at 40 Gb/s and pageable copies at 8 GB/s
  socket-fixed       the socket transport after the issue's item 3: non-blocking SEND, one H2D
                     per host then an on-device broadcast over NVLink
  xla-ib             `transport: xla`, NCCL over one 400 Gb/s InfiniBand NIC per GPU, the
                     array crossing once and fanning out over NVLink (the default figures)
  xla-nvlink         the same two stages inside one NVLink domain (e.g. two 4-GPU hosts of
                     one node, or an NVL72 rack): the edge on NVLink

Every figure is a nominal data-sheet number or an assumption stated in the JSON
(`assumptions`); `benchmarks/gpu_transfer_check.py` measures the copies on a real GPU.
Run: `python -m benchmarks.transfer_share` (milliseconds; writes
benchmarks/results/transfer_share.json).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orchestrator.core.config import parse_cluster
from orchestrator.core.planner.cost import MeshChoice
from orchestrator.core.planner.topology import from_cluster
from orchestrator.core.planner.transports import edge_layout
from orchestrator.core.schedule import generate, lower, simulate

RESULTS = Path(__file__).resolve().parent / "results"
MIB = 2**20
LLAMA8B = {"d_model": 4096, "tokens_per_microbatch": 4 * 4096, "bytes_per_element": 2, "compute_s": 0.130}
CLUSTER = {"address": "auto", "platform": "gpu", "hosts": 2, "devices_per_host": 8, "cpus_per_host": 8,
           "gpu": {"accelerator_type": "H100", "gpus_per_node": 8}}
TP8 = MeshChoice(1, 8, ("data", "model"), (("heads", "model"), ("mlp", "model")), "megatron")
ACT = ("batch", None, "embed")

SCENARIOS = {
    "socket-today": {"transport": "socket", "links": {}},
    "socket-today-slow": {"transport": "socket", "links": {"dcn": {"bandwidth_gbps": 5.0, "latency_us": 30},
                                                           "host_copy": {"bandwidth_gbps": 8.0, "latency_us": 10}}},
    "socket-fixed": {"transport": "socket", "links": {"send_blocking": 0.0, "send_issue_us": 100},
                     "once_per_host": True},
    "xla-ib": {"transport": "xla", "links": {}},
    "xla-nvlink": {"transport": "xla", "links": {}, "edge_class": "group"},
}


def topology(scenario: dict):
    """The planner's `Topology` of the example's cluster under one scenario."""
    cl = parse_cluster({**CLUSTER, **({"links": scenario["links"]} if scenario["links"] else {})})
    topo = from_cluster(cl, transport=scenario["transport"])
    if scenario.get("once_per_host"):
        topo = dataclasses.replace(topo, transport=dataclasses.replace(topo.transport, h2d_per_device=False))
    return topo


def transfer_share(topo, nbytes: float, compute_s: float, m: int, edge_class: str = "dcn",
                   schedule: str = "1f1b", layout=None) -> dict:
    """A 2-stage step with and without the edge's costs (`simulate`), and what the transport adds.

    Args:
      topo: the planner's `Topology` (its transport, links, host copies).
      nbytes: bytes of one activation (its gradient is the same size).
      compute_s: F + B of one microbatch on one stage (B = 2 F).
      m: microbatches per step.
      edge_class: the link class the edge crosses.
      layout: `EdgeLayout` (None: replicated → replicated over the stage's devices).

    Returns:
      {"edge": EdgeCost parts (s), "step_s", "step_free_s", "share", "sender_held_s",
       "receiver_held_s"} (held: per step, all edges' holds on that stage's compute thread).

    Example:
      >>> t = topology(SCENARIOS["xla-ib"])
      >>> r = transfer_share(t, 128 * MIB, 0.13, 8)
      >>> r["share"] < 0.05 < transfer_share(topology(SCENARIOS["socket-today"]), 128 * MIB, 0.13, 8)["share"]
      True
    """
    layout = layout or edge_layout(TP8, TP8, ACT, topo.devices_per_host)
    edge = topo.edge(edge_class, nbytes, layout)
    low = lower(generate(schedule, 2, m))
    costs = {"F": compute_s / 3, "B": 2 * compute_s / 3}
    free = simulate(low, costs).step_time
    sim = simulate(low, costs, edge.transfer_s, send_block=edge.send_block_s, recv_block=edge.recv_block_s)
    return {"edge": edge.to_dict(), "edge_delay_s": edge.delay_s, "step_s": sim.step_time, "step_free_s": free,
            "share": 1 - free / sim.step_time,
            "sender_held_s": 2 * m * edge.send_block_s, "receiver_held_s": 2 * m * edge.recv_block_s}


def run(ms=(4, 8, 16)) -> dict:
    nbytes = LLAMA8B["tokens_per_microbatch"] * LLAMA8B["d_model"] * LLAMA8B["bytes_per_element"]
    out = {"what": "a cost-model estimate, not a measurement: orchestrator.core.planner's Topology.edge and the "
                   "schedule simulator on nominal data-sheet figures and stated assumptions",
           "example": {**LLAMA8B, "activation_bytes": nbytes, "activation_mib": nbytes / MIB, "stages": 2,
                       "stage": "one node of 8 H100s, tensor-parallel over 8 (activation replicated)",
                       "schedule": "1f1b", "F": "compute_s / 3", "B": "2 compute_s / 3"},
           "scenarios": {}}
    for name, sc in SCENARIOS.items():
        topo = topology(sc)
        rows = {str(m): transfer_share(topo, nbytes, LLAMA8B["compute_s"], m, sc.get("edge_class", "dcn"))
                for m in ms}
        link = topo.links[sc.get("edge_class", "dcn")]
        out["scenarios"][name] = {
            "transport": topo.transport.name, "send_blocking": topo.transport.blocking,
            "send_issue_us": topo.transport.issue_s * 1e6, "h2d_per_device": topo.transport.h2d_per_device,
            "edge_link": {"class": sc.get("edge_class", "dcn"), "gbps": link.bandwidth / 1e9,
                          "latency_us": link.latency_s * 1e6},
            "host_copy_gbps": None if topo.host_copy is None else topo.host_copy.bandwidth / 1e9,
            "fanout_link_gbps": topo.collective_link("host").bandwidth / 1e9,
            "by_microbatches": rows}
    out["assumptions"] = [
        "H100 SXM data sheet: NVLink 450 GB/s per direction, PCIe Gen5 x16 64 GB/s per direction",
        "pageable device<->host copies (np.asarray per shard, device_put from numpy) at a quarter of PCIe, "
        "16 GB/s (socket-today-slow: 8 GB/s); not measured here",
        "100 GbE at line rate 12.5 GB/s for one TCP stream (socket-today-slow: 5 GB/s)",
        "NCCL across nodes: one 400 Gb/s NIC per GPU, 50 GB/s, 10 us; the replicated array crosses on ONE lane "
        "(the tile plan moves it once per host) and fans out over NVLink",
        "xla SEND issue cost 100 us on the compute thread; no other hold",
        "1F1B, 2 stages, F = compute/3, B = 2 compute/3, forward and backward edges the same size",
    ]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=RESULTS / "transfer_share.json")
    args = ap.parse_args(argv)
    res = run()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(res["what"])
    for name, sc in res["scenarios"].items():
        r = sc["by_microbatches"]["8"]
        e = r["edge"]
        print(f"{name:<18} edge {r['edge_delay_s'] * 1e3:7.2f} ms (sender held {e['send_block_s'] * 1e3:6.2f}, "
              f"receiver held {e['recv_block_s'] * 1e3:6.2f})  m=8 step {r['step_s']:.3f} s vs {r['step_free_s']:.3f} s "
              f"free: transfer share {r['share'] * 100:5.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
