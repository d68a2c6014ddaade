"""Cross-mesh resharding on Ray with simulated devices, through the pipeline's own transport.

A random tensor leaves one stage actor with that stage's sharding and arrives on
another stage whose mesh and layout differ; what arrives must be bit-identical
to the numpy source, shard by shard, at the global positions JAX reports
(`Shard.index`) — no tolerance: resharding moves bytes, it computes nothing.

Each row of CASES is a pair of stage geometries, stage 0 and stage 1 (logical
axes ("batch", "seq", "embed") mapped to mesh axes by each stage's layout), and
runs in both directions: "forward" sends stage 0 -> 1 (SEND_F / RECV_F),
"backward" 1 -> 0 (the gradient way), through `Edge`s as a pipeline stage does.

Every case runs through each way a stage can move a tensor: Ray actor calls
(`RayTransport`), and the socket transport pipelines use by default
(`SocketTransport`) as a TCP stream placed straight into the destination shards
("tcp"), through the destination's shared memory ("shm"), and falling back to a
stream when the destination's shared-memory pool is full ("shm-full").

Actors (`benchmarks.reshard_probe.ReshardProbe`) are shared by the whole module: two
single-host stages with 8 simulated devices each (a case's mesh uses the first
prod(mesh) of them), and one 2-host stage of
2 + 2 devices joined by jax.distributed, so that a destination with hosts (1, 2)
gets one payload per host and checks only its own addressable shards.
"""
from __future__ import annotations

import numpy as np
import pytest

from orchestrator.core.edges import StageGeom, edge_plan
from orchestrator.core.reshard import shard_boxes
from benchmarks.reshard_probe import ProbeSet, random_array
from tests.conftest import alive_actors, wait_until

pytestmark = pytest.mark.ray

AXES = ("batch", "seq", "embed")
SHAPE = (16, 6, 24)
TIMEOUT = 60.0


def one_host(mesh: dict, layout: dict, host: int) -> StageGeom:
    return StageGeom.of(mesh, (host,), int(np.prod(list(mesh.values()))), layout)


# name -> (geometry of stage 0, geometry of stage 1, dtype). Stage 0 is always the single-host actor
# "a" (host 0); stage 1 is actor "b" (host 1), or the two-host stage "pair" when it has hosts (1, 2).
CASES = {
    "2x2-vs-4x1": (one_host({"data": 2, "model": 2}, {"batch": "data", "embed": "model"}, 0),
                   one_host({"data": 4, "model": 1}, {"batch": "data", "embed": "model"}, 1), np.float32),
    "replicated-vs-sharded": (one_host({"data": 4}, {}, 0),
                              one_host({"data": 4}, {"batch": "data"}, 1), np.float32),
    "1-vs-8": (one_host({"data": 1}, {"batch": "data"}, 0),
               one_host({"data": 2, "model": 4}, {"batch": "data", "embed": "model"}, 1), np.int32),
    "transposed-spec": (one_host({"data": 2, "model": 4}, {"batch": "data", "embed": "model"}, 0),
                        one_host({"data": 2, "model": 4}, {"batch": "model", "embed": "data"}, 1), np.float32),
    "two-axes-on-one-dim": (one_host({"data": 4, "model": 2}, {"embed": ("data", "model")}, 0),
                            one_host({"model": 2, "data": 4}, {"embed": ("model", "data"), "batch": None}, 1),
                            np.float32),
    "1-host-vs-2-hosts": (one_host({"data": 2, "model": 2}, {"batch": "data", "embed": "model"}, 0),
                          StageGeom.of({"data": 2, "model": 2}, (1, 2), 2, {"batch": "data"}), np.float32),
    "1-host-vs-2-hosts-transposed": (one_host({"data": 4}, {"batch": "data"}, 0),
                                     StageGeom.of({"data": 2, "model": 2}, (1, 2), 2,
                                                  {"batch": "model", "embed": "data"}), np.float32),
}
# what the brief's table calls each direction, for reading failures
ALIASES = {("replicated-vs-sharded", "backward"): "sharded->replicated",
           ("1-vs-8", "backward"): "8->1", ("2x2-vs-4x1", "backward"): "4x1->2x2",
           ("1-host-vs-2-hosts", "backward"): "2 hosts->1 host"}


class Probes(ProbeSet):
    """The module's actors (benchmarks.reshard_probe.ProbeSet), checking the 2-host world on start."""

    def start(self) -> None:
        worlds = super().start()
        assert [w["process"] for w in worlds] == [0, 1]


@pytest.fixture(scope="module")
def probes(ray_local):
    p = Probes(ray_local, timeout=TIMEOUT)
    try:
        p.start()
        yield p
    finally:
        p.close()
    wait_until(lambda: not alive_actors(), 30, "the probe actors to exit")


def assert_bits_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{what}: got {got.dtype}{list(got.shape)}, want {want.dtype}{list(want.shape)}"
    if got.tobytes() != want.tobytes():
        bad = np.argwhere(got.view(np.uint8) != want.view(np.uint8))
        raise AssertionError(f"{what}: {len(bad)} bytes differ, first at {bad[0].tolist()}")


