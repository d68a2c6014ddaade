"""The pipeline executor: a thin dispatcher over a lowered, validated schedule.

Basic flow:
  start():  one actor per host of each stage (placement.actor_options), then
            for multi-host stages the stage's coordinator address from its host
            0, then `setup` on all actors at once, then `connect` neighbours
            (transport socket: with every actor's listening address).
  steps(n): each actor runs its own lowered action list per step and
            exchanges tensors directly with its neighbours; the driver only
            triggers steps (`orchestrator.driver.dispatch`, per `cluster.executor`: one
            `run_steps` call per actor per `steps_per_call` steps by default, or
            the same as a Ray Compiled Graph, or one call per action as a
            reference), waits with a
            deadline, and collects losses and spans. It makes no scheduling
            decisions and never touches a tensor.
  shutdown(): every actor told to abort its step at once (the "io" group: a
            survivor blocked in a RECV on a dead peer returns now, not at its
            deadline), then a compiled graph's teardown (which waits for every
            actor's step: after the abort, not before) bounded by the same grace —
            past it the actors are killed —, a bounded `shutdown` call, then kill
            every actor and remove the placement group — also after errors and
            Ctrl-C. After a failure the survivors get only `ABORT_GRACE_S` (the
            attempt is thrown away: they wait for nothing, not jax.distributed's
            barrier with a dead peer) and are killed.
The progress deadline (`orchestrator.core.recovery.ProgressDeadline`, shared by the
recovery loop's attempts) bounds each call: `timeouts.step_s` until steps were measured,
then max(30 s, 3 × n × the median step time) for a call of n steps, never above n × step_s;
an attempt's first step (compilation) is not measured. In runs with restarts the heartbeats
(`recovery.HeartbeatWatch`) see a hang one step's deadline after the step stopped moving, and
the call's deadline (plus one step's) is their backstop. Once measured, every actor's RECV
deadline follows it too (`RECV_FACTOR` × the call's deadline, never above `timeouts.step_s`):
looser than the driver's, so the driver — which can tell the hung actor from the ones waiting
on it — always calls a hang first.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from collections.abc import Sequence

from orchestrator.driver import placement
from orchestrator.core.edges import stage_geoms
from orchestrator.driver.waiting import StageFailure, stage_failure, wait_all
from stages.hooks import WorkerHook
from stages.ties import tie_stages
from stages.worker import StageWorker
from orchestrator.core.contract import (ActorId, CheckpointSpec, OptimizerSpec, StageSpec, Timeouts, TlsFiles,
                                        TransferOrder, TransportSpec, WorkerConfig)

RECV_FACTOR = 2.0    # an actor's RECV deadline: this × the driver's progress deadline for a call
# After a failure: the seconds the survivors (told to abort) get to end their step and close before they
# are killed. An aborted survivor's step ends and its transport closes well within it; what it would
# wait for after that (jax.distributed's shutdown barrier, with a dead peer) can hold the whole
# timeouts.shutdown_s and is not waited for (the measurement: docs/decisions.md, "Abort grace").
ABORT_GRACE_S = 5.0
CAUSE_GRACE_S = 3.0      # transport xla: how long a death's report waits to see the world's coordinator die too


@dataclass
class StepResult:
    step: int
    loss: float
    wall_s: float
    spans: list          # (stage, host, action, start, end)
    stats: list = field(default_factory=list)   # per actor: {stage, host, **telemetry.stage_stats}
    checkpoints: list = field(default_factory=list)   # save reports handed back with this step (stages.checkpoint)
    eval_loss: float | None = None   # mean loss over the eval batches, when the step evaluated


class PipelineExecutor:
    def __init__(self, checked, lowered, data_source, run: str, eval_schedule=None,
                 hooks: Sequence[WorkerHook] = (), checkpoint: CheckpointSpec | None = None, deadline=None,
                 placement_wait: float = 0.0, avoid_nodes: Sequence[str] = ()):
        self.checked, self.lowered, self.data, self.run = checked, lowered, data_source, run
        self.eval_schedule = eval_schedule
        self.hooks = tuple(hooks)       # stages.hooks.WorkerHook objects, passed to every actor
        self.checkpoint = checkpoint     # the stages' CheckpointSpec (orchestrator.driver.checkpoint.prepare)
        t = checked.cluster.timeouts
        self.timeouts = Timeouts(t.init_s, t.step_s, t.shutdown_s, t.jax_distributed_init_s)
        from orchestrator.core.recovery import ProgressDeadline

        self.deadline = deadline if deadline is not None else ProgressDeadline(t.step_s)
        self.pg = None
        # a restart's placement waits for the cluster to fit again (placement.reserve), avoiding lost nodes
        self.placement_wait, self.avoid_nodes = float(placement_wait), tuple(avoid_nodes)
        self.placement_s: float | None = None     # how long reserving the placement group took
        self.recv_s: float | None = None          # the RECV deadline last set on the actors (None: step_s)
        self.recv_seq = 0                         # how many times it was set (the actors keep the newest)
        self.heartbeats: dict[str, dict] = {}     # label -> the last heartbeat answer (`unresponsive`)
        self.actors: list[list] = []     # [stage][host]
        self.labels: list[list[str]] = []
        self.info: list[dict] = []
        # transport "socket": a fresh secret per run; peers' connections must present it
        self.plane = checked.cluster.data_plane      # "auto" resolved for the platform
        self.token = secrets.token_bytes(32) if self.plane == "socket" else None
        self.kind = checked.cluster.executor
        self.dispatcher = None      # made by the first steps() call
        self.beats = None           # recovery.HeartbeatWatch while steps run (runs with restarts)
        self.dispatch_info: dict = {}

    # -- lifecycle ---------------------------------------------------------
    def worker_config(self, stage, host: int) -> WorkerConfig:
        """The contract of `stage`'s host `host` (`orchestrator.core.contract`)."""
        from orchestrator.core.recovery import compile_cache_dir

        checked, job = self.checked, self.checked.job
        cluster = checked.cluster
        evals = () if self.eval_schedule is None else self.eval_schedule.actions[stage.index]
        tls = cluster.transport_tls
        return WorkerConfig(
            run=self.run, stage=stage.index, host=host, cluster_host=stage.hosts[host],
            stage_spec=StageSpec(
                index=stage.index, hosts=tuple(stage.hosts), devices_per_host=stage.devices_per_host,
                mesh=tuple(dict(stage.mesh).items()), layout=tuple(dict(stage.layout).items()),
                chunks=tuple(tuple(c) for c in stage.chunks),
                actions=tuple(str(a) for a in self.lowered.actions[stage.index] if a is not None),
                eval_actions=tuple(str(a) for a in evals if a is not None),
                remat=stage.remat, fuse_loss_chunk=job.pipeline.fuse_loss_chunk),
            spec=checked.model, data=self.data, microbatches=job.pipeline.microbatches,
            microbatch_size=checked.microbatch_size, optimizer=OptimizerSpec.of(job.optimizer.spec()),
            seed=job.run.seed, num_stages=len(checked.stages), steps=job.run.steps, eval_every=job.run.eval_every,
            geoms=tuple(stage_geoms(checked)),
            tie_stages=tie_stages(checked.model.ties, [s.chunks for s in checked.stages]),
            timeouts=self.timeouts,
            transport=TransportSpec(kind=self.plane, token=self.token, same_machine=cluster.transport_same_machine,
                                    tls=None if tls is None else TlsFiles(tls.cert_file, tls.key_file, tls.ca_file),
                                    transfers=self._transfers() if self.plane == "xla" else ()),
            loss_scale=job.precision.scaling(), checkpoint=self.checkpoint,
            compile_cache=compile_cache_dir(job), pin_cpus=cluster.pin_cpus, hooks=self.hooks,
            on_nonfinite=job.failure.on_nonfinite)

    def _transfers(self) -> tuple[TransferOrder, ...]:
        """The world's transfer order of a training step and of an eval batch (`transport: xla`)."""
        from orchestrator.core.schedule.transfers import world_order

        chunks = [tuple(s.chunks) or (tuple(s.layers),) for s in self.checked.stages]
        orders = [TransferOrder("F", world_order(self.lowered, chunks))]
        if self.eval_schedule is not None:
            orders.append(TransferOrder("E", world_order(self.eval_schedule, chunks)))
        return tuple(orders)

    def _coordinators(self) -> list:
        """Per stage, the coordinator address its setup gets: a multi-host stage's own (its host 0
        picks it), or under `transport: xla` the one world's (cluster host 0's actor picks it)."""
        def pick(row, names, what):
            return wait_all([row[0].coordinator_address.remote()], self.timeouts.init_s, what, names[:1])[0]

        if self.plane == "xla":       # process 0 of the world: the actor of cluster host 0
            s, h = next((s, st.hosts.index(0)) for s, st in enumerate(self.checked.stages) if 0 in st.hosts)
            world = pick(self.actors[s][h:], self.labels[s][h:], "picking the world's coordinator")
            return [world] * len(self.actors)
        return [pick(row, names, "picking the stage coordinator") if len(row) > 1 else None
                for row, names in zip(self.actors, self.labels)]

    def start(self) -> None:
        import ray

        from ray.util import placement_group_table

        t0 = time.perf_counter()
        self.pg = placement.reserve(self.checked, f"{self.run}/pg", self.timeouts.init_s,
                                    wait_for_fit=self.placement_wait, avoid=self.avoid_nodes)
        self.placement_s = time.perf_counter() - t0
        bundle_nodes = placement_group_table(self.pg).get("bundles_to_node_id", {})
        # the mailbox ("io") accepts pushes while the default group runs the step
        remote = ray.remote(concurrency_groups={"io": 4})(StageWorker)
        for stage in self.checked.stages:
            row, names = [], []
            for host in range(len(stage.hosts)):
                opts = placement.actor_options(self.checked, stage, host, self.pg, self.run)
                opts["namespace"] = f"meshpipe-{self.run}"   # also when the driver attached elsewhere
                row.append(remote.options(**opts).remote(self.worker_config(stage, host)))
                names.append(ActorId(stage.index, host))
            self.actors.append(row)
            self.labels.append(names)
        coords = self._coordinators()
        refs, labels = [], []
        for row, names, coord in zip(self.actors, self.labels, coords):
            refs += [a.setup.remote(coord) for a in row]
            labels += names
        try:
            self.info = wait_all(refs, self.timeouts.init_s, "stage setup", labels)
        except StageFailure as e:
            raise self.first_cause(e) from e
        for rec in self.info:
            bundle = self.checked.stages[rec["stage"]].hosts[rec["host"]]
            rec["bundle"], rec["bundle_node_id"] = bundle, bundle_nodes.get(bundle)
        if self.token is None:
            refs = [a.connect.remote(self.actors) for row in self.actors for a in row]
        else:   # socket transport: every actor's listening address, [stage][host]
            flat = wait_all([a.transport_address.remote() for row in self.actors for a in row],
                            self.timeouts.init_s, "collecting transport addresses", labels)
            it = iter(flat)
            addresses = [[next(it) for _ in row] for row in self.actors]
            refs = [a.connect.remote(self.actors, addresses) for row in self.actors for a in row]
        wait_all(refs, self.timeouts.init_s, "connecting stages", labels)

    def unresponsive(self, labels: list[str], timeout: float = 5.0) -> list[str]:
        """Of these actors, those whose "io" group does not answer a heartbeat within `timeout`
        (a stopped process; an actor waiting on a peer answers)."""
        answers = self._heartbeats(labels, timeout)
        self.heartbeats.update(answers)
        return [lbl for lbl in labels if lbl not in answers]

    def finished_steps(self, skip=(), timeout: float = 2.0) -> dict:
        """label -> the newest step each actor (but those in `skip`: hung, or on a lost node) says it
        finished (heartbeat's `done`), for those answering within `timeout`; after a failure, for
        `orchestrator.core.recovery.failed_step`."""
        labels = [lbl for names in self.labels for lbl in names if lbl not in skip]
        return {lbl: beat.get("done") for lbl, beat in self._heartbeats(labels, timeout).items()}

    def _heartbeats(self, labels: list[str], timeout: float) -> dict:
        """label -> heartbeat answer of those of these actors that answer within `timeout`."""
        import ray

        by_label = {lbl: a for row, names in zip(self.actors, self.labels) for a, lbl in zip(row, names)}
        refs = {by_label[lbl].heartbeat.options(concurrency_group="io").remote(): lbl
                for lbl in labels if lbl in by_label}
        answers: dict = {}
        if refs:
            ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
            for r in ready:
                try:
                    answers[refs[r]] = ray.get(r, timeout=1.0)
                except Exception:  # noqa: BLE001 - dead counts as not answering
                    pass
        return answers

    def abort(self, reason: str) -> None:
        """Tell every actor to abandon its step now (fire and forget; `abort_step` runs beside it)."""
        for a in (a for row in self.actors for a in row):
            try:
                a.abort_step.options(concurrency_group="io").remote(reason)
            except Exception:  # noqa: BLE001 - best effort; shutdown kills them anyway
                pass

    def shutdown(self, unresponsive: Sequence[str] = (), after_failure: bool = False) -> dict:
        """Tear everything down (bounded); `unresponsive`: labels of actors killed first, without
        waiting for them (a hung process would hold the bounded `shutdown` wait to its end).
        `after_failure`: the attempt failed and is thrown away — the survivors, told to abort,
        get `ABORT_GRACE_S` (not `timeouts.shutdown_s`) to end their step and close
        (`StageWorker.shutdown(after_failure=True)`: nothing waited for), then they are killed;
        one still in its step then (e.g. inside an XLA collective with a dead peer, which no
        abort reaches) is among `stuck`. Returns {"graceful_s": the seconds the survivors'
        shutdown was waited for, "stuck": labels of the survivors killed without it}."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for row, names in zip(self.actors, self.labels):
            for a, lbl in zip(row, names):
                if lbl in unresponsive:
                    ray.kill(a, no_restart=True)
        kept = [(a, lbl) for row, names in zip(self.actors, self.labels) for a, lbl in zip(row, names)
                if lbl not in unresponsive]
        flat = [a for a, _ in kept]
        # before `shutdown`, which queues behind a step that waits on a dead peer, and before a compiled
        # graph's teardown, which waits for every actor's step to end
        self.abort("the driver is shutting the run down")
        grace = min(ABORT_GRACE_S, self.timeouts.shutdown_s) if after_failure else self.timeouts.shutdown_s
        t0 = time.perf_counter()
        stuck = []
        dispatcher, self.dispatcher = self.dispatcher, None
        if dispatcher is not None:
            try:   # a compiled graph is torn down before its actors die: within the grace, else they are killed
                stuck = [lbl for lbl in dispatcher.close(grace) if lbl not in unresponsive]
            except Exception:  # noqa: BLE001 - best effort; the kill below is what counts
                pass
        if flat and not stuck:
            try:
                refs = [a.shutdown.remote(after_failure) for a in flat]
                _, left = ray.wait(refs, num_returns=len(refs), timeout=grace)
                stuck = [lbl for (_, lbl), r in zip(kept, refs) if r in left]
            except Exception:  # noqa: BLE001 - best effort; the kill below is what counts
                pass
        graceful_s = time.perf_counter() - t0
        for a in flat:
            ray.kill(a, no_restart=True)
        self.actors = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
        return {"graceful_s": graceful_s, "stuck": stuck}

    # -- running -----------------------------------------------------------
    def steps(self, count: int, start: int = 0):
        """Run `count` steps from step `start`, yielding a StepResult as each completes (orchestrator.driver.dispatch:
        how the actors are told to go is `cluster.executor`; wall = time between completions)."""
        from orchestrator.driver import dispatch

        flat = [a for row in self.actors for a in row]
        labels = [lbl for names in self.labels for lbl in names]
        counts = [len(self.lowered.actions[s]) - self.lowered.actions[s].count(None)
                  for s, row in enumerate(self.actors) for _ in row]
        if self.dispatcher is None:    # an attempt's first call compiles: the configured deadline
            self.dispatcher = dispatch.make(self.kind, flat, labels, counts, self.timeouts.step_s,
                                            self.checked.cluster.calls_of_steps)
            # a lost node or a hang noticed in seconds; under compiled_graph also a death (its channel
            # reads do not see one: the heartbeats do), so there always
            if self.checked.job.failure.max_restarts > 0 or self.kind == "compiled_graph":
                from orchestrator.driver.recovery import HeartbeatWatch, NodeWatch

                nodes = NodeWatch(self.info)
                self.beats = HeartbeatWatch(dict(zip(labels, flat)), self.timeouts.step_s)

                def watch() -> None:
                    nodes()
                    self.beats()

                self.dispatcher.watch = watch
                self.dispatcher.death = self.beats.death
        measured = False
        self.dispatch_info = {"dispatcher": type(self.dispatcher).__name__,
                              "steps_per_call": getattr(self.dispatcher, "per_call", 1)}
        for i, outs, wall in self._steps_of(count, start):
            losses = next(o["losses"] for o in outs if "losses" in o)
            spans = [(o["stage"], o["host"], *span) for o in outs for span in o["spans"]]
            stats = [{"stage": o["stage"], "host": o["host"], **o.get("stats", {})} for o in outs]
            ev = next((o["eval_losses"] for o in outs if "eval_losses" in o), None)
            saved = [rec for o in outs for rec in o.get("checkpoints", ())]
            if measured:
                self.deadline.observe(wall)
                self.dispatcher.call_s = self.deadline.call_s
                if self.beats is not None:       # one step's deadline, for the heartbeats
                    self.beats.step_s = self.deadline.step_s()
                    # the heartbeats see a hang one step deadline after the step stopped moving; the
                    # call's deadline (from when the driver began to wait) is their backstop
                    self.dispatcher.call_s = lambda n: self.deadline.call_s(n) + self.deadline.step_s()
                self._follow_deadline(flat)
            measured = True
            yield StepResult(step=i, loss=sum(losses) / len(losses), wall_s=wall, spans=spans, stats=stats,
                             eval_loss=None if ev is None else sum(ev) / len(ev), checkpoints=saved)

    def _steps_of(self, count: int, start: int):
        """The dispatcher's steps, a death reported as its first cause (`first_cause`)."""
        try:
            yield from self.dispatcher.steps(count, start)
        except StageFailure as e:
            cause = self.first_cause(e)
            if cause is e:
                raise
            raise cause from e

    def first_cause(self, e: StageFailure) -> StageFailure:
        """Under `transport: xla` the world's coordinator runs in cluster host 0's actor: when it dies,
        JAX's coordination service aborts every other process of the world within a second, and
        whichever death Ray reports first may be one of those aborts. So a death of another actor
        is checked against the coordinator's (a heartbeat, `CAUSE_GRACE_S`): if that actor is dead
        too, its death is the cause. (Any other process's death takes the world down only after
        JAX's heartbeat timeout, set far above the driver's own detection: `stages.jaxinit`.)"""
        if self.plane != "xla" or not e.died or not self.actors:
            return e
        s, h = next((s, st.hosts.index(0)) for s, st in enumerate(self.checked.stages) if 0 in st.hosts)
        root = self.labels[s][h]
        if e.label == root:
            return e
        import ray
        from ray.exceptions import ActorUnavailableError, RayActorError

        deadline = time.monotonic() + CAUSE_GRACE_S
        while True:       # "unavailable" is Ray's word for a state it has not settled yet: ask again
            ref = self.actors[s][h].heartbeat.options(concurrency_group="io").remote()
            try:
                ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
                return e
            except ActorUnavailableError:
                if time.monotonic() >= deadline:
                    return e
                time.sleep(0.1)
            except RayActorError as dead:
                cause = stage_failure("the world's coordinator (heartbeat)", root, dead)
                cause.message += f" (then {e.label} died with it: JAX's coordination service aborted it)"
                return cause
            except Exception:  # noqa: BLE001 - alive but slow, or unknown: the death seen stays the cause
                return e

    def _follow_deadline(self, flat: list) -> None:
        """Set every actor's RECV deadline to RECV_FACTOR × the progress deadline of a call (fire and
        forget, in the "io" group) when it moved by more than a tenth since last set; each setting is
        numbered, and an actor keeps the newest whatever order its "io" threads run them in."""
        per_call = getattr(self.dispatcher, "per_call", 1)
        want = min(self.timeouts.step_s, RECV_FACTOR * self.deadline.call_s(per_call))
        if self.recv_s is not None and abs(want - self.recv_s) <= 0.1 * self.recv_s:
            return
        self.recv_s, self.recv_seq = want, self.recv_seq + 1
        for a in flat:
            try:
                a.set_recv_deadline.options(concurrency_group="io").remote(want, self.recv_seq)
            except Exception:  # noqa: BLE001 - the actor keeps its deadline; a dead one fails its step anyway
                pass

    def node_of(self, stage: int | None, host: int | None) -> dict:
        """Where (stage, host) ran: cluster host (bundle) index and Ray node id, as far as known."""
        if stage is None:
            return {}
        rec = next((r for r in self.info if (r.get("stage"), r.get("host")) == (stage, host)), None)
        if rec is not None:
            return {"cluster_host": rec.get("bundle"), "node_id": rec.get("bundle_node_id")}
        try:
            return {"cluster_host": self.checked.stages[stage].hosts[host], "node_id": None}
        except (IndexError, TypeError):
            return {}

    def checkpoint_flush(self) -> list[dict]:
        """Every actor's save in flight, finished (bounded); the reports not yet handed back."""
        refs, labels = [], []
        for row, names in zip(self.actors, self.labels):
            refs += [a.checkpoint_flush.remote() for a in row]
            labels += names
        return [rec for part in wait_all(refs, self.timeouts.step_s, "finishing checkpoint saves", labels)
                for rec in part]

    def param_norms(self) -> dict[str, float]:
        return self._per_param("param_norms", "param norms")

    def param_arrays(self) -> dict:
        """Every parameter leaf as a whole numpy array (every host joins the gather; any host's copy)."""
        return self._per_param("param_arrays", "param arrays")

    def _per_param(self, method: str, what: str) -> dict:
        refs, labels = [], []
        for row, names in zip(self.actors, self.labels):
            refs += [getattr(a, method).remote() for a in row]
            labels += names
        out: dict = {}
        for part in wait_all(refs, self.timeouts.step_s, what, labels):
            out.update(part)
        return dict(sorted(out.items()))
