"""The stage half of checkpoints: save a stage host's `StageState` with orbax, restore it into the current shardings.

Basic flow (the worker calls it; `orchestrator.core.checkpoint` is the on-disk layout and
`orchestrator.driver.checkpoint` the commit protocol above it):
  - after a step, `due(steps_done)` → `save(state, progs, data)`: the state (`stages.state`) as
    one orbax tree — {"arrays": every persistent leaf under its model-wide name (`named_leaves`:
    parameters `param_name`, optimizer state `opt_name`, mutable model state `state_name`,
    stage-wide fields `opt:<field>|<path>`), "step", "data": {"next_step"}, "rng": {"seed"}} —
    goes to an orbax `AsyncCheckpointer` (PyTree handler). The call blocks only for the
    device→host copy; the bytes are written on orbax's thread while the next steps run. A
    thread of ours waits for orbax to finish and then (host 0) lists the directory's files
    with size and sha256: the host's report for the driver (`reports()`, handed back with the
    step results).
  - one save in flight: the next `save` first waits (bounded) for the previous one.
  - multi-host stage: every host of the stage calls `save` on the same directory; orbax writes
    only each host's own shards (its addressable data) and host 0 finalises (orbax's
    primary host, barriers over the stage's own jax.distributed world). Under `transport: xla`
    the job is one world: orbax is scoped to the stage's processes (`processes`, `_orbax_world`).
  - `restore(plan, state, progs, mesh, who)`: for each stage directory of the commit that holds
    names this stage needs, one partial orbax restore straight into `stages.state.abstract`'s
    targets; the leaves go back into the state by name, so another layout restores the same
    names. Knows nothing of the actor: a state in, a state out.
"""
from __future__ import annotations

import contextlib
import errno
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from orchestrator.core.contract import RestorePlan
from orchestrator.core.checkpoint import file_table, opt_name, stage_dir, step_dir
from orchestrator.core.checkpoint import state_name as _state_name
from orchestrator.core.model.pipeline import key_path
from orchestrator.core.model.spec import param_name
from orchestrator.core.recovery import storage_error, storage_words

def _keys(path) -> tuple[str, ...]:
    return tuple(key_path([k]) for k in path)


def named_state(progs, params, opt_state) -> list[tuple[Any, list[str], Any, list[str]]]:
    """Per chunk: (params treedef, a name per params leaf, opt-state treedef, a name per opt leaf).

    A params leaf is named `param_name(layer, part, path)`; an optimizer-state leaf whose path ends
    with a params leaf's path (adam's mu/nu follow the params) is named after it with the rest of
    its path as prefix (`opt:0/mu|03.block2/wq`); any other (a shared `count`) `opt:<path>|*`.
    """
    import jax

    out = []
    for prog, p, o in zip(progs, params, opt_state):
        pleaves, ptree = jax.tree_util.tree_flatten_with_path(p)
        by_path: dict[tuple[str, ...], str] = {}
        pnames = []
        for path, _ in pleaves:
            keys = _keys(path)
            j = int(keys[0])                       # the part's index within the chunk's list
            name = param_name(prog.start + j, prog.layers[j], "/".join(keys[1:]))
            by_path[keys] = name
            pnames.append(name)
        oleaves, otree = jax.tree_util.tree_flatten_with_path(o)
        onames = []
        for path, _ in oleaves:
            keys = _keys(path)
            hit = max((k for k in by_path if len(k) <= len(keys) and keys[len(keys) - len(k):] == k),
                      key=len, default=None)
            prefix = keys[:len(keys) - len(hit)] if hit else keys
            onames.append(opt_name("/".join(prefix), by_path[hit] if hit else None))
        out.append((ptree, pnames, otree, onames))
    return out


def state_name(layer_index: int, layer, path: str) -> str:
    """The checkpoint (and `param_arrays`) name of a mutable-state leaf: `state:02.bn/bn/mean`."""
    return _state_name(param_name(layer_index, layer, path))


