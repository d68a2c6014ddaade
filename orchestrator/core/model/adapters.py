"""Adapters: a framework's model, unchanged, as a `PipelineModel`.

Each adapter asks for what the framework does not already say: how the model
splits into a pipeline sequence, and the loss. Logical axes come from the
framework's own metadata where it has some (flax.nnx `nnx.with_partitioning`),
else from path patterns (`by_path`).

  plain(init, parts, ...)       plain JAX: `init(key) -> {part name: params}` and one
                                `apply(params, x)` per part; axes by path pattern.
  nnx_model(make, parts, ...)   flax.nnx: `make(rngs) -> nnx.Module`; parts name
                                submodules or parameters by attribute path ("embed",
                                "blocks.0", or ("head", ("norm", "unembed"), call)); axes
                                from each nnx.Param's partitioning metadata.
  linen_model(module, parts)    flax.linen: parts own top-level `params` entries (a
                                submodule's or a parameter's) and call a method; axes from
                                `nn.with_logical_partitioning`.
  eqx_model(make, parts, ...)   equinox: `make(key) -> eqx.Module` (or make_with_state's
                                (model, state)); parts by attribute path, submodules (applied
                                per example, vmapped) or array fields; axes by path pattern.

Split rule, the same in the three: a part is a list of attribute paths and a call. A
path names a submodule OR a parameter (an `nnx.Param` attribute such as a Llama's
top-level `unembed`, a linen `self.param(...)` entry, an equinox array field); the
call receives them in order, as the model's own forward would use them (a submodule as
a module, an nnx parameter as its `nnx.Param`, a linen/equinox parameter as its array),
e.g. ``("head", ("norm", "unembed"), lambda norm, w, x: norm(x) @ w)``. A path alone
(no call) must name a submodule: it is called on x; a parameter has no call of its own.

Parts are initialised from one model key, `jax.random.key(run.seed)`, so the pipelined
parameters are those of the whole model's own init (`make(nnx.Rngs(key))`, `init(key)`):
a single-process training of the model from that key is the numerical reference. jax and flax
are imported inside functions only; flax and equinox come with meshpipe's `models`
extra (`orchestrator.core.extras.require`: the error says so when they are missing).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence, Union

from orchestrator.core.extras import require
from orchestrator.core.model.pipeline import (ArraySpec, AxesFn, ModelError, Part, PipelineModel, batch_first,
                                              by_path, key_path, picked, replicated)

__all__ = ["plain", "nnx_model", "linen_model", "eqx_model", "as_spec"]



def _entry(entry) -> tuple[str, tuple[str, ...], Any]:
    """A `parts` entry as (name, attribute paths, call): a path alone, or (name, path(s), call)."""
    if isinstance(entry, str):
        return entry, (entry,), None
    name, paths, call = entry
    return name, ((paths,) if isinstance(paths, str) else tuple(paths)), call

def as_spec(value: Union[ArraySpec, Sequence, Mapping]) -> ArraySpec:
    """An ArraySpec from an ArraySpec, a (shape, dtype[, axes]) tuple or a mapping of those names."""
    if isinstance(value, ArraySpec):
        return value
    if isinstance(value, Mapping):
        return ArraySpec(tuple(value["shape"]), str(value["dtype"]), tuple(value.get("axes", ())))
    shape, dtype, *rest = value
    return ArraySpec(tuple(shape), str(dtype), tuple(rest[0]) if rest else ())


def _rules(axes) -> AxesFn:
    if axes is None:
        return replicated
    return axes if callable(axes) else by_path(axes)


def _out_rules(out_axes) -> AxesFn:
    if out_axes is None:
        return batch_first
    return out_axes if callable(out_axes) else by_path(out_axes, default=batch_first)


# ----------------------------------------------------------------------------- plain JAX

def plain(init: Callable[[Any], Mapping[str, Any]], parts: Sequence[tuple[str, Callable]], *,
          loss: Callable, input, label, axes=None, out_axes=None, vocab: int = 0,
          ties: Sequence[tuple[str, str]] = ()) -> PipelineModel:
    """A plain-JAX model: one init for the whole model and one apply per part.

    Args:
      init: key -> {part name: that part's parameter pytree}.
      parts: (name, apply) in pipeline order; apply(params, x) -> y, or
        apply(params, x, *, rng, train) when it takes those keywords.
      loss: (y, labels) -> scalar.
      input, label: one example's input / label (`ArraySpec` or (shape, dtype[, axes])).
      axes: parameter axes, a callable (path, shape) -> axes or path rules for `by_path`,
        matched against "part name/leaf path" (e.g. ``("block*/w1", ("embed", "mlp"))``).
      out_axes: output axes, the same way ("part name/leaf path"; default `batch` first).
      ties: pairs of parameter names ("part name/leaf path") that are one array held by two parts
        (`init` must give both the same value), e.g. ``[("embed/table", "head/table")]``.

    Example:
        >>> import jax.numpy as jnp
        >>> m = plain(lambda k: {"lin": {"w": jnp.ones((3, 2))}}, [("lin", lambda p, x: x @ p["w"])],
        ...           loss=lambda y, t: jnp.mean((y - t) ** 2), input=((3,), "float32"), label=((2,), "float32"),
        ...           axes=[("lin/w", ("in", "out"))])
        >>> m.parts[0].axes("w", (3, 2))
        ('in', 'out')
    """
    import inspect

    rules, outs = _rules(axes), _out_rules(out_axes)
    built = []
    for name, fn in parts:
        try:
            kw = set(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            kw = set()
        takes = {"rng", "train"} & kw

        def apply(p, x, *, rng=None, train=True, fn=fn, takes=takes):
            extra = {k: v for k, v in (("rng", rng), ("train", train)) if k in takes}
            return fn(p, x, **extra)

        def pick(whole, name=name):
            if name not in whole:
                raise ModelError(f"init returned no parameters for part {name!r} (it has {sorted(whole)})")
            return whole[name]

        built.append(Part(name, picked(init, pick), apply,
                          axes=lambda path, shape, name=name: rules(f"{name}/{path}", shape),
                          out_axes=lambda path, shape, name=name: outs(f"{name}/{path}", shape),
                          whole=(init, pick, None)))
    return PipelineModel(tuple(built), loss, as_spec(input), as_spec(label), vocab,
                         ties=tuple(tuple(t) for t in ties))


# ----------------------------------------------------------------------------- flax.nnx

def _walk(root, path: str, what: str):
    """The submodule at attribute path `path` ("blocks.0.attn"); ModelError naming what is missing."""
    node = root
    done = []
    for step in filter(None, path.split(".")):
        try:
            node = node[int(step)] if step.isdigit() else getattr(node, step)
        except (AttributeError, IndexError, KeyError, TypeError):
            have = "" if step.isdigit() else ", ".join(sorted(k for k in vars(node) if not k.startswith("_")))
            raise ModelError(f"split point {path!r} does not exist: {type(node).__name__} at "
                             f"{'.'.join(done) or what} has no {'index' if step.isdigit() else 'attribute'} "
                             f"{step!r}{f' (it has: {have})' if have else ''}") from None
        done.append(step)
    return node


def _nnx_axes(state) -> dict[str, tuple]:
    """Logical axes per leaf path from nnx partitioning metadata (`nnx.with_partitioning`)."""
    import jax
    from flax import nnx

    out = {}
    flat = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda v: isinstance(v, nnx.Variable))[0]
    for path, var in flat:
        meta = var.get_metadata() if hasattr(var, "get_metadata") else {}
        names = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding")
        if names is not None and not isinstance(names, (tuple, list)):
            names = tuple(names)     # a PartitionSpec
        out[key_path(path)] = None if names is None else tuple(names)
    return out


def nnx_model(make: Callable, parts: Sequence[Union[str, tuple]], *, loss: Callable, input, label,
              out_axes=None, vocab: int = 0) -> PipelineModel:
    """A flax.nnx model, unchanged, split at submodules or parameters named by attribute path.

    Args:
      make: rngs -> the whole nnx.Module (e.g. ``lambda rngs: Llama(cfg, rngs=rngs)``).
      parts: in pipeline order; each a path ("embed", "blocks.3": the submodule is called
        on x) or (name, paths, call) with call(*held, x) -> y, e.g.
        ``("head", ("norm", "lm_head"), lambda norm, head, x: head(norm(x)))``. A path may
        also name an `nnx.Param` attribute (a top-level ``self.unembed = nnx.Param(...)``):
        the call gets that `nnx.Param`, as the model's own forward does, e.g.
        ``("head", ("norm", "unembed"), lambda norm, w, x: norm(x) @ w)`` or an embedding
        table ``("embed", "embed", lambda table, x: table[...][x])``. Such a path needs a call.
      loss, input, label, out_axes, vocab: as for `plain`.

    Examples:
        A top-level embedding and unembedding, each an `nnx.Param`:

        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> class Tiny(nnx.Module):
        ...     def __init__(self, rngs):
        ...         self.embed = nnx.Param(jax.random.normal(rngs.params(), (16, 8)), out_sharding=("vocab", "embed"))
        ...         self.mix = nnx.Linear(8, 8, rngs=rngs)
        ...         self.unembed = nnx.Param(jax.random.normal(rngs.params(), (8, 16)))
        ...     def __call__(self, t):
        ...         return self.mix(self.embed[...][t]) @ self.unembed
        >>> m = nnx_model(Tiny, [("embed", "embed", lambda e, t: e[...][t]), "mix",
        ...                      ("head", "unembed", lambda w, x: x @ w)],
        ...               loss=lambda y, t: jnp.mean((y - t) ** 2), input=((), "int32"), label=((16,), "float32"))
        >>> [p.name for p in m.parts], m.parts[0].axes("embed", (16, 8))
        (['embed', 'mix', 'head'], ('vocab', 'embed'))

    Parameters are the `nnx.Param` variables, named "<part>/<attribute path>/<leaf path>"
    ("<part>/<attribute path>" for a path naming a Param itself);
    their logical axes are the names given to `nnx.with_partitioning` (unannotated leaves are
    replicated). RNG state (`nnx.Dropout(..., rngs=rngs)`'s stream) is not trained or carried:
    on every call each stream a part holds is reseeded (`nnx.reseed`) with fold_in(rng, j), j
    the stream's index among the part's stream names sorted, rng meshpipe's key for (seed,
    step, microbatch, part); and the part is put in `train()` / `eval()` mode. `nnx.BatchStat`
    variables (BatchNorm's running mean and variance) are the part's mutable state
    (`Part.state_init`): "<attribute path>" -> pure dict, passed in on every call and read back
    after it (in train mode as the call updated them; `eval()` uses them unchanged). Other
    variable kinds (e.g. `nnx.Cache`, `nnx.Intermediate`, a user's own) are refused at plan time.

    Tied weights: a submodule named by two parts (the embedding in the first part and in the
    head, ``("head", ("norm", "embed"), lambda norm, embed, x: embed.attend(norm(x)))``) is one
    array of the model held by both: each part keeps a copy (equal at init: both come from the
    same model's init) and every Param leaf under it is tied (`PipelineModel.ties`), so their
    gradients are summed at the step's end and the copies stay identical.
    """
    import jax

    nnx = require("flax.nnx", "nnx_model")

    def kinds_of(tree):
        return sorted({type(v).__name__ for v in jax.tree.leaves(tree, is_leaf=lambda v: isinstance(v, nnx.Variable))})

    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: make(nnx.Rngs(0)))

    def whole_init(key):        # shared by every part (one trace for all: `pipeline.abstract_inits`)
        with nnx.use_eager_sharding(False):
            return make(nnx.Rngs(key))

    outs = _out_rules(out_axes)
    built = []
    holders: dict[str, list[str]] = {}      # attribute path -> the parts holding it (two or more: tied)
    leaves: dict[str, list[str]] = {}       # attribute path -> its Param leaf paths
    for entry in parts:
        name, paths, call = _entry(entry)
        subs = {}
        axes: dict[str, tuple] = {}
        stateful = []
        for path in paths:
            sub = _walk(abstract, path, type(abstract).__name__)
            if isinstance(sub, nnx.Variable):        # a parameter itself (a Llama's top-level `unembed`)
                _param_part_ok(isinstance(sub, nnx.Param), type(sub).__name__, path, name, call)
                subs[path] = (None, jax.tree.structure(sub), None, None, ())
                axes[path] = _nnx_axes(sub).get("")
                holders.setdefault(path, []).append(name)
                leaves[path] = [""]
                continue
            if not isinstance(sub, nnx.Module):
                raise ModelError(f"split point {path!r} is a {type(sub).__name__}, not an nnx.Module or an "
                                 "nnx.Param")
            graph, state, stats, rngs, rest = nnx.split(sub, nnx.Param, nnx.BatchStat, nnx.RngState, ...)
            if jax.tree.leaves(rest):
                raise ModelError(f"split point {path!r} holds nnx variables {kinds_of(rest)}: only nnx.Param "
                                 "(trained), nnx.BatchStat (mutable state, carried per stage) and RNG state "
                                 "are supported")
            streams = sorted({v.tag for v in jax.tree.leaves(rngs, is_leaf=lambda v: isinstance(v, nnx.Variable))})
            has_stats = bool(jax.tree.leaves(stats))
            if has_stats:
                stateful.append(path)
            subs[path] = (graph, jax.tree.structure(state), jax.tree.structure(stats) if has_stats else None,
                          rngs, streams)
            axes.update({f"{path}/{k}": v for k, v in _nnx_axes(state).items()})
            holders.setdefault(path, []).append(name)
            leaves[path] = list(_nnx_axes(state))

        def pick(whole, paths=paths):
            return {p: _nnx_params(_walk(whole, p, "model")) for p in paths}

        def pick_state(whole, stateful=tuple(stateful)):
            return {p: nnx.to_pure_dict(nnx.state(_walk(whole, p, "model"), nnx.BatchStat)) for p in stateful}

        def apply(params, x, *, rng=None, train=True, state=None, subs=subs, call=call, paths=paths,
                  stateful=tuple(stateful)):
            mods = []
            for p in paths:
                graph, treedef, stats_def, rngs, streams = subs[p]
                if graph is None:           # a parameter: the call gets an nnx.Param, with its metadata
                    mods.append(jax.tree.unflatten(treedef, [params[p]]))
                    continue
                pieces = [jax.tree.unflatten(treedef, jax.tree.leaves(params[p]))]
                if stats_def is not None:
                    pieces.append(jax.tree.unflatten(stats_def, jax.tree.leaves(state[p])))
                if streams:
                    pieces.append(_rng_values(rngs))
                mod = nnx.merge(graph, *pieces)
                if streams and rng is not None:
                    nnx.reseed(mod, **{name: jax.random.fold_in(rng, j) for j, name in enumerate(streams)})
                if streams or stats_def is not None:
                    mod.train() if train else mod.eval()
                mods.append(mod)
            y = mods[0](x) if call is None else call(*mods, x)
            if not stateful:
                return y
            new = {p: nnx.to_pure_dict(nnx.state(m, nnx.BatchStat)) for p, m in zip(paths, mods) if p in stateful}
            return y, new

        built.append(Part(name, picked(whole_init, pick), apply,
                          axes=lambda path, shape, axes=axes: axes.get(path) or (None,) * len(shape),
                          out_axes=lambda path, shape, name=name: outs(f"{name}/{path}", shape), paths=paths,
                          state_init=picked(whole_init, pick_state) if stateful else None,
                          whole=(whole_init, pick, pick_state if stateful else None)))
    def leaf_name(part, path, leaf):
        return f"{part}/{path}/{leaf}" if leaf else f"{part}/{path}"

    ties = tuple((leaf_name(names[0], path, leaf), leaf_name(other, path, leaf))
                 for path, names in holders.items() for other in names[1:] for leaf in leaves[path])
    return PipelineModel(tuple(built), loss, as_spec(input), as_spec(label), vocab, ties=ties)


def _nnx_params(node):
    """The trained values at an attribute path: a pure dict of a submodule's nnx.Params, or the
    array of an nnx.Param the path names itself."""
    from flax import nnx

    if isinstance(node, nnx.Variable):
        return node[...]
    return nnx.to_pure_dict(nnx.state(node, nnx.Param))


def _param_part_ok(trained: bool, what: str, path: str, part: str, call) -> None:
    """A path naming a parameter (`what`, e.g. "Param"): it must be a trained one and its part must
    have a call (a parameter has no call of its own)."""
    if not trained:
        raise ModelError(f"split point {path!r} is a {what} variable: a path names a submodule or a trained "
                         "parameter (nnx.Param)")
    if call is None:
        raise ModelError(f"split point {path!r} is a parameter ({what}), not a submodule: it has no call of its "
                         f"own; name it in a (name, paths, call) part, e.g. ({part!r}, ({path!r},), "
                         "lambda w, x: x @ w)")


def _keywords(fn) -> set:
    import inspect

    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _rng_values(abstract):
    """Placeholder values for an nnx RNG state of shape structs (reseeded before any use)."""
    import jax
    import jax.numpy as jnp

    def value(s):
        if jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key):
            return jax.random.split(jax.random.key(0), s.shape) if s.shape else jax.random.key(0)
        return jnp.zeros(s.shape, s.dtype)

    return jax.tree.map(value, abstract)


# ----------------------------------------------------------------------------- flax.linen

def _padded(names, shape) -> tuple:
    names = tuple(names or ())
    return names + (None,) * (len(shape) - len(names)) if len(names) <= len(shape) else names


def linen_model(module, parts: Sequence[tuple], *, loss: Callable, input, label, out_axes=None,
                vocab: int = 0, rngs: Sequence[str] = ()) -> PipelineModel:
    """A flax.linen model, unchanged, split by top-level parameter collections.

    Args:
      module: the linen Module (its `init(key, x)` gives the whole model's variables).
      parts: in pipeline order, each (name, keys, method): `keys` the top-level entries of
        `params` this part owns (e.g. ("blocks_0",)), `method(module, x)` what it computes,
        e.g. ``("block0", ("blocks_0",), lambda m, x: m.blocks[0](x))`` (submodules defined in
        `setup`, so the method can call one alone). A key may name a top-level parameter
        (``self.w_out = self.param("w_out", ...)`` in setup): ``("out", ("w_out",), lambda m, x:
        x @ m.w_out)``. Setup reads every top-level parameter on any call, so the parts that do
        not own one get zeros in its place; a method that computes with a parameter its part
        does not own is refused when the model is described.
      loss, input, label, out_axes, vocab: as for `plain`.
      rngs: the RNG collections the model draws from (e.g. ("dropout",)): on each call collection
        j gets fold_in(rng, j), rng meshpipe's key for (seed, step, microbatch, part); a method
        that takes a `train` keyword (``lambda m, x, train: m.block(x, deterministic=not train)``)
        gets the mode.

    Logical axes come from `nn.with_logical_partitioning` metadata (`nn.get_partition_spec`).
    Parameters are named "<part>/<key>/<leaf path>". The `batch_stats` collection (BatchNorm's
    running statistics) is the mutable state of the part whose params keys have the same
    top-level names (`Part.state_init`): in train mode the method runs with
    `mutable=["batch_stats"]` and the updated entries come back; in eval mode they are used
    as they are (the method must pass `use_running_average=not train` itself). Any other
    collection is refused at plan time.
    """
    import jax
    import numpy as np

    nn = require("flax.linen", "linen_model")
    spec_in = as_spec(input)
    example = jax.ShapeDtypeStruct((2, *spec_in.shape), np.dtype(spec_in.dtype))
    abstract = jax.eval_shape(lambda x: module.init(jax.random.key(0), x), example)
    extra = sorted(set(abstract) - {"params", "batch_stats"})
    if extra:
        raise ModelError(f"linen variable collections {extra} are not supported: only 'params' (trained) and "
                         "'batch_stats' (mutable state, carried per stage)")
    names = nn.get_partition_spec(abstract)["params"]
    have = sorted(abstract["params"])
    # top-level parameters (`self.param(...)` in the model's setup, not a submodule's): setup reads
    # every one of them on any method call, so a part that does not own one gets a placeholder
    # (`_linen_placeholders`), which its method must not use
    top = {k: v for k, v in nn.unbox(abstract)["params"].items() if not isinstance(v, Mapping)}
    stats = abstract.get("batch_stats", {})
    owned = {k for _, keys, _ in parts for k in ((keys,) if isinstance(keys, str) else keys)}
    orphan = sorted(set(stats) - owned)
    if orphan:
        raise ModelError(f"batch_stats entry {orphan[0]!r} belongs to no part: a part owns the batch_stats entry "
                         f"of the same top-level name as its params keys (parts own {sorted(owned)})")
    outs = _out_rules(out_axes)

    def whole_init(key):        # shared by every part (one trace for all: `pipeline.abstract_inits`)
        return nn.unbox(module.init(key, jax.numpy.zeros(example.shape, example.dtype)))

    built = []
    for name, keys, method in parts:
        keys = (keys,) if isinstance(keys, str) else tuple(keys)
        missing = [k for k in keys if k not in abstract["params"]]
        if missing:
            raise ModelError(f"split point {missing[0]!r} does not exist: the model's params are {have}")
        axes = {}
        for k in keys:
            flat = jax.tree_util.tree_flatten_with_path(names[k], is_leaf=lambda v: isinstance(
                v, jax.sharding.PartitionSpec))[0]
            axes.update({"/".join(filter(None, (k, key_path(p)))): tuple(v) for p, v in flat})
        stateful = tuple(k for k in keys if k in stats)
        others = {k: v for k, v in top.items() if k not in keys}

        def pick(whole, keys=keys):
            return {k: whole["params"][k] for k in keys}

        def pick_state(whole, stateful=stateful):
            return {k: whole["batch_stats"][k] for k in stateful}

        takes_train = "train" in _keywords(method)

        def apply(params, x, *, rng=None, train=True, state=None, method=method, takes_train=takes_train,
                  stateful=stateful, others=others, name=name):
            keys = None if rng is None or not rngs else {c: jax.random.fold_in(rng, j) for j, c in enumerate(rngs)}
            kw = {"train": train} if takes_train else {}

            def run(placeholders):
                full = {**placeholders, **params}
                if not stateful:
                    return module.apply({"params": full}, x, method=method, rngs=keys, **kw)
                variables = {"params": full, "batch_stats": dict(state)}
                if not train:
                    return module.apply(variables, x, method=method, rngs=keys, **kw), state
                y, upd = module.apply(variables, x, method=method, rngs=keys, mutable=["batch_stats"], **kw)
                got = upd.get("batch_stats", {})
                return y, {k: got.get(k, state[k]) for k in stateful}

            return run(_linen_placeholders(run, others, name))

        built.append(Part(name, picked(whole_init, pick), apply,
                          axes=lambda path, shape, axes=axes: _padded(axes.get(path), shape),
                          out_axes=lambda path, shape, name=name: outs(f"{name}/{path}", shape), paths=keys,
                          state_init=picked(whole_init, pick_state) if stateful else None,
                          whole=(whole_init, pick, pick_state if stateful else None)))
    return PipelineModel(tuple(built), loss, spec_in, as_spec(label), vocab)


def _linen_placeholders(run: Callable, others: Mapping[str, Any], part: str) -> dict:
    """Zeros for the top-level parameters a linen part does not own (its method runs the model's
    setup, which reads them all), after checking from `run`'s jaxpr that the method does not use
    them: a part that computes with a parameter must own it. ModelError naming them otherwise."""
    import jax
    import jax.numpy as jnp

    if not others:
        return {}
    zeros = {k: jnp.zeros(v.shape, v.dtype) for k, v in others.items()}
    closed = jax.make_jaxpr(run)(zeros)
    inner = closed.jaxpr
    names = jax.tree_util.tree_flatten_with_path(zeros)[0]
    by_var = {id(v): key_path(p) for (p, _), v in zip(names, inner.invars)}
    used = {by_var[id(v)] for e in inner.eqns for v in e.invars if id(v) in by_var}
    used |= {by_var[id(v)] for v in inner.outvars if id(v) in by_var}
    if used:
        raise ModelError(f"part {part!r} uses the top-level parameter(s) {sorted(used)} without owning them: add "
                         f"them to the part's keys (a parameter belongs to the one part that computes with it; "
                         f"two parts sharing one array is a tie, which linen_model does not support)")
    return zeros


# ----------------------------------------------------------------------------- equinox

def _eqx_indices(tree) -> list[tuple[str, Any]]:
    """(path, eqx.nn.StateIndex) of every state index in `tree`, in equinox's traversal order."""
    import equinox as eqx
    import jax

    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda v: isinstance(v, eqx.nn.StateIndex))[0]
    return [(key_path(p), v) for p, v in flat if isinstance(v, eqx.nn.StateIndex)]


def _eqx_made(make: Callable) -> Callable:
    """key -> (model, eqx.nn.State or None) from the user's `make`, which returns the model or
    `eqx.nn.make_with_state`'s (model, state); a bare model holding state indices is made so here."""
    import equinox as eqx

    def made(key):
        out = make(key)
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], eqx.nn.State):
            return out
        if not isinstance(out, eqx.Module):
            raise ModelError(f"make(key) returned {type(out).__name__}, not an eqx.Module or "
                             "eqx.nn.make_with_state's (model, state)")
        indices = _eqx_indices(out)
        if not indices:
            return out, None
        if any(type(v.init).__name__ == "_Sentinel" for _, v in indices):
            raise ModelError(f"make(key) returned a model made by eqx.nn.make_with_state without its state "
                             f"(state index {indices[0][0]!r} has no initial value): return (model, state)")
        return eqx.nn.make_with_state(lambda: out)()

    return made


def eqx_model(make: Callable, parts: Sequence[str | tuple], *, loss: Callable, input, label,
              axes=None, out_axes=None, vocab: int = 0, axis_name: str = "batch") -> PipelineModel:
    """An equinox model, unchanged, split at submodules or array fields named by attribute path.

    Args:
      make: key -> the whole eqx.Module, or (model, state) for a model with state
        (``eqx.nn.make_with_state(Model)(key)``, e.g. one holding `eqx.nn.BatchNorm`).
      parts: in pipeline order; each a path ("embed", "blocks.0"; the submodule is applied
        per example, `jax.vmap(sub, axis_name=axis_name)(x)`, equinox's convention; a
        submodule with state as ``jax.vmap(sub, axis_name=axis_name, in_axes=(0, None),
        out_axes=(0, None))(x, state)``) or (name, paths, call) with call(*submodules, x) -> y
        over the batch, or call(*submodules, x, state) -> (y, state) for a part with state. A
        path may name an array field of the model (``w_out: jax.Array``): the call gets the
        array, e.g. ``("out", "w_out", lambda w, x: x @ w)``; such a path needs a call.
      axes: path rules (`by_path`) matched against "<attribute path>/<leaf path>", e.g.
        ``("blocks.*/weight", ("mlp", "embed"))``; unmatched leaves are replicated.
      loss, input, label, out_axes, vocab: as for `plain`.
      axis_name: the vmapped batch axis's name (what `eqx.nn.BatchNorm(axis_name=...)` reduces over).

    The part's parameters are its submodules' array leaves (`eqx.partition(sub, eqx.is_array)`);
    everything else is static. Parameters are named "<part>/<attribute path>/<leaf path>".
    State (`eqx.nn.StateIndex` values in `eqx.nn.State`, e.g. BatchNorm's running statistics)
    is the mutable state of the part holding the index (`Part.state_init`): "<attribute path>"
    -> {"<index path>": value}, an `eqx.nn.State` of the part's indices rebuilt on each call and
    read back after it. Eval calls the submodules under `eqx.nn.inference_mode` (BatchNorm uses
    its running statistics and leaves them unchanged); training calls them as `make` built them.
    """
    import jax

    eqx = require("equinox", "eqx_model")

    def is_param(v):
        return eqx.is_array(v) or isinstance(v, jax.ShapeDtypeStruct)

    made = _eqx_made(make)
    abstract, abstract_state = eqx.filter_eval_shape(made, jax.random.key(0))
    if not isinstance(abstract, eqx.Module):
        raise ModelError(f"make(key) returned {type(abstract).__name__}, not an eqx.Module")
    rules, outs = _rules(axes), _out_rules(out_axes)
    built = []
    for entry in parts:
        name, paths, call = _entry(entry)
        statics, index = {}, {}
        for path in paths:
            sub = _walk(abstract, path, type(abstract).__name__)
            if is_param(sub):         # an array field of the model (a top-level `w_out: jax.Array`)
                _param_part_ok(True, "array", path, name, call)
            statics[path] = eqx.partition(sub, is_param)[1]
            if _eqx_indices(sub):
                index[path] = _eqx_indices(sub)
        stateful = tuple(p for p in paths if p in index)
        sdef = (jax.tree.structure(abstract_state.substate(tuple(_walk(abstract, p, "model") for p in stateful)))
                if stateful else None)

        def pick(whole, paths=paths):
            return {p: eqx.filter(_walk(whole[0], p, "model"), eqx.is_array) for p in paths}

        def pick_state(whole, stateful=stateful, index=index):
            return {p: {ip: whole[1].get(idx) for ip, idx in index[p]} for p in stateful}

        def apply(params, x, *, rng=None, train=True, state=None, paths=paths, call=call, statics=statics,
                  stateful=stateful, index=index, sdef=sdef, name=name):
            mods = [eqx.combine(params[p], statics[p]) for p in paths]
            if not train:
                mods = [eqx.nn.inference_mode(m, True) for m in mods]
            if not stateful:
                return jax.vmap(mods[0], axis_name=axis_name)(x) if call is None else call(*mods, x)
            st = jax.tree.unflatten(sdef, jax.tree.leaves([state[p][ip] for p in stateful for ip, _ in index[p]]))
            if call is None:
                y, st = jax.vmap(mods[0], axis_name=axis_name, in_axes=(0, None), out_axes=(0, None))(x, st)
            else:
                y, st = call(*mods, x, st)
            if not isinstance(st, eqx.nn.State):
                raise ModelError(f"part {name!r} holds equinox state: its call must return (y, eqx.nn.State), "
                                 f"got (y, {type(st).__name__})")
            return y, {p: {ip: st.get(idx) for ip, idx in index[p]} for p in stateful}

        built.append(Part(name, picked(made, pick), apply, axes=rules,
                          out_axes=lambda path, shape, name=name: outs(f"{name}/{path}", shape), paths=paths,
                          state_init=picked(made, pick_state) if stateful else None,
                          whole=(made, pick, pick_state if stateful else None)))
    return PipelineModel(tuple(built), loss, as_spec(input), as_spec(label), vocab)
