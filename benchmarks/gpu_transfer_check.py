"""How a stage edge's bytes move on this machine's accelerator, with no Ray: copies, one world, sockets.

A prepared script for a GPU session (issue #37, item 10): it needs jax (with CUDA there) and
meshpipe's `stages/` and `orchestrator.core`, never ray (the JSON records `ray_imported`, and
the run fails if it is), runs in a few minutes and writes JSON with the device and versions.
Each part runs in its own child process(es) with a deadline, so one part failing (NCCL refusing
a GPU twice, a hang) is recorded and the others still run. Parts:

  copies   D2H / H2D of 32 and 128 MiB bf16 activations over the local devices (every D2H from
           a fresh device array: a jax.Array keeps its host copy once fetched):
             d2h  meshpipe (`np.asarray` per shard, one after another, as `TiledTransport.send`),
                  `copy_to_host_async` on every shard then `np.asarray` (with the issue's own
                  time: what the compute thread would wait), and to pinned host memory
                  (`device_put` to the `pinned_host` memory kind) where the device has it;
             h2d  meshpipe (`device_put` of each destination shard from pageable numpy, as
                  `TiledTransport._to_array`), a replicated destination as meshpipe does it
                  today (the whole array once per device) vs once to one device then an
                  on-device broadcast, and from pinned host memory.
  world    two processes sharing the machine's first accelerator in ONE `jax.distributed`
           world; process 0 `device_put`s a 32 and a 128 MiB array to process 1's device (the
           `transport: xla` hop). On one GPU NCCL may refuse a communicator that holds the same
           GPU twice: the error is the result then. A second pair forces XLA's socket transfer
           library (`jax_force_dcn_cross_host_transfers`), which needs no NCCL; on CPU that library
           (`jax_cross_host_transfer_socket_address`, an explicit port per process) carries both.
           A transfer that never completes fails after `jax_cross_host_transfer_timeout_seconds`.
  socket   the socket transport (`stages.socket_transport.SocketTransport`, through its public
           API as the stage worker uses it: expect / connect / send / recv) between two
           processes, each a one-device stage on the first accelerator: a 32 and a 128 MiB
           tensor from process 0 to 1, acknowledged by a one-element tensor back, over shared
           memory (same machine, the default) and over TCP; the sender's blocked time per
           SEND (`send` returning) and the one-way time (round trip less the ack's own).
  mock     a stage program compiled for a 2-host × 8-GPU topology: on GPU with
           `jax_mock_gpu_topology = 1x2x8` (one slice, 2 hosts, 8 GPUs each; compile only);
           if XLA refuses that with one local GPU, 1x2x1 is tried too. Elsewhere the flag does not
           apply (it mocks the CUDA client), and the same program
           is compiled for 16 simulated CPU devices instead, so the code path is proven.
           XLA's memory_analysis per device is recorded either way.

Run from the repository root (a GPU session: one call, well under 10 minutes):

    PYTHONPATH=. python3 benchmarks/gpu_transfer_check.py              # all parts
    python -m benchmarks.gpu_transfer_check --parts copies,socket --reps 3

Writes $OUT/gpu_transfer_check.json if OUT is set, else benchmarks/results/gpu_transfer_check.json
(`--out` overrides), rewritten after each part.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

MIB = 2**20
SIZES_MIB = (32, 128)
SMOKE_SIZES_MIB = (1, 2)             # --smoke: proves every path in seconds (tests)
COLS = 4096                          # an activation's model dim: rows × 4096 bf16
PARTS = ("copies", "world", "socket", "mock")
MOCK_TOPOLOGY = "1x2x8"              # <slices> x <hosts per slice> x <devices per host>
TOKEN = b"gpu-transfer-check-token-0123456789"
MARK = "RESULT "                     # a child's result: one line, this prefix, then JSON


# ----------------------------------------------------------------------------- shared helpers

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed(fn, reps: int, warmup: int = 1) -> dict:
    """Median and min seconds of `fn()` over `reps` calls after `warmup`."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(ts), "min_s": min(ts), "reps": reps}


def _timed_fresh(make, fn, reps: int, warmup: int = 1) -> dict:
    """`_timed` of `fn(x)` on a fresh `x = make()` each call (made outside the timing): a jax.Array
    keeps its host copy once fetched, so fetching the same array twice would time nothing."""
    ts = []
    for i in range(warmup + reps):
        x = make()
        t0 = time.perf_counter()
        fn(x)
        if i >= warmup:
            ts.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(ts), "min_s": min(ts), "reps": reps}