def named_mstate(progs, mstate) -> list[tuple[Any, list[str]]]:
    """Per chunk: (mutable-state treedef, a name per leaf, `state_name`); no leaves when stateless."""
    import jax

    out = []
    for prog, s in zip(progs, mstate):
        leaves, tree = jax.tree_util.tree_flatten_with_path(s)
        names = []
        for path, _ in leaves:
            keys = _keys(path)
            j = int(keys[0])
            names.append(state_name(prog.start + j, prog.layers[j], "/".join(keys[1:])))
        out.append((tree, names))
    return out


def named_leaves(progs, state) -> list[tuple[str, Any]]:
    """Every persistent leaf of `state` (a `stages.state.StageState`) under its model-wide name, in
    save order: per chunk its parameters, optimizer state and mutable model state (a leaf shared by
    chunks, adam's `count`, once), then the stage-wide fields (`stage_fields`). TRANSIENT fields
    (the gradient accumulators) are not saved."""
    import jax

    from stages.state import stage_fields

    chunks = state.chunks
    named = named_state(progs, [c.params for c in chunks], [c.opt_state for c in chunks])
    out, seen = [], set()
    for (_, pn, _, on), (_, sn), c in zip(named, named_mstate(progs, [c.mstate for c in chunks]), chunks):
        for name, leaf in zip(pn + on + sn, jax.tree.leaves(c.params) + jax.tree.leaves(c.opt_state)
                              + jax.tree.leaves(c.mstate)):
            if name not in seen:
                seen.add(name)
                out.append((name, leaf))
    for field, value in stage_fields(state):
        out += [(stage_name(field, path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]]
    return out


def stage_name(field: str, path=()) -> str:
    """The name of a stage-wide state leaf: `opt:<field>|<its path in the field>` (`*`: the field itself).

    >>> stage_name("skips")
    'opt:skips|*'
    """
    return opt_name(field, "/".join(_keys(path)) or None)


def processes(cfg) -> tuple[int, ...] | None:
    """The JAX processes a stage's saves and restores involve when the job is ONE world
    (`transport: xla`: the stage's cluster hosts), else None: the stage's own world is all of them."""
    return tuple(cfg.stage_spec.hosts) if cfg.transport.kind == "xla" else None


@contextlib.contextmanager
def _orbax_world(procs: tuple[int, ...] | None):
    """While a one-host stage of a job-wide world (`transport: xla`) saves or restores: orbax sees a
    one-process world. Orbax's rules are a process-0-writes, all-processes-sync world's: it refuses a
    fully addressable jax.Array when jax has several processes ("host local") and writes numpy and
    scalar leaves only on process 0 — both wrong for a stage that is one process of many. jax's
    own code never reads the public `jax.process_index`/`jax.process_count` it swaps (it calls
    `xla_bridge`), and the step thread is the only one at work meanwhile (the transfers of the
    step are flushed; a save is synchronous in this mode). A multi-host stage keeps the real
    world, with orbax scoped to its processes (`_multiprocessing`) and no host leaves
    (`_global_leaves`)."""
    if procs is None or len(procs) != 1:
        yield
        return
    import jax

    real = jax.process_index, jax.process_count
    jax.process_index, jax.process_count = (lambda backend=None: 0), (lambda backend=None: 1)
    try:
        yield
    finally:
        jax.process_index, jax.process_count = real


def _global_leaves(state: dict, mesh) -> dict:
    """A multi-host stage's save tree with its numpy / scalar leaves as jax.Arrays replicated over the
    stage's mesh (orbax writes host leaves only on process 0 of the world; these it writes with the
    stage's own primary process)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    replicated = NamedSharding(mesh, PartitionSpec())

    def lift(leaf):
        if isinstance(leaf, (np.ndarray, np.generic)):
            host = np.asarray(leaf)
            return jax.make_array_from_callback(host.shape, replicated, lambda idx: host[idx])
        return leaf

    return jax.tree.map(lift, state)


def _own_signal_keys(procs: tuple[int, ...] | None) -> None:
    """Inside a job-wide world every stage's orbax shares the coordination service's key-value store,
    and orbax names its save signals `awaitable_signals_contract_<operation id>/...` — the same names
    in every stage, which each stage's saves also delete: stage 1's step-directory signal wiped stage
    0's and a 2-host stage's save waited 300 s for it (measured). Each stage's processes get their own
    key prefix (a class attribute of orbax's, in this process only: it holds one stage)."""
    if procs is None:
        return
    from orbax.checkpoint._src.futures import future

    future.AwaitableSignalsContract.awaitable_signals_contract_prefix = (
        f"meshpipe-stage-of-{procs[0]}/awaitable_signals_contract")


def _multiprocessing(procs: tuple[int, ...] | None):
    """Orbax's options for a stage inside a bigger world: its own processes, its first as primary,
    its own barrier names (stage saves run at the same time under different directories)."""
    from orbax.checkpoint.options import MultiprocessingOptions

    if procs is None or len(procs) == 1:      # the stage's own world, or a one-process view (`_orbax_world`)
        return MultiprocessingOptions()
    return MultiprocessingOptions(primary_host=procs[0], active_processes=set(procs),
                                  barrier_sync_key_prefix=f"meshpipe-stage-of-{procs[0]}")


def _handler(procs: tuple[int, ...] | None, registry=None):
    import orbax.checkpoint as ocp

    kwargs = {} if registry is None else {"type_handler_registry": registry}
    return ocp.PyTreeCheckpointHandler(multiprocessing_options=_multiprocessing(procs), **kwargs)


def _save_registry(procs: tuple[int, ...] | None = None):
    """Orbax's standard handlers for what a stage saves; replica-parallel saving only across hosts.

    Orbax can split a shard replicated over R devices into R slices, one written by each replica
    (`use_replica_parallel`): each slice is a jitted `slice_in_dim` per distinct shape, compiled
    on the step thread during the first save (it blocked the first save several times longer:
    `docs/decisions.md`, "Replica-parallel saving"), and device work on every later save.
    In a one-host stage the replicas are that process's own devices, so the slices buy no parallel
    writing: replica 0 writes each shard whole. In a multi-host stage a shard replicated over
    hosts (a `data` axis that spans them) is split, so every host writes its share in parallel.
    """
    import jax
    from orbax.checkpoint import type_handlers as th

    across_hosts = jax.process_count() > 1 if procs is None else len(procs) > 1
    primary = 0 if procs is None or len(procs) == 1 else procs[0]
    return th.create_type_handler_registry(
        (int, th.ScalarHandler()), (float, th.ScalarHandler()), (np.number, th.ScalarHandler()),
        (np.ndarray, th.NumpyHandler()),
        (jax.Array, th.ArrayHandler(primary_host=primary, use_replica_parallel=across_hosts)))


class StageCheckpointer:
    """Saves and restores one stage host's state (see the module docstring).

    Args:
      root: the job's `checkpoint.dir`.
      every: save after every `every` steps done, and after the last (`total`).
      asynchronous: False waits for each save to finish before the step loop goes on.
      stage, host: who this is (host 0 lists the files).
      seed: `run.seed`, recorded with each save.
      timeout: bound on waiting for a previous save.
      procs: the stage's JAX processes inside a job-wide world (`processes`); None: its own world.
    """

    def __init__(self, root: str, every: int, total: int, asynchronous: bool, stage: int, host: int,
                 seed: int = 0, timeout: float = 600.0, procs: tuple[int, ...] | None = None, mesh=None):
        from orchestrator.core.extras import require

        ocp = require("orbax.checkpoint", "checkpoint:")     # a node without it: the error names the extra

        self.root, self.every, self.total = Path(root), every, total
        self.asynchronous, self.stage, self.host, self.timeout = asynchronous, stage, host, timeout
        self.seed = seed                # recorded with each save (`rng.seed`)
        _own_signal_keys(procs)
        with _orbax_world(procs):
            self._ckptr = ocp.AsyncCheckpointer(_handler(procs, _save_registry(procs)),
                                                multiprocessing_options=_multiprocessing(procs))
        self.procs, self.mesh = procs, mesh
        self._thread: threading.Thread | None = None
        self._done: list[dict] = []
        self._error: BaseException | None = None
        self._step = 0                  # the step of the save in flight (or last started)
        self._lock = threading.Lock()
        self.last_blocking_s = 0.0

    def due(self, steps_done: int) -> bool:
        return steps_done % self.every == 0 or steps_done == self.total

    def save(self, state, progs, data: dict | None = None) -> float:
        """Start saving `state` (a `stages.state.StageState`: after `state.step` steps); `data`: the
        loader's position (None on a host that loads nothing), reported with the save. Returns the
        blocking seconds."""
        import orbax.checkpoint as ocp

        from stages.state import host_array

        self._wait_previous()
        t0 = time.perf_counter()
        steps_done = int(state.step)
        tree, names = {}, {}
        for name, leaf in named_leaves(progs, state):
            key = f"a{len(tree):05d}"
            tree[key], names[key] = (leaf if hasattr(leaf, "sharding") else host_array(leaf)), name
        saved = {"arrays": tree, "step": np.int64(steps_done), "data": {"next_step": np.int64(steps_done)},
                 "rng": {"seed": np.int64(self.seed)}}
        directory = stage_dir(self.root, steps_done, self.stage)
        self._step = steps_done
        try:
            directory.parent.mkdir(parents=True, exist_ok=True)
        except FileExistsError:      # something that is not a directory stands at step_<N>
            raise NotADirectoryError(errno.ENOTDIR, "not a directory: the checkpoint's step directory cannot be "
                                     "made", str(directory.parent)) from None
        if self.procs is not None and len(self.procs) > 1:
            saved = _global_leaves(saved, self.mesh)
        with _orbax_world(self.procs):
            self._ckptr.save(directory, args=ocp.args.PyTreeSave(saved))
            if self.procs is not None and len(self.procs) == 1:
                self._ckptr.wait_until_finished()        # the one-process view must not outlive this call
        blocking = self.last_blocking_s = time.perf_counter() - t0
        meta = {name: {"shape": list(leaf.shape), "dtype": str(leaf.dtype), "key": key}
                for key, (name, leaf) in ((k, (names[k], tree[k])) for k in tree)}
        nbytes = int(sum(int(np.prod(leaf.shape, dtype=np.int64)) * leaf.dtype.itemsize for leaf in tree.values()))
        self._thread = threading.Thread(target=self._finish, args=(steps_done, directory, meta, nbytes, blocking, data),
                                        name=f"meshpipe checkpoint {steps_done}", daemon=True)
        self._thread.start()
        if not self.asynchronous:
            self._wait_previous()
        return blocking

    def _finish(self, steps_done: int, directory: Path, meta: dict, nbytes: int, blocking: float,
                data: dict | None) -> None:
        t0 = time.perf_counter()
        try:
            self._ckptr.wait_until_finished()
            files = file_table(directory) if self.host == 0 else {}
            rec = {"step": steps_done, "stage": self.stage, "host": self.host, "path": directory.name,
                   "files": files, "arrays": meta if self.host == 0 else {}, "bytes": nbytes,
                   "blocking_s": blocking, "write_s": time.perf_counter() - t0, "data": data}
            with self._lock:
                self._done.append(rec)
        except BaseException as e:  # noqa: BLE001 - raised on the step thread by the next call
            self._error = e

    def _wait_previous(self) -> None:
        thread = self._thread
        if thread is not None:
            thread.join(self.timeout)
            if thread.is_alive():
                raise TimeoutError(f"checkpoint save of stage {self.stage} host {self.host} did not finish "
                                   f"within {self.timeout:.0f} s")
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            storage = storage_error(e)
            full = (f"checkpoint.dir = {self.root} refused the write ({storage_words(storage[0])}; the last "
                    "committed checkpoint is kept): " if storage else "")
            raise RuntimeError(f"checkpoint save of step {self._step} failed on stage {self.stage} host "
                               f"{self.host}: {full}{type(e).__name__}: {e}") from e

    def reports(self) -> list[dict]:
        """Saves finished since the last call (this host's reports for the driver)."""
        if self._error is not None:
            self._wait_previous()
        with self._lock:
            out, self._done = self._done, []
        return out

    def flush(self) -> list[dict]:
        """Wait (bounded) for the save in flight; every report not handed out yet."""
        self._wait_previous()
        return self.reports()

    def close(self) -> None:
        try:
            self._wait_previous()
        finally:
            with _orbax_world(self.procs):
                self._ckptr.close()


def restore(plan: RestorePlan, state, progs, mesh, who: str, procs: tuple[int, ...] | None = None):
    """`state` (a `stages.state.StageState`, which gives the structure, names and shardings) with
    every persistent leaf read from committed step `plan.step`, by name: each array lands directly
    in the sharding `state` has for it; `procs`: the stage's processes inside a job-wide world
    (`processes`). Returns the restored state."""
    import jax
    import orbax.checkpoint as ocp

    from stages.state import abstract

    where = {}       # name -> (stage record index, key)
    for i, rec in enumerate(plan.stages):
        for arr in rec.arrays:
            where.setdefault(arr.name, (i, arr.key))
    named = named_leaves(progs, state)
    targets = abstract([leaf for _, leaf in named], mesh)
    want: dict[int, dict] = {}
    for (name, _), target in zip(named, targets):
        if name not in where:
            field = name[len("opt:"):].split("|", 1)[0]
            if field in state._fields:      # a stage-wide field (e.g. loss_scale): a run saved without it
                raise RuntimeError(f"{who}: checkpoint step {plan.step} has no {field.replace('_', '-')} state "
                                   f"({name!r}): it was saved without it")
            raise RuntimeError(f"{who}: checkpoint step {plan.step} has no array {name!r}")
        i, key = where[name]
        want.setdefault(i, {})[key] = (name, target)
    got: dict[str, Any] = {}
    _own_signal_keys(procs)
    with _orbax_world(procs), ocp.Checkpointer(_handler(procs), multiprocessing_options=_multiprocessing(procs)) \
            as ckptr:
        for i, keyed in sorted(want.items()):
            item = {"arrays": {k: t for k, (_, t) in keyed.items()}}
            args = {"arrays": {k: _restore_args(t) for k, (_, t) in keyed.items()}}
            directory = step_dir(plan.root, plan.step) / plan.stages[i].path
            try:
                out = ckptr.restore(directory, args=ocp.args.PyTreeRestore(item, restore_args=args,
                                                                           partial_restore=True))
            except Exception as e:
                raise RuntimeError(f"{who}: restoring {directory} failed: {type(e).__name__}: "
                                   f"{str(e)[:400]}") from e
            for key, (name, _) in keyed.items():
                got[name] = out["arrays"][key]
    restored = _rebuild(state, progs, got)
    jax.block_until_ready(restored)
    return restored


def _restore_args(target):
    import orbax.checkpoint as ocp

    if isinstance(target, np.ndarray):
        return ocp.RestoreArgs(restore_type=np.ndarray)
    return ocp.ArrayRestoreArgs(sharding=target.sharding)


def _rebuild(state, progs, got: dict):
    """`state` with its persistent leaves replaced by `got` (name -> restored leaf); a host scalar
    comes back as the Python type it was."""
    import jax

    from stages.state import ChunkState, stage_fields

    chunks = state.chunks
    named = named_state(progs, [c.params for c in chunks], [c.opt_state for c in chunks])
    named_s = named_mstate(progs, [c.mstate for c in chunks])
    new = []
    for c, (ptree, pn, otree, on) in enumerate(named):
        stree, sn = named_s[c]
        new.append(ChunkState(jax.tree_util.tree_unflatten(ptree, [got[n] for n in pn]),
                              jax.tree_util.tree_unflatten(otree, [got[n] for n in on]),
                              chunks[c].grads, jax.tree_util.tree_unflatten(stree, [got[n] for n in sn])))
    fields = {}
    for field, value in stage_fields(state):
        leaves, tree = jax.tree_util.tree_flatten_with_path(value)
        fields[field] = jax.tree_util.tree_unflatten(
            tree, [_as_host(leaf, got[stage_name(field, path)]) for path, leaf in leaves])
    return state._replace(chunks=tuple(new), **fields)


def _as_host(like, value):
    """A restored host scalar as the Python type `like` is (a device array stays as it came)."""
    if isinstance(like, (bool, int, float)) and not hasattr(like, "sharding"):
        return type(like)(np.asarray(value).item())
    return value
