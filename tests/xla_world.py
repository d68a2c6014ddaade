"""One process of a real multi-process JAX world running `stages.xla_transport` without Ray.

`python -m tests.xla_world SCENARIO PROCESS WORLD PORT OUT` — each process of the world joins it
(`stages.jaxinit.join_world`), builds every stage's mesh, runs its stage's lowered action list
for two training steps and one eval batch, with SENDs of reference tensors and RECVs checked
against the same references (no model: the transport alone), and writes OUT/<process>.json:
what it received and whether each tensor matched, the transport's counters, and its listening
addresses. tests/test_xla_transport.py starts the processes and reads the files.

Scenarios (process = cluster host; devices per process in DEVICES):
  chain   4 processes, 3 stages, 1F1B (m=4): stage 0 = processes 0+1 ({data: 2, model: 2}, a
          2-host stage), stage 1 = process 2 ({model: 4}), stage 2 = process 3 ({data: 2}).
          Edge 0→1: an f32 leaf (batch, embed) P(data, model) → P(None, model); a bf16 leaf
          (batch, mlp) → replicated on stage 1's 4 devices (one copy per host, fanned out on
          device); an int32 leaf (no gradient goes back). Edge 1→2: 4 devices → 2.
  pair    2 processes, 2 stages, GPipe (m=2): {data: 2} → {model: 2}: an f32 leaf cut alike on
          both sides (one whole-array device_put) and a bf16 leaf that becomes replicated.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time

SCENARIOS = {
    "chain": {"world": 4, "schedule": ("1f1b", 3, 4),
              "stages": [({"data": 2, "model": 2}, (0, 1), {"batch": "data", "embed": "model"}),
                         ({"model": 4}, (2,), {"embed": "model"}),
                         ({"data": 2}, (3,), {"batch": "data"})],
              "leaves": {1: [((8, 8), "float32", ("batch", "embed")), ((8, 4), "bfloat16", ("batch", "mlp")),
                             ((8,), "int32", ("batch",))],
                         2: [((8, 8), "float32", ("batch", "embed"))]}},
    "pair": {"world": 2, "schedule": ("gpipe", 2, 2),
             "stages": [({"data": 2}, (0,), {"batch": "data", "mlp": "data"}),
                        ({"model": 2}, (1,), {"batch": "model"})],
             "leaves": {1: [((8, 6), "float32", ("batch", "embed")), ((4, 4), "bfloat16", ("mlp", None))]}},
}


def reference(step: int, tag: str, kind: str, mb: int, boundary: int, j: int, shape, dtype):
    """The tensor a sender sends and its receiver expects (small integers: exact in bf16)."""
    import numpy as np

    from orchestrator.core.edges import leaf_dtype

    n = int(np.prod(shape))
    base = (np.arange(n) % 61 + 3 * mb + 5 * j + 11 * (kind == "B") + 2 * step + 13 * (tag != "F"))
    return base.reshape(shape).astype(leaf_dtype(dtype))


def main(name: str, process: int, world: int, port: int, out: str) -> None:
    sc = SCENARIOS[name]
    os.environ["JAX_PLATFORMS"] = "cpu"
    per_host = {h: math.prod(mesh.values()) // len(hosts) for mesh, hosts, _ in sc["stages"] for h in hosts}
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={per_host[process]}"
    import jax
    import numpy as np

    from orchestrator.core.edges import StageGeom
    from orchestrator.core.schedule import Kind, forward_only, generate, lower
    from orchestrator.core.schedule.transfers import world_order
    from stages.jaxinit import join_world, listens_on
    from stages.xla_transport import XlaTransport, stage_meshes

    t0 = time.time()
    address = join_world(world, process, f"127.0.0.1:{port}", "127.0.0.1", 60, who=f"process {process}",
                         transfer_timeout_s=60)
    geoms = [StageGeom.of(m, hosts, per_host[hosts[0]], layout) for m, hosts, layout in sc["stages"]]
    meshes = stage_meshes(geoms)
    stage = next(s for s, g in enumerate(geoms) if process in g.hosts)
    sched, p, m = sc["schedule"]
    chunks = [[(s, s + 1)] for s in range(p)]
    low, ev = lower(generate(sched, p, m)), lower(forward_only(p, m))
    leaf_table = {b: [(j, shape, dtype, axes) for j, (shape, dtype, axes) in enumerate(ls)]
                  for b, ls in sc["leaves"].items()}

    def leaves(boundary, kind):
        return [x for x in leaf_table[boundary] if kind == "F" or x[2] != "int32"]

    tr = XlaTransport(me=process, stage=stage, geoms=geoms, meshes=meshes,
                      programs={"F": world_order(low, chunks), "E": world_order(ev, chunks)},
                      leaves=leaves, io_timeout=60)
    from jax.sharding import NamedSharding, PartitionSpec

    def sharding(s, axes):
        return NamedSharding(meshes[s], PartitionSpec(*geoms[s].side(axes).spec))

    results = []
    for step, tag, sch in ((0, "F", low), (1, "F", low), (2, "E0", ev)):
        tr.begin(step, tag)
        for a in sch.actions[stage]:
            if a is None or a.kind not in (Kind.SEND_F, Kind.SEND_B, Kind.RECV_F, Kind.RECV_B):
                continue
            kind = "F" if a.kind in (Kind.SEND_F, Kind.RECV_F) else "B"
            forward_edge = a.kind in (Kind.SEND_F, Kind.RECV_B)
            boundary = a.stage + 1 if forward_edge else a.stage
            peer = a.stage + 1 if forward_edge else a.stage - 1
            ktag = tag if kind == "F" else "B"
            for j, shape, dtype, axes in leaves(boundary, kind):
                key = (step, ktag, a.microbatch, 0, j)
                want = reference(step, tag, kind, a.microbatch, boundary, j, shape, dtype)
                if a.kind in (Kind.SEND_F, Kind.SEND_B):
                    arr = jax.make_array_from_callback(shape, sharding(stage, axes), lambda idx, w=want: w[idx])
                    tr.send(key, arr, None)
                else:
                    got = tr.recv(key, shape, dtype, sharding(stage, axes), None, 60)
                    ok = got.sharding == sharding(stage, axes) and all(
                        np.array_equal(np.asarray(sh.data), want[sh.index]) for sh in got.addressable_shards)
                    results.append({"key": list(key), "from": peer, "ok": bool(ok), "dtype": str(got.dtype),
                                    "shards": len(got.addressable_shards)})
                    if not ok:
                        results[-1]["got"] = [np.asarray(sh.data).astype(float).ravel()[:6].tolist()
                                              for sh in got.addressable_shards]
                        results[-1]["want"] = [want[sh.index].astype(float).ravel()[:6].tolist()
                                               for sh in got.addressable_shards]
        tr.flush(60)
    listening = listens_on(address)
    import psutil

    listeners = sorted({f"{c.laddr.ip}:{c.laddr.port}" for c in psutil.Process().net_connections(kind="inet")
                        if c.status == psutil.CONN_LISTEN})
    info = {"process": process, "stage": stage, "received": results, "calls": tr.calls,
            "whole_sends": tr.whole_sends, "tile_sends": tr.tile_sends, "sent_bytes": tr.sent_bytes,
            "transfer_address": address, "transfer_listening": listening, "listeners": listeners,
            "seconds": time.time() - t0}
    tr.close()
    with open(os.path.join(out, f"{process}.json.part"), "w") as f:
        json.dump(info, f)
    os.replace(os.path.join(out, f"{process}.json.part"), os.path.join(out, f"{process}.json"))
    # Leave only when every process has written its report: a process that exits (the coordinator
    # above all) while a peer's last transfer still reads from it ends that peer's run (CI saw
    # "recv() failed ... Transport endpoint is not connected" then the coordination service's abort).
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(os.path.exists(os.path.join(out, f"{i}.json"))
                                                  for i in range(world)):
        time.sleep(0.05)
    sys.stdout.flush()
    os._exit(0)      # no jax.distributed.shutdown: the reports are the result, the file barrier the end


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
