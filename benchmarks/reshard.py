"""Cross-mesh reshard throughput: the stage transports beside a raw object-store push.

Run:  python -m benchmarks.reshard [--quick] [--cases NAME,NAME]
Writes benchmarks/results/reshard.{md,json} (--quick: reshard.quick.{md,json}) and prints the markdown.

For every case (two stage geometries, a float32 tensor with logical axes
("batch", "embed")) and size (16 MiB, 64 MiB, 7 repeats; --quick: 16 MiB, 5 repeats),
between the same sender and receiver actors (`benchmarks.reshard_probe`), the
median over repeats of the time from the sender's first instruction to the
receiver holding its result (one monotonic clock: the actors share a machine),
after WARMUP untimed moves of each variant. Variants alternate within each repeat:

  socket   `SocketTransport.send` / `.recv` exactly as a stage runs them (the
           pipeline default). Here every peer is on the same machine, so payloads of
           1 MiB or more go through the receiver's shared memory: the sender writes
           each tile straight into its place in the destination shards (one copy);
           the receiver builds the jax.Array (CPU `device_put` adopts the buffers).
  tcp      the same transport with shared memory off: what peers on different
           machines do. One TCP stream per destination host, laid out block by block
           in destination order, read straight into the destination shards.
  ray      `RayTransport.send` / `.recv` (cluster `transport: ray`): the tiles of
           each destination host as ONE actor-call argument (Ray puts it in the
           object store), mailbox, `assemble`, `device_put`, jax.Array.
  ray-put  the issue's literal design on the Ray object store: the sender gathers
           each destination host's distinct destination shards (or, when several
           source hosts contribute, the tiles), `ray.put`s them as one object and
           pushes the ref; the receiver `ray.get`s and builds the jax.Array.
  raw      the same bytes per (source host, destination host) as ONE numpy buffer:
           sender `ray.put`, ref pushed into the receiver's mailbox, receiver
           `ray.get`. Moves bytes, builds nothing: the reference.

Columns: `ratio` = raw time / variant time (throughput ratio, target >= 0.9);
`bytes/lb` = plan.cross_host_bytes / plan.lower_bound_bytes (target 1.0). Each
variant's time is split into send (the sender's send call), arrive (t0 -> the
slowest receiver's mailbox take returned) and build (take -> jax.Array ready).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time
from pathlib import Path

import numpy as np

from orchestrator.core.edges import StageGeom, edge_plan
from orchestrator.core.reshard.tiles import aligned_empty
from stages.mailbox import Mailbox
from benchmarks.reshard_probe import ProbeSet, ReshardProbe, random_array

AXES = ("batch", "embed")
VARIANTS = ("socket", "tcp", "ray", "ray-put", "raw")
TOKEN = b"reshard-benchmark-token"
WARMUP = 3      # untimed moves per variant and case before the timed repeats
TIMEOUT = 120.0
RESULTS = Path(__file__).resolve().parent / "results"


def one_host(mesh: dict, layout: dict, host: int) -> StageGeom:
    return StageGeom.of(mesh, (host,), int(np.prod(list(mesh.values()))), layout)


_2X2 = one_host({"data": 2, "model": 2}, {"batch": "data", "embed": "model"}, 0)
_4X1 = one_host({"data": 4, "model": 1}, {"batch": "data", "embed": "model"}, 1)
_REPL = one_host({"data": 4}, {}, 0)
_SHARD = one_host({"data": 4}, {"batch": "data"}, 1)
_ONE = one_host({"data": 1}, {"batch": "data"}, 0)
_EIGHT = one_host({"data": 2, "model": 4}, {"batch": "data", "embed": "model"}, 1)
_T_SRC = one_host({"data": 2, "model": 4}, {"batch": "data", "embed": "model"}, 0)
_T_DST = one_host({"data": 2, "model": 4}, {"batch": "model", "embed": "data"}, 1)
_PAIR = StageGeom.of({"data": 2, "model": 2}, (1, 2), 2, {"batch": "data"})

# name -> (geometry of stage 0 (actor "a"), geometry of stage 1 ("b", or the 2-host "pair"), direction);
# "forward" moves stage 0 -> 1 (SEND_F), "backward" 1 -> 0 (SEND_B), as in a pipeline.
CASES = {
    "2x2->4x1": (_2X2, _4X1, "forward"),
    "replicated->sharded": (_REPL, _SHARD, "forward"),
    "sharded->replicated": (_REPL, _SHARD, "backward"),
    "1->8": (_ONE, _EIGHT, "forward"),
    "8->1": (_ONE, _EIGHT, "backward"),
    "transposed spec": (_T_SRC, _T_DST, "forward"),
    "1 host->2 hosts": (_2X2, _PAIR, "forward"),
    "2 hosts->1 host": (_2X2, _PAIR, "backward"),
}


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def _groups(plan, dst_host: int) -> dict:
    """Destination devices on `dst_host` grouped by the global box they hold (replicas share a group)."""
    from orchestrator.core.reshard import shard_boxes

    boxes = shard_boxes(plan.dst, plan.shape)
    groups: dict = {}
    for d in plan.dst.devices_on(dst_host):
        groups.setdefault(boxes[d], []).append(d)
    return groups


def ship_shards(plan, src_host: int, dst_host: int, shards: dict) -> tuple:
    """ray-put payload for `dst_host`: its distinct destination shards when `src_host` supplies them all.

    Returns ("shards", [(dst devices, array)]) — one aligned array per distinct
    destination block on `dst_host` (a tile that is a whole contiguous shard is
    used as is) — or ("tiles", [contiguous tile arrays]) in plan order.
    """
    from orchestrator.core.reshard import pack

    tiles = plan.sends[src_host][dst_host]
    arrays = pack(plan, src_host, dst_host, shards)
    if any(t.src_host != src_host for t in plan.recvs[dst_host]):
        return ("tiles", [a if a.flags.c_contiguous else np.ascontiguousarray(a) for a in arrays])
    out = []
    for devs in _groups(plan, dst_host).values():
        pieces = [(a, where) for t, a in zip(tiles, arrays) for dev, where in t.targets if dev == devs[0]]
        if len(pieces) == 1 and pieces[0][0].shape == plan.dst_shard_shape and pieces[0][0].flags.c_contiguous:
            buf = pieces[0][0]
        else:
            buf = aligned_empty(plan.dst_shard_shape, plan.dtype)
            for a, where in pieces:
                buf[where] = a
        out.append((tuple(devs), buf))
    return ("shards", out)


def local_shards(plan, dst_host: int, received: dict) -> dict:
    """Receiver side of ray-put: dst device -> numpy shard, from shipped shards or tiles."""
    from orchestrator.core.reshard import assemble

    shipped = [p for p in received.values() if p[0] == "shards"]
    if shipped:
        return {d: a for devs, a in shipped[0][1] for d in devs}
    return assemble(plan, dst_host, {s: p[1] for s, p in received.items()})


class TimedMailbox(Mailbox):
    """A Mailbox that notes when each take returned."""

    def __init__(self, owner: str):
        super().__init__(owner)
        self.taken_at: dict = {}

    def take(self, key, timeout):
        value = super().take(key, timeout)
        self.taken_at[key] = time.perf_counter()
        return value


class BenchProbe(ReshardProbe):
    """A `ReshardProbe` with timed sends/receives of one cached source array, per variant."""

    def __init__(self, name: str):
        super().__init__(name)
        self.inbox = TimedMailbox(name)
        self._armed = threading.Event()
        self._array = None
        self._raw: dict = {}
        self._inflight: list = []
        self._verify_seed: int | None = None

    # -- sender ----------------------------------------------------------------
    def prepare(self, seed: int, shape, to_stage: int) -> None:
        """Build the source jax.Array and, per destination host, one raw buffer of the plan's bytes."""
        self._array = self.source_array(seed, shape, np.float32)
        plan = self._plan(to_stage, shape, sending=True)
        self._raw = {}
        for dst_host, tiles in plan.sends.get(self.transport.me, {}).items():
            nbytes = sum(t.nbytes for t in tiles)
            if nbytes:
                buf = aligned_empty((nbytes,), np.uint8)
                buf[:] = 1
                self._raw[dst_host] = buf

    def _plan(self, peer_stage: int, shape, sending: bool):
        mine, edge = self.geoms[self.stage], self.edge(peer_stage)
        src, dst = (mine, edge.geom) if sending else (edge.geom, mine)
        return edge_plan(src, dst, edge.axes, tuple(shape), np.float32)

    def _push(self, to_stage: int, dst_host: int, key, payload) -> None:
        peer = self.actors[to_stage][self.geoms[to_stage].hosts.index(dst_host)]
        self._inflight.append(peer.deliver.options(concurrency_group="io").remote((*key, self.transport.me),
                                                                                 payload))

    def timed_send(self, key, to_stage: int, variant: str) -> dict:
        import ray

        key = tuple(key)
        t0 = time.perf_counter()
        if variant in self.transports:
            self.transports[variant].send(key, self._array, self.edge(to_stage))
        elif variant == "raw":
            for dst_host, buf in self._raw.items():
                self._push(to_stage, dst_host, key, [ray.put(buf)])
        else:
            plan = self._plan(to_stage, self._array.shape, sending=True)
            me = self.transport.me
            by_device = {self.transport.flat[s.device.id]: s for s in self._array.addressable_shards}
            for dst_host, tiles in plan.sends.get(me, {}).items():
                if tiles:
                    shards = {d: np.asarray(by_device[d].data) for d in {t.src_device for t in tiles}}
                    self._push(to_stage, dst_host, key, [ray.put(ship_shards(plan, me, dst_host, shards))])
        t1 = time.perf_counter()
        if variant in self.transports:
            self.transports[variant].flush(TIMEOUT)
        if self._inflight:
            ray.get(self._inflight, timeout=TIMEOUT)
            self._inflight.clear()
        return {"t0": t0, "send_s": t1 - t0}

    def warm_store(self, mib: int, times: int = 2) -> None:
        """Touch the object store's memory once, so the first case does not pay its page faults."""
        import ray

        for _ in range(times):
            buf = np.ones(mib * 2**20, np.uint8)
            ref = ray.put(buf)
            del ref, buf

    # -- receiver ----------------------------------------------------------------
    def wait_armed(self, timeout: float) -> bool:
        return self._armed.wait(timeout)

    def timed_recv(self, key, shape, from_stage: int, variant: str, verify: bool = False) -> dict:
        import jax
        import ray

        key, shape = tuple(key), tuple(shape)
        sharding = self.sharding()
        if variant in self.transports:
            self.transports[variant].expect(self.edge(from_stage), shape, np.float32)
        self._armed.set()
        try:
            if variant in self.transports:
                array = self.transports[variant].recv(key, shape, np.float32, sharding, self.edge(from_stage),
                                                      TIMEOUT)
            else:
                plan = self._plan(from_stage, shape, sending=False)
                me = self.transport.me
                received = {src: ray.get(self.inbox.take((*key, src), TIMEOUT)[0], timeout=TIMEOUT)
                            for src, per_dst in plan.sends.items() if per_dst.get(me)}
                if variant == "raw":
                    array = received
                else:
                    local = local_shards(plan, me, received)
                    arrays = [jax.device_put(local[i], d) for i, d in self.transport.local]
                    array = jax.make_array_from_single_device_arrays(shape, sharding, arrays)
            if variant != "raw":
                jax.block_until_ready(array)
            t_end = time.perf_counter()
        finally:
            self._armed.clear()
        taken = [v for k, v in self.inbox.taken_at.items() if k[:len(key)] == key]
        out = {"t_end": t_end, "taken": max(taken) if taken else t_end}
        self.inbox.taken_at.clear()
        if verify and variant != "raw":
            want = random_array(self._verify_seed, shape)
            out["ok"] = all(np.asarray(s.data).tobytes() == want[s.index].tobytes()
                            for s in array.addressable_shards)
        return out

    def expect_seed(self, seed: int) -> None:
        """The seed the next verified receive is checked against."""
        self._verify_seed = seed


