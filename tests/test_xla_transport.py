"""`stages.xla_transport` in real multi-process JAX worlds, without Ray (`tests/xla_world.py`).

Each test starts one Python process per world process, every one joining the same
`jax.distributed` world bound to 127.0.0.1, and reads back what each received: every tensor
equal to its reference on every addressable shard, with the receiving program's sharding.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.xla_world import SCENARIOS

# one world's cross-process device_put on CPU (jax_cross_host_transfer_socket_address) was built and
# checked on JAX 0.10; the oldest-versions CI step (JAX 0.8.3) leaves it out
pytestmark = [pytest.mark.jax_min_0_10]

ROOT = Path(__file__).resolve().parents[1]
WORLD_S = 240          # the whole world's run, start-up included (the 2-core machine, loaded)


def run_world(name: str, tmp_path: Path) -> list[dict]:
    """Start the scenario's processes, wait (bounded) and return each one's report."""
    from stages.jaxinit import reserve_port

    world = SCENARIOS[name]["world"]
    address, held = reserve_port("127.0.0.1")
    held.close()
    port = int(address.rpartition(":")[2])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(open(tmp_path / f"log{i}.txt", "w")) for i in range(world)]
        procs = [subprocess.Popen([sys.executable, "-m", "tests.xla_world", name, str(i), str(world), str(port),
                                   str(tmp_path)], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
                 for i, f in enumerate(logs)]
        deadline = time.monotonic() + WORLD_S
        try:
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
    reports = []
    for i in range(world):
        out = tmp_path / f"{i}.json"
        if not out.exists():
            tail = (tmp_path / f"log{i}.txt").read_text()[-3000:]
            pytest.fail(f"process {i} of {name!r} wrote no report (exit {procs[i].returncode}):\n{tail}")
        reports.append(json.loads(out.read_text()))
    return reports


def _check_received(reports: list[dict], want: dict[int, int]) -> None:
    for r in reports:
        bad = [x for x in r["received"] if not x["ok"]]
        assert not bad, (r["process"], bad[:3])
        assert len(r["received"]) == want[r["process"]], (r["process"], len(r["received"]))
        assert r["transfer_listening"], r          # XLA's transfer socket is this process's, on the port picked
        assert r["transfer_address"].startswith("127.0.0.1:")
        assert not wildcard(r["listeners"]), (r["process"], r["listeners"])


def wildcard(listeners) -> list[str]:
    """Of "ip:port" listening addresses, those on every interface (0.0.0.0, ::)."""
    return [a for a in listeners if a.rpartition(":")[0].strip("[]") in ("0.0.0.0", "::", "::ffff:0.0.0.0", "")]


def test_pair_whole_array_and_replicated_fan_out(tmp_path):
    """{data: 2} -> {model: 2}, GPipe m=2, two training steps and one eval batch: the f32 leaf cut
    alike moves as one whole-array device_put, the bf16 leaf that becomes replicated as tiles (one
    copy per host, fanned out on device); gradients come back the same ways."""
    reports = run_world("pair", tmp_path)
    # stage 1 receives 2 leaves x 2 microbatches x (2 steps + 1 eval); stage 0 the gradients of 2 steps
    _check_received(reports, {0: 2 * 2 * 2, 1: 2 * 2 * 3})
    sender = reports[0]
    assert sender["whole_sends"] == 2 * 3 and sender["tile_sends"] == 2 * 3, sender
    assert {x["dtype"] for x in reports[1]["received"]} == {"float32", "bfloat16"}


@pytest.mark.slow
def test_chain_of_three_stages_with_a_two_host_stage(tmp_path):
    """4 processes, 3 stages, 1F1B m=4, two steps and an eval: a 2-host stage -> one host (layout
    change, bf16 replicated fan-out, an int leaf that gets no gradient), 4 devices -> 2. Every
    process makes every transfer call (the world's order): stage 2 draws the keys of edge 0->1 and
    stage 0 those of edge 1->2, and still every tensor arrives right."""
    reports = run_world("chain", tmp_path)
    m, steps = 4, 2
    # stage 0 hosts: gradients of leaves 0 and 1 (float) per microbatch; stage 1: 3 leaves forward (+ eval)
    # and 1 gradient; stage 2: 1 leaf forward (+ eval)
    _check_received(reports, {0: 2 * m * steps, 1: 2 * m * steps, 2: 3 * m * (steps + 1) + m * steps,
                              3: m * (steps + 1)})
    assert len({r["calls"] for r in reports}) == 1      # every process issued every transfer
    assert all(r["whole_sends"] == 0 for r in reports)
