"""The stage worker: one Ray actor per host of a stage's submesh.

Basic flow (driven by `orchestrator.driver.executor`):
  1. `__init__` runs in a fresh process whose env (XLA_FLAGS device count,
     JAX_PLATFORMS) was set by the actor's runtime_env before jax is imported.
  2. `setup(coordinator)` — for a multi-host stage, joins the stage's own JAX
     world as the platform's backend planned it (`orchestrator.core.backends.jaxinit`:
     explicit coordinator on CPU/GPU, auto-detection on whole TPU slices;
     bounded timeout); builds the stage's
     named `Mesh`, the jitted programs, parameters and optimizer state. With
     `compile_cache` (`failure.compile_cache`) JAX's persistent compilation cache
     is on first: a restarted stage loads its programs instead of compiling them.
  3. `connect(actors[, addresses])` — every stage's actor handles (interleaved
     schedules send from the last stage back to the first for the next chunk);
     with `transport: socket` also every actor's `transport_address()`.
  4. `run_step(step)` — executes this stage's lowered action list for one step:
     F/B/I/W compute, SEND_* push tensors to the neighbours' mailboxes (never
     block), RECV_* take from this actor's mailbox (bounded wait), OPT updates.
     Returns the step's losses (last stage) and per-action spans.
     Each action runs its kind's handler (`stages.actions.HANDLERS`, resolved
     once per action at construction) over the step's `StepState`.
     The same list can be driven as `run_steps(first, count)` (several steps in
     one call) or `run_action(step, i)` (one call per action: the reference
     executor); all three share `_begin` / `_act` / `_finish`.
     With `data.eval`, after every `eval_every`-th step (and the last) the same call
     runs the forward-only eval list (`orchestrator.core.schedule.forward_only`) on the
     eval batches and returns their losses (`_with_eval`).
  5. `param_norms()`, `data_state()`, `shutdown()`.
Hooks (`stages.hooks.WorkerHook`, from `WorkerConfig.hooks`) run at the start of
`setup` and of every step: the extension point for profilers and the tests' faults.
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

from stages.actions import EVAL_HANDLERS, StepState, handler_for, program_of
from stages.data import HostLoader, rows_array, rows_of
from stages.mailbox import Mailbox, MailboxClosed
from stages.telemetry import LivePeak
from orchestrator.core.recovery import STEP_NOTE
from orchestrator.core.schedule.ir import RECVS
from orchestrator.core.model.spec import ModelSpec, param_name


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
    data: Any                 # orchestrator.core.data.DataPlan: each host opens its own reader
    microbatches: int
    optimizer: dict                 # the job's optimizer section (JobConfig.optimizer.spec())
    seed: int
    actions: tuple[str, ...]
    num_stages: int
    timeouts: dict[str, float] = field(default_factory=dict)
    hosts: tuple[int, ...] = (0,)   # cluster host index of each host of this stage
    devices_per_host: int = 1
    geoms: tuple = ()               # orchestrator.core.edges.StageGeom of every stage (peers' meshes/layouts)
    chunks: tuple[tuple[int, int], ...] = ()   # layer range per virtual chunk; () means (layers,)
    pin_cpus: bool = False          # pin this process to core (cluster_host mod cores) before jax loads
    hooks: tuple = ()               # stages.hooks.WorkerHook objects, called at setup and each step's start
    transport: str = "ray"          # "ray" (actor calls), "socket" (stages.socket_transport) or "xla" (one JAX world)
    transport_token: bytes | None = field(default=None, repr=False)   # per-run secret for "socket"
    transport_same_machine: str = "unix"   # "socket": same-machine peers over "unix" (+ shared memory) or "tcp"
    transport_tls: dict | None = None      # "socket": {cert_file, key_file, ca_file} paths on this node, or None
    remat: str = "none"             # rematerialisation of this stage's parts (orchestrator.core.model.policy)
    fuse_loss_chunk: bool = False   # pipeline.fuse_loss_chunk (stages.actions.fused_chunks)
    eval_actions: tuple[str, ...] = ()   # this stage's forward-only eval list (data.eval), else ()
    eval_every: int | None = None        # evaluate after every k-th step ...
    total_steps: int = 0                 # ... and after the last one
    checkpoint: dict | None = None  # {root, every, total, async[, restore]} (stages.checkpoint); None: off
    loss_scale: dict | None = None  # DynamicLossScale fields (orchestrator.core.model.policy); None: off
    compile_cache: str | None = None   # JAX persistent compilation cache directory (recovery.compile_cache_dir)
    tie_stages: tuple = ()          # per spec.ties entry: (stage of its earlier side, of its later side)
    # "xla": the world's transfer order, (("F", training step's), ("E", eval's)) of
    # orchestrator.core.schedule.transfers.Transfer tuples (every stage gets the same)
    transfers: tuple = ()
    on_nonfinite: str = "stop"      # failure.on_nonfinite: "skip" decides globally before the update

    @property
    def layer_chunks(self) -> tuple[tuple[int, int], ...]:
        return tuple(self.chunks) or (tuple(self.layers),)

    @property
    def who(self) -> str:
        return f"{self.run} stage {self.stage} host {self.host}"


def use_compile_cache(jax, path: str, who: str) -> None:
    """Turn on JAX's persistent compilation cache in `path` (created owner-only) for every program,
    however quick its compile; a directory others may write is refused (its entries are loaded
    as executables)."""
    import stat

    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or st.st_uid != os.getuid():
        raise RuntimeError(f"{who}: failure.compile_cache = {path!r}: the directory must belong to this user "
                           f"and not be writable by others (mode {stat.S_IMODE(st.st_mode):o}); its entries "
                           "are loaded as compiled programs")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


class StageWorker:
    def __init__(self, cfg: WorkerConfig):
        self.cfg = cfg
        self.inbox = Mailbox(cfg.who)
        self.actors: list[list] = []    # every stage's actor handles, set by connect()
        self._step_state = None         # the step run_action is in
        # what this actor is at, for `heartbeat`: (step, action text or None between steps, whether it
        # is a RECV, since when on this process's clock); set before each action (`_doing`)
        self.doing: tuple = (None, None, False, time.monotonic())
        self.last_done: int | None = None     # the newest step finished here (heartbeat's `done`)
        # what a RECV (and the end-of-step flush) waits: timeouts.step_s until the driver has
        # measured steps, then what it sets (`set_recv_deadline`: a multiple of its progress deadline)
        self.recv_s = float(cfg.timeouts.get("step_s", 600.0))
        self.live_peak = LivePeak()      # live device bytes at the training steps' peak (telemetry)
        self._stash_sizes: dict = {}     # (kind, chunk) -> bytes of what that action keeps (`Stash`)
        self.ckpt = None                # stages.checkpoint.StageCheckpointer when checkpointing
        self._coordinator_port = None   # host 0 of a multi-host stage: the socket holding its port
        from orchestrator.core.model.policy import DynamicLossScale

        # loss scaling: the rule and (scale, finite steps in a row); the same on every stage
        self.scaler = DynamicLossScale(**cfg.loss_scale) if cfg.loss_scale else None
        self.scale_state = self.scaler.start() if self.scaler else None
        from orchestrator.core.schedule import Action

        self.actions = [Action.parse(text) for text in cfg.actions]
        # the step program: each action with its text (span label) and its kind's handler, resolved once
        # (the loss chunk's F and B run as one program where the schedule puts them back to back)
        loss_chunk = next((c for c, (_, stop) in enumerate(cfg.layer_chunks) if stop == cfg.spec.num_layers), None)
        self.program = program_of(self.actions, cfg.who, loss_chunk, fuse=cfg.fuse_loss_chunk)
        # the forward-only eval program (data.eval), resolved the same way from its own table
        self.eval_program = [(a, str(a), handler_for(a, cfg.who, EVAL_HANDLERS))
                             for a in (Action.parse(text) for text in cfg.eval_actions)]
        self._eval_batches = None       # this host's rows of the eval batches, read once
        self.pinned: set[int] | None = None
        self.pinned_threads: set[int] = set()
        if cfg.pin_cpus:
            cores = sorted(os.sched_getaffinity(0))
            self.pinned = {cores[cfg.cluster_host % len(cores)]}
            self._pin_thread()

    # -- lifecycle ---------------------------------------------------------
    def coordinator_address(self) -> str:
        """host 0 of a multi-host stage: reserve a free port on the node address for this stage's
        JAX world (its coordinator binds only there); the port stays held by this actor until
        `setup` has started the coordinator on it (`stages.jaxinit.reserve_port`)."""
        import ray

        from stages.jaxinit import reserve_port

        if self._coordinator_port is not None:
            self._coordinator_port.close()
        address, self._coordinator_port = reserve_port(ray.util.get_node_ip_address())
        return address

    def setup(self, coordinator: str | None = None) -> dict:
        cfg = self.cfg
        t0 = time.perf_counter()
        for hook in cfg.hooks:
            hook.on_setup(cfg)
        import jax

        if cfg.compile_cache:
            use_compile_cache(jax, cfg.compile_cache, cfg.who)
        from stages.telemetry import watch_compiles

        watch_compiles()   # sums jax compile time in this process, for stage_stats

        from orchestrator.core.model.registry import build_model
        from stages import dataplane
        from stages.program import StageProgram

        # as the platform's backend planned it (MESHPIPE_JAX_INIT), or the job's one world (transport xla)
        held, self._coordinator_port = self._coordinator_port, None
        import ray

        transfer_address = dataplane.join_jax(cfg, coordinator, held, ray.util.get_node_ip_address(), self.recv_s)
        self.mesh = dataplane.stage_mesh(cfg)
        devices = self.mesh.devices
        model, tx = build_model(cfg.spec.factory, cfg.spec.args), cfg.optimizer
        self.progs = [StageProgram(cfg.spec, model, start, stop, microbatches=cfg.microbatches, optimizer=tx,
                                   mesh=self.mesh, layout=cfg.layout, remat=cfg.remat)
                      for start, stop in cfg.layer_chunks]
        self.params = [prog.init_params(cfg.seed) for prog in self.progs]
        self.mstate = [prog.init_mstate(cfg.seed) for prog in self.progs]     # mutable model state (BatchNorm)
        states = [prog.init_state(p) for prog, p in zip(self.progs, self.params)]
        self.opt_state = [st[0] for st in states]
        self.grads = [st[1] for st in states]
        restore_s = self._setup_checkpoint()
        self.transport = dataplane.make_transport(self, transfer_address)
        self._plan_edges()
        self._open_data()
        restored = (cfg.checkpoint or {}).get("restore") or {}
        if "source" in restored.get("data", {}):
            self.load_data_state(restored["data"])     # checks seed and source, then the position
        jax.block_until_ready(self.params)
        return {"stage": cfg.stage, "host": cfg.host, "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id(),
                "devices": int(devices.size), "local_devices": len(jax.local_devices()),
                "transport": type(self.transport).__name__, "setup_s": time.perf_counter() - t0,
                "transport_tls": getattr(self.transport, "tls_server", None) is not None,
                "restore_s": restore_s}

    def _setup_checkpoint(self) -> float | None:
        """The stage's checkpointer (`cfg.checkpoint`); restores the saved state first when asked.
        Returns the restore's seconds (None: nothing restored)."""
        ck, self.ckpt = self.cfg.checkpoint, None
        if not ck:
            return None
        from stages.checkpoint import StageCheckpointer, processes, restore

        from orchestrator.core.checkpoint import check_probe

        check_probe(ck["root"], ck["probe"], f"{self.cfg.who} on {socket.gethostname()}")
        took = None
        if ck.get("restore"):
            t0 = time.perf_counter()
            restore(self, ck["restore"])
            took = time.perf_counter() - t0
        self.ckpt = StageCheckpointer(ck["root"], ck["every"], ck["total"], ck["async"], self.cfg.stage,
                                      self.cfg.host, timeout=self.cfg.timeouts.get("step_s", 600.0),
                                      procs=processes(self.cfg))
        return took

    def checkpoint_flush(self) -> list[dict]:
        """Wait (bounded) for this host's save in flight; the reports not yet handed back."""
        return [] if getattr(self, "ckpt", None) is None else self.ckpt.flush()

    def _plan_edges(self) -> None:
        """Per chunk: where its input comes from and its output goes (virtual stage c·p + s ± 1), one
        (Edge, global shape, dtype) per leaf of the activation that crosses."""
        from orchestrator.core.edges import leaf_dtype
        from stages.transport import Edge

        cfg, p = self.cfg, self.cfg.num_stages
        v = len(self.progs)
        mbs = cfg.data.global_batch // cfg.microbatches

        def leaves(layer: int, peer: int):
            geom = cfg.geoms[peer % p]
            return [(Edge(peer % p, geom, tuple(leaf.axes)), leaf.batched(mbs), leaf_dtype(leaf.dtype))
                    for leaf in cfg.spec.layers[layer].outputs]

        self.edge_in, self.edge_out = [], []
        for c, (start, stop) in enumerate(cfg.layer_chunks):
            virtual = c * p + cfg.stage
            before, after = virtual - 1, virtual + 1
            self.edge_in.append(None if before < 0 else leaves(start - 1, before))
            self.edge_out.append(None if after >= p * v else leaves(stop - 1, after))
            # what may arrive (the transport refuses anything else): activations in, gradients back
            for edge, shape, dtype in (self.edge_in[c] or []) + (self.edge_out[c] or []):
                self.transport.expect(edge, shape, dtype)

    def _in_flight(self) -> int:
        """How many tensors of one expected kind (one edge leaf) may have arrived here and not been
        taken yet: a training step's microbatches (the next step's cannot come before this host
        has taken them: a sender needs this stage's gradients first), plus every evaluation
        batch's (forward-only: the first stage may run all of them ahead), with one more step's
        worth as margin. The transport refuses a connection that makes it hold more."""
        cfg = self.cfg
        return cfg.microbatches * (2 + (cfg.data.eval_batches if cfg.data is not None else 0))

    def _open_data(self) -> None:
        """Loaders for this host's rows: inputs on the first stage, labels on the last (else none)."""
        cfg = self.cfg
        mbs = cfg.data.global_batch // cfg.microbatches
        first, last = self.progs[0], self.progs[-1]
        self.rows_in = rows_of(first.input_sharding(), (mbs, *cfg.spec.input_shape)) if first.first else None
        self.rows_lab = rows_of(last.label_sharding(), (mbs, *cfg.spec.label_shape)) if last.last else None
        self.loader = None
        if self.rows_in is not None or self.rows_lab is not None:
            self.loader = HostLoader(cfg.data, self.rows_in, self.rows_lab, cfg.microbatches, who=cfg.who)

    def host_operand(self, local, rows, shape, sharding):
        """This host's rows of a microbatch as the jitted program's operand."""
        if self.transport.single_device:
            return local                  # one device: the host holds every row (see recv_operand)
        return rows_array(local, rows, shape, sharding)

    def data_state(self) -> dict | None:
        """The loader's position (a small dict for a checkpoint); None on a host that loads nothing."""
        return None if self.loader is None else self.loader.state()

    def load_data_state(self, state: dict) -> None:
        if self.loader is not None:
            self.loader.load_state(state)

    def transport_address(self):
        """(host, port) this actor's transport listens on after setup; None for the Ray transport."""
        return getattr(self.transport, "address", None)

    def connect(self, actors: list[list], addresses: list[list] | None = None) -> None:
        """Handles of every stage's actors (interleaved schedules talk to more than two neighbours),
        and for the socket transport every actor's `transport_address()` ([stage][host])."""
        self.actors = [list(row) for row in actors]
        if addresses is not None:
            self.transport.connect(addresses)

    def deliver(self, key, payload) -> None:
        self.inbox.put(key, payload)

    def shutdown(self, after_failure: bool = False) -> None:
        """Close what this actor holds. `after_failure`: the attempt is thrown away and the driver
        kills this process next, so nothing is waited for — not a checkpoint save in flight (it
        never commits), not the data loader's thread, and not `jax.distributed.shutdown`, whose
        barrier waits for every process of the stage's world, a dead peer's too (it held the
        driver's whole `timeouts.shutdown_s` after a node loss); the inbox and the transport's
        sockets are closed, so nothing of this actor still waits or listens."""
        self.inbox.close("shutdown")
        if after_failure:
            if getattr(self, "transport", None) is not None:
                self.transport.close()
            return
        if getattr(self, "ckpt", None) is not None:
            self.ckpt.close()
        if getattr(self, "loader", None) is not None:
            self.loader.close()
        if getattr(self, "transport", None) is not None:
            self.transport.close()
        if self.cfg.stage_hosts > 1 or self.cfg.transport == "xla":    # every process of the world at once
            import jax

            jax.distributed.shutdown()

    # -- one step ----------------------------------------------------------
    def run_step(self, step: int) -> dict:
        """Execute this stage's lowered action list for `step` (see the module docstring)."""
        try:
            st = self._begin(step)
            for a, text, handler in self.program:
                self._act(st, a, text, handler)
            return self._with_eval(step, self._finish(st))
        except Exception as e:
            self._fail(step, e)
            raise
        finally:
            self._doing(None, None)

    def run_steps(self, first: int, count: int) -> list[dict]:
        """Steps first .. first+count-1 in one call (no Ray task boundary between them); each
        result also carries `end` — this process's monotonic clock when that step finished."""
        outs = []
        for step in range(first, first + count):
            outs.append({**self.run_step(step), "end": time.perf_counter()})
        return outs

    def run_action(self, step: int, index: int) -> dict | None:
        """Action `index` of `step`'s list — the one-call-per-action reference executor. The
        driver calls 0, 1, ... in order; the last returns what `run_step` returns."""
        try:
            if index == 0:
                self._step_state = self._begin(step)
            st = self._step_state
            if st is None or st.step != step or index != st.done:
                expected = "action 0" if st is None else f"action {st.done} of step {st.step}"
                raise RuntimeError(f"{self.cfg.who}: action {index} of step {step} out of order "
                                   f"(expected {expected})")
            self._act(st, *self.program[index])
            if index == len(self.program) - 1:
                self._step_state = None
                return self._with_eval(step, self._finish(st))
            return None
        except Exception as e:
            self._fail(step, e)
            raise
        finally:
            self._doing(None, None)      # between actions the driver is the one at work

    def heartbeat(self) -> dict:
        """Called in the "io" group: answers while a step runs or waits; a stopped process does not
        (how the driver tells the hung actor from the ones waiting on it). Says what the actor is at
        (`doing`: the action under way, None between steps; `waiting`: it is a RECV; `busy_s`:
        seconds at it, this process's clock) — `orchestrator.core.recovery.stalled` reads it —
        and `done`, the newest step it finished (`orchestrator.core.recovery.failed_step`)."""
        step, doing, waiting, since = self.doing
        return {"pid": os.getpid(), "time": time.time(), "recv_s": self.recv_s, "step": step, "doing": doing,
                "waiting": waiting, "busy_s": time.monotonic() - since, "done": self.last_done}

    def _doing(self, step, what: str | None, waiting: bool = False) -> None:
        self.doing = (step, what, waiting, time.monotonic())

    def set_recv_deadline(self, seconds: float) -> float:
        """Called in the "io" group once steps are measured: the seconds a RECV of a step that starts
        from now on may wait (never above `timeouts.step_s`, never below 1 s), and the transport's
        own waits (a frame under way, a blocked write: `Transport.set_io_timeout`); returns it."""
        self.recv_s = min(max(float(seconds), 1.0), float(self.cfg.timeouts.get("step_s", 600.0)))
        if getattr(self, "transport", None) is not None:
            self.transport.set_io_timeout(self.recv_s)
        return self.recv_s

    def abort_step(self, reason: str) -> None:
        """A peer's step failed: whatever this actor waits for from it fails now, not at its deadline.
        (Runs in the "io" group, beside the step.) No recovery inside a step: the driver tears the
        job down (and with `failure.max_restarts` starts it again from the last checkpoint)."""
        self.inbox.close(reason)

    def _fail(self, step: int, error: Exception) -> None:
        """A step failed here: this actor starts no further step (queued ones fail at once), and
        unless it was itself told by a peer, every other actor gets `abort_step` (fire and forget)."""
        if self.inbox.closed:
            return         # aborted by a peer (or the transport closed), or failed before: no echo
        reason = f"{self.cfg.who} failed in step {step}: {type(error).__name__}: {str(error)[:300]}"
        error.add_note(STEP_NOTE + reason)   # the driver reads the step from it (orchestrator.core.recovery.origin)
        self.inbox.close(reason)
        for s, row in enumerate(self.actors):
            for h, actor in enumerate(row):
                if (s, h) != (self.cfg.stage, self.cfg.host):
                    try:
                        actor.abort_step.options(concurrency_group="io").remote(reason)
                    except Exception:  # noqa: BLE001 - best effort; every wait still has its deadline
                        pass

    def _pin_thread(self) -> None:
        """Pin the calling thread (threads it starts inherit it). Affinity is per thread: a Ray
        Compiled Graph runs steps on its own thread, which Ray started before any pinning."""
        import threading

        tid = threading.get_ident()
        if self.pinned is not None and tid not in self.pinned_threads:
            os.sched_setaffinity(0, self.pinned)
            self.pinned_threads.add(tid)

    def _begin(self, step: int) -> StepState:
        if self.inbox.closed:
            raise MailboxClosed(f"{self.cfg.who}: not starting step {step}: {self.inbox.closed}")
        self._doing(step, "start of step (hooks, data)")
        for hook in self.cfg.hooks:
            hook.on_step(self.cfg, step)
        self._pin_thread()
        st = StepState(step, self.recv_s, on_peak=self.live_peak, sizes=self._stash_sizes)
        self.transport.begin(step, st.tag)
        if self.loader is not None:
            waited = self.loader.wait_s
            st.batch = self.loader.get(step, st.timeout)
            st.data_wait_s = self.loader.wait_s - waited
        return st

    def _act(self, st: StepState, a, text: str, handler) -> None:
        """One action of the list (`stages.actions`: its kind's handler), with its span."""
        self._doing(st.step, text, a.kind in RECVS)
        t0 = time.time()
        handler(self, st, a)
        st.spans.append((text, t0, time.time()))
        st.done += 1

    def sum_over_stages(self, step: int, local: float, timeout: float, tag: str = "NORM") -> float:
        """`local` summed over every stage (the global gradient norm's square): host 0 of each stage
        sends its scalar to every host of the other stages, each host adds what the others sent.
        Every stage's hosts hold the same value (their arrays are global), so one sender suffices."""
        cfg = self.cfg
        if cfg.num_stages == 1:
            return local
        refs = []
        if cfg.host == 0:
            for s, row in enumerate(self.actors):
                if s != cfg.stage:
                    refs += [a.deliver.options(concurrency_group="io").remote((step, tag, cfg.stage), local)
                             for a in row]
        total = local + sum(float(self.inbox.take((step, tag, s), timeout))
                            for s in range(cfg.num_stages) if s != cfg.stage)
        if refs:
            import ray

            ray.get(refs, timeout=timeout)
        return total

    def exchange_tie(self, step: int, tie: int, mine: np.ndarray, timeout: float) -> np.ndarray:
        """A tied array's gradient swapped with the stage holding the tie's other side
        (`stages.ties`): host 0 sends this stage's (global) array to every host of that stage,
        every host takes the one that stage's host 0 sent (bounded wait)."""
        cfg = self.cfg
        a, b = cfg.tie_stages[tie]
        peer = b if cfg.stage == a else a
        refs = []
        if cfg.host == 0:
            refs = [h.deliver.options(concurrency_group="io").remote((step, "TIE", tie, cfg.stage), mine)
                    for h in self.actors[peer]]
        got = self.inbox.take((step, "TIE", tie, peer), timeout)
        if refs:
            import ray

            ray.get(refs, timeout=timeout)
        return got

    def _finish(self, st: StepState) -> dict:
        cfg = self.cfg
        self._doing(st.step, "end of step (flush, checkpoint)")
        self.transport.flush(st.timeout)
        from stages.telemetry import stage_stats

        out = {"stage": cfg.stage, "host": cfg.host, "spans": st.spans,
               "stats": {**stage_stats(self), "stash_peak_bytes": st.stash.peak,
                         "stash_peak_items": st.stash.peak_items, "data_wait_s": st.data_wait_s,
                         "data_bytes_read": self.loader.bytes_read if self.loader is not None else 0,
                         "data_windows_read": self.loader.windows_read if self.loader is not None else 0,
                         "data_rows": len(self.loader.rows) if self.loader is not None else 0}}
        if self.progs[-1].last:
            out["losses"] = [float(st.losses[i]) for i in range(cfg.microbatches)]
        if st.loss_scale is not None:
            out["stats"].update(loss_scale=float(st.loss_scale), skipped=bool(st.skipped))
        if st.health is not None:       # training health (orchestrator.core.health): the driver judges
            out["stats"]["health"] = list(st.health)
        if self.ckpt is not None:       # between steps: the state after this step's OPT
            if self.ckpt.due(st.step + 1):
                out["stats"]["checkpoint_blocking_s"] = self.ckpt.save(st.step + 1, self)
            out["checkpoints"] = self.ckpt.reports()
        self.last_done = st.step
        return out

    # -- evaluation (forward-only schedule) -------------------------------
    def _with_eval(self, step: int, out: dict) -> dict:
        """After step `step`'s update: when an evaluation is due, run it (all stages do, in the same
        step) and add `eval_losses` (last stage: one mean loss per eval batch) and `eval_s`."""
        cfg = self.cfg
        due = self.eval_program and ((cfg.eval_every and (step + 1) % cfg.eval_every == 0)
                                     or step + 1 == cfg.total_steps)
        if not due:
            return out
        t0 = time.perf_counter()
        if self._eval_batches is None:
            loader = None if self.loader is None else HostLoader(
                cfg.data.eval, self.rows_in, self.rows_lab, cfg.microbatches, who=f"{cfg.who} eval")
            self._eval_batches = [None if loader is None else loader.load(b) for b in range(cfg.data.eval_batches)]
        losses = []
        for b, batch in enumerate(self._eval_batches):
            st = StepState(step, self.recv_s, tag=f"E{b}")   # its own mailbox keys
            self.transport.begin(step, st.tag)
            st.batch = batch
            for a, text, handler in self.eval_program:
                self._doing(step, f"eval {b} {text}", a.kind in RECVS)
                handler(self, st, a)
            if self.progs[-1].last:
                losses.append(float(np.mean([float(st.losses[i]) for i in range(cfg.microbatches)])))
        self.transport.flush(self.recv_s)
        out["eval_s"] = time.perf_counter() - t0
        if self.progs[-1].last:
            out["eval_losses"] = losses
        return out

    def param_norms(self) -> dict[str, float]:
        """L2 norm of every parameter leaf of this stage (global, across hosts)."""
        return {name: float(np.linalg.norm(np.asarray(full, dtype=np.float64)))
                for name, full in self._gathered().items()}

    def param_arrays(self) -> dict[str, np.ndarray]:
        """Every parameter leaf of this stage as a whole numpy array (gathered across hosts), and
        every mutable-state leaf (`state_name`, e.g. BatchNorm's running mean)."""
        import jax

        from orchestrator.core.model.pipeline import key_path
        from stages.checkpoint import state_name
        from stages.dataplane import gather

        out = self._gathered()
        for prog, mstate in zip(self.progs, self.mstate):
            for i, (layer, s) in enumerate(zip(prog.layers, mstate), start=prog.start):
                for path, leaf in jax.tree_util.tree_flatten_with_path(s)[0]:
                    out[state_name(i, layer, key_path(path))] = gather(leaf)
        return out

    def _gathered(self) -> dict[str, np.ndarray]:
        import jax

        from orchestrator.core.model.pipeline import key_path
        from stages.dataplane import gather

        out = {}
        for prog, params in zip(self.progs, self.params):
            for i, (layer, p) in enumerate(zip(prog.layers, params), start=prog.start):
                for path, leaf in jax.tree_util.tree_flatten_with_path(p)[0]:
                    out[param_name(i, layer, key_path(path))] = gather(leaf)
        return out
