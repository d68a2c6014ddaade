"""`shard_boxes` / `shard_shape` against real JAX NamedSharding on 8 simulated CPU devices.

JAX runs in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=8 so
the device count does not depend on whether another test imported jax first. The
table covers 1-, 2- and 3-axis meshes (with a scrambled device order), every spec
for 2-dim arrays on several meshes (replicated, partial, two mesh axes on one dim,
either axis order), specs shorter than the rank, and 1-/3-dim arrays.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from orchestrator.core.reshard import MeshSide, shard_boxes, shard_shape

pytest.importorskip("jax")

JAX_SCRIPT = r"""
import json, sys
import numpy as np
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
assert jax.device_count() == 8, jax.devices()
by_id = {d.id: d for d in jax.devices()}
out = []
for case in json.load(sys.stdin):
    devices = np.array([by_id[i] for i in case["devices"]], dtype=object).reshape(case["mesh"])
    spec = PartitionSpec(*[tuple(e) if isinstance(e, list) else e for e in case["spec"]])
    sharding = NamedSharding(Mesh(devices, tuple(case["names"])), spec)
    shape = tuple(case["shape"])
    boxes = {d.id: [list(s.indices(n)[:2]) for s, n in zip(idx, shape)]
             for d, idx in sharding.devices_indices_map(shape).items()}
    out.append({"boxes": boxes, "shard_shape": list(sharding.shard_shape(shape))})
json.dump(out, sys.stdout)
"""

SCRAMBLED = [3, 6, 0, 5, 2, 7, 4, 1]


def all_specs(names, ndim):
    options = [None] + [p for k in range(1, len(names) + 1) for p in itertools.permutations(names, k)]
    for entries in itertools.product(options, repeat=ndim):
        used = [a for e in entries if e for a in e]
        if len(used) == len(set(used)):
            yield tuple(e if e is None or len(e) > 1 else e[0] for e in entries)


def cases():
    table = []
    for mesh, names in [((8,), "a"), ((2, 4), "xy"), ((4, 2), "yx"), ((2, 2, 2), "abc"), ((1, 8), "pq")]:
        n = math.prod(mesh)
        for order in (list(range(n)), SCRAMBLED[:n]):
            for spec in all_specs(names, 2):
                table.append((mesh, names, order, spec, (16, 24)))
    table += [
        ((2, 2, 2), "abc", SCRAMBLED, ("b",), (8, 3, 5)),               # spec shorter than rank
        ((2, 2, 2), "abc", SCRAMBLED, (None, ("c", "a"), "b"), (3, 8, 4)),
        ((2, 4), ("data", "model"), list(range(8)), (("model", "data"),), (16,)),
        ((2, 4), ("data", "model"), SCRAMBLED, (), (5, 7)),               # fully replicated
        ((4,), "a", [6, 1, 3, 4], ("a",), (8,)),                          # 4 of the 8 devices
    ]
    return table


def test_shard_boxes_match_jax_named_sharding():
    table = cases()
    payload = [{"mesh": list(m), "names": list(names), "devices": order,
                "spec": [list(e) if isinstance(e, tuple) else e for e in spec], "shape": list(shape)}
               for m, names, order, spec, shape in table]
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip())
    proc = subprocess.run([sys.executable, "-c", JAX_SCRIPT], input=json.dumps(payload), env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = json.loads(proc.stdout)
    assert len(expected) == len(table) > 150
    for (mesh, names, order, spec, shape), want in zip(table, expected):
        side = MeshSide(np.array(order).reshape(mesh), np.zeros(mesh, int), tuple(names), spec)
        got = {d: [list(b) for b in box] for d, box in shard_boxes(side, shape).items()}
        assert got == {int(d): box for d, box in want["boxes"].items()}, (side, shape)
        assert list(shard_shape(side, shape)) == want["shard_shape"], (side, shape)
