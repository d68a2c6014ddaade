"""`meshpipe calibrate`'s probe actor: time one host's devices, its mesh's collectives, and sends.

One `CalibrationProbe` runs per cluster host, in the same kind of process a stage
actor runs in (the driver gives it the backend's environment: simulated device
count, platform), so what it times is what the stage programs see.

Basic flow (driven by `orchestrator.driver.calibrate`):
  1. `device()` — jitted programs over ALL of the host's devices at once, sharded
     the way a stage program is (one shard per device): a batched N×N matmul
     (per-device FLOP/s = 2N³ / time) and an elementwise `x·a + b` over a large
     array (per-device bytes/s = 2 × shard bytes / time); also a one-device matmul
     and a tiny sharded program's dispatch time, for the record; and two chains of
     tiny dots and tanhs, `KERNEL_CHAIN` and 4× as long (`kernels_short`, `kernels_long`:
     their kernel counts from the compiled HLO, `count_kernels`), whose time difference per
     kernel is one kernel's own cost (`planner.calibrate.fit_kernel_time`). The same programs
     timed on every host at once: `prepare_device()` on each (build, compile, warm up),
     then `time_device(which, start_at)` on each, which sleeps until the wall-clock
     `start_at` the driver gives them all and repeats the program for at least
     `min_s` (the median of the repetitions; the start and end come back so the driver
     can check the hosts' windows overlapped; across machines the clocks' skew shifts them).
     And a program shaped like a small stage's forward (`stage_sized`: residual MLP blocks
     of 64 × 64 and 64 × 256 matmuls per device), timed the same two ways: its all-busy ÷
     alone time is `device.shared_slowdown`, what simulated hosts sharing cores cost each
     other at stage scale (`planner.topology`).
  2. `collectives(sizes)` — all-reduce and all-gather over the host's devices at
     each size (bytes per device, the convention of `planner.topology`), through
     `shard_map`; the driver fits α-β to them (`planner.calibrate.fit_alpha_beta`); and one
     all-reduce of `COMBINED` arrays of 4 KiB each (one `psum` of a tuple: one combined op, as
     XLA makes of a backward's gradient all-reduces), whose growth with the count is fitted
     apart (`planner.calibrate.fit_per_array`).
     Across hosts, a fresh pair of probes placed as one 2-host stage's actors first
     joins one JAX world exactly as a multi-host stage does (`coordinator_address` on
     the first, then `join` on both: `stages.jaxinit`, gloo on CPU); `collectives`
     then runs over the mesh of both hosts' devices (k = all of them) and, with more
     than one device per host, over its host axis alone (k = 2, one group per local
     device, all at once) — what a mesh axis spanning hosts does in a stage program.
  3. `open_transport(...)` / `connect(...)` / `expect_sends(...)` / `pingpong(...)` — meshpipe's own socket
     transport (`stages.socket_transport`, the stage-to-stage path) between two probes,
     one-device "stages" on each side; a tensor goes A → B and back, so one send is
     half the round trip.
Each timing is the median of a few repetitions after one warm-up (compile) run;
receives wait at most `timeout` seconds. `close()` releases the transport.
"""
from __future__ import annotations

import os
import statistics
import time

__all__ = ["CalibrationProbe", "KERNEL_CHAIN", "COMBINED"]

KERNEL_CHAIN = 32       # dot + tanh pairs in the short kernel chain (the long one: 4×)
COMBINED = (1, 4, 16)   # arrays in one combined all-reduce (`_sweep`)
COMBINED_BYTES = 4096   # bytes per device of each of them
STAGE_ROWS, STAGE_WIDTH, STAGE_BLOCKS = 64, 64, 8    # the stage-sized program (`_stage_sized`)


