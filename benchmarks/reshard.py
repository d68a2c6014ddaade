"""Cross-mesh reshard throughput: the pipeline's RayTransport beside a raw object-store push.

Run:  python -m benchmarks.reshard [--quick] [--cases NAME,NAME]
Writes benchmarks/results/reshard.{md,json} (--quick: reshard.quick.{md,json}) and prints the markdown.

For every case (two stage geometries, a float32 tensor with logical axes
("batch", "embed")) and size (16 MiB, 64 MiB; --quick: 16 MiB, 3 repeats),
between the same sender and receiver actors (`stages.reshard_probe`), the
median over repeats of the time from the sender's first instruction to the
receiver holding its result (one monotonic clock: the actors share a machine):

  transport  `RayTransport.send` / `.recv` exactly as a stage runs them: the
             sender reads its shards, `pack`s the tiles per destination host and
             pushes them as ONE call argument; the receiver takes them from its
             mailbox, `assemble`s, `device_put`s and builds the jax.Array.
  raw        the same bytes per (source host, destination host) as ONE numpy
             buffer: sender `ray.put`, ref pushed into the receiver's mailbox,
             receiver `ray.get`. Moves bytes, builds nothing: the ceiling.
  fix        the transport's wire format and flow, with three local changes:
             the sender makes non-contiguous tiles contiguous before pushing them;
             the receiver assembles each DISTINCT destination block once, into a
             64-byte aligned buffer that every device holding that block shares,
             and uses a received tile that is a whole destination shard as it is.
  proto-arg  prototype sender + the fix receiver: when one source host supplies
             all of a destination host's data (always so from a 1-host stage), the
             sender ships that host's distinct destination SHARDS, gathered into
             64-byte aligned buffers (a tile that already is a whole contiguous
             shard is shipped as is); otherwise the tiles, made contiguous. One
             call argument per destination host, as now.
  proto-put  the same, but the sender `ray.put`s the payload and pushes the ref.

Why these: on XLA:CPU `device_put` of a 64-byte aligned C-contiguous numpy
array aliases it (no copy), while an unaligned one is copied, slowly; numpy's
allocator gives 16-byte alignment (so `assemble`'s output is aligned by luck),
Ray's object store gives 64. And Ray pickles a non-contiguous array in-band,
which costs extra copies on both ends and loses the alignment.

Columns: `ratio` = raw time / variant time (throughput ratio, target >= 0.9);
`bytes/lb` = plan.cross_host_bytes / plan.lower_bound_bytes (target 1.0). The
transport's time is split into send (sender: shards, pack, serialise + put),
arrive (t0 -> mailbox take returned, slowest receiver) and build (take -> jax.Array);
a separate profile re-runs each step on one payload.
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

from orchestrator.edges import StageGeom, edge_plan
from stages.mailbox import Mailbox
from stages.reshard_probe import ProbeSet, ReshardProbe, random_array

AXES = ("batch", "embed")
VARIANTS = ("transport", "raw", "fix", "proto-arg", "proto-put")
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


def _aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(n + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + n].view(dtype).reshape(shape)


def _zero_copy_ok(a: np.ndarray) -> bool:
    return a.flags.c_contiguous and a.ctypes.data % 64 == 0


def _groups(plan, dst_host: int) -> dict:
    """Destination devices on `dst_host` grouped by the global box they hold (replicas share a group)."""
    from orchestrator.reshard import shard_boxes

    boxes = shard_boxes(plan.dst, plan.shape)
    groups: dict = {}
    for d in plan.dst.devices_on(dst_host):
        groups.setdefault(boxes[d], []).append(d)
    return groups


def assemble_fast(plan, dst_host: int, received: dict) -> dict:
    """`reshard.assemble`, the fix's way: whole-shard tiles used as they arrived; every other
    distinct destination block assembled once, into a 64-byte aligned buffer its devices share."""
    tiles = plan.recvs.get(dst_host, ())
    arrays = [a for s in sorted(plan.sends) for a in received.get(s, ())]
    if len(arrays) != len(tiles):
        raise ValueError(f"host {dst_host} expects {len(tiles)} tiles, got {len(arrays)}")
    out: dict = {}
    for tile, array in zip(tiles, arrays):
        if tile.shape == plan.dst_shard_shape and _zero_copy_ok(array):
            for dev, _ in tile.targets:
                out[dev] = array
    whole = set(out)
    rep = {}
    for devs in _groups(plan, dst_host).values():
        if devs[0] not in whole:
            buf = _aligned_empty(plan.dst_shard_shape, plan.dtype)
            for d in devs:
                out[d], rep[d] = buf, d == devs[0]
    for tile, array in zip(tiles, arrays):
        for dev, where in tile.targets:
            if rep.get(dev):
                out[dev][where] = array
    return out


def ship_shards(plan, src_host: int, dst_host: int, shards: dict) -> tuple:
    """Prototype payload for `dst_host`: its distinct destination shards when `src_host` supplies them all.

    Returns ("shards", [(dst devices, array)]) — one aligned array per distinct
    destination block on `dst_host` (a tile that is a whole contiguous shard is
    used as is) — or ("tiles", [contiguous tile arrays]) in plan order.
    """
    from orchestrator.reshard import pack

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
            buf = _aligned_empty(plan.dst_shard_shape, plan.dtype)
            for a, where in pieces:
                buf[where] = a
        out.append((tuple(devs), buf))
    return ("shards", out)


def local_shards(plan, dst_host: int, received: dict) -> dict:
    """Receiver side of the prototype: dst device -> numpy shard, from tiles or shipped shards."""
    shipped = [p for p in received.values() if isinstance(p, tuple) and p[0] == "shards"]
    if shipped:
        return {d: a for devs, a in shipped[0][1] for d in devs}
    return assemble_fast(plan, dst_host, {s: p[1] if isinstance(p, tuple) else p for s, p in received.items()})


class TimedMailbox(Mailbox):
    """A Mailbox that notes when each take returned and keeps the last payloads (for profiling)."""

    def __init__(self, owner: str):
        super().__init__(owner)
        self.taken_at: dict = {}
        self.kept: dict = {}

    def take(self, key, timeout):
        value = super().take(key, timeout)
        self.taken_at[key] = time.perf_counter()
        self.kept[key[-1]] = value
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
                buf = _aligned_empty((nbytes,), np.uint8)
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

        from orchestrator.reshard import pack

        key = tuple(key)
        t0 = time.perf_counter()
        if variant == "transport":
            self.transport.send(key, self._array, self.edge(to_stage))
        elif variant == "raw":
            for dst_host, buf in self._raw.items():
                self._push(to_stage, dst_host, key, [ray.put(buf)])
        else:
            plan = self._plan(to_stage, self._array.shape, sending=True)
            me = self.transport.me
            by_device = {self.transport.flat[s.device.id]: s for s in self._array.addressable_shards}
            for dst_host, tiles in plan.sends.get(me, {}).items():
                if not tiles:
                    continue
                shards = {d: np.asarray(by_device[d].data) for d in {t.src_device for t in tiles}}
                if variant == "fix":
                    payload = [p if p.flags.c_contiguous else np.ascontiguousarray(p)
                               for p in pack(plan, me, dst_host, shards)]
                else:
                    payload = ship_shards(plan, me, dst_host, shards)
                self._push(to_stage, dst_host, key, [ray.put(payload)] if variant == "proto-put" else payload)
        t1 = time.perf_counter()
        self.transport.flush(TIMEOUT)
        if self._inflight:
            ray.get(self._inflight, timeout=TIMEOUT)
            self._inflight.clear()
        return {"t0": t0, "send_s": t1 - t0}

    def profile_send(self, to_stage: int, reps: int = 3) -> dict:
        """Sender steps one by one (medians, summed over destination hosts).

        pack: read shards and cut tile views (the transport); put: serialise the
        transport's payload into the object store (what a call argument costs);
        contig / contig_put: the fix's sender (non-contiguous tiles copied first, then put);
        gather / gather_put: the prototype's `ship_shards`, then put.
        """
        import ray

        from orchestrator.reshard import pack

        plan = self._plan(to_stage, self._array.shape, sending=True)
        me = self.transport.me
        by_device = {self.transport.flat[s.device.id]: s for s in self._array.addressable_shards}
        steps = ("pack_s", "put_s", "contig_s", "contig_put_s", "gather_s", "gather_put_s")
        out: dict = {k: [] for k in steps}
        noncontig = 0
        for _ in range(reps):
            ts = dict.fromkeys(steps, 0.0)
            for dst_host, tiles in plan.sends.get(me, {}).items():
                if not tiles:
                    continue
                t = [time.perf_counter()]
                shards = {d: np.asarray(by_device[d].data) for d in {x.src_device for x in tiles}}
                payload = pack(plan, me, dst_host, shards)
                t.append(time.perf_counter())
                ref = ray.put(payload)
                t.append(time.perf_counter())
                noncontig = sum(not p.flags.c_contiguous for p in payload)
                del ref
                t.append(time.perf_counter())
                contig = [p if p.flags.c_contiguous else np.ascontiguousarray(p) for p in payload]
                t.append(time.perf_counter())
                ref = ray.put(contig)
                t.append(time.perf_counter())
                del ref, contig, payload
                t.append(time.perf_counter())
                proto = ship_shards(plan, me, dst_host, shards)
                t.append(time.perf_counter())
                ref = ray.put(proto)
                t.append(time.perf_counter())
                del ref, proto
                ts["pack_s"] += t[1] - t[0]
                ts["put_s"] += t[2] - t[1]
                ts["contig_s"] += t[4] - t[3]
                ts["contig_put_s"] += t[5] - t[4]
                ts["gather_s"] += t[7] - t[6]
                ts["gather_put_s"] += t[8] - t[7]
            for k, v in ts.items():
                out[k].append(v)
        return {**{k: _median(v) for k, v in out.items()}, "noncontig_tiles": noncontig}

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
        self.inbox.kept.clear()
        self._armed.set()
        try:
            if variant == "transport":
                array = self.transport.recv(key, shape, np.float32, sharding, self.edge(from_stage), TIMEOUT)
            else:
                plan = self._plan(from_stage, shape, sending=False)
                me = self.transport.me
                received = {}
                for src, per_dst in plan.sends.items():
                    if per_dst.get(me):
                        got = self.inbox.take((*key, src), TIMEOUT)
                        received[src] = ray.get(got[0]) if variant in ("raw", "proto-put") else got
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
            out["aliased"] = sum(np.shares_memory(np.asarray(s.data), np.asarray(s2.data))
                                 for s in array.addressable_shards for s2 in array.addressable_shards
                                 if s is not s2)
        return out

    def expect_seed(self, seed: int) -> None:
        """The seed the next verified receive is checked against."""
        self._verify_seed = seed

    def profile_recv(self, shape, from_stage: int, reps: int = 3) -> dict:
        """Receiver steps on the last transport payload (medians): the transport's and the fix's."""
        import jax

        from orchestrator.reshard import assemble

        plan = self._plan(from_stage, tuple(shape), sending=False)
        me = self.transport.me
        received = dict(self.inbox.kept)
        sharding = self.sharding()
        out: dict = {k: [] for k in ("assemble_s", "device_put_s", "make_array_s", "aligned_frac",
                                     "fix_assemble_s", "fix_device_put_s")}
        for _ in range(reps):
            t0 = time.perf_counter()
            local = assemble(plan, me, received)
            t1 = time.perf_counter()
            arrays = jax.block_until_ready([jax.device_put(local[i], d) for i, d in self.transport.local])
            t2 = time.perf_counter()
            jax.block_until_ready(jax.make_array_from_single_device_arrays(tuple(shape), sharding, arrays))
            t3 = time.perf_counter()
            out["aligned_frac"].append(np.mean([local[i].ctypes.data % 64 == 0 for i, _ in self.transport.local]))
            del local, arrays
            t4 = time.perf_counter()
            fixed = assemble_fast(plan, me, received)
            t5 = time.perf_counter()
            arrays = jax.block_until_ready([jax.device_put(fixed[i], d) for i, d in self.transport.local])
            t6 = time.perf_counter()
            del fixed, arrays
            for k, v in zip(("assemble_s", "device_put_s", "make_array_s", "fix_assemble_s", "fix_device_put_s"),
                            (t1 - t0, t2 - t1, t3 - t2, t5 - t4, t6 - t5)):
                out[k].append(v)
        self.inbox.kept.clear()
        return {k: _median(v) for k, v in out.items()}


class Bench(ProbeSet):
    """The actors: "a" (8 devices), "b" (8 devices), "pair" (2 hosts × 2 devices, jax.distributed)."""

    def __init__(self, ray):
        super().__init__(ray, BenchProbe, TIMEOUT)
        self.start()
        ray.get([x.warm_store.remote(256) for x in (self.a, self.b, *self.pair)], timeout=TIMEOUT)

    def run_case(self, name: str, shape: tuple, reps: int, seed: int) -> dict:
        ray = self.ray
        geom_a, geom_b, direction = CASES[name]
        a, b = [self.a], (self.pair if len(geom_b.hosts) == 2 else [self.b])
        geoms, actors = (geom_a, geom_b), (a, b)
        ray.get([x.configure.remote(geoms, stage, i, AXES, actors)
                 for stage, row in enumerate(actors) for i, x in enumerate(row)], timeout=TIMEOUT)
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
                    "ok": all(g.get("ok", True) for g in got),
                    "aliased_shards": sum(g.get("aliased", 0) for g in got)}

        checks = {v: once(v, (seed, "warm", v), verify=True) for v in VARIANTS}
        bad = [v for v, c in checks.items() if not c["ok"]]
        if bad:
            raise AssertionError(f"{name} {shape}: variants {bad} delivered wrong data")
        runs: dict = {v: [] for v in VARIANTS}
        for r in range(reps):
            for v in VARIANTS:
                runs[v].append(once(v, (seed, r, v)))
        # profile the transport's steps on one more transport payload
        rrefs = [x.timed_recv.remote((seed, "prof"), shape, s_stage, "transport") for x in receivers]
        ray.get([x.wait_armed.options(concurrency_group="io").remote(TIMEOUT) for x in receivers],
                timeout=TIMEOUT)
        ray.get([x.timed_send.remote((seed, "prof"), r_stage, "transport") for x in senders], timeout=TIMEOUT)
        ray.get(rrefs, timeout=TIMEOUT)
        prof_recv = ray.get([x.profile_recv.remote(shape, s_stage) for x in receivers], timeout=TIMEOUT)
        prof_send = ray.get([x.profile_send.remote(r_stage) for x in senders], timeout=TIMEOUT)

        med = {v: {k: _median([x[k] for x in runs[v]]) for k in ("total_s", "send_s", "arrive_s", "build_s")}
               for v in VARIANTS}
        mib = plan.cross_host_bytes / 2**20
        return {
            "case": name, "shape": list(shape), "mib": int(np.prod(shape)) * 4 / 2**20,
            "src": plan.src.describe(), "dst": plan.dst.describe(),
            "src_hosts": list(src.hosts), "dst_hosts": list(dst.hosts), "tiles": len(plan.tiles),
            "cross_host_bytes": plan.cross_host_bytes, "lower_bound_bytes": plan.lower_bound_bytes,
            "bytes_ratio": plan.cross_host_bytes / plan.lower_bound_bytes if plan.lower_bound_bytes else 1.0,
            "reps": reps, "median": med,
            "throughput_mib_s": {v: mib / med[v]["total_s"] for v in VARIANTS},
            "ratio": {v: med["raw"]["total_s"] / med[v]["total_s"] for v in VARIANTS if v != "raw"},
            "ratio_of_best": {v: min(x["total_s"] for x in runs["raw"]) / min(x["total_s"] for x in runs[v])
                              for v in VARIANTS if v != "raw"},
            "aliased_shard_pairs": {v: checks[v]["aliased_shards"] for v in VARIANTS if v != "raw"},
            "profile_send": _max_dicts(prof_send), "profile_recv": _max_dicts(prof_recv),
            "runs": runs,
        }


def _max_dicts(ds: list[dict]) -> dict:
    """Over the hosts of one side: the slowest host's figure for each step."""
    return {k: max(d[k] for d in ds) for k in ds[0]}


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def markdown(results: list[dict], meta: dict) -> str:
    others = [v for v in VARIANTS if v not in ("transport", "raw")]
    lines = [f"# Reshard benchmark ({meta['mode']})", "",
             f"{meta['when']}; {meta['machine']}, load average {meta['load']} at start; jax {meta['jax']}, "
             f"ray {meta['ray']}; median of {meta['reps']} repeats; times in ms. ratio = raw time / variant "
             "time (throughput ratio; target >= 0.9); bytes/lb = cross_host_bytes / lower_bound_bytes "
             "(target 1.0). Variants are described in `benchmarks/reshard.py`.", "",
             "| case | MiB | tiles | bytes/lb | raw | transport | **ratio** | "
             + " | ".join(f"{v} | ratio" for v in others) + " |",
             "|---|---:|---:|---:|---:|---:|---:|" + "---:|---:|" * len(others)]
    for r in results:
        m, q = r["median"], r["ratio"]
        lines.append(f"| {r['case']} | {r['mib']:.0f} | {r['tiles']} | {r['bytes_ratio']:.3f} | "
                     f"{_ms(m['raw']['total_s'])} | {_ms(m['transport']['total_s'])} | **{q['transport']:.2f}** | "
                     + " | ".join(f"{_ms(m[v]['total_s'])} | {q[v]:.2f}" for v in others) + " |")
    lines += ["", "The same ratios from the best (fastest) of the repeats of each variant — less sensitive to "
              "other load on the machine:", "",
              "| case | MiB | " + " | ".join(v for v in VARIANTS if v != "raw") + " |",
              "|---|---:|" + "---:|" * (len(VARIANTS) - 1)]
    for r in results:
        lines.append(f"| {r['case']} | {r['mib']:.0f} | "
                     + " | ".join(f"{r['ratio_of_best'][v]:.2f}" for v in VARIANTS if v != "raw") + " |")
    lines += ["", "Where the transport's time goes (ms). send / arrive / build: medians of the timed "
              "transport runs (send = sender's `send` call; arrive = t0 until the slowest receiver's "
              "mailbox take returned; build = take until the jax.Array is ready). The rest: a step-by-step "
              "profile on one payload, slowest host: pack (read shards, cut tile views), put (serialise the "
              "transport's payload into the object store), assemble / device_put / make_array (the "
              "transport's receiver; `aligned` = share of assembled shards that happened to be 64-byte "
              "aligned, i.e. device_put without a copy), the fix's steps (sender: make tiles contiguous, "
              "put; receiver: assemble, device_put) and the prototype sender's gather and put.", "",
              "| case | MiB | send | arrive | build | pack | put | assemble | device_put | aligned | "
              "make_array | fix contiguous | fix put | fix assemble | fix device_put | proto gather | proto put |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        t, ps, pr = r["median"]["transport"], r["profile_send"], r["profile_recv"]
        lines.append(f"| {r['case']} | {r['mib']:.0f} | {_ms(t['send_s'])} | {_ms(t['arrive_s'])} | "
                     f"{_ms(t['build_s'])} | {_ms(ps['pack_s'])} | {_ms(ps['put_s'])} | "
                     f"{_ms(pr['assemble_s'])} | {_ms(pr['device_put_s'])} | {pr['aligned_frac']:.0%} | "
                     f"{_ms(pr['make_array_s'])} | {_ms(ps['contig_s'])} | {_ms(ps['contig_put_s'])} | "
                     f"{_ms(pr['fix_assemble_s'])} | {_ms(pr['fix_device_put_s'])} | "
                     f"{_ms(ps['gather_s'])} | {_ms(ps['gather_put_s'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    import os

    import jax
    import ray

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16 MiB only, 3 repeats")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    args = ap.parse_args(argv)
    sizes = [(2048, 2048)] if args.quick else [(2048, 2048), (4096, 4096)]
    reps = 3 if args.quick else 5
    names = [n.strip() for n in args.cases.split(",") if n.strip()] or list(CASES)
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        ap.error(f"unknown cases {unknown}; known: {list(CASES)}")
    meta = {"mode": "quick" if args.quick else "full", "when": time.strftime("%Y-%m-%d %H:%M"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
            "load": " ".join(f"{x:.1f}" for x in os.getloadavg()),
            "jax": jax.__version__, "ray": ray.__version__, "reps": reps}
    ray.init(address="local", num_cpus=8, include_dashboard=False, namespace="meshpipe-bench",
             logging_level="ERROR")
    results = []
    try:
        bench = Bench(ray)
        try:
            for shape in sizes:
                for i, name in enumerate(names):
                    t = time.perf_counter()
                    results.append(bench.run_case(name, shape, reps, seed=100 + i))
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
