"""The stage transports side by side: per-edge GB/s, the compute thread's time per SEND, the `large` step.

Run:  python -m benchmarks.transport [--quick] [--no-step]
Writes benchmarks/results/transport.{json,md} (--quick: transport.quick.{json,md}) and prints the markdown.

Edges (`EdgeProbe`, two Ray actors of 2 simulated CPU devices each, one JAX world of two processes
joined as `transport: xla` joins it, so every transport runs between the same two processes): a
float32 (rows, 1024) tensor, axes (batch, embed), {data: 2} -> {data: 2} on the other process, at
1, 16 and 128 MiB. Transports, alternated within every repeat (each after WARMUP untimed moves):

  xla      `XlaTransport`: XLA's own transfer (on CPU its socket transfer library), one whole-array
           `device_put` (both sides cut the tensor alike);
  unix     `SocketTransport` as a stage on the same machine runs it: Unix socket, shared memory;
  tcp      the same with shared memory off: what peers on different machines do;
  ray      `RayTransport`: the tiles as one actor call per destination host.

Per move: the sender stamps t0 (monotonic: the actors share a machine) and calls `send`; the time
inside that call is the compute thread's `blocked_s`; then it flushes. The receiver's `recv` returns
the jax.Array with every shard ready and stamps t1. `wire_s` = t1 - t0, GB/s = bytes / wire_s,
`blocked/wire` = blocked_s / wire_s (target <= 0.05). Medians over repeats.

Step (`large`, 1F1B, m=8; `benchmarks.pipeline`'s job: 2 stages of one device, each actor pinned to
its own core through `cluster.pin_cpus`, affinity read back on the actors): the step period per
transport (`formulas.call_period_s`), runs alternated socket, xla, ray, socket, xla, ray.

Honesty: the machine's load before and after each part, the actors' affinity and the world's
listeners are recorded; a figure no sound measurement can produce (a negative or zero time, a
blocked time above the wire time, more than MAX_GBPS) fails the run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
SIZES_MIB = (1, 16, 128)
VARIANTS = ("xla", "unix", "tcp", "ray")
WARMUP = 2
MAX_GBPS = 200.0            # above any memory bandwidth of this kind of machine: a measurement error
TIMEOUT = 300.0
COLS = 1024


class EdgeProbe:
    """One process of a 2-process world: stage `me` of two {data: 2} stages, every transport built."""

    def __init__(self, me: int):
        self.me = me

    def join(self, coordinator: str) -> dict:
        from stages.jaxinit import join_world

        self.address = join_world(2, self.me, coordinator, "127.0.0.1", 120, who=f"probe {self.me}",
                                  transfer_timeout_s=TIMEOUT)
        return {"pid": os.getpid(), "affinity": sorted(os.sched_getaffinity(0))}

    def build(self, actors: list, token: bytes) -> dict:
        from orchestrator.core.edges import StageGeom
        from orchestrator.core.schedule.transfers import Transfer
        from stages.mailbox import Mailbox
        from stages.socket_transport import SocketTransport
        from stages.transport import Edge, RayTransport
        from stages.xla_transport import XlaTransport, stage_meshes

        self.geoms = [StageGeom.of({"data": 2}, (h,), 2, {"batch": "data"}) for h in (0, 1)]
        self.meshes = stage_meshes(self.geoms)
        self.inbox = Mailbox(f"probe {self.me}")
        self.actors = [[a] for a in actors]
        args = {"me": self.me, "geom": self.geoms[self.me], "mesh": self.meshes[self.me], "inbox": self.inbox,
                "peers": lambda s: self.actors[s]}
        self.transports = {"ray": RayTransport(**args)}
        for name, opts in (("unix", {}), ("tcp", {"shared_memory": False})):
            self.transports[name] = SocketTransport(**args, token=token, stage=self.me, geoms=self.geoms,
                                                    host="127.0.0.1", io_timeout=TIMEOUT, **opts)
        order = (Transfer("F", 0, 0, 0, 1, 0, 1),)
        self.xla = {}
        for mib in SIZES_MIB:
            rows = mib * 2**20 // (4 * COLS)
            self.xla[mib] = XlaTransport(me=self.me, stage=self.me, geoms=self.geoms, meshes=self.meshes,
                                         programs={"F": order, "E": ()}, io_timeout=TIMEOUT,
                                         leaves=lambda b, k, r=rows: [(0, (r, COLS), np.dtype(np.float32),
                                                                       ("batch", "embed"))])
        self.xla[SIZES_MIB[0]].warm_up(TIMEOUT)
        self.edge = Edge(1 - self.me, self.geoms[1 - self.me], ("batch", "embed"))
        if self.me == 1:
            for mib in SIZES_MIB:
                for name in ("unix", "tcp"):
                    self.transports[name].expect(self.edge, (mib * 2**20 // (4 * COLS), COLS), np.float32)
        return {name: t.address for name, t in self.transports.items() if name != "ray"}

    def connect(self, addresses: dict) -> None:
        for name, rows in addresses.items():
            self.transports[name].connect(rows)

    def deliver(self, key, payload) -> None:
        self.inbox.put(key, payload)

    def _array(self, mib: int, seed: int):
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        rows = mib * 2**20 // (4 * COLS)
        host = np.random.default_rng(seed).standard_normal((rows, COLS), dtype=np.float32)
        sharding = NamedSharding(self.meshes[self.me], PartitionSpec("data"))
        return host, jax.block_until_ready(jax.make_array_from_callback(host.shape, sharding, lambda i: host[i]))

    def send(self, variant: str, mib: int, step: int) -> dict:
        _, array = self._array(mib, step)
        t = self.xla[mib] if variant == "xla" else self.transports[variant]
        key = (step, "F", 0, 0, 0)
        if variant == "xla":
            t.begin(step, "F")
        t0 = time.monotonic()
        t.send(key, array, self.edge)
        blocked = time.monotonic() - t0
        t.flush(TIMEOUT)
        return {"t0": t0, "blocked_s": blocked}

    def recv(self, variant: str, mib: int, step: int, check: bool) -> dict:
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        rows = mib * 2**20 // (4 * COLS)
        sharding = NamedSharding(self.meshes[self.me], PartitionSpec("data"))
        t = self.xla[mib] if variant == "xla" else self.transports[variant]
        key = (step, "F", 0, 0, 0)
        if variant == "xla":
            t.begin(step, "F")
        got = jax.block_until_ready(t.recv(key, (rows, COLS), np.float32, sharding, self.edge, TIMEOUT))
        t1 = time.monotonic()
        ok = None
        if check:
            want, _ = self._array(mib, step)
            ok = all(np.array_equal(np.asarray(s.data), want[s.index]) for s in got.addressable_shards)
        if variant == "xla":
            t.flush(TIMEOUT)
        return {"t1": t1, "ok": ok}

    def listeners(self) -> list[str]:
        import psutil

        return sorted(f"{c.laddr.ip}:{c.laddr.port}" for c in psutil.Process().net_connections(kind="inet")
                      if c.status == psutil.CONN_LISTEN)


def measure_edges(ray, repeats: int, sizes=SIZES_MIB) -> dict:
    from stages.jaxinit import reserve_port

    remote = ray.remote(concurrency_groups={"io": 4})(EdgeProbe)
    env = {"env_vars": {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}}
    actors = [remote.options(num_cpus=0.5, max_restarts=0, runtime_env=env).remote(i) for i in (0, 1)]
    try:
        address, held = reserve_port("127.0.0.1")
        held.close()
        joined = ray.get([a.join.remote(address) for a in actors], timeout=TIMEOUT)
        token = os.urandom(32)
        got = ray.get([a.build.remote(actors, token) for a in actors], timeout=TIMEOUT)
        addresses = {name: [[g[name]] for g in got] for name in got[0]}
        ray.get([a.connect.remote(addresses) for a in actors], timeout=TIMEOUT)
        listeners = ray.get([a.listeners.remote() for a in actors], timeout=TIMEOUT)
        rows, step = [], 0
        for mib in sizes:
            samples = {v: [] for v in VARIANTS}
            for rep in range(WARMUP + repeats):
                for v in (VARIANTS if rep % 2 == 0 else VARIANTS[::-1]):       # alternated
                    step += 1
                    r = actors[1].recv.remote(v, mib, step, rep in (0, WARMUP + repeats - 1))
                    s = actors[0].send.remote(v, mib, step)
                    sent, recvd = ray.get([s, r], timeout=TIMEOUT)
                    if recvd["ok"] is False:
                        raise RuntimeError(f"{v} {mib} MiB: wrong data arrived")
                    if rep >= WARMUP:
                        samples[v].append((recvd["t1"] - sent["t0"], sent["blocked_s"]))
            for v in VARIANTS:
                wire = statistics.median(w for w, _ in samples[v])
                blocked = statistics.median(b for _, b in samples[v])
                rows.append({"variant": v, "mib": mib, "wire_s": wire, "blocked_s": blocked,
                             "gbps": mib * 2**20 / wire / 1e9, "blocked_over_wire": blocked / wire,
                             "samples": samples[v]})
        return {"rows": rows, "actors": joined, "listeners": listeners}
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)


def measure_steps(rounds: int, steps: int, warmup: int) -> list[dict]:
    """The `large` 1F1B step per transport, runs alternated (module docstring)."""
    from benchmarks.common import SIZES
    from benchmarks.formulas import call_period_s
    from benchmarks.pipeline import CLUSTER, job_dict
    from orchestrator.core.config import check_job, parse_cluster, parse_job
    from orchestrator.core.plan import make_plan
    from orchestrator.driver.executor import PipelineExecutor

    size, out = SIZES["large"], []
    for r in range(rounds):
        for transport in ("socket", "xla", "ray"):
            name = f"bench-transport-{transport}-{r}"
            checked = check_job(parse_job(job_dict(size, "1f1b", 8, warmup + steps, name)),
                                parse_cluster({**CLUSTER, "pin_cpus": True, "transport": transport}))
            plan = make_plan(checked)
            ex = PipelineExecutor(checked, plan.schedule, checked.data, name)
            walls, affinity, load = [], {}, os.getloadavg()
            try:
                ex.start()
                for res in ex.steps(warmup + steps):
                    if res.step >= warmup:
                        walls.append(res.wall_s)
                    for st in res.stats:
                        if "affinity" in st:
                            affinity[f"stage{st['stage']}"] = st["affinity"]
            finally:
                ex.shutdown()
            out.append({"transport": transport, "round": r, "step_s": call_period_s(walls, warmup,
                        checked.cluster.calls_of_steps), "walls_s": walls, "affinity": affinity,
                        "load_before": load, "load_after": os.getloadavg(),
                        "workers": sorted({w["transport"] for w in ex.info})})
    return out


def check(result: dict) -> None:
    """Refuse figures no sound measurement produces (module docstring)."""
    for row in result["edges"]["rows"]:
        if not 0 < row["wire_s"] or row["gbps"] > MAX_GBPS or not 0 <= row["blocked_s"] <= row["wire_s"]:
            raise SystemExit(f"impossible edge figure, not published: {row}")
    for row in result.get("steps", []):
        if not row["step_s"] or row["step_s"] <= 0:
            raise SystemExit(f"impossible step figure, not published: {row}")
        if len({tuple(a) for a in row["affinity"].values()}) != len(row["affinity"]):
            raise SystemExit(f"the stage actors were not pinned to distinct cores: {row}")


def markdown(result: dict) -> str:
    lines = [f"# Stage transports side by side ({result['when']}, {result['machine']})", "",
             (f"load before/after edges: {result['load_edges']}; jax {result['versions']['jax']}, "
              f"ray {result['versions']['ray']}"), "",
             "| transport | MiB | wire ms | GB/s | SEND blocked µs | blocked / wire |", "|---|---|---|---|---|---|"]
    for r in result["edges"]["rows"]:
        lines.append(f"| {r['variant']} | {r['mib']} | {1e3 * r['wire_s']:.2f} | {r['gbps']:.2f} | "
                     f"{1e6 * r['blocked_s']:.0f} | {r['blocked_over_wire']:.4f} |")
    if result.get("steps"):
        lines += ["", "`large` 1F1B m=8, step period (s), runs alternated:", "",
                  "| transport | round | step s | load before | affinity |", "|---|---|---|---|---|"]
        for r in result["steps"]:
            lines.append(f"| {r['transport']} | {r['round']} | {r['step_s']:.4f} | "
                         f"{', '.join(f'{x:.1f}' for x in r['load_before'])} | {r['affinity']} |")
        by = {}
        for r in result["steps"]:
            by.setdefault(r["transport"], []).append(r["step_s"])
        lines += ["", "median step per transport: " + ", ".join(
            f"{t} {statistics.median(v):.4f} s" for t, v in by.items())]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-step", action="store_true")
    args = ap.parse_args()
    import jax
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    try:
        load0 = os.getloadavg()
        edges = measure_edges(ray, 3 if args.quick else 7, SIZES_MIB)
        result = {"when": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{os.cpu_count()} cores, {platform.machine()}",
                  "versions": {"jax": jax.__version__, "ray": ray.__version__},
                  "load_edges": [load0, os.getloadavg()], "edges": edges}
        if not args.no_step:
            result["steps"] = measure_steps(1 if args.quick else 2, 6 if args.quick else 10, 3)
    finally:
        ray.shutdown()
    check(result)
    stem = "transport.quick" if args.quick else "transport"
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (RESULTS / f"{stem}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
