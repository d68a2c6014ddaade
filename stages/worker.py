"""The stage worker: one Ray actor per host of a stage's submesh.

Basic flow (driven by `orchestrator.executor`):
  1. `__init__` runs in a fresh process whose env (XLA_FLAGS device count,
     JAX_PLATFORMS) was set by the actor's runtime_env before jax is imported.
  2. `setup(coordinator)` — for a multi-host stage, joins the stage's own JAX
     world as the platform's backend planned it (`orchestrator.backends.jaxinit`:
     explicit coordinator on CPU/GPU, auto-detection on whole TPU slices;
     bounded timeout); builds the stage's
     named `Mesh`, the jitted programs, parameters and optimizer state.
  3. `connect(prev, next)` — handles of the neighbouring stages' actors.
  4. `run_step(step)` — executes this stage's lowered action list for one step:
     F/B/I/W compute, SEND_* push tensors to the neighbours' mailboxes (never
     block), RECV_* take from this actor's mailbox (bounded wait), OPT updates.
     Returns the step's losses (last stage) and per-action spans.
  5. `param_norms()`, `shutdown()`.
Actors make no scheduling decisions: the action list is the plan's.
All hosts of a stage execute the same actions in the same order (SPMD).
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stages.data import DataSource, microbatch
from stages.mailbox import Mailbox
from stages.spec import ModelSpec, param_name


@dataclass(frozen=True)
class WorkerConfig:
    run: str
    stage: int
    host: int                 # host index within the stage (= jax process id there)
    stage_hosts: int          # hosts in this stage
    cluster_host: int         # host index in the cluster (bundle index)
    layers: tuple[int, int]
    mesh: dict[str, int]
    layout: dict[str, Any]
    spec: ModelSpec
    data: DataSource
    microbatches: int
    optimizer: tuple[str, dict]
    seed: int
    actions: tuple[str, ...]
    num_stages: int
    timeouts: dict[str, float] = field(default_factory=dict)
    hosts: tuple[int, ...] = (0,)   # cluster host index of each host of this stage
    devices_per_host: int = 1
    prev_geom: Any = None           # orchestrator.edges.StageGeom of the neighbours (None at the ends)
    next_geom: Any = None
    pin_cpus: bool = False          # pin this process to core (cluster_host mod cores) before jax loads
    fail_setup: str | None = None   # test-only fault injection: setup raises this message

    @property
    def who(self) -> str:
        return f"{self.run} stage {self.stage} host {self.host}"


class StageWorker:
    def __init__(self, cfg: WorkerConfig):
        self.cfg = cfg
        self.inbox = Mailbox(cfg.who)
        self.prev: list = []
        self.next: list = []
        from orchestrator.schedule import Action

        self.actions = [Action.parse(text) for text in cfg.actions]
        if cfg.pin_cpus:
            cores = sorted(os.sched_getaffinity(0))
            os.sched_setaffinity(0, {cores[cfg.cluster_host % len(cores)]})

    # -- lifecycle ---------------------------------------------------------
    def coordinator_address(self) -> str:
        """host 0 of a multi-host stage: pick a free port for this stage's JAX world."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        import ray

        ip = ray.util.get_node_ip_address()
        return f"{ip}:{port}"

    def setup(self, coordinator: str | None = None) -> dict:
        cfg = self.cfg
        t0 = time.perf_counter()
        if cfg.fail_setup:
            raise RuntimeError(f"{cfg.who}: {cfg.fail_setup}")
        import jax

        from orchestrator.telemetry import watch_compiles

        watch_compiles()   # sums jax compile time in this process, for stage_stats

        from orchestrator.backends.jaxinit import initialize as join_submesh

        # as the platform's backend planned it (MESHPIPE_JAX_INIT): explicit coordinator, TPU auto-detect, none
        join_submesh(cfg.stage_hosts, cfg.host, coordinator, cfg.timeouts.get("jax_distributed_init_s", 60),
                     who=cfg.who)
        from jax.sharding import Mesh

        from stages.models.base import load_impl
        from stages.program import StageProgram, make_optimizer

        devices = np.array(jax.devices())
        n = int(np.prod(list(cfg.mesh.values())))
        if devices.size != n:
            raise RuntimeError(f"{cfg.who}: mesh {cfg.mesh} needs {n} devices, the stage has {devices.size}")
        owners = [d.process_index for d in devices]
        if owners != sorted(owners) or owners.count(cfg.host) != cfg.devices_per_host:
            raise RuntimeError(f"{cfg.who}: jax device order {owners} is not host-major with "
                               f"{cfg.devices_per_host} devices per host")
        self.mesh = Mesh(devices.reshape(tuple(cfg.mesh.values())), tuple(cfg.mesh))
        self.prog = StageProgram(cfg.spec, load_impl(cfg.spec), *cfg.layers, microbatches=cfg.microbatches,
                                 optimizer=make_optimizer(*cfg.optimizer), mesh=self.mesh, layout=cfg.layout)
        self.params = self.prog.init_params(cfg.seed)
        self.opt_state, self.grads = self.prog.init_state(self.params)
        from stages.transport import make_transport

        self.transport = make_transport(self)
        mbs = cfg.data.global_batch // cfg.microbatches
        start, stop = cfg.layers
        self.in_shape = (mbs, *cfg.spec.layers[start - 1].out_shape) if start > 0 else None
        self.out_shape = (mbs, *cfg.spec.layers[stop - 1].out_shape)
        jax.block_until_ready(self.params)
        import ray

        return {"stage": cfg.stage, "host": cfg.host, "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id(),
                "devices": int(devices.size), "local_devices": len(jax.local_devices()),
                "setup_s": time.perf_counter() - t0}

    def connect(self, prev: list, nxt: list) -> None:
        self.prev, self.next = list(prev), list(nxt)

    def deliver(self, key, payload) -> None:
        self.inbox.put(key, payload)

    def shutdown(self) -> None:
        self.inbox.close("shutdown")
        if self.cfg.stage_hosts > 1:
            import jax

            jax.distributed.shutdown()

    # -- one step ----------------------------------------------------------
    def run_step(self, step: int) -> dict:
        import jax

        cfg, prog = self.cfg, self.prog
        timeout = cfg.timeouts.get("step_s", 600.0)
        x_all = y_all = None
        if prog.first or prog.last:
            x_all, y_all = cfg.data.batch(step)
        inputs: dict = {}
        residuals: dict = {}
        outputs: dict = {}
        dys: dict = {}
        dxs: dict = {}
        losses: dict[int, Any] = {}
        spans = []
        for a in self.actions:
            kind, mb = a.kind.value, a.microbatch
            t0 = time.time()
            if kind == "F":
                if prog.first:
                    x = self.transport.from_host(microbatch(x_all, mb, cfg.microbatches), prog.input_sharding())
                else:
                    x = inputs.pop(mb)
                labels = None
                if prog.last:
                    labels = self.transport.from_host(microbatch(y_all, mb, cfg.microbatches),
                                                      prog.label_sharding())
                y, residuals[mb] = prog.fwd(self.params, x, labels)
                jax.block_until_ready(y)
                if prog.last:
                    losses[mb] = y
                else:
                    outputs[mb] = y
            elif kind == "B":
                dx, dp = prog.bwd(self.params, residuals.pop(mb), dys.pop(mb, None))
                self.grads = prog.accumulate(self.grads, dp)
                if dx is not None:
                    dxs[mb] = dx
                jax.block_until_ready(self.grads)
            elif kind == "I":
                dx = prog.bwd_i(self.params, residuals[mb], dys.get(mb))
                if dx is not None:
                    dxs[mb] = jax.block_until_ready(dx)
            elif kind == "W":
                dp = prog.bwd_w(self.params, residuals.pop(mb), dys.pop(mb, None))
                self.grads = jax.block_until_ready(prog.accumulate(self.grads, dp))
            elif kind == "RECV_F":
                inputs[mb] = self.transport.recv((step, "F", mb), self.in_shape, np.float32,
                                                 prog.input_sharding(), "prev", timeout)
            elif kind == "RECV_B":
                dys[mb] = self.transport.recv((step, "B", mb), self.out_shape, np.float32,
                                              prog.output_sharding(), "next", timeout)
            elif kind == "SEND_F":
                self.transport.send((step, "F", mb), outputs.pop(mb), "next")
            elif kind == "SEND_B":
                self.transport.send((step, "B", mb), dxs.pop(mb), "prev")
            elif kind == "OPT":
                self.params, self.opt_state, self.grads = prog.update(self.params, self.opt_state, self.grads)
                jax.block_until_ready(self.params)
            else:
                raise ValueError(f"{cfg.who}: cannot execute action {a}")
            spans.append((str(a), t0, time.time()))
        self.transport.flush(timeout)
        from orchestrator.telemetry import stage_stats

        out = {"stage": cfg.stage, "host": cfg.host, "spans": spans, "stats": stage_stats(self)}
        if prog.last:
            out["losses"] = [float(losses[i]) for i in range(cfg.microbatches)]
        return out

    def param_norms(self) -> dict[str, float]:
        """L2 norm of every parameter leaf of this stage (global, across hosts)."""
        from jax.experimental import multihost_utils

        norms = {}
        for i, (layer, p) in enumerate(zip(self.prog.layers, self.params), start=self.cfg.layers[0]):
            for name in sorted(p):
                full = np.asarray(multihost_utils.process_allgather(p[name], tiled=True), dtype=np.float64)
                norms[param_name(i, layer, name)] = float(np.linalg.norm(full))
        return norms