def move(probes: Probes, name: str, direction: str, seed: int, via: str) -> None:
    """Configure both stages for CASES[name], move one tensor `direction` `via` a transport,
    check every receiver."""
    ray = probes.ray
    geom_a, geom_b, dtype = CASES[name]
    geoms = (geom_a, geom_b)
    actors = probes.configure(geoms, AXES, token=b"reshard-test-token")
    src, dst = (0, 1) if direction == "forward" else (1, 0)
    (src_geom, senders), (dst_geom, receivers) = (geoms[src], actors[src]), (geoms[dst], actors[dst])
    key = (seed, direction, 0)
    ray.get([x.expect.remote(SHAPE, dtype, src) for x in receivers], timeout=TIMEOUT)
    recvs = [x.recv.remote(key, SHAPE, dtype, src, TIMEOUT, via) for x in receivers]
    sends = [x.send.remote(key, seed, SHAPE, dtype, dst, TIMEOUT, via) for x in senders]
    sent, got = ray.get(sends, timeout=TIMEOUT), ray.get(recvs, timeout=TIMEOUT)

    want = random_array(seed, SHAPE, dtype)
    plan = edge_plan(src_geom, dst_geom, AXES, SHAPE, dtype)
    dst_side = plan.dst
    boxes = shard_boxes(dst_side, SHAPE)
    for host, out in zip(dst_geom.hosts, got):
        alias = ALIASES.get((name, direction))
        where = f"{name} {direction}{f' ({alias})' if alias else ''}, destination host {host}"
        assert out["sharding_ok"], f"{where}: the array does not carry the destination sharding"
        # JAX's shard positions on this host are exactly the plan's boxes for this host's devices
        expected_boxes = sorted(boxes[d] for d in dst_side.devices_on(host))
        assert sorted(index for index, _ in out["shards"]) == expected_boxes, where
        for index, data in out["shards"]:
            assert_bits_equal(data, want[tuple(slice(lo, hi) for lo, hi in index)], f"{where}, shard {index}")
        if len(dst_geom.hosts) == 1:
            assert_bits_equal(out["full"], want, f"{where}, whole array")
        else:
            assert out["full"] is None, f"{where}: one host of two cannot hold the whole array"
    # every byte crossed once and only what the destination lacked: the plan's lower bound
    assert sum(s["sent_bytes"] for s in sent) == plan.cross_host_bytes == plan.lower_bound_bytes
    if via != "ray":      # the reader threads placed the tiles; nothing is left waiting
        states = ray.get([x.mailbox_state.remote() for x in receivers], timeout=TIMEOUT)
        assert all(st == {"delivered": [], "pending": 0} for st in states), states
        counts = [c[via] for c in ray.get([x.transport_counts.remote() for x in senders], timeout=TIMEOUT)]
        pairs = sum(1 for s in src_geom.hosts for d, tiles in plan.sends[s].items() if tiles)
        way, other = ("shm", "stream") if via == "shm" else ("stream", "shm")   # (fresh transports per case)
        assert sum(c[way] for c in counts) == pairs and sum(c[other] for c in counts) == 0, (via, counts)
        return
    # exactly one delivery per (source host, destination host) pair with tiles, all taken
    for host, state in zip(dst_geom.hosts, ray.get([x.mailbox_state.remote() for x in receivers], timeout=TIMEOUT)):
        senders_to_host = sorted(s for s, per_dst in plan.sends.items() if per_dst.get(host))
        # (several senders deliver concurrently, so in any order)
        assert sorted(state["delivered"]) == [(*key, s) for s in senders_to_host], (host, state)
        assert state["pending"] == 0, (host, state)


@pytest.mark.parametrize("via", ["tcp", "shm", "shm-full", "ray"])
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("name", list(CASES))
def test_tensor_arrives_bit_identical(probes, name, direction, via):
    seed = 1000 * list(CASES).index(name) + (direction == "backward") + 10 * (via == "ray")
    move(probes, name, direction, seed, via)


def test_two_destination_hosts_get_one_object_each(probes):
    """1 host -> hosts (1, 2): each destination host is sent to once, only its half of the batch."""
    geom_a, geom_b, dtype = CASES["1-host-vs-2-hosts"]
    plan = edge_plan(geom_a, geom_b, AXES, SHAPE, dtype)
    assert sorted(plan.sends[0]) == [1, 2]
    half = int(np.prod(SHAPE)) * np.dtype(dtype).itemsize // 2
    assert [sum(t.nbytes for t in plan.sends[0][h]) for h in (1, 2)] == [half, half]
    # both devices of a host want the same half: each tile has two targets, sent once
    assert all(len(t.targets) == 2 for h in (1, 2) for t in plan.sends[0][h])
    move(probes, "1-host-vs-2-hosts", "forward", seed=7, via="ray")


def test_probe_actors_leave_nothing_behind(probes, no_leaks):
    """Last in the module: kill the shared actors; `no_leaks` checks none survives."""
    probes.close()
