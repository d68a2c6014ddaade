"""`platform: tpu` — Cloud TPU VM slices (GCE `ray up` or GKE/KubeRay).

Answers:
  hosts/devices   Ray's TPU node labels: every TPU VM carries `ray.io/tpu-slice-name`,
                  `ray.io/tpu-worker-id`, `ray.io/tpu-pod-type` and a `TPU: <chips>`
                  resource; worker 0 of each slice also has `TPU-<pod type>-head: 1`.
                  `sites()` binds the job's slice indices to intact slices of
                  `tpu.type` (all workers 0..n-1 alive, idle ones first).
  host order      cluster host i of a slice is the TPU VM at PHYSICAL position i of the
                  slice's host grid, row-major (what TPU_PROCESS_BOUNDS and an aligned
                  subslice mean). A VM's `ray.io/tpu-worker-id` need not be that position:
                  where Ray has labelled the slice's VMs from libtpu's chip coordinates
                  (`ray.io/tpu-subslice-<topology>`, Ray's subslice discovery), the one-VM
                  label IS the physical position and `sites()` pins host i to the VM that has
                  it; without those labels the worker id is taken as the position.
  bundle          {"CPU": cpus_per_host, "TPU": chips of the host, **resources_per_host}
                  pinned to (slice, worker id) with `bundle_label_selector`; the bundle
                  on worker 0 also takes the slice's `TPU-<pod type>-head` resource, which
                  gangs the slice: no other job can claim it while we hold it.
  actor           resources={"TPU": chips}: Ray sets TPU_VISIBLE_CHIPS (and for 1-2
                  chips TPU_CHIPS_PER_HOST_BOUNDS) itself.
  env / jax init  by the stage's shape (`stage_kind`):
    whole slices  JAX_PLATFORMS=tpu and `jax.distributed.initialize()` without arguments
                  (JAX's Cloud TPU auto-detection: process id = TPU worker id, which is
                  why bundles are pinned to worker ids); over n > 1 slices also
                  MEGASCALE_COORDINATOR_ADDRESS/NUM_SLICES/SLICE_ID/PORT (DCN).
    one host of a multi-host slice, or part of a host (1/2/4 chips)
                  a single-process JAX world on those chips: TPU_PROCESS_BOUNDS=1,1,1,
                  TPU_CHIPS_PER_PROCESS_BOUNDS=<chip grid>, a process port of its own
                  per process on the VM (TPU_PROCESS_PORT, TPU_MESH_CONTROLLER_*).
    ICI-aligned subslice of several hosts (e.g. 2 of the 4 hosts of a v5e-16)
                  TPU_PROCESS_BOUNDS=<subslice host grid>, TPU_PROCESS_ADDRESSES,
                  TPU_WORKER_ID/CLOUD_TPU_TASK_ID = index in the subslice, and an
                  explicit `jax.distributed.initialize(coordinator, n, i)`.
  legal shapes    a stage takes whole slices, one host, an aligned subslice of
                  consecutive workers, or (partial hosts) exactly one host;
                  anything else is refused at `check_job` with the legal options.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

from orchestrator.core.backends.base import Backend, Node, PlacementError
from orchestrator.core.backends.jaxinit import JaxInit
from orchestrator.core.backends.tpu_topology import (WORKER_DIMS, aligned_block, chip_bounds, geometry,
                                                     process_bounds)

__all__ = ["TpuBackend", "TpuSite", "SLICE_LABEL", "WORKER_LABEL", "POD_TYPE_LABEL", "SUBSLICE_LABEL"]

SLICE_LABEL = "ray.io/tpu-slice-name"
WORKER_LABEL = "ray.io/tpu-worker-id"
POD_TYPE_LABEL = "ray.io/tpu-pod-type"
SUBSLICE_LABEL = "ray.io/tpu-subslice-"      # + topology: Ray's subslice index, from physical positions
MEGASCALE_PORT = "8081"          # Ray's DEFAULT_MEGASCALE_PORT
PROCESS_PORT = 8471              # libtpu's default TPU_PROCESS_PORT
MESH_CONTROLLER_PORT = 8476      # per-process port for single-process worlds on a shared VM


@dataclass(frozen=True)
class TpuSite:
    """Where one host bundle goes: slice (index in the job, Ray's name), worker id, slot on the VM."""

    slice_index: int
    slice_name: str
    worker: int
    slot: int


class TpuBackend(Backend):
    platform = "tpu"
    needs_addresses = True   # MEGASCALE coordinator, subslice process addresses

    @cached_property
    def geom(self):
        t = self.cluster.tpu
        return geometry(t.type, t.topology, t.chips_per_host)

    @property
    def chips(self) -> int:
        """Chips per meshpipe host (= per bundle / actor)."""
        return self.cluster.devices_per_host // self.geom.devices_per_chip

    @property
    def per_vm(self) -> int:
        """meshpipe hosts per TPU VM (1 unless hosts are parts of VMs)."""
        return max(1, self.geom.chips_per_host // max(1, self.chips))

    @property
    def per_slice(self) -> int:
        return self.geom.hosts * self.per_vm

    # -- config time ---------------------------------------------------------
    def check_cluster(self):
        cl, g = self.cluster, self.geom
        dph, dpc, cph = cl.devices_per_host, g.devices_per_chip, g.chips_per_host
        what = f"tpu.type {cl.tpu.type} ({g.hosts} VM(s) of {cph} chips, {dpc} jax device(s) per chip)"
        if dph % dpc or dph // dpc not in (1, 2, 4, 8) or dph // dpc > cph or cph % (dph // dpc):
            return [("devices_per_host", dph, f"with {what} a host is a whole VM ({cph * dpc} devices) or "
                     f"1, 2 or 4 of its chips (× {dpc} devices) dividing the VM")]
        out = []
        want = cl.tpu.slices * self.per_slice
        if cl.hosts != want:
            part = f", each VM split into {self.per_vm} hosts of {self.chips} chips" if self.per_vm > 1 else ""
            out.append(("hosts", cl.hosts, f"must equal tpu.slices × hosts per slice = {cl.tpu.slices} × "
                        f"{self.per_slice} = {want} ({what}{part})"))
        if cl.placement_strategy == "STRICT_SPREAD" and self.per_vm > 1:
            out.append(("placement_strategy", cl.placement_strategy, f"STRICT_SPREAD puts every host on its own "
                        f"node, but {self.per_vm} hosts share each TPU VM here; use SPREAD (bundles are pinned "
                        "to TPU workers by labels anyway)"))
        if cl.placement_strategy == "STRICT_PACK" and cl.tpu.slices * g.hosts > 1:
            out.append(("placement_strategy", cl.placement_strategy, f"STRICT_PACK needs one node, but the "
                        f"cluster is {cl.tpu.slices * g.hosts} TPU VMs; use SPREAD"))
        return out

    def stage_kind(self, hosts: Sequence[int]) -> tuple:
        """("slices", n) | ("host",) | ("partial",) | ("subslice", topology, worker dims) | ("illegal", why)."""
        a, h, s = hosts[0], len(hosts), self.per_slice
        if self.per_vm > 1:
            return ("partial",) if h == 1 else ("illegal", "a host here is part of a TPU VM, and a multi-host "
                                                "submesh needs whole VMs")
        if a % s == 0 and h % s == 0:
            return ("slices", h // s)
        if h == 1:
            return ("host",)
        if a // s == (a + h - 1) // s:
            blk = aligned_block(self.geom, a % s, h)
            if blk:
                return ("subslice", *blk)
            return ("illegal", f"workers {a % s}..{a % s + h - 1} of a slice are not an ICI-aligned subslice")
        return ("illegal", "it crosses a slice boundary without taking whole slices")

    def legal_shapes(self) -> str:
        g, s = self.geom, self.per_slice
        if self.per_vm > 1:
            return f"exactly 1 host per stage (a host is {self.chips} of the {g.chips_per_host} chips of one VM)"
        if s == 1:
            return "any number of hosts (each host is a whole single-VM slice; several slices join over DCN)"
        opts = ["1 host"]
        for h in range(2, s):
            starts = [w for w in range(s) if aligned_block(g, w, h)]
            if starts:
                opts.append(f"{h} hosts starting at worker {' or '.join(map(str, starts))} of a slice "
                            f"(subslice {aligned_block(g, starts[0], h)[0]})")
        opts.append(f"a multiple of {s} hosts starting at a slice boundary (whole slices)")
        return "; ".join(opts)

    def check_stages(self, stage_hosts):
        out = []
        s = self.per_slice
        for i, hosts in enumerate(stage_hosts):
            if not hosts:
                continue
            kind = self.stage_kind(hosts)
            if kind[0] != "illegal":
                continue
            a, b = hosts[0], hosts[-1]
            where = (f"cluster hosts {a}..{b} = slice {a // s} worker {(a % s) // self.per_vm}"
                     f"{'' if a // s == b // s and a == b else f' .. slice {b // s} worker {(b % s) // self.per_vm}'}")
            out.append((f"pipeline.stages[{i}].hosts", len(hosts),
                        f"illegal TPU submesh: stage {i} would take {where}, but {kind[1]}; with tpu.type "
                        f"{self.cluster.tpu.type} ({self.geom.topology}) a stage takes {self.legal_shapes()}"))
        return out

    # -- the live cluster ----------------------------------------------------
    def sites(self, n_hosts, nodes=None):
        needed = -(-n_hosts // self.per_slice) if n_hosts else 0
        names = self.bind(needed, nodes) if nodes is not None else [f"<slice {j}>" for j in range(needed)]
        workers = [self.physical_workers(name, nodes) if nodes is not None else None for name in names]
        out = []
        for b in range(n_hosts):
            j, r = divmod(b, self.per_slice)
            pos = r // self.per_vm
            out.append(TpuSite(j, names[j], workers[j][pos] if workers[j] else pos, r % self.per_vm))
        return out

    def physical_workers(self, slice_name: str, nodes: Sequence[Node]) -> dict[int, int]:
        """{physical position: worker id} of one slice's VMs (module docstring, host order).

        The one-VM subslice label (`ray.io/tpu-subslice-2x2` on a 2-D slice, `-2x2x1` on a 3-D
        one) is Ray's row-major physical position; without it on every VM, the worker ids.
        Raises PlacementError when the labels are not one position per VM."""
        members = [n for n in nodes if n.labels.get(SLICE_LABEL) == slice_name and WORKER_LABEL in n.labels]
        dims = self.geom.worker_dims
        unit = next((t for t, d in WORKER_DIMS.items() if dims and len(d) == len(dims) and all(x == 1 for x in d)),
                    None)
        key = SUBSLICE_LABEL + unit if unit else None
        if key is None or not members or not all(key in n.labels for n in members):
            return {int(n.labels[WORKER_LABEL]): int(n.labels[WORKER_LABEL]) for n in members}
        out = {int(n.labels[key]): int(n.labels[WORKER_LABEL]) for n in members}
        if sorted(out) != list(range(self.geom.hosts)) or len(out) != len(members):
            seen = {n.labels[WORKER_LABEL]: n.labels[key] for n in members}
            raise PlacementError(f"cluster.tpu.type = {self.cluster.tpu.type!r}: slice {slice_name}'s {key} labels "
                                 f"are not one physical position 0..{self.geom.hosts - 1} per TPU VM (worker id → "
                                 f"position: {seen}); Ray's subslice discovery writes them from libtpu's chip "
                                 "coordinates")
        return out

    def check_live(self, n_hosts, nodes):
        self.sites(n_hosts, nodes)

    def bind(self, needed: int, nodes: Sequence[Node]) -> list[str]:
        """Names of `needed` intact slices of our type, idle ones first; PlacementError if too few."""
        g, key = self.geom, f"cluster.tpu.type = {self.cluster.tpu.type!r}"
        tpu_nodes = [n for n in nodes if n.resources.get("TPU", 0) > 0]
        if not tpu_nodes:
            raise PlacementError(f"{key}: the live cluster has no node with a TPU resource "
                                 f"({len(nodes)} node(s)); start Ray on the TPU VMs (see docs/guides/scaling-out.md)")
        bare = [n.node_id[:8] for n in tpu_nodes if SLICE_LABEL not in n.labels or WORKER_LABEL not in n.labels]
        if bare:
            raise PlacementError(f"{key}: TPU node(s) {', '.join(bare)} lack the {SLICE_LABEL} / {WORKER_LABEL} "
                                 "labels that pin each host bundle to its TPU worker; Ray sets them on Cloud TPU "
                                 "VMs and GKE TPU pods (TPU_NAME / TPU_WORKER_ID)")
        slices: dict[str, list[Node]] = defaultdict(list)
        for n in tpu_nodes:
            if n.labels.get(POD_TYPE_LABEL) == g.pod_type:
                slices[n.labels[SLICE_LABEL]].append(n)
        intact, broken = [], []
        for name, members in sorted(slices.items()):
            workers = sorted(int(n.labels[WORKER_LABEL]) for n in members)
            if workers == list(range(g.hosts)) and all(n.resources.get("TPU") == g.chips_per_host for n in members):
                head = next(n for n in members if n.labels[WORKER_LABEL] == "0")
                idle = all(n.free("TPU") >= n.resources["TPU"] for n in members) and head.free(g.head_resource) >= 1
                intact.append((not idle, name))
            else:
                broken.append(f"{name} (workers {workers}, TPU {[n.resources.get('TPU') for n in members]})")
        if len(intact) < needed:
            seen = sorted({n.labels.get(POD_TYPE_LABEL, "?") for n in tpu_nodes})
            raise PlacementError(
                f"{key}: the job needs {needed} intact {g.pod_type} slice(s) ({g.hosts} TPU VM(s) with TPU = "
                f"{g.chips_per_host}, workers 0..{g.hosts - 1}) but the live cluster has {len(intact)}"
                f"{': ' + ', '.join(n for _, n in sorted(intact)) if intact else ''}"
                f"{'; incomplete: ' + '; '.join(broken) if broken else ''}; TPU pod types present: {', '.join(seen)}")
        return [name for _, name in sorted(intact)[:needed]]

    # -- per host ------------------------------------------------------------
    def bundle(self, host, site):
        b = {"CPU": float(self.cluster.cpus_per_host), "TPU": float(self.chips), **self.extra_resources()}
        if site is not None and site.worker == 0 and site.slot == 0:
            b[self.geom.head_resource] = 1.0
        return b

    def label_selector(self, site):
        return {} if site is None else {SLICE_LABEL: site.slice_name, WORKER_LABEL: str(site.worker)}

    def actor_resources(self):
        return {"num_cpus": float(self.cluster.cpus_per_host),
                "resources": {"TPU": float(self.chips), **self.extra_resources()}}

    def env(self, stage, host, site, addresses):
        env = {"JAX_PLATFORMS": "tpu", "PYTHONUNBUFFERED": "1"}
        kind = self.stage_kind(stage.hosts)
        if kind[0] == "slices" and kind[1] > 1:
            env.update(MEGASCALE_COORDINATOR_ADDRESS=addresses[0], MEGASCALE_NUM_SLICES=str(kind[1]),
                       MEGASCALE_SLICE_ID=str(host // self.per_slice), MEGASCALE_PORT=MEGASCALE_PORT)
        elif kind[0] in ("host", "partial"):
            slot = site.slot if site is not None else 0
            grid = chip_bounds(self.chips)
            env.update(TPU_PROCESS_BOUNDS="1,1,1", TPU_CHIPS_PER_PROCESS_BOUNDS=grid,
                       TPU_HOST_BOUNDS="1,1,1", TPU_CHIPS_PER_HOST_BOUNDS=grid,
                       TPU_PROCESS_PORT=str(PROCESS_PORT + slot),
                       TPU_PROCESS_ADDRESSES=f"localhost:{PROCESS_PORT + slot}", CLOUD_TPU_TASK_ID="0",
                       TPU_MESH_CONTROLLER_ADDRESS=f"localhost:{MESH_CONTROLLER_PORT + slot}",
                       TPU_MESH_CONTROLLER_PORT=str(MESH_CONTROLLER_PORT + slot))
        elif kind[0] == "subslice":
            bounds = process_bounds(kind[2])
            grid = chip_bounds(self.geom.chips_per_host)
            env.update(TPU_PROCESS_BOUNDS=bounds, TPU_CHIPS_PER_PROCESS_BOUNDS=grid,
                       TPU_HOST_BOUNDS=bounds, TPU_CHIPS_PER_HOST_BOUNDS=grid,
                       TPU_PROCESS_PORT=str(PROCESS_PORT),
                       TPU_PROCESS_ADDRESSES=",".join(f"{a}:{PROCESS_PORT}" for a in addresses),
                       TPU_WORKER_HOSTNAMES=",".join(addresses),
                       TPU_WORKER_ID=str(host), CLOUD_TPU_TASK_ID=str(host))
        return env

    def jax_init(self, stage, host):
        n = len(stage.hosts)
        kind = self.stage_kind(stage.hosts)[0]
        if n == 1 or kind in ("host", "partial"):
            return JaxInit("none", 1, 0)
        if kind == "slices":
            return JaxInit("auto", n, host)
        return JaxInit("explicit", n, host)

