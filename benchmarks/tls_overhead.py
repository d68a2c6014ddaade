"""What TLS costs the socket transport (cluster `transport_tls`): one link, then the tiny pipeline.

  1. link: one `Listener` and one `_Conn` in this process (no Ray), plain TCP vs TLS (the same
     context the stage actors build, `orchestrator.core.tls.contexts`): frames of 64 KiB and
     16 MiB sent back to back for about a second (after one warm-up frame), three times
     each; median MB/s of payload delivered.
  2. pipeline: the tiny 2-stage GPT of tests/test_pipeline_numerics.py on an embedded Ray,
     `transport_same_machine: tcp` so both runs use TCP links, plain vs TLS, in the order
     plain, TLS, TLS, plain; median step time of each run (the first step compiles and is left
     out); the losses of all four must be identical.

The load average is recorded before and after (`machine_info`, `load_end`): on a shared machine
read the difference, not the digits. Throwaway certificates come from benchmarks/tls_certs.py.

    python -m benchmarks.tls_overhead --steps 20 --out benchmarks/results/tls_overhead.json
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import machine_info, median

TOKEN = b"b" * 32
ORDER = ("plain", "tls", "tls", "plain")   # ABBA: a load that drifts during the runs hits both alike


def link(tls: dict | None, nbytes: int, seconds: float = 1.0) -> float:
    """MB/s (1e6 bytes) of payload through one connection, frames of `nbytes` bytes."""
    from orchestrator.core.tls import contexts
    from stages.frames import encode_frame
    from stages.mailbox import Mailbox
    from stages.socket_conn import Listener, _Conn

    server, client = contexts(tls) if tls else (None, None)
    box = Mailbox("bench")
    lst = Listener("127.0.0.1", TOKEN, lambda frame, conn: box.put(frame.key, frame.arrays), print,
                   io_timeout=30, name="bench", tls=server)
    conn = _Conn(lst.address, TOKEN, io_timeout=30, tls=client)
    payload = np.ones(nbytes // 4, np.float32)
    try:
        conn.send(encode_frame(("warm-up",), [payload]))       # first-use imports and allocations
        box.take(("warm-up",), timeout=30)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            conn.send(encode_frame((n,), [payload]))
            box.take((n,), timeout=30)
            n += 1
        return n * nbytes / (time.perf_counter() - t0) / 1e6
    finally:
        conn.close()
        lst.close()


def tiny_job(out: Path, steps: int) -> dict:
    return {
        "run": {"name": "tls-bench", "steps": steps, "seed": 1, "output_dir": str(out)},
        "model": {"name": "gpt", "args": {"vocab": 64, "d_model": 32, "heads": 4, "d_mlp": 64, "blocks": 2}},
        "data": {"source": "synthetic", "global_batch": 16, "seq_len": 16},
        "optimizer": {"name": "adam", "args": {"learning_rate": 0.003}},
        "pipeline": {"schedule": "1f1b", "microbatches": 4, "stages": [
            {"layers": [0, 2], "mesh": {"data": 2}}, {"layers": [2, 4], "mesh": {"model": 2}}]},
        "layout": {"batch": "data", "heads": "model", "mlp": "model", "vocab": "model"},
    }


def pipeline(tls: dict | None, steps: int, out: Path) -> dict:
    from orchestrator.core.config import check_job, parse_cluster, parse_job
    from orchestrator.driver.runner import run_job

    cluster = {"address": None, "platform": "cpu", "hosts": 4, "devices_per_host": 2, "cpus_per_host": 0.5,
               "transport_same_machine": "tcp", **({"transport_tls": tls} if tls else {})}
    return run_job(check_job(parse_job(tiny_job(out, steps)), parse_cluster(cluster)), echo=lambda s: None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results/tls_overhead.json")
    args = ap.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from benchmarks.tls_certs import make_tls

    result: dict = {"machine": machine_info()}
    with tempfile.TemporaryDirectory() as tmp:
        tls = make_tls(Path(tmp) / "pki")
        result["link_mb_s"] = {f"{n >> 10} KiB": {name: median([link(cfg, n) for _ in range(3)])
                                                  for name, cfg in (("plain", None), ("tls", tls))}
                               for n in (64 << 10, 16 << 20)}       # median of 3 runs of ~1 s
        runs = [(name, pipeline(tls if name == "tls" else None, args.steps, Path(tmp) / f"{name}{i}"))
                for i, name in enumerate(ORDER)]
    if len({tuple(r["losses"]) for _, r in runs}) != 1:
        raise SystemExit("TLS changed the losses: the transport delivered different bytes")
    result["pipeline_order"] = list(ORDER)
    result["pipeline_step_ms"] = {k: [median(r["step_times_s"][1:]) * 1e3 for name, r in runs if name == k]
                                  for k in ("plain", "tls")}
    result["steps"] = args.steps
    result["load_end"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