def _rate(rec: dict, nbytes: int) -> dict:
    rec["gb_per_s"] = nbytes / rec["median_s"] / 1e9 if rec["median_s"] > 0 else None
    return rec


def _emit(result: dict) -> None:
    result["ray_imported"] = "ray" in sys.modules and sys.modules["ray"] is not None
    print(MARK + json.dumps(result, default=str), flush=True)


def _device_info() -> dict:
    import jax

    d = jax.local_devices()[0]
    return {"backend": jax.default_backend(), "device_kind": d.device_kind, "local_devices": jax.local_device_count(),
            "memories": [m.kind for m in d.addressable_memories()] if hasattr(d, "addressable_memories") else []}


def _activation(mib: int):
    import jax.numpy as jnp
    import numpy as np

    rows = mib * MIB // (COLS * 2)
    return np.arange(rows * COLS, dtype=np.float32).reshape(rows, COLS).astype(jnp.bfloat16)


# ----------------------------------------------------------------------------- part: copies

def child_copies(reps: int) -> dict:
    """Part `copies` (module docstring), in this process's local devices."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devices = jax.local_devices()
    mesh = Mesh(np.array(devices), ("d",))
    split, rep = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())
    pinned = "pinned_host" in _device_info()["memories"]
    out = {"device": _device_info(), "pinned_host": pinned, "sizes": {}}
    for mib in SIZES_MIB:
        host = _activation(mib)
        nbytes = host.nbytes
        arr = jax.device_put(host, split)
        arr.block_until_ready()
        r: dict = {"bytes": nbytes}

        def fresh():
            return jax.block_until_ready(jax.device_put(host, split))

        def d2h_meshpipe(a):
            return [np.asarray(sh.data) for sh in a.addressable_shards]

        def d2h_async(a):
            for sh in a.addressable_shards:
                sh.data.copy_to_host_async()
            return [np.asarray(sh.data) for sh in a.addressable_shards]

        def d2h_async_issue(a):     # what the compute thread waits for: the issue only
            for sh in a.addressable_shards:
                sh.data.copy_to_host_async()

        r["d2h_meshpipe"] = _rate(_timed_fresh(fresh, d2h_meshpipe, reps), nbytes)
        r["d2h_copy_to_host_async"] = _rate(_timed_fresh(fresh, d2h_async, reps), nbytes)
        r["d2h_copy_to_host_async"]["issue_median_s"] = _timed_fresh(fresh, d2h_async_issue, reps)["median_s"]
        shards = [np.array(x, copy=True) for x in d2h_meshpipe(arr)]      # fresh pageable memory, as a receiver holds
        r["h2d_meshpipe"] = _rate(_timed(lambda: jax.block_until_ready(jax.device_put(shards, devices)), reps), nbytes)
        whole = [host] * len(devices)
        r["h2d_replicated_per_device"] = _rate(_timed(
            lambda: jax.block_until_ready(jax.device_put(whole, devices)), reps), nbytes * len(devices))

        def once_then_broadcast():
            one = jax.device_put(host, devices[0])
            return jax.block_until_ready(jax.device_put(one, rep))

        r["h2d_once_then_broadcast"] = _rate(_timed(once_then_broadcast, reps), nbytes * len(devices))
        if pinned:
            to_pinned, to_device = split.with_memory_kind("pinned_host"), split.with_memory_kind("device")
            r["d2h_pinned"] = _rate(_timed(lambda: jax.block_until_ready(jax.device_put(arr, to_pinned)), reps), nbytes)
            r["d2h_pinned_then_numpy"] = _rate(_timed_fresh(
                lambda: jax.block_until_ready(jax.device_put(arr, to_pinned)),
                lambda a: [np.asarray(sh.data) for sh in a.addressable_shards], reps), nbytes)
            staged = jax.block_until_ready(jax.device_put(arr, to_pinned))
            r["h2d_pinned"] = _rate(_timed(lambda: jax.block_until_ready(jax.device_put(staged, to_device)), reps),
                                    nbytes)
        else:
            r["pinned"] = (f"not applicable: this device's memory kinds are {out['device']['memories']}, "
                           "no pinned_host")
        out["sizes"][str(mib)] = r
    return out


# ----------------------------------------------------------------------------- part: world

def child_world(rank: int, coordinator: str, xfer_port: int, reps: int, timeout_s: float, force_dcn: bool) -> dict:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    jax.config.update("jax_cross_host_transfer_socket_address", f"127.0.0.1:{xfer_port + rank}")
    jax.config.update("jax_cross_host_transport_addresses", "127.0.0.1:0")
    jax.config.update("jax_cross_host_transfer_timeout_seconds", max(10, int(timeout_s / 3)))
    if force_dcn:       # XLA's socket transfer library even where the backend has its own (NCCL)
        jax.config.update("jax_force_dcn_cross_host_transfers", True)
    out: dict = {"rank": rank, "force_dcn": force_dcn}
    try:
        kw = {"local_device_ids": [0]} if os.environ.get("JAX_PLATFORMS", "") not in ("cpu",) else {}
        jax.distributed.initialize(coordinator, 2, rank, initialization_timeout=int(timeout_s), **kw)
    except Exception as e:  # noqa: BLE001 - the refusal is the finding
        out["error"] = f"jax.distributed.initialize: {type(e).__name__}: {e}"
        return out
    from jax._src import distributed

    client = distributed.global_state.client

    def barrier(name):
        client.wait_at_barrier(name, int(timeout_s * 1000))

    try:
        devs = jax.devices()
        out["devices"] = [f"{d} (process {d.process_index})" for d in devs]
        src_dev = next(d for d in devs if d.process_index == 0)
        dst_dev = next(d for d in devs if d.process_index == 1)
        src = NamedSharding(Mesh(np.array([src_dev]), ("x",)), P())
        dst = NamedSharding(Mesh(np.array([dst_dev]), ("x",)), P())
        out["sizes"] = {}
        for mib in SIZES_MIB:
            host = _activation(mib)
            if rank == 0:
                x = jax.make_array_from_single_device_arrays(host.shape, src, [jax.device_put(host, src_dev)])
            else:
                x = jax.make_array_from_single_device_arrays(host.shape, src, [], dtype=host.dtype)
            times, issues, ok = [], [], True
            for i in range(reps + 1):
                barrier(f"size{mib}-rep{i}")
                t0 = time.perf_counter()
                y = jax.device_put(x, dst)
                issues.append(time.perf_counter() - t0)
                if rank == 1:
                    y.block_until_ready()
                    times.append(time.perf_counter() - t0)
                    got = np.asarray(y.addressable_shards[0].data)
                    ok = ok and bool((got[:, :8] == host[:, :8]).all() and (got[-1] == host[-1]).all())
                barrier(f"size{mib}-rep{i}-done")
            rec = {"bytes": host.nbytes, "issue_median_s": statistics.median(issues[1:])}
            if rank == 1:
                rec.update(_rate({"median_s": statistics.median(times[1:]), "min_s": min(times[1:]), "reps": reps},
                                 host.nbytes), values_equal=ok)
            out["sizes"][str(mib)] = rec
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
    finally:
        try:
            jax.distributed.shutdown()
        except Exception as e:  # noqa: BLE001
            out.setdefault("shutdown_error", f"{type(e).__name__}: {e}")
    return out


# ----------------------------------------------------------------------------- part: socket

def _wait_file(path: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} did not appear within {timeout_s:g} s")
        time.sleep(0.01)
    return path.read_text()


def child_socket(rank: int, rendezvous: str, reps: int, timeout_s: float) -> dict:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from orchestrator.core.edges import StageGeom
    from stages.mailbox import Mailbox
    from stages.socket_transport import SocketTransport
    from stages.transport import Edge

    where = Path(rendezvous)
    geoms = tuple(StageGeom.of({"data": 1}, (h,), 1, {"batch": "data"}) for h in (0, 1))
    mesh = Mesh(np.array(jax.local_devices()[:1]), ("data",))
    sh = NamedSharding(mesh, P("data"))
    axes = ("batch", "embed")
    other = 1 - rank
    to_peer, from_peer = Edge(other, geoms[other], axes), Edge(other, geoms[other], axes)
    ack = np.zeros((1, 1), np.float32)
    out: dict = {"rank": rank, "variants": {}}
    for variant, opts in (("shared_memory", {}), ("tcp", {"shared_memory": False})):
        t = SocketTransport(me=rank, geom=geoms[rank], mesh=mesh, inbox=Mailbox(f"stage {rank}"), peers=None,
                            token=TOKEN, stage=rank, geoms=geoms, host="127.0.0.1", io_timeout=timeout_s, **opts)
        rec: dict = {}
        try:
            (where / f"{variant}-addr{rank}").write_text(json.dumps(list(t.address)))
            peer = tuple(json.loads(_wait_file(where / f"{variant}-addr{other}", timeout_s)))
            t.connect([[tuple(t.address)], [peer]] if rank == 0 else [[peer], [tuple(t.address)]])
            for mib in SIZES_MIB:
                host = _activation(mib)
                if rank == 1:
                    t.expect(from_peer, host.shape, host.dtype)
                else:
                    t.expect(from_peer, ack.shape, ack.dtype)
                (where / f"{variant}-{mib}-ready{rank}").write_text("1")
                _wait_file(where / f"{variant}-{mib}-ready{other}", timeout_s)
                x = jax.device_put(host, sh) if rank == 0 else None
                acks = jax.device_put(ack, sh) if rank == 1 else None
                blocked, rtt, ok = [], [], True
                for i in range(reps + 1):
                    key = (i, "F", mib, 0)
                    if rank == 0:
                        t0 = time.perf_counter()
                        t.send(key, x, to_peer)
                        blocked.append(time.perf_counter() - t0)
                        t.recv(key, ack.shape, ack.dtype, sh, from_peer, timeout_s).block_until_ready()
                        rtt.append(time.perf_counter() - t0)
                    else:
                        got = t.recv(key, host.shape, host.dtype, sh, from_peer, timeout_s)
                        got.block_until_ready()
                        t.send(key, acks, to_peer)
                        if i == 0:
                            g = np.asarray(got)
                            ok = bool((g[:, :8] == host[:, :8]).all() and (g[-1] == host[-1]).all())
                rec[str(mib)] = {"bytes": host.nbytes, "values_equal": ok} if rank == 1 else _rate(
                    {"median_s": statistics.median(rtt[1:]), "min_s": min(rtt[1:]), "reps": reps,
                     "send_blocked_median_s": statistics.median(blocked[1:]),
                     "what": "round trip: the tensor one way, a one-element ack back"}, host.nbytes)
            rec["sends"] = {"shm": t.shm_sends, "stream": t.stream_sends}
            t.flush(timeout_s)
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
        finally:
            (where / f"{variant}-done{rank}").write_text("1")
            try:
                _wait_file(where / f"{variant}-done{other}", timeout_s)
            except TimeoutError:
                pass
            t.close()
        out["variants"][variant] = rec
    return out


# ----------------------------------------------------------------------------- part: mock

def child_mock(timeout_s: float, topology: str = MOCK_TOPOLOGY) -> dict:
    import jax

    gpu = False
    try:
        import jax_plugins  # noqa: F401  (present with the CUDA plugin)
        gpu = any(p.startswith("cuda") for p in os.listdir(os.path.dirname(jax_plugins.__path__[0] + "/")))
    except Exception:  # noqa: BLE001
        gpu = False
    out: dict = {"flag_exists": "jax_mock_gpu_topology" in jax.config.values}
    if gpu and os.environ.get("JAX_PLATFORMS", "") in ("", "cuda", "gpu"):
        jax.config.update("jax_mock_gpu_topology", topology)
        out["mode"] = f"jax_mock_gpu_topology={topology}"
    else:
        out["mode"] = "cpu stand-in: 16 simulated CPU devices (jax_mock_gpu_topology mocks the CUDA client only)"
    try:
        _, hosts, per_host = (int(x) for x in topology.split("x"))
        out.update(_compile_stage(jax.devices(), hosts if gpu else 2, per_host if gpu else 8))
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
    return out


MOCK_MODEL = {"vocab": 32768, "d_model": 1024, "heads": 16, "d_mlp": 4096, "blocks": 4}
SMOKE_MOCK_MODEL = {"vocab": 128, "d_model": 64, "heads": 8, "d_mlp": 128, "blocks": 4}


def _compile_stage(devices, hosts: int = 2, per_host: int = 8) -> dict:
    """A GPT stage of 2 blocks (`MOCK_MODEL`) on a {data: hosts, model: per_host} mesh over `devices`
    (host-major, as the stage worker builds it), compiled ahead of time (forward and backward +
    accumulate); XLA's bytes per device."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh

    from stages.aot_profile import build_source
    from stages.program import StageProgram

    n = hosts * per_host
    if len(devices) < n:
        return {"skipped": f"{len(devices)} devices; the {hosts} × {per_host} mesh needs {n}"}
    smoke = SIZES_MIB == SMOKE_SIZES_MIB
    source = {"kind": "modelspec", "name": "gpt", "seq_len": 16 if smoke else 1024, "compute": "bfloat16",
              "args": SMOKE_MOCK_MODEL if smoke else MOCK_MODEL}
    spec, model = build_source(source)
    mesh = Mesh(np.array(devices[:n]).reshape(hosts, per_host), ("data", "model"))
    prog = StageProgram(spec, model, 1, 3, microbatches=4, optimizer=optax.adam(1e-4), mesh=mesh,
                        layout={"batch": "data", "heads": "model", "mlp": "model", "vocab": "model"})

    def sds(shape, dtype, sh):
        return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sh)

    params = [jax.tree.map(lambda s, sh: sds(s.shape, s.dtype, sh), tree, shard)
              for tree, shard in zip(prog.param_trees(), prog.param_shardings())]
    xs = [sds(leaf.batched(8), leaf.dtype, sh) for leaf, sh in zip(prog.in_leaves, prog.input_shardings())]
    t0 = time.perf_counter()
    fwd = prog.jitted_fwd().lower(params, xs).compile()
    y, res = fwd.out_info[:2]
    bwd = prog.bwd_acc.lower(params, res, [y[i] for i in prog.out_diff], params).compile()
    mem = {}
    for name, c in (("F", fwd), ("B", bwd)):
        m = c.memory_analysis()
        mem[name] = {k: int(getattr(m, f"{k}_size_in_bytes", 0)) for k in ("argument", "output", "temp")}
    return {"model": source["args"], "seq_len": source["seq_len"], "mesh": {"data": hosts, "model": per_host},
            "devices": len(devices), "processes": sorted({d.process_index for d in devices[:n]}), "device_kind": devices[0].device_kind,
            "layers": [1, 3], "memory_per_device": mem, "compile_s": time.perf_counter() - t0}