def _median_time(fn, reps: int) -> float:
    fn()                                   # compile / warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class CalibrationProbe:
    """One host's probe (see the module docstring). `host`: the cluster host index; `pin`: the
    cluster's `pin_cpus` — pin this process to core (host mod cores) before jax loads, as a stage
    actor of that host pins itself (`stages.worker`), so the probe times what the stages will get."""

    def __init__(self, host: int, pin: bool = False):
        self.host = host
        if pin:
            cores = sorted(os.sched_getaffinity(0))
            os.sched_setaffinity(0, {cores[host % len(cores)]})
        self.transport = None
        self._held = None          # the first probe of a 2-host world: the socket holding its coordinator port

    # -- one JAX world over two hosts (module doc, step 2) ---------------------------------
    def coordinator_address(self) -> str:
        """Reserve the JAX world's coordinator port on this node (as a stage's host 0 does)."""
        import ray

        from stages.jaxinit import reserve_port

        if self._held is not None:
            self._held.close()
        address, self._held = reserve_port(ray.util.get_node_ip_address())
        return address

    def join(self, hosts: int, index: int, coordinator: str, timeout: float) -> dict:
        """Join the `hosts`-process JAX world as process `index` (`stages.jaxinit.initialize`); `info()`."""
        from stages.jaxinit import initialize

        held, self._held = self._held, None
        initialize(hosts, index, coordinator, timeout, who=f"calibration probe host {self.host}", reservation=held)
        return self.info()

    def info(self) -> dict:
        import jax

        return {"host": self.host, "pid": os.getpid(), "devices": len(jax.devices()),
                "platform": jax.devices()[0].platform, "affinity": sorted(os.sched_getaffinity(0))}

    def _mesh(self):
        import jax
        import numpy as np
        from jax.sharding import Mesh

        return Mesh(np.array(jax.devices()), ("d",))

    @staticmethod
    def _ones(shape, sharding):
        """A float32 array of ones with this (possibly multi-process) sharding; each process makes its own shards."""
        import jax
        import numpy as np

        return jax.make_array_from_callback(shape, sharding, lambda idx: np.ones(shape, np.float32)[idx])

    def prepare_device(self, n: int = 384, elems: int = 1 << 22) -> dict:
        """Build, compile and warm up `device()`'s sharded matmul and elementwise programs; their sizes."""
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P

        mesh = self._mesh()
        k = mesh.devices.size
        sh = NamedSharding(mesh, P("d"))
        a = jax.device_put(jnp.ones((k, n, n), jnp.float32) * 0.5, sh)
        b = jax.device_put(jnp.ones((k, n, n), jnp.float32) * 0.25, sh)
        mm = jax.jit(lambda x, y: jnp.einsum("kij,kjl->kil", x, y), out_shardings=sh)
        x = jax.device_put(jnp.ones((k, elems), jnp.float32), sh)
        ew = jax.jit(lambda v: v * 1.5 + 1.0, out_shardings=sh)
        self._programs = {"matmul": lambda: mm(a, b).block_until_ready(),
                          "elementwise": lambda: ew(x).block_until_ready()}
        counts = []
        for name, links in (("kernels_short", KERNEL_CHAIN), ("kernels_long", 4 * KERNEL_CHAIN)):
            fn, nk = self._chain(mesh, links)
            self._programs[name] = fn
            counts.append(nk)
        self._programs["stage_sized"] = self._stage_sized(mesh)
        for fn in self._programs.values():
            fn()                                                   # compile / warm-up
        self._device_arrays = (a, b, sh)
        return {"devices": k, "matmul_n": n, "elementwise_bytes_per_device": 8 * elems, "kernel_counts": counts}

    @staticmethod
    def _stage_sized(mesh):
        """A program shaped like a small stage's forward: `STAGE_BLOCKS` residual MLP blocks
        x + tanh(x W₁) W₂ over `STAGE_ROWS` rows per device (the batch sharded over the mesh),
        width `STAGE_WIDTH`, 4× in the middle; run it."""
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P

        k = mesh.devices.size
        sh, rep = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())
        x = jax.device_put(jnp.full((k * STAGE_ROWS, STAGE_WIDTH), 0.1, jnp.float32), sh)
        w1 = jax.device_put(jnp.full((STAGE_WIDTH, 4 * STAGE_WIDTH), 0.01, jnp.float32), rep)
        w2 = jax.device_put(jnp.full((4 * STAGE_WIDTH, STAGE_WIDTH), 0.01, jnp.float32), rep)

        def blocks(v, a, b):
            for _ in range(STAGE_BLOCKS):
                v = v + jnp.tanh(v @ a) @ b
            return v

        fn = jax.jit(blocks, out_shardings=sh)
        return lambda: fn(x, w1, w2).block_until_ready()

    @staticmethod
    def _chain(mesh, links: int):
        """A compiled chain of `links` tiny dot + tanh pairs over the mesh's devices (one shard each):
        (run it, its kernel count)."""
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P

        from orchestrator.core.planner.profile import count_kernels

        k = mesh.devices.size
        sh, rep = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())

        def chain(v, w):
            for _ in range(links):
                v = jnp.tanh(v @ w)
            return v

        v = jax.device_put(jnp.ones((4 * k, 16), jnp.float32), sh)
        w = jax.device_put(jnp.full((16, 16), 0.01, jnp.float32), rep)
        compiled = jax.jit(chain, out_shardings=sh).lower(v, w).compile()
        return (lambda: compiled(v, w).block_until_ready()), count_kernels(compiled.as_text())

    def time_device(self, which: str, start_at: float = 0.0, min_s: float = 0.3, reps: int = 5) -> dict:
        """Time a prepared program (`matmul` | `elementwise`) from wall-clock `start_at` (`time.time()`;
        0: now) for at least `reps` repetitions and `min_s` seconds; the median and the window."""
        fn = self._programs[which]
        wait = start_at - time.time()
        if wait > 0:
            time.sleep(wait)
        start = time.time()
        times = []
        while len(times) < reps or time.time() - start < min_s:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return {"which": which, "seconds": statistics.median(times), "reps": len(times), "start": start,
                "end": time.time(), "late_s": max(0.0, -wait)}

    def device(self, n: int = 384, elems: int = 1 << 22, reps: int = 5) -> dict:
        """Per-device matmul FLOP/s and memory bandwidth, all devices of this host busy at once, and
        seconds per kernel (module doc)."""
        import jax
        import jax.numpy as jnp

        from orchestrator.core.planner.calibrate import fit_kernel_time

        size = self.prepare_device(n, elems)
        k = size["devices"]
        t_mm = self.time_device("matmul", reps=reps)["seconds"]
        t_ew = self.time_device("elementwise", reps=reps)["seconds"]
        a, b, sh = self._device_arrays
        d0 = jax.devices()[0]
        a1, b1 = jax.device_put(a[0], d0), jax.device_put(b[0], d0)
        mm1 = jax.jit(lambda x, y: x @ y)
        t_one = _median_time(lambda: mm1(a1, b1).block_until_ready(), reps)
        t_kern = [_median_time(self._programs[w], max(reps, 20)) for w in ("kernels_short", "kernels_long")]
        t_stage = self.time_device("stage_sized", reps=max(reps, 20))["seconds"]
        tiny = jax.device_put(jnp.ones((k, 8), jnp.float32), sh)
        inc = jax.jit(lambda v: v + 1.0, out_shardings=sh)
        t_tiny = _median_time(lambda: inc(tiny).block_until_ready(), max(reps, 20))
        return {"devices": k, "matmul_n": n, "matmul_s": t_mm, "flops_per_device": 2 * n**3 / t_mm,
                "single_device_flops": 2 * n**3 / t_one, "elementwise_bytes_per_device": 8 * elems,
                "elementwise_s": t_ew, "bandwidth_per_device": 8 * elems / t_ew, "tiny_dispatch_s": t_tiny,
                "kernel_counts": size["kernel_counts"], "kernel_chain_s": t_kern,
                "kernel_s": fit_kernel_time(size["kernel_counts"], t_kern), "stage_sized_s": t_stage}

    def collectives(self, sizes: list[int], reps: int = 5) -> list[dict]:
        """[{kind, k, nbytes, seconds, axis}] for all-reduce and all-gather over every device of this
        JAX world (one host, or the hosts that `join`ed: axis "all") and, in a multi-process world
        with several devices per process, over the process axis alone (axis "hosts")."""
        import jax
        import numpy as np
        from jax.sharding import Mesh

        devices = np.array(jax.devices())
        procs = jax.process_count()
        meshes = [("all", Mesh(devices.reshape(-1, 1), ("d", "rest")))]
        if procs > 1 and devices.size > procs:      # host-major, as the stage worker checks
            meshes.append(("hosts", Mesh(devices.reshape(procs, -1), ("d", "rest"))))
        out = []
        for axis, mesh in meshes:
            out += [{**s, "axis": axis} for s in self._sweep(mesh, sizes, reps)]
        return out

    def _sweep(self, mesh, sizes: list[int], reps: int) -> list[dict]:
        """The sweep over mesh axis "d" (every group of it at once, one per index of "rest")."""
        import jax
        from jax.sharding import NamedSharding, PartitionSpec as P

        k, rest = mesh.shape["d"], mesh.shape["rest"]
        if k < 2:
            return []
        spec = P(("d", "rest"))
        sh = NamedSharding(mesh, spec)
        smap = getattr(jax, "shard_map", None)
        if smap is None:   # pragma: no cover - older jax
            from jax.experimental.shard_map import shard_map as smap
        ar = jax.jit(smap(lambda v: jax.lax.psum(v, "d"), mesh=mesh, in_specs=spec, out_specs=spec))
        ag = jax.jit(smap(lambda v: jax.lax.all_gather(v, "d", tiled=True), mesh=mesh, in_specs=spec,
                          out_specs=spec))
        out = []
        for nbytes in sizes:
            per = max(k, nbytes // 4 // k * k)                 # float32 elements per device, divisible by k
            x = self._ones((k * rest * per,), sh)                                  # all-reduce: per per device
            t = _median_time(lambda: ar(x).block_until_ready(), reps)
            out.append({"kind": "all-reduce", "k": k, "nbytes": 4 * per, "seconds": t})
            y = self._ones((rest * per,), sh)                                      # all-gather: result per
            t = _median_time(lambda: ag(y).block_until_ready(), reps)
            out.append({"kind": "all-gather", "k": k, "nbytes": 4 * per, "seconds": t})
        for n in COMBINED:     # one all-reduce of n arrays, as XLA combines a backward's gradient all-reduces
            per = max(k, COMBINED_BYTES // 4 // k * k)
            xs = [self._ones((k * rest * per,), sh) for _ in range(n)]
            arn = jax.jit(smap(lambda *v: jax.lax.psum(v, "d"), mesh=mesh, in_specs=(spec,) * n,
                               out_specs=(spec,) * n))
            t = _median_time(lambda: jax.block_until_ready(arn(*xs)), reps)
            out.append({"kind": "all-reduce", "k": k, "nbytes": 4 * per * n, "arrays": n, "seconds": t})
        return out

    # -- sends over meshpipe's socket transport --------------------------------------------
    def open_transport(self, stage: int, hosts: list[int], token: bytes, io_timeout: float):
        """A socket transport for probe-stage `stage` of the probe-stages on `hosts`; its address."""
        import jax
        import numpy as np
        from jax.sharding import Mesh

        from orchestrator.core.edges import StageGeom
        from stages.mailbox import Mailbox
        from stages.socket_transport import SocketTransport

        self.geoms = tuple(StageGeom.of({"data": 1}, [h], 1, {}) for h in hosts)
        self.stage = stage
        mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
        self.inbox = Mailbox(f"calibration probe host {self.host}")
        self.transport = SocketTransport(me=hosts[stage], geom=self.geoms[stage], mesh=mesh, inbox=self.inbox,
                                         peers=lambda s: [], token=token, stage=stage, geoms=self.geoms,
                                         io_timeout=io_timeout)
        return self.transport.address

    def connect(self, addresses: list[list]) -> None:
        self.transport.connect(addresses)

    def expect_sends(self, peer: int, sizes: list[int]) -> None:
        """Accept `pingpong`'s tensors of every size from probe-stage `peer`. Both sides call this,
        and the driver waits for both, BEFORE either starts `pingpong`: a tensor that arrives
        before its receiver expects it closes the connection (`SocketTransport.expect`), and
        expecting each size only as its turn came raced the sender's next size."""
        import numpy as np

        from stages.transport import Edge

        for nbytes in sizes:
            self.transport.expect(Edge(peer, self.geoms[peer], (None,)), (max(1, nbytes // 4),), np.float32)

    def pingpong(self, peer: int, first: bool, sizes: list[int], reps: int, timeout: float) -> list[dict]:
        """Bounce a float32 tensor of each size with probe-stage `peer` (`expect_sends` first, on
        both sides); `first` sends first.

        Returns [{kind: "send", k: 2, nbytes, seconds}] (seconds: half the median round
        trip) on the first side, [] on the other.
        """
        import jax
        import numpy as np

        from stages.transport import Edge

        out = []
        d0 = jax.devices()[0]
        for nbytes in sizes:
            n = max(1, nbytes // 4)
            to_peer = Edge(peer, self.geoms[peer], (None,))
            from_peer = Edge(peer, self.geoms[peer], (None,))
            x = jax.device_put(np.ones((n,), np.float32), d0)
            rounds = []
            for r in range(reps + 1):                        # round 0 warms the connection up
                key = ("cal", int(nbytes), r)
                t0 = time.perf_counter()
                if first:
                    self.transport.send((*key, "a"), x, to_peer)
                    self.transport.recv_operand((*key, "b"), (n,), np.float32, None, from_peer, timeout)
                else:
                    got = self.transport.recv_operand((*key, "a"), (n,), np.float32, None, from_peer, timeout)
                    self.transport.send((*key, "b"), jax.device_put(got, d0), to_peer)
                if r:
                    rounds.append(time.perf_counter() - t0)
            if first:
                out.append({"kind": "send", "k": 2, "nbytes": 4 * n, "seconds": statistics.median(rounds) / 2})
        self.transport.flush(timeout)
        return out

    def close(self) -> None:
        if self.transport is not None:
            self.inbox.close("calibration done")
            self.transport.close()
            self.transport = None
