"""Loader benchmark: tokens/s one host's `HostLoader` reads, and what the step waits on it.

    python -m benchmarks.data_loader [--steps 200] [--step-ms 120] [--out DIR] [--hosts 1 2]

Basic flow: prepare the corpus (Debian's licence texts, or the stdlib's `email` sources) into
token shards with a locally trained BPE (`meshpipe prepare`, cached in --out) → for the `large`
benchmark size (vocab 256, seq 64, microbatch 12, m = 8 → a global batch of 96 rows) and a
host holding 1/h of the rows (h = --hosts):
  1. throughput: `load(step)` back to back on the calling thread, tokens/s (inputs + labels
     of this host's rows; a window is seq + 1 tokens);
  2. share of the step: a consumer that calls `get(step)` then "computes" for --step-ms (a
     sleep standing in for the step; pass the measured `large` step time), with prefetch 2 and
     with prefetch 0 (loading on the step's path); wait share = summed `get` wait / wall time.
Records the conditions it saw (os.getloadavg, process affinity). The machine this runs on may
be shared: label the figures with the load printed beside them.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np


def measure(out: Path, steps: int, step_ms: float, hosts: int) -> dict:
    from orchestrator.core.data.plan import DataPlan
    from orchestrator.core.data.shards import resolve_tokens
    from orchestrator.core.data.sampler import windows_per_shard
    from stages.data import HostLoader
    from benchmarks.corpus import prepared

    seq, mbs, m, vocab = 64, 12, 8, 320
    shards = prepared(out, vocab=vocab, shard_tokens=1 << 16)
    ts = resolve_tokens(str(shards))
    plan = DataPlan(source="tokens", model="gpt", global_batch=mbs * m, seed=0, input_shape=(seq,),
                    label_shape=(seq,), vocab=vocab, seq_len=seq, files=ts.files, dtype=ts.dtype,
                    counts=tuple(windows_per_shard(t, seq) for t in ts.tokens))
    rows = np.arange(mbs // hosts)                 # host 0 of h: the first 1/h of each microbatch
    rec = {"hosts_sharing_batch": hosts, "rows_per_step": len(rows) * m, "seq_len": seq,
           "loadavg": os.getloadavg(), "affinity": sorted(os.sched_getaffinity(0)),
           "corpus_tokens": int(sum(ts.tokens))}
    lo = HostLoader(plan, rows, rows, m)
    lo.load(0)
    t = time.perf_counter()
    for s in range(steps):
        lo.load(s)
    dt = time.perf_counter() - t
    rec["load_ms_per_step"] = dt / steps * 1e3
    rec["tokens_per_s"] = steps * len(rows) * m * (seq + 1) / dt
    for prefetch in (2, 0):
        from dataclasses import replace

        lo = HostLoader(replace(plan, prefetch=prefetch), rows, rows, m)
        n = max(10, min(steps, int(3000 / step_ms)))
        t = time.perf_counter()
        for s in range(n):
            lo.get(s, timeout=60)
            time.sleep(step_ms / 1e3)
        wall = time.perf_counter() - t
        lo.close()
        rec[f"wait_share_prefetch{prefetch}"] = lo.wait_s / wall
        rec[f"wait_ms_per_step_prefetch{prefetch}"] = lo.wait_s / n * 1e3
    rec["loadavg_after"] = os.getloadavg()
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--step-ms", type=float, default=120.0, help="the step time the consumer stands in for")
    ap.add_argument("--hosts", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", default=None, help="where the prepared shards are cached")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="meshpipe-data-bench-"))
    for h in args.hosts:
        print(json.dumps(measure(out, args.steps, args.step_ms, h)))


if __name__ == "__main__":
    main()