# ----------------------------------------------------------------------------- the parent

def _run_children(argvs: list[list[str]], env: dict, timeout_s: float) -> list[dict]:
    """Start the children together; each one's RESULT line, or what stopped it (bounded wait)."""
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.gpu_transfer_check", *a], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for a in argvs]
    deadline = time.monotonic() + timeout_s
    out = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            so, se = p.communicate()
            out.append({"error": f"ran past {timeout_s:g} s and was killed", "stderr_tail": se[-2000:]})
            continue
        line = next((x for x in reversed(so.splitlines()) if x.startswith(MARK)), None)
        if line is None:
            out.append({"error": f"exited {p.returncode} without a result", "stderr_tail": se[-3000:]})
        else:
            rec = json.loads(line[len(MARK):])
            rec["exit_code"] = p.returncode
            out.append(rec)
    return out


def _versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version(), "machine": platform.machine()}
    for pkg in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "libtpu", "numpy"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def parent(args) -> int:
    out_path = args.out or (Path(os.environ["OUT"]) / "gpu_transfer_check.json" if os.environ.get("OUT")
                            else ROOT / "benchmarks" / "results" / "gpu_transfer_check.json")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    res: dict = {"what": "stage-edge transfers on this machine's accelerator without Ray (issue #37, item 10)",
                 "versions": _versions(), "host": platform.node(), "parts": {}, "started": time.strftime("%F %T")}

    def save():
        res["wall_s"] = time.perf_counter() - t0
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(res, indent=1, default=str) + "\n")

    common = ["--reps", str(args.reps), "--timeout-s", str(args.timeout_s)] + (["--smoke"] if args.smoke else [])
    res["smoke"] = args.smoke
    res["sizes_mib"] = list(SIZES_MIB)
    for part in args.parts:
        if time.perf_counter() - t0 > args.budget_s:
            res["parts"][part] = {"skipped": f"budget of {args.budget_s:g} s spent"}
            continue
        t1 = time.perf_counter()
        if part == "copies":
            got = _run_children([["--child", "copies", *common]], env, args.timeout_s)[0]
        elif part == "world":
            wenv = {**env, "CUDA_VISIBLE_DEVICES": env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}
            got = {}
            for variant, flag in (("default", []), ("force_dcn", ["--force-dcn"])):
                coord, xfer = f"127.0.0.1:{_free_port()}", _free_port()
                got[variant] = {"ranks": _run_children([["--child", "world", "--rank", str(r), "--coordinator", coord,
                                                         "--xfer-port", str(xfer), *flag, *common] for r in (0, 1)],
                                                       wenv, args.timeout_s)}
        elif part == "socket":
            with tempfile.TemporaryDirectory(prefix="gpu-transfer-check-") as where:
                senv = {**env, "CUDA_VISIBLE_DEVICES": env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}
                got = {"ranks": _run_children([["--child", "socket", "--rank", str(r), "--rendezvous", where,
                                                *common] for r in (0, 1)], senv, args.timeout_s)}
        else:
            menv = dict(env)
            on_cpu = env.get("JAX_PLATFORMS", "") == "cpu" or not _has_cuda_plugin()
            if on_cpu:
                menv["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=16").strip()
            got = _run_children([["--child", "mock", *common]], menv, args.timeout_s)[0]
            if not on_cpu and "error" in got:     # the mock may want as many local GPUs as it names per host
                got = {MOCK_TOPOLOGY: got, "1x2x1": _run_children([["--child", "mock", "--mock-topology", "1x2x1",
                                                                    *common]], menv, args.timeout_s)[0]}
        got["part_s"] = time.perf_counter() - t1
        res["parts"][part] = got
        save()
        print(f"{part}: {time.perf_counter() - t1:.1f} s" + (f" (error: {_first_error(got)})" if _first_error(got)
                                                              else ""), flush=True)
    res["ray_imported"] = any(_ray_seen(p) for p in res["parts"].values())
    save()
    print(f"wrote {out_path}")
    return 1 if res["ray_imported"] else 0


