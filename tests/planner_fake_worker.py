"""A stand-in profiling worker for the Profiler's tests (run as `python -m tests.planner_fake_worker`).

Speaks the worker protocol of `orchestrator.core.planner.profile`: a profile per
request, an error for rules naming `bad`, a long sleep for batch 99 (to hit the
deadline), and it records the XLA_FLAGS / JAX_PLATFORMS it was started with.
"""
import json
import os
import sys
import time

req = json.loads(sys.stdin.read())
for r in req["requests"]:
    if any(a == "bad" for a, _ in r["rules"]):
        print(json.dumps({"key": r["key"], "error": "ValueError: cannot shard 'bad'"}), flush=True)
        continue
    if r["batch"] == 99:
        time.sleep(60)
    prof = {"flops": {"fwd": 1.0 * r["batch"], "bwd": 2.0 * r["batch"]}, "bytes_accessed": {"fwd": 0, "bwd": 0},
            "residual_bytes": 8.0, "temp_bytes": 0.0, "collectives": [],
            "compile_s": 0.01, "env": [os.environ.get("XLA_FLAGS"), os.environ.get("JAX_PLATFORMS")]}
    print(json.dumps({"key": r["key"], "profile": prof}), flush=True)