class Bench(ProbeSet):
    """The actors: "a" (8 devices), "b" (8 devices), "pair" (2 hosts × 2 devices, jax.distributed)."""

    def __init__(self, ray):
        super().__init__(ray, BenchProbe, TIMEOUT)
        self.start()
        ray.get([x.warm_store.remote(256) for x in (self.a, self.b, *self.pair)], timeout=TIMEOUT)

    def run_case(self, name: str, shape: tuple, reps: int, seed: int, variants=VARIANTS) -> dict:
        ray = self.ray
        geom_a, geom_b, direction = CASES[name]
        geoms = (geom_a, geom_b)
        actors = self.configure(geoms, AXES, TOKEN)
        s_stage, r_stage = (0, 1) if direction == "forward" else (1, 0)
        senders, receivers, src, dst = actors[s_stage], actors[r_stage], geoms[s_stage], geoms[r_stage]
        plan = edge_plan(src, dst, AXES, shape, np.float32)
        ray.get([x.prepare.remote(seed, shape, r_stage) for x in senders]
                + [x.expect_seed.remote(seed) for x in receivers], timeout=TIMEOUT)

        def once(variant: str, key: tuple, verify: bool = False) -> dict:
            rrefs = [x.timed_recv.remote(key, shape, s_stage, variant, verify) for x in receivers]
            if not all(ray.get([x.wait_armed.options(concurrency_group="io").remote(TIMEOUT)
                                for x in receivers], timeout=TIMEOUT)):
                raise TimeoutError(f"{name}: receivers never started waiting")
            sent = ray.get([x.timed_send.remote(key, r_stage, variant) for x in senders], timeout=TIMEOUT)
            got = ray.get(rrefs, timeout=TIMEOUT)
            t0 = min(s["t0"] for s in sent)
            return {"total_s": max(g["t_end"] for g in got) - t0,
                    "send_s": max(s["send_s"] for s in sent),
                    "arrive_s": max(g["taken"] for g in got) - t0,
                    "build_s": max(g["t_end"] - g["taken"] for g in got),
                    "ok": all(g.get("ok", True) for g in got)}

        # warm-up, the first one verified: fresh TCP connections grow their windows, buffer pools
        # and the object store fill; every variant gets the same number of untimed moves
        checks = {v: once(v, (seed, "warm", v), verify=True) for v in variants}
        for w in range(WARMUP - 1):
            for v in variants:
                once(v, (seed, "warm", w, v))
        bad = [v for v, c in checks.items() if not c["ok"]]
        if bad:
            raise AssertionError(f"{name} {shape}: variants {bad} delivered wrong data")
        runs: dict = {v: [] for v in variants}
        for r in range(reps):
            for v in variants:
                runs[v].append(once(v, (seed, r, v)))
        med = {v: {k: _median([x[k] for x in runs[v]]) for k in ("total_s", "send_s", "arrive_s", "build_s")}
               for v in variants}
        mib = plan.cross_host_bytes / 2**20
        return {
            "case": name, "shape": list(shape), "mib": int(np.prod(shape)) * 4 / 2**20,
            "src": plan.src.describe(), "dst": plan.dst.describe(),
            "src_hosts": list(src.hosts), "dst_hosts": list(dst.hosts), "tiles": len(plan.tiles),
            "cross_host_bytes": plan.cross_host_bytes, "lower_bound_bytes": plan.lower_bound_bytes,
            "bytes_ratio": plan.cross_host_bytes / plan.lower_bound_bytes if plan.lower_bound_bytes else 1.0,
            "reps": reps, "median": med,
            "throughput_mib_s": {v: mib / med[v]["total_s"] for v in variants},
            "ratio": {v: med["raw"]["total_s"] / med[v]["total_s"] for v in variants if v != "raw"},
            "ratio_of_best": {v: min(x["total_s"] for x in runs["raw"]) / min(x["total_s"] for x in runs[v])
                              for v in variants if v != "raw"},
            "runs": runs,
        }


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def markdown(results: list[dict], meta: dict) -> str:
    variants = meta["variants"]
    moving = [v for v in variants if v != "raw"]
    lines = [f"# Reshard benchmark ({meta['mode']})", "",
             f"{meta['when']}; {meta['machine']}, load average {meta['load']} at start; jax {meta['jax']}, "
             f"ray {meta['ray']}; median of {meta['reps']} repeats; times in ms. ratio = raw time / variant "
             "time (throughput ratio; target >= 0.9); bytes/lb = cross_host_bytes / lower_bound_bytes "
             "(target 1.0). Variants are described in `benchmarks/reshard.py`; `socket` is what pipelines use.",
             "", "| case | MiB | tiles | bytes/lb | raw | " + " | ".join(f"{v} | ratio" for v in moving) + " |",
             "|---|---:|---:|---:|---:|" + "---:|---:|" * len(moving)]
    for r in results:
        m, q = r["median"], r["ratio"]
        lines.append(f"| {r['case']} | {r['mib']:.0f} | {r['tiles']} | {r['bytes_ratio']:.3f} | "
                     f"{_ms(m['raw']['total_s'])} | "
                     + " | ".join(f"{_ms(m[v]['total_s'])} | **{q[v]:.2f}**" if v == "socket"
                                  else f"{_ms(m[v]['total_s'])} | {q[v]:.2f}" for v in moving) + " |")
    lines += ["", "The same ratios from the best (fastest) repeat of each variant (less sensitive to other "
              "load), and where each variant's time goes (ms, medians): send = the sender's send call, "
              "arrive = t0 until the slowest receiver's mailbox take returned, build = take until the "
              "jax.Array was ready.", "",
              "| case | MiB | " + " | ".join(f"{v} best" for v in moving) + " | "
              + " | ".join(f"{v} send / arrive / build" for v in variants) + " |",
              "|---|---:|" + "---:|" * (len(moving) + len(variants))]
    for r in results:
        m = r["median"]
        lines.append(f"| {r['case']} | {r['mib']:.0f} | "
                     + " | ".join(f"{r['ratio_of_best'][v]:.2f}" for v in moving) + " | "
                     + " | ".join(f"{_ms(m[v]['send_s'])} / {_ms(m[v]['arrive_s'])} / {_ms(m[v]['build_s'])}"
                                  for v in variants) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    import os

    import jax
    import ray

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16 MiB only, 5 repeats")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated variants (raw is always run)")
    args = ap.parse_args(argv)
    sizes = [(2048, 2048)] if args.quick else [(2048, 2048), (4096, 4096)]
    reps = 5 if args.quick else 7
    names = [n.strip() for n in args.cases.split(",") if n.strip()] or list(CASES)
    variants = tuple(dict.fromkeys([v.strip() for v in args.variants.split(",") if v.strip()] + ["raw"]))
    if set(variants) - set(VARIANTS):
        ap.error(f"unknown variants {sorted(set(variants) - set(VARIANTS))}; known: {list(VARIANTS)}")
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        ap.error(f"unknown cases {unknown}; known: {list(CASES)}")
    meta = {"mode": "quick" if args.quick else "full", "when": time.strftime("%Y-%m-%d %H:%M"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
            "load": " ".join(f"{x:.1f}" for x in os.getloadavg()),
            "jax": jax.__version__, "ray": ray.__version__, "reps": reps, "variants": variants}
    ray.init(address="local", num_cpus=8, include_dashboard=False, namespace="meshpipe-bench",
             logging_level="ERROR")
    results = []
    try:
        bench = Bench(ray)
        try:
            for shape in sizes:
                for i, name in enumerate(names):
                    t = time.perf_counter()
                    results.append(bench.run_case(name, shape, reps, seed=100 + i, variants=variants))
                    q = results[-1]["ratio"]
                    print(f"  {name:22s} {results[-1]['mib']:3.0f} MiB  "
                          + "  ".join(f"{v} {x:.2f}" for v, x in q.items())
                          + f"  ({time.perf_counter() - t:.1f} s)", flush=True)
        finally:
            bench.close()
    finally:
        ray.shutdown()
    md = markdown(results, meta)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "reshard.quick" if args.quick else "reshard"
    (RESULTS / f"{stem}.md").write_text(md)
    (RESULTS / f"{stem}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(md)


if __name__ == "__main__":
    main()