def _has_cuda_plugin() -> bool:
    from importlib import metadata

    for pkg in ("jax-cuda12-plugin", "jax-cuda13-plugin"):
        try:
            metadata.version(pkg)
            return True
        except metadata.PackageNotFoundError:
            pass
    return False


def _ray_seen(rec) -> bool:
    if isinstance(rec, dict):
        return bool(rec.get("ray_imported")) or any(_ray_seen(v) for v in rec.values())
    if isinstance(rec, list):
        return any(_ray_seen(v) for v in rec)
    return False


def _first_error(rec) -> str | None:
    if isinstance(rec, dict):
        if "error" in rec:
            return str(rec["error"])[:200]
        for v in rec.values():
            e = _first_error(v)
            if e:
                return e
    if isinstance(rec, list):
        for v in rec:
            e = _first_error(v)
            if e:
                return e
    return None


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--timeout-s", type=float, default=150.0, help="each part's deadline")
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip the parts left after this many seconds")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="1 and 2 MiB, a tiny mock-topology stage (tests)")
    ap.add_argument("--child", choices=PARTS, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--coordinator", default="", help=argparse.SUPPRESS)
    ap.add_argument("--xfer-port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--rendezvous", default="", help=argparse.SUPPRESS)
    ap.add_argument("--force-dcn", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mock-topology", default=MOCK_TOPOLOGY, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    bad = [p for p in args.parts if p not in PARTS]
    if bad:
        ap.error(f"--parts: unknown {bad}; known: {', '.join(PARTS)}")
    return args


def main(argv=None) -> int:
    global SIZES_MIB
    args = parse_args(argv)
    if args.smoke:
        SIZES_MIB = SMOKE_SIZES_MIB
    if args.child is None:
        return parent(args)
    try:
        if args.child == "copies":
            rec = child_copies(args.reps)
        elif args.child == "world":
            rec = child_world(args.rank, args.coordinator, args.xfer_port, args.reps, args.timeout_s, args.force_dcn)
        elif args.child == "socket":
            rec = child_socket(args.rank, args.rendezvous, args.reps, args.timeout_s)
        else:
            rec = child_mock(args.timeout_s, args.mock_topology)
    except Exception as e:  # noqa: BLE001 - a part that fails is recorded, not lost
        rec = {"error": f"{type(e).__name__}: {str(e)[:1500]}"}
    _emit(rec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
