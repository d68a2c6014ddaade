"""The stage worker: one Ray actor per host of a stage's submesh.

Basic flow (driven by `orchestrator.driver.executor`):
  1. `__init__` runs in a fresh process whose env (XLA_FLAGS device count,
     JAX_PLATFORMS) was set by the actor's runtime_env before jax is imported.
  2. `setup(coordinator)` — for a multi-host stage, joins the stage's own JAX
     world as the platform's backend planned it (`orchestrator.core.backends.jaxinit`:
     explicit coordinator on CPU/GPU, auto-detection on whole TPU slices;
     bounded timeout); builds the stage's
     named `Mesh`, the jitted programs, and the stage's training state (`stages.state.StageState`:
     initialised, or restored from the checkpoint the driver names). With
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
     once per action at construction): `state = handler(ctx, state, step_state, action)` —
     the context (`stages.actions.StageContext`: programs and I/O) in, the training state in
     and out, the step's tensors in `StepState`; no handler reaches into the actor.
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
import threading
import time

import numpy as np

from stages.actions import EVAL_HANDLERS, StageContext, StepState, handler_for, program_of
from stages.data import HostLoader, rows_of
from stages.mailbox import Mailbox, MailboxClosed
from orchestrator.core.recovery import storage_error
from stages.telemetry import LivePeak
from orchestrator.core.contract import FAILURE_ATTR, StepFailure, WorkerConfig
from orchestrator.core.schedule.ir import RECVS
from orchestrator.core.model.spec import param_name


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


def step_failure(stage: int, host: int, step: int, error: BaseException) -> StepFailure:
    """The record of `error` failing `step` on this stage host: STORAGE when checkpoint.dir refused
    a write (`orchestrator.core.recovery.storage_error`: no restart can help), else ERROR."""
    text = str(error)[:300]
    storage = storage_error(error)
    return StepFailure(stage, host, step, f"{type(error).__name__}: {text.splitlines()[0] if text else ''}".rstrip(),
                       kind="storage" if storage else "error",
                       errno=storage[0] if storage else None, path=storage[1] if storage else None)


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
        self.recv_s = float(cfg.timeouts.step_s)
        self.recv_seq = -1               # the newest setting applied (`set_recv_deadline`'s seq)
        self._recv_lock = threading.Lock()
        self.live_peak = LivePeak()      # live device bytes at the training steps' peak (telemetry)
        self._stash_sizes: dict = {}     # (kind, chunk) -> bytes of what that action keeps (`Stash`)
        self.ckpt = None                # stages.checkpoint.StageCheckpointer when checkpointing
        self.state = None               # the stage's training state (stages.state.StageState), from setup
        self.ctx: StageContext | None = None     # what the handlers read: programs, I/O (setup)
        self.loader = None              # this host's data loader (first / last stage), from setup
        self._coordinator_port = None   # host 0 of a multi-host stage: the socket holding its port
        # loss scaling: the rule and (scale, finite steps in a row); the same on every stage
        from orchestrator.core.schedule import Action

        self.actions = [Action.parse(text) for text in cfg.stage_spec.actions]
        # the step program: each action with its text (span label) and its kind's handler, resolved once
        # (the loss chunk's F and B run as one program where the schedule puts them back to back)
        loss_chunk = next((c for c, (_, stop) in enumerate(cfg.layer_chunks) if stop == cfg.spec.num_layers), None)
        self.program = program_of(self.actions, cfg.who, loss_chunk, fuse=cfg.stage_spec.fuse_loss_chunk)
        # the forward-only eval program (data.eval), resolved the same way from its own table
        self.eval_program = [(a, str(a), handler_for(a, cfg.who, EVAL_HANDLERS))
                             for a in (Action.parse(text) for text in cfg.stage_spec.eval_actions)]
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
        from stages.stage_io import StageIO, make_transport
        from stages.state import init as init_state

        # as the platform's backend planned it (MESHPIPE_JAX_INIT), or the job's one world (transport xla)
        held, self._coordinator_port = self._coordinator_port, None
        import ray

        transfer_address = dataplane.join_jax(cfg, coordinator, held, ray.util.get_node_ip_address(), self.recv_s)
        self.mesh = dataplane.stage_mesh(cfg)
        model = build_model(cfg.spec.factory, cfg.spec.args)
        self.progs = [StageProgram(cfg.spec, model, start, stop, microbatches=cfg.microbatches,
                                   optimizer=cfg.optimizer.to_spec(), mesh=self.mesh,
                                   layout=cfg.stage_spec.layout_map, remat=cfg.stage_spec.remat)
                      for start, stop in cfg.layer_chunks]
        self.state = init_state(self.progs, cfg.seed, cfg.loss_scale)
        restore_s = self._setup_checkpoint()
        transport = make_transport(cfg, self.mesh, self.inbox, lambda stage: self.actors[stage], self.recv_s,
                                   transfer_address)
        rows_in, rows_lab = self._open_data()
        self.ctx = StageContext(cfg, self.progs, StageIO(cfg, transport, self.inbox, rows_in, rows_lab), cfg.loss_scale)
        restore = cfg.checkpoint.restore if cfg.checkpoint is not None else None
        if restore is not None and restore.position is not None:
            self.load_data_state(restore.position.to_dict())     # checks seed and source, then the position
        if self.loader is not None:      # batches a health rollback skipped (StageState.data_offset)
            self.loader.offset = self.state.data_offset or 0
        jax.block_until_ready(self.state)
        return {"stage": cfg.stage, "host": cfg.host, "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id(),
                "devices": int(self.mesh.devices.size), "local_devices": len(jax.local_devices()),
                "transport": type(transport).__name__, "setup_s": time.perf_counter() - t0,
                "transport_tls": getattr(transport, "tls_server", None) is not None,
                "restore_s": restore_s}

    @property
    def transport(self):
        """The stage's transport (None before setup)."""
        return None if self.ctx is None else self.ctx.io.transport

    def _setup_checkpoint(self) -> float | None:
        """The stage's checkpointer (`cfg.checkpoint`); restores the saved state first when asked.
        Returns the restore's seconds (None: nothing restored)."""
        ck, self.ckpt = self.cfg.checkpoint, None
        if not ck:
            return None
        from stages.checkpoint import StageCheckpointer, processes, restore, stage_name

        from orchestrator.core.checkpoint import check_probe

        check_probe(ck.root, ck.probe, f"{self.cfg.who} on {socket.gethostname()}")
        took = None
        if ck.restore is not None:
            t0 = time.perf_counter()
            plan = ck.restore
            if plan.locate(stage_name("data_offset")) is not None:    # a run that skipped data: restore it too
                self.state = self.state._replace(data_offset=0)
            self.state = restore(plan, self.state, self.progs, self.mesh, self.cfg.who, processes(self.cfg))
            offset = (self.state.data_offset or 0) + plan.skip_batches     # a health rollback skips more
            self.state = self.state._replace(step=plan.step, data_offset=offset or None)
            took = time.perf_counter() - t0
        self.ckpt = StageCheckpointer(ck.root, ck.every, ck.total, ck.asynchronous, self.cfg.stage,
                                      self.cfg.host, seed=self.cfg.seed, timeout=self.cfg.timeouts.step_s,
                                      procs=processes(self.cfg), mesh=self.mesh)
        return took

    def checkpoint_flush(self) -> list[dict]:
        """Wait (bounded) for this host's save in flight; the reports not yet handed back."""
        return [] if getattr(self, "ckpt", None) is None else self.ckpt.flush()

    def _open_data(self) -> tuple:
        """This host's rows of a microbatch (inputs on the first stage, labels on the last, else None)
        and their loader."""
        cfg = self.cfg
        mbs = cfg.microbatch_size
        first, last = self.progs[0], self.progs[-1]
        rows_in = rows_of(first.input_sharding(), (mbs, *cfg.spec.input_shape)) if first.first else None
        rows_lab = rows_of(last.label_sharding(), (mbs, *cfg.spec.label_shape)) if last.last else None
        self.loader = None
        if rows_in is not None or rows_lab is not None:
            self.loader = HostLoader(cfg.data, rows_in, rows_lab, cfg.microbatches, who=cfg.who)
        return rows_in, rows_lab

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
        self.ctx.io.actors = self.actors
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
        if self.cfg.stage_hosts > 1 or self.cfg.transport.kind == "xla":    # every process of the world at once
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

    def set_recv_deadline(self, seconds: float, seq: int = 0) -> float:
        """Called in the "io" group once steps are measured: the seconds a RECV of a step that starts
        from now on may wait (never above `timeouts.step_s`, never below 1 s), and the transport's
        own waits (a frame under way, a blocked write: `Transport.set_io_timeout`); returns the
        deadline in force. `seq` numbers the driver's settings: the "io" group runs up to four calls
        at once, so two settings sent back to back may run in either order, and one older than the
        newest applied is ignored."""
        with self._recv_lock:
            if seq < self.recv_seq:
                return self.recv_s
            self.recv_seq = seq
            self.recv_s = min(max(float(seconds), 1.0), float(self.cfg.timeouts.step_s))
            if getattr(self, "transport", None) is not None:
                self.transport.set_io_timeout(self.recv_s)
            return self.recv_s

    def abort_step(self, reason: str, failure: StepFailure | None = None) -> None:
        """A peer's step failed (`failure`, from its `_fail`) or the driver stops the run: whatever
        this actor waits for fails now, not at its deadline, carrying `failure` (runs in the "io"
        group, beside the step). No recovery inside a step: the driver tears the job down (and with
        `failure.max_restarts` starts it again from the last checkpoint)."""
        self.inbox.close(reason, failure)

    def _fail(self, step: int, error: Exception) -> None:
        """A step failed here: the error gets this actor's `StepFailure` (how the driver learns where
        and in which step, `orchestrator.core.contract.FAILURE_ATTR`); this actor starts no further
        step (queued ones fail at once), and unless it was itself told by a peer, every other actor
        gets `abort_step` with the same record (fire and forget).

        Already aborted by a peer (or failed before): no echo, and an error after the abort is
        left to the peer's record (it may be the abort's consequence) — except a refused checkpoint
        write, which never is: when every stage's write fails in one step, the peer that failed
        first aborts the others while their own writes fail, and each one's must still say STORAGE."""
        failure = step_failure(self.cfg.stage, self.cfg.host, step, error)
        if self.inbox.closed:
            if failure.kind == "storage" and getattr(error, FAILURE_ATTR, None) is None:
                setattr(error, FAILURE_ATTR, failure)
            return
        setattr(error, FAILURE_ATTR, failure)
        text = str(error)[:300]
        reason = f"{self.cfg.who} failed in step {step}: {type(error).__name__}: {text}"
        self.inbox.close(reason, failure)
        for s, row in enumerate(self.actors):
            for h, actor in enumerate(row):
                if (s, h) != (self.cfg.stage, self.cfg.host):
                    try:
                        actor.abort_step.options(concurrency_group="io").remote(reason, failure)
                    except Exception:  # noqa: BLE001 - best effort; every wait still has its deadline
                        pass

    def _pin_thread(self) -> None:
        """Pin the calling thread (threads it starts inherit it). Affinity is per thread: a Ray
        Compiled Graph runs steps on its own thread, which Ray started before any pinning."""
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
        self.state = handler(self.ctx, self.state, st, a)
        st.spans.append((text, t0, time.time()))
        st.done += 1

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
        if self.state.step != st.step + 1:
            raise RuntimeError(f"{cfg.who}: step {st.step} ended with the state at step {self.state.step} "
                               "(its OPT did not run once)")
        if self.ckpt is not None:       # between steps: the state after this step's OPT
            if self.ckpt.due(self.state.step):
                out["stats"]["checkpoint_blocking_s"] = self.ckpt.save(self.state, self.progs, self.data_state())
            out["checkpoints"] = self.ckpt.reports()
        self.last_done = st.step
        return out

    # -- evaluation (forward-only schedule) -------------------------------
    def _with_eval(self, step: int, out: dict) -> dict:
        """After step `step`'s update: when an evaluation is due, run it (all stages do, in the same
        step) and add `eval_losses` (last stage: one mean loss per eval batch) and `eval_s`."""
        cfg = self.cfg
        due = self.eval_program and ((cfg.eval_every and (step + 1) % cfg.eval_every == 0)
                                     or step + 1 == cfg.steps)
        if not due:
            return out
        t0 = time.perf_counter()
        if self._eval_batches is None:
            loader = None if self.loader is None else HostLoader(
                cfg.data.eval, self.ctx.io.rows_in, self.ctx.io.rows_lab, cfg.microbatches, who=f"{cfg.who} eval")
            self._eval_batches = [None if loader is None else loader.load(b) for b in range(cfg.data.eval_batches)]
        losses = []
        for b, batch in enumerate(self._eval_batches):
            st = StepState(step, self.recv_s, tag=f"E{b}")   # its own mailbox keys
            self.transport.begin(step, st.tag)
            st.batch = batch
            for a, text, handler in self.eval_program:
                self._doing(step, f"eval {b} {text}", a.kind in RECVS)
                handler(self.ctx, self.state, st, a)      # a forward-only list leaves the state as it is
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
        for prog, mstate in zip(self.progs, (c.mstate for c in self.state.chunks)):
            for i, (layer, s) in enumerate(zip(prog.layers, mstate), start=prog.start):
                for path, leaf in jax.tree_util.tree_flatten_with_path(s)[0]:
                    out[state_name(i, layer, key_path(path))] = gather(leaf)
        return out

    def _gathered(self) -> dict[str, np.ndarray]:
        import jax

        from orchestrator.core.model.pipeline import key_path
        from stages.dataplane import gather

        out = {}
        for prog, params in zip(self.progs, (c.params for c in self.state.chunks)):
            for i, (layer, p) in enumerate(zip(prog.layers, params), start=prog.start):
                for path, leaf in jax.tree_util.tree_flatten_with_path(p)[0]:
                    out[param_name(i, layer, key_path(path))] = gather(leaf)
        return out
