"""Cross-mesh resharding plan: named cases, exhaustive small meshes, hypothesis properties.

Pure numpy (no jax, no ray). Every plan goes through `check_plan`, which moves a
global array's source shards through pack/assemble and compares each destination
shard with the numpy slice a NamedSharding asks for, computed here by an
independent reference (`ref_boxes`, np.ravel_multi_index). `shard_boxes` itself is
checked against real JAX in test_reshard_plan_jax.py.
"""
from __future__ import annotations

import itertools
import math
import pathlib
import pickle
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.core.reshard.stream import blocks_on, stream_layout
from orchestrator.core.reshard import (
    MeshSide,
    ReshardError,
    assemble,
    make_plan,
    pack,
    plan_cache,
    shard_boxes,
    shards_of,
)


# ---------------------------------------------------------------- reference + checker

def entry_axes(entry):
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def ref_boxes(side: MeshSide, shape) -> dict[int, tuple[slice, ...]]:
    """NamedSharding semantics written another way: block = ravel_multi_index of the spec's axes."""
    sizes = dict(zip(side.axis_names, side.devices.shape))
    spec = list(side.spec) + [None] * (len(shape) - len(side.spec))
    out = {}
    for coord in np.ndindex(side.devices.shape):
        at = dict(zip(side.axis_names, coord))
        box = []
        for n, entry in zip(shape, spec):
            axes = entry_axes(entry)
            blocks = math.prod(sizes[a] for a in axes)
            b = int(np.ravel_multi_index([at[a] for a in axes], [sizes[a] for a in axes])) if axes else 0
            box.append(slice(b * n // blocks, (b + 1) * n // blocks))
        out[int(side.devices[coord])] = tuple(box)
    return out


def check_plan(plan, flat: bool = False) -> None:
    """Every invariant the plan promises, by brute force."""
    shape, dtype, src, dst = plan.shape, plan.dtype, plan.src, plan.dst
    glob = (np.arange(math.prod(shape)) % 30011).astype(dtype).reshape(shape)
    sboxes, dboxes = ref_boxes(src, shape), ref_boxes(dst, shape)
    assert {d: tuple(slice(a, b) for a, b in box) for d, box in shard_boxes(src, shape).items()} == sboxes

    # sends and recvs describe the same tiles in the same order
    assert set(plan.sends) == set(src.host_ids) and set(plan.recvs) == set(dst.host_ids)
    for s, per in plan.sends.items():
        for d, tiles in per.items():
            assert tiles and all(t.src_host == s and t.dst_host == d for t in tiles)
    for d, tiles in plan.recvs.items():
        assert tiles == tuple(t for s in sorted(plan.sends) for t in plan.sends[s].get(d, ()))

    # pack + assemble reproduce the destination shards
    for d in dst.host_ids:
        received = {}
        for s in src.host_ids:
            mine = {dev: glob[sboxes[dev]] for dev in src.devices_on(s)}  # a host only sees its own shards
            received[s] = pack(plan, s, d, mine)
        if flat:
            received = [a for s in sorted(received) for a in received[s]]
        out = assemble(plan, d, received)
        assert set(out) == set(dst.devices_on(d))
        for dev, arr in out.items():
            np.testing.assert_array_equal(arr, glob[dboxes[dev]])
            assert arr.dtype == dtype and arr.shape == plan.dst_shard_shape

    # tiles: sources and targets on the right hosts, each target element written exactly once,
    # nothing arrives at a host twice, nothing crosses to a host that already holds it
    per_dev = {dev: np.zeros(plan.dst_shard_shape, int) for dev in dst.devices.ravel().tolist()}
    lower = 0
    for d, tiles in plan.recvs.items():
        needed = np.zeros(shape, bool)
        for dev in dst.devices_on(d):
            needed[dboxes[dev]] = True
        held = np.zeros(shape, bool)
        for dev in src.devices_on(d):
            held[sboxes[dev]] = True
        arrived = np.zeros(shape, int)
        for t in tiles:
            where = tuple(slice(a, b) for a, b in t.box)
            assert src.host_of(t.src_device) == t.src_host
            assert t.nbytes == math.prod(t.shape) * dtype.itemsize
            arrived[where] += 1
            if not t.is_local:
                assert not held[where].any(), f"{t} sends data host {d} already holds"
            for dev, local in t.targets:
                assert dst.host_of(dev) == d
                per_dev[dev][local] += 1
        assert arrived.max(initial=0) <= 1, f"host {d} receives some data twice"
        assert ((arrived > 0) == needed).all()
        lower += int((needed & ~held).sum()) * dtype.itemsize
    for dev, count in per_dev.items():
        assert (count == 1).all(), f"device {dev} shard not covered exactly once"
    check_streams(plan, glob, sboxes, dboxes)
    tiles = plan.tiles
    assert plan.lower_bound_bytes == lower
    assert plan.cross_host_bytes == lower
    assert plan.cross_host_bytes == sum(t.nbytes for t in tiles if not t.is_local)
    assert plan.local_bytes == sum(t.nbytes for t in tiles if t.is_local)
    assert plan.to_json()["tiles"] == len(tiles)

    # replicated source: when every source host holds every block, senders are balanced
    # within one tile (greedy least-loaded over largest-first pieces)
    held_by = {s: {tuple((b.start, b.stop) for b in sboxes[dev]) for dev in src.devices_on(s)}
               for s in src.host_ids}
    if len({frozenset(v) for v in held_by.values()}) == 1:
        loads = [sum(t.nbytes for ts in plan.sends[s].values() for t in ts if not t.is_local)
                 for s in src.host_ids]
        biggest = max((t.nbytes for t in tiles if not t.is_local), default=0)
        assert max(loads) - min(loads) <= biggest


def check_streams(plan, glob, sboxes, dboxes) -> None:
    """Stream layouts: the sender's runs (or its staged blocks) written in order and read back
    through the receiver's runs rebuild every destination shard, each block in one run when
    one source host supplies it."""
    for d in plan.dst.host_ids:
        blocks = blocks_on(plan, d)
        bufs = {b: np.zeros(plan.dst_shard_shape, plan.dtype) for b in set(blocks.values())}
        for s in plan.src.host_ids:
            lay = stream_layout(plan, s, d)
            shards = {dev: np.ascontiguousarray(glob[sboxes[dev]]).reshape(-1).view(np.uint8)
                      for dev in plan.src.devices_on(s)}
            stream = b"".join(shards[dev][off:off + n].tobytes() for dev, off, n in lay.send.tolist())
            assert len(stream) == lay.nbytes == sum(t.nbytes for t in plan.sends[s].get(d, ()))
            pos = 0
            for seg in lay.segments:          # staging a whole block gives the same bytes
                a, b = lay.send[seg.send[0]:seg.send[1], 2].sum(), pos
                if seg.whole:
                    staged = np.zeros(plan.dst_shard_shape, plan.dtype)
                    for t in seg.tiles:
                        staged[t.targets[0][1]] = glob[sboxes[t.src_device]][t.src_slice]
                    assert staged.tobytes() == stream[b:b + a]
                    assert [r for r in lay.recv.tolist() if r[0] == seg.block] == [[seg.block, 0, a]]
                pos += a
            pos = 0
            for block, off, n in lay.recv.tolist():
                bufs[block].reshape(-1).view(np.uint8)[off:off + n] = np.frombuffer(stream[pos:pos + n], np.uint8)
                pos += n
            assert pos == len(stream)
        for dev, block in blocks.items():
            np.testing.assert_array_equal(bufs[block], glob[dboxes[dev]])


def side(shape, names, spec, hosts, devices=None) -> MeshSide:
    n = math.prod(shape)
    devices = np.arange(n) if devices is None else np.asarray(devices)
    return MeshSide(devices.reshape(shape), np.asarray(hosts).reshape(shape), tuple(names), tuple(spec))


def sent_by(plan) -> dict[int, int]:
    return {s: sum(t.nbytes for ts in per.values() for t in ts if not t.is_local)
            for s, per in plan.sends.items()}


# ---------------------------------------------------------------- named cases

F32_8x8 = 8 * 8 * 4

NAMED = {
    # name: (src, dst, shape, cross_host_bytes, local_bytes)
    "2x2->4x1": (side((2, 2), "xy", ("x", "y"), [0, 0, 1, 1]),
                 side((4, 1), "ab", ("a", None), [2, 2, 3, 3]), (8, 8), F32_8x8, 0),
    "replicated->sharded": (side((2,), "x", (), [0, 1]),
                            side((4,), "a", ("a",), [2, 2, 3, 3]), (8, 8), F32_8x8, 0),
    "sharded->replicated": (side((4,), "a", ("a",), [0, 0, 1, 1]),
                            side((2,), "x", (), [0, 1]), (8, 8), F32_8x8, F32_8x8),
    "1->8": (side((1,), "x", (), [0]),
             side((8,), "a", ("a",), [1] * 4 + [2] * 4), (8, 8), F32_8x8, 0),
    "8->1": (side((8,), "a", ("a",), [0] * 4 + [1] * 4),
             side((1,), "x", (), [0]), (8, 8), F32_8x8 // 2, F32_8x8 // 2),
    "transposed spec": (side((2, 2), "xy", ("x", "y"), [0, 0, 1, 1]),
                        side((2, 2), "xy", ("y", "x"), [0, 0, 1, 1]), (8, 8), F32_8x8 // 2, F32_8x8 // 2),
    "swap sharded dim": (side((2,), "x", ("x", None), [0, 1]),
                         side((2,), "x", (None, "x"), [0, 1]), (8, 8), F32_8x8 // 2, F32_8x8 // 2),
    "two mesh axes on one dim": (side((2, 2), "xy", (("x", "y"),), [0, 0, 1, 1]),
                                 side((2, 2), "xy", (("y", "x"),), [0, 0, 1, 1]), (8, 8), F32_8x8 // 2,
                                 F32_8x8 // 2),
    "replicated 2 hosts -> 2 hosts": (side((2,), "x", (), [0, 1]),
                                      side((2,), "y", (), [2, 3]), (8, 8), 2 * F32_8x8, 0),
    "identity": (side((2, 2), "xy", ("x",), [0, 0, 1, 1]),
                 side((2, 2), "xy", ("x",), [0, 0, 1, 1]), (8, 8), 0, F32_8x8),
}


@pytest.mark.parametrize("name", list(NAMED))
def test_named_case(name):
    src, dst, shape, cross, local = NAMED[name]
    plan = make_plan(shape, np.float32, src, dst)
    check_plan(plan)
    check_plan(plan, flat=True)
    assert (plan.cross_host_bytes, plan.local_bytes) == (cross, local), plan.describe()


def test_replicated_source_spreads_over_both_senders():
    src, dst, shape, *_ = NAMED["replicated 2 hosts -> 2 hosts"]
    plan = make_plan(shape, np.float32, src, dst)
    assert sent_by(plan) == {0: F32_8x8, 1: F32_8x8}
    src, dst, shape, *_ = NAMED["replicated->sharded"]
    assert sent_by(make_plan(shape, np.float32, src, dst)) == {0: F32_8x8 // 2, 1: F32_8x8 // 2}


def test_one_arrival_per_host_placed_on_every_device():
    src = side((2,), "x", ("x",), [0, 1])
    dst = side((2, 2), "ab", ("a",), [5, 5, 5, 5])  # replicated over b: two devices want each row block
    plan = make_plan((8, 8), np.float32, src, dst)
    check_plan(plan)
    assert [len(t.targets) for t in plan.recvs[5]] == [2, 2]
    assert plan.cross_host_bytes == F32_8x8


def test_local_data_is_copied_not_sent():
    src = side((2,), "x", ("x",), [0, 1])
    dst = side((2,), "y", (None, "y"), [1, 0])
    plan = make_plan((4, 4), np.int32, src, dst)
    check_plan(plan)
    assert {(t.src_host, t.dst_host) for t in plan.tiles if t.is_local} == {(0, 0), (1, 1)}
    assert plan.cross_host_bytes == plan.local_bytes == 32


def test_scalar_and_empty_arrays():
    one = side((2,), "x", (), [0, 1])
    check_plan(make_plan((), np.float64, one, side((2,), "y", (), [2, 2])))
    plan = make_plan((0, 4), np.float32, side((2,), "x", ("x",), [0, 1]), side((2,), "y", (None, "y"), [2, 3]))
    check_plan(plan)
    assert plan.tiles == () and plan.dst_shard_shape == (0, 2)


# ---------------------------------------------------------------- rejection

BAD = [
    # (src, dst, shape, fragment of the reason)
    (side((2, 2), "xy", ("x", "y"), [0, 0, 1, 1]), side((4,), "a", ("a",), [2] * 4), (6, 8), "dim 0 of size 6"),
    (side((4,), "a", ("a",), [0] * 4), side((2,), "x", (), [1, 1]), (6, 8), "into 4 equal blocks"),
    (side((2, 2), "xy", (("x", "y"),), [0] * 4), side((2,), "a", (None, "a"), [1, 1]), (8, 3), "size 3"),
    (side((2,), "x", ("x",), [0, 1]), side((2,), "a", ("b",), [1, 1]), (8, 8), "mesh axis 'b'"),
    (side((2, 2), "xy", ("x", "x"), [0] * 4), side((2,), "a", (), [1, 1]), (8, 8), "'x' twice"),
    (side((2, 2), "xy", (("x", "y"), "y"), [0] * 4), side((2,), "a", (), [1, 1]), (8, 8), "'y' twice"),
    (side((2,), "x", ("x", None, None), [0, 1]), side((2,), "a", (), [1, 1]), (8, 8), "3 entries"),
]


@pytest.mark.parametrize("src,dst,shape,reason", BAD)
def test_bad_shardings_rejected_with_context(src, dst, shape, reason):
    with pytest.raises(ReshardError) as info:
        make_plan(shape, np.float32, src, dst)
    msg = str(info.value)
    assert isinstance(info.value, ValueError)
    assert str(list(shape)) in msg and src.describe() in msg and dst.describe() in msg, msg
    assert reason in msg, msg
    with pytest.raises(ReshardError):
        plan_cache(shape, np.float32, src, dst)


def test_describe_names_axis_sizes_and_spec():
    assert side((2, 4), ("data", "model"), ("model", None), [0] * 8).describe() == \
        "mesh(data=2, model=4) P('model', None)"


@pytest.mark.parametrize("kwargs,reason", [
    (dict(devices=np.arange(4).reshape(2, 2), hosts=np.zeros(4, int), axis_names=("x", "y")), "hosts shape"),
    (dict(devices=np.arange(4).reshape(2, 2), hosts=np.zeros((2, 2), int), axis_names=("x",)), "axis_names"),
    (dict(devices=np.zeros((2, 2), int), hosts=np.zeros((2, 2), int), axis_names=("x", "y")), "distinct"),
    (dict(devices=np.arange(4).reshape(2, 2), hosts=np.zeros((2, 2), int), axis_names=("x", "x")), "repeat"),
    (dict(devices=np.arange(2), hosts=np.zeros(2, int), axis_names=("x",), spec=(1,)), "spec entry"),
])
def test_malformed_side_rejected(kwargs, reason):
    with pytest.raises(ReshardError, match=reason):
        MeshSide(**kwargs)


# ---------------------------------------------------------------- values, caching, transport helpers

def test_sides_compare_by_value_and_plans_are_cached():
    a = side((2, 2), "xy", (("x",), None), [0, 0, 1, 1])
    b = MeshSide([[0, 1], [2, 3]], [[0, 0], [1, 1]], ("x", "y"), ["x", ()])
    assert a == b and hash(a) == hash(b) and a.spec == ("x", None)
    assert a != side((2, 2), "xy", ("x", None), [0, 1, 0, 1])
    with pytest.raises(ValueError):
        a.devices[0, 0] = 7  # read-only copy
    dst = side((4,), "a", (None, "a"), [2, 2, 3, 3])
    plan_cache.cache_clear()
    p1 = plan_cache((8, 8), "float32", a, dst)
    p2 = plan_cache([8, 8], np.float32, b, dst)
    assert p1 is p2 and plan_cache.cache_info().hits == 1
    assert plan_cache((8, 8), "float16", a, dst) is not p1


def test_plan_is_immutable_printable_and_picklable():
    src, dst, shape, *_ = NAMED["2x2->4x1"]
    plan = make_plan(shape, np.float32, src, dst)
    with pytest.raises(TypeError):
        plan.recvs[2] = ()
    with pytest.raises(AttributeError):
        plan.cross_host_bytes = 0
    again = pickle.loads(pickle.dumps(plan))
    assert again.recvs == plan.recvs and again.sends == plan.sends and again.src == plan.src
    check_plan(again)
    text = plan.describe()
    assert "host 0 -> host 2" in text and "lower bound 256 B" in text and "8 tiles" in text
    assert "tiles=8" in repr(plan)
    assert plan.describe(max_pairs=1).splitlines()[-1] == "  ... 1 more host pairs, 128 B"
    summary = plan.to_json()
    assert {k: summary[k] for k in ("cross_host_bytes", "lower_bound_bytes", "local_bytes", "tiles")} == \
        {"cross_host_bytes": 256, "lower_bound_bytes": 256, "local_bytes": 0, "tiles": 8}


def test_pack_and_assemble_check_their_inputs():
    src, dst, shape, *_ = NAMED["2x2->4x1"]
    plan = make_plan(shape, np.float32, src, dst)
    glob = np.arange(64, dtype=np.float32).reshape(shape)
    shards = shards_of(glob, src)
    with pytest.raises(ValueError, match="shard has shape"):
        pack(plan, 0, 2, {d: s[:1] for d, s in shards.items()})
    tiles = pack(plan, 0, 2, shards)
    assert pack(plan, 0, 0, shards) == [] and pack(plan, 9, 2, shards) == []
    assert len(tiles) == 4 and not plan.sends[1].get(2)  # host 2's rows all live on host 0
    with pytest.raises(ValueError, match="expects 4 tiles from host 0, got 3"):
        assemble(plan, 2, {0: tiles[:3]})
    with pytest.raises(ValueError, match="not source hosts"):
        assemble(plan, 2, {0: tiles, 7: []})
    with pytest.raises(ValueError, match="expects 4 tiles, got 3"):
        assemble(plan, 2, tiles[:3])
    with pytest.raises(ValueError, match="arrived with shape"):
        assemble(plan, 2, [tiles[0].T] + tiles[1:])


# ---------------------------------------------------------------- exhaustive small meshes

def all_specs(names, ndim):
    """Every spec for an ndim array over these mesh axes (each axis at most once, any order)."""
    options = [None] + [p for k in range(1, len(names) + 1) for p in itertools.permutations(names, k)]
    for entries in itertools.product(options, repeat=ndim):
        used = [a for e in entries if e for a in e]
        if len(used) == len(set(used)):
            yield tuple(e if e is None or len(e) > 1 else e[0] for e in entries)


SMALL_MESHES = [((4,), "a", ([0, 0, 1, 1], [0, 1, 2, 3])),
                ((2, 2), "xy", ([0, 0, 1, 1], [0, 1, 0, 1], [0, 0, 0, 0]))]
SMALL_SIDES = [side(shape, names, spec, hosts)
               for shape, names, layouts in SMALL_MESHES
               for spec in all_specs(names, 2) for hosts in layouts]


@pytest.mark.parametrize("dst_offset", [0, 2])
def test_exhaustive_small_meshes(dst_offset):
    count = 0
    for src in SMALL_SIDES:
        for d in SMALL_SIDES:
            dst = MeshSide(d.devices, d.hosts + dst_offset, d.axis_names, d.spec)
            check_plan(make_plan((4, 8), np.int16, src, dst))
            count += 1
    assert count == len(SMALL_SIDES) ** 2 > 500


# ---------------------------------------------------------------- hypothesis properties

MESH_SHAPES = [s for k in (1, 2, 3) for s in itertools.product((1, 2, 4, 8), repeat=k) if math.prod(s) <= 8]


@st.composite
def mesh_sides(draw, ndim, pool, host_base):
    mesh = draw(st.sampled_from(MESH_SHAPES))
    names = tuple(draw(st.permutations(pool))[: len(mesh)])
    free = list(draw(st.permutations(names)))
    spec = []
    for _ in range(draw(st.one_of(st.just(ndim), st.integers(0, ndim)))):
        k = min(draw(st.sampled_from([0, 1, 1, 2])), len(free))
        axes, free = free[:k], free[k:]
        spec.append(None if not axes else tuple(axes) if k > 1 or draw(st.booleans()) else axes[0])
    n = math.prod(mesh)
    devices = np.array(draw(st.permutations(range(100, 100 + n)))).reshape(mesh)
    n_hosts = draw(st.integers(1, n))
    hosts = np.array(draw(st.lists(st.integers(0, n_hosts - 1), min_size=n, max_size=n))).reshape(mesh)
    base = draw(host_base)
    return MeshSide(devices, hosts + base, names, tuple(spec))


@st.composite
def reshard_cases(draw):
    ndim = draw(st.integers(1, 3))
    src = draw(mesh_sides(ndim, ("x", "y", "z"), st.just(0)))
    dst = draw(mesh_sides(ndim, ("x", "y", "z", "w"), st.integers(0, 6)))
    shape = []
    for d in range(ndim):
        blocks = [math.prod(s.mesh_shape[a] for a in entry_axes(s.spec[d] if d < len(s.spec) else None))
                  for s in (src, dst)]
        shape.append(math.lcm(*blocks) * draw(st.integers(1, 3)))
    dtype = draw(st.sampled_from([np.float32, np.int16, np.float64, np.uint8]))
    return tuple(shape), dtype, src, dst


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=reshard_cases(), flat=st.booleans())
def test_random_reshards_hold_every_invariant(case, flat):
    shape, dtype, src, dst = case
    check_plan(make_plan(shape, dtype, src, dst), flat=flat)


@settings(max_examples=100, deadline=None)
@given(case=reshard_cases(), extra=st.integers(1, 7))
def test_indivisible_shapes_rejected(case, extra):
    shape, dtype, src, dst = case
    blocks = [math.prod(dst.mesh_shape[a] for a in entry_axes(e)) for e in dst.spec]
    sharded = [d for d, b in enumerate(blocks) if b > 1 and extra % b]
    if not sharded:
        return
    bad = list(shape)
    bad[sharded[0]] += extra
    with pytest.raises(ReshardError) as info:
        make_plan(bad, dtype, src, dst)
    assert str(bad) in str(info.value) and dst.describe() in str(info.value)


def test_plan_modules_import_neither_jax_nor_ray():
    code = ("import sys, orchestrator.core.reshard; "
            "assert not {'jax', 'ray'} & set(sys.modules), sorted({'jax', 'ray'} & set(sys.modules))")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=pathlib.Path(__file__).parents[1])
