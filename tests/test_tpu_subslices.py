"""meshpipe's TPU sub-slice arithmetic against Ray's own TPU helpers (pure: Ray's functions, no cluster).

Ray (`ray._private.accelerators.tpu`) computes a TPU VM's physical position in its slice from
libtpu's chip coordinates (`_get_physical_worker_id_from_coords`) and labels every VM with its
subslice index per sub-topology (`_build_subslice_labels`); the VM's `ray.io/tpu-worker-id`
need not be that position. These tests build nodes the way Ray would label them, with worker
ids that are NOT row-major, and check that meshpipe pins each stage's hosts to VMs forming one
of Ray's subslices, in physical order.
"""
from __future__ import annotations

import itertools

import pytest

from orchestrator.core.backends import Node, PlacementError, get_backend
from orchestrator.core.backends.tpu import SLICE_LABEL, SUBSLICE_LABEL, WORKER_LABEL
from orchestrator.core.backends.tpu_topology import WORKER_DIMS, aligned_block, geometry
from orchestrator.core.config import check_job, parse_cluster
from orchestrator.core.hosts import plan_hosts
from tests.test_backends import TPU, gpt_job

# Ray 2.60's helpers (2.52 has no `_build_subslice_labels`): imported by the tests, not at collection, so
# the oldest-versions step (Ray 2.52, `-m "not ray_260"`) can collect this file and leave it out
pytestmark = [pytest.mark.ray_260]
POD, TOPO = "v5litepod-16", "4x4"


def _build_subslice_labels(physical: int, topology: str) -> dict:
    from ray._private.accelerators.tpu import _build_subslice_labels as build

    return build(physical, topology)


def _get_physical_worker_id_from_coords(coords: list, topology: str) -> int:
    from ray._private.accelerators.tpu import _get_physical_worker_id_from_coords as physical

    return physical(coords, topology)


def chip_coords(position: int, topology: str) -> list[list[int]]:
    """The [x, y(, z)] chip coordinates of the VM at row-major `position` (4 chips per VM)."""
    chips = [int(d) for d in topology.split("x")]
    dims = WORKER_DIMS[topology]
    if len(dims) == 2:
        (wy, wx), (cy, cx) = dims, (chips[0], chips[1])
        by, bx = cy // wy, cx // wx
        y, x = divmod(position, wx)
        return [[x * bx + i, y * by + j] for j in range(by) for i in range(bx)]
    (wz, wy, wx), (cz, cy, cx) = dims, (chips[0], chips[1], chips[2])
    bz, by, bx = cz // wz, cy // wy, cx // wx
    z, rest = divmod(position, wy * wx)
    y, x = divmod(rest, wx)
    return [[x * bx + i, y * by + j, z * bz + k] for k in range(bz) for j in range(by) for i in range(bx)]


def ray_labelled_nodes(worker_at: list[int], name="tpu-a", topology=TOPO, pod=POD) -> list[Node]:
    """VMs of one slice as Ray labels them: VM at physical position p has worker id worker_at[p],
    and Ray's subslice labels computed from its chip coordinates."""
    out = []
    for pos, worker in enumerate(worker_at):
        physical = _get_physical_worker_id_from_coords(chip_coords(pos, topology), topology)
        assert physical == pos          # the coordinates above are what Ray reads as position `pos`
        res = {"CPU": 8.0, "TPU": 4.0, **({f"TPU-{pod}-head": 1.0} if worker == 0 else {})}
        labels = {SLICE_LABEL: name, WORKER_LABEL: str(worker), "ray.io/tpu-pod-type": pod,
                  **_build_subslice_labels(physical, topology)}
        out.append(Node(f"{name}-vm{pos}", f"10.0.0.{pos}", res, labels, dict(res)))
    return out


def test_meshpipes_aligned_blocks_are_rays_subslices():
    """Every block meshpipe accepts (consecutive physical positions) is one of Ray's subslices."""
    checked = 0
    for parent, dims in WORKER_DIMS.items():
        n = 1
        for d in dims:
            n *= d
        if n == 1:
            continue
        version = "v4" if len(dims) == 3 else "v5litepod"
        cores = n * 4 * (2 if version == "v4" else 1)
        try:
            geom = geometry(f"{version}-{cores}", parent)
        except Exception:
            continue
        labels = [_build_subslice_labels(p, parent) for p in range(geom.hosts)]
        for first, count in itertools.product(range(geom.hosts), range(2, geom.hosts)):
            blk = aligned_block(geom, first, count)
            if blk is None or first + count > geom.hosts:
                continue
            key = SUBSLICE_LABEL + blk[0]
            members = {p for p in range(geom.hosts) if labels[p].get(key) == labels[first][key]}
            assert members == set(range(first, first + count)), (parent, first, count, blk)
            checked += 1
    assert checked >= 10


@pytest.mark.parametrize("worker_at", [
    [0, 1, 2, 3],              # row-major: worker id = position
    [0, 2, 1, 3],              # column-major ids
    [3, 0, 2, 1],              # any order
])
def test_subslice_stages_land_on_one_ray_subslice_in_physical_order(worker_at):
    cluster = parse_cluster(TPU)
    nodes = ray_labelled_nodes(worker_at)
    job = check_job(gpt_job([2, 2], 4), cluster)
    places = plan_hosts(job, nodes)
    by_worker = {int(n.labels[WORKER_LABEL]): n for n in nodes}
    for stage in (0, 1):
        mine = [hp for hp in places if hp.stage == stage]
        vms = [by_worker[int(hp.label_selector[WORKER_LABEL])] for hp in mine]
        # one of Ray's 2x4 subslices, the whole of it
        assert len({vm.labels[SUBSLICE_LABEL + "2x4"] for vm in vms}) == 1
        # host i of the stage is the VM at physical position 2·stage + i (TPU_WORKER_ID, process addresses)
        assert [vm.labels[SUBSLICE_LABEL + "2x2"] for vm in vms] == [str(2 * stage), str(2 * stage + 1)]
        assert [hp.env["TPU_WORKER_ID"] for hp in mine] == ["0", "1"]
        assert mine[0].env["TPU_PROCESS_BOUNDS"] == "2,1,1"
    # the head resource goes to the bundle on worker 0, wherever it sits
    heads = [hp for hp in places if f"TPU-{POD}-head" in hp.bundle_resources]
    assert [hp.label_selector[WORKER_LABEL] for hp in heads] == ["0"]


def test_without_rays_subslice_labels_worker_ids_are_taken_as_positions():
    nodes = ray_labelled_nodes([0, 2, 1, 3])
    bare = [Node(n.node_id, n.address, n.resources, {k: v for k, v in n.labels.items()
                                                      if not k.startswith(SUBSLICE_LABEL)}, n.available) for n in nodes]
    backend = get_backend(parse_cluster(TPU))
    assert backend.physical_workers("tpu-a", bare) == {0: 0, 1: 1, 2: 2, 3: 3}
    assert backend.physical_workers("tpu-a", nodes) == {0: 0, 1: 2, 2: 1, 3: 3}


def test_inconsistent_subslice_labels_are_refused_with_what_was_seen():
    nodes = ray_labelled_nodes([0, 1, 2, 3])
    broken = [Node(n.node_id, n.address, n.resources, {**n.labels, SUBSLICE_LABEL + "2x2": "0"}, n.available)
              for n in nodes]
    with pytest.raises(PlacementError, match=r"ray.io/tpu-subslice-2x2 labels are not one physical position"):
        get_backend(parse_cluster(TPU)).sites(4, broken)
