"""The pipeline-model interface every model front end produces, and its shape-only description.

A `PipelineModel` is a sequence of pipeline-able `Part`s (for a decoder: the
embedding, each block, the head) and a loss. Each part is a pure pair, as optax's
`GradientTransformation` is:

    params = part.init(key)                       # key: the run's model key, the same for every part
    y      = part.apply(params, x, rng=rng, train=True)   # x, y: pytrees of arrays, batch first

(a part with mutable state, `Part.state_init`, also takes `state=` and returns (y, new state)),
plus the logical axes of each parameter leaf (`part.axes(path, shape)`) and of each
output leaf (`part.out_axes(path, shape)`, `batch` first). Every part is initialised
from the same model key, so the parts together hold exactly the parameters the
user's own whole-model init gives (a part's init may build the whole model under
jit and keep its piece: XLA drops the rest).

Adapters build one from a framework's model without changing it
(`orchestrator.core.model.adapters`: plain JAX, flax.nnx); a job names the factory
that does (`model: {factory: "pkg.module:fn", args: {...}}`).

`describe(model, ...)` turns a PipelineModel into the pure `ModelSpec` the planner
uses, by `jax.eval_shape` only (no devices, no arrays): each part's parameter leaves
(parts that build the whole model and keep their piece, `Part.whole`, from one trace of
the whole init: `abstract_inits`),
each part's output leaves fed to the next part (a mismatch is reported here, at plan
time), the loss (a scalar), a stateful part's state (it must come back as it went in) and
the model's tied parameters (`PipelineModel.ties`, resolved to layer indices). jax is imported inside functions only.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence, Union

from orchestrator.core.model.spec import LayerSpec, LeafSpec, ModelSpec, ParamDef

Axes = tuple  # tuple[str | None, ...]
AxesFn = Callable[[str, tuple], Union[Axes, None]]

__all__ = ["ArraySpec", "ModelError", "Part", "PipelineModel", "abstract_inits", "by_path", "batch_first",
           "describe", "key_path", "picked", "run_part", "DESCRIBE_BATCH"]

DESCRIBE_BATCH = 2     # the batch size shapes are evaluated at (outputs must carry it first)


class ModelError(ValueError):
    """A model that meshpipe cannot pipeline; the message names the part and the rule."""


@dataclass(frozen=True)
class ArraySpec:
    """One example's model input or label: shape (no batch dim), dtype, logical axes (batch first)."""

    shape: tuple[int, ...]
    dtype: str
    axes: tuple[str | None, ...] = ()

    def leaf(self) -> LeafSpec:
        axes = tuple(self.axes) or ("batch",) + (None,) * len(self.shape)
        return LeafSpec("", tuple(self.shape), str(self.dtype), axes)


def batch_first(path: str, shape: tuple) -> Axes:
    """Default output axes: `batch` on the first dim, the rest unnamed (replicated)."""
    return ("batch",) + (None,) * (len(shape) - 1)


def replicated(path: str, shape: tuple) -> Axes:
    """Default parameter axes: no dim named, so the leaf is replicated over every stage's mesh."""
    return (None,) * len(shape)


@dataclass(frozen=True)
class Part:
    """One pipeline-able piece of a model (see the module docstring).

    Attributes:
      name: shown in plans and parameter names (`01.blocks.0/...`).
      init: key -> parameter pytree of this part.
      apply: (params, x, *, rng, train) -> y.
      axes: (leaf path, shape) -> logical axes of a parameter leaf (None: replicated).
      out_axes: (leaf path, batched shape) -> logical axes of an output leaf.
      paths: the model attribute paths this part holds, in order (the nnx, linen and
        equinox adapters fill it); a job's `pipeline.split_at` may name the first one.
      state_init: None for a part without mutable state; else key -> the part's mutable
        (non-parameter) state pytree, e.g. BatchNorm's running statistics. Such a part's
        apply takes `state=` and returns (y, new state): in train mode the state as the
        microbatch updated it, in eval mode the state unchanged. The state is not
        differentiated or optimised; the stage threads it through its forwards in
        microbatch order and checkpoints it with the parameters.
      whole: for a part whose init builds the whole model and keeps its piece (every
        adapter's), (whole init, pick, pick state): key -> the whole model's init output,
        whole -> this part's parameters, whole -> its state (None: stateless). `init` is
        then `pick(whole init(key))`; parts sharing one whole init (the same function
        object) are shape-evaluated from ONE trace of it (`abstract_inits`), not one per part.
    """

    name: str
    init: Callable[[Any], Any]
    apply: Callable[..., Any]
    axes: AxesFn = replicated
    out_axes: AxesFn = batch_first
    paths: tuple[str, ...] = ()
    state_init: Callable[[Any], Any] | None = None
    whole: tuple[Callable, Callable, Callable | None] | None = None


def picked(whole_init: Callable, pick: Callable) -> Callable:
    """A part's init that builds the whole model and keeps its piece: key -> pick(whole_init(key))."""
    def init(key):
        return pick(whole_init(key))
    return init


def run_part(part: Part, params, x, state=None, *, rng=None, train: bool = True):
    """(y, new state) of one part; a stateless part gives (y, None)."""
    if part.state_init is None:
        return part.apply(params, x, rng=rng, train=train), None
    return part.apply(params, x, rng=rng, train=train, state=state)


@dataclass(frozen=True)
class PipelineModel:
    """A model as meshpipe pipelines it: parts in order, a loss, one example's input and label.

    `loss(y, labels)` takes the last part's output and returns the scalar mean loss of the
    microbatch (computed in float32). `vocab`: for token inputs, the data source draws ids
    below it. `ties`: pairs of parameter names "<part name>/<leaf path>" that are one array of
    the model held by two parts (a GPT's embedding reused as its unembedding); the parts' inits
    must give them equal values (the nnx adapter finds ties itself: a submodule two parts name).
    """

    parts: tuple[Part, ...]
    loss: Callable[[Any, Any], Any]
    input: ArraySpec
    label: ArraySpec
    vocab: int = 0
    meta: Mapping[str, Any] = field(default_factory=dict)
    ties: tuple[tuple[str, str], ...] = ()


def by_path(rules: Union[Mapping[str, Axes], Iterable[tuple[str, Axes]]], default: AxesFn = replicated) -> AxesFn:
    """Logical axes by path pattern (fnmatch, first match wins), for equinox / plain-JAX models.

    Example:
        >>> axes = by_path([("*/w1", ("embed", "mlp")), ("*/w2", ("mlp", "embed"))])
        >>> axes("block0/w1", (4, 8)), axes("block0/b", (8,))
        (('embed', 'mlp'), (None,))
    """
    items = list(rules.items()) if isinstance(rules, Mapping) else [tuple(r) for r in rules]

    def axes(path: str, shape: tuple) -> Axes:
        for pattern, names in items:
            if fnmatch.fnmatchcase(path, pattern):
                return None if names is None else tuple(names)
        return default(path, shape)

    return axes


def key_path(path: Sequence[Any]) -> str:
    """A jax key path as `a/b/0` (dict keys, attribute names and sequence indices joined by '/')."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def _struct(tree) -> str:
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return "{" + ", ".join(f"{key_path(p) or '(array)'}: {getattr(v, 'dtype', '?')}{list(getattr(v, 'shape', ()))}"
                           for p, v in leaves) + "}"


def _axes_ok(what: str, axes, shape) -> Axes:
    if axes is None:
        return (None,) * len(shape)
    axes = tuple(axes)
    if len(axes) != len(shape) or not all(a is None or isinstance(a, str) for a in axes):
        raise ModelError(f"{what}: logical axes {axes!r} must name each of its {len(shape)} dims "
                         f"(shape {tuple(shape)}) with a string or None")
    return axes


def abstract_inits(parts: Sequence[Part]) -> list[tuple[Any, Any]]:
    """Per part, (parameters, state or None) as shape structs, by `jax.eval_shape` of the inits.

    Parts that share a whole init (`Part.whole`) are evaluated from one trace of it, so a
    model whose every part builds the whole model costs one trace, not one per part; if
    that trace fails, each part is traced alone so the error names the part.

    Raises:
      ModelError: a part's init or state init failed (naming the part).
    """
    import jax

    out: list = [None] * len(parts)
    groups: dict[int, list[int]] = {}
    for i, part in enumerate(parts):
        if part.whole is not None:
            groups.setdefault(id(part.whole[0]), []).append(i)
    for idx in groups.values():
        def pieces(idx=idx):
            whole = parts[idx[0]].whole[0](jax.random.key(0))
            return [(parts[i].whole[1](whole),
                     None if parts[i].state_init is None or parts[i].whole[2] is None else parts[i].whole[2](whole))
                    for i in idx]
        try:
            got = jax.eval_shape(pieces)
        except Exception:  # noqa: BLE001 - traced part by part below, so the error names the part
            continue
        for i, (params, state) in zip(idx, got):
            out[i] = [params, state]
    for i, part in enumerate(parts):
        what = f"part {i} ({part.name})"
        if out[i] is None:
            try:
                out[i] = [jax.eval_shape(lambda part=part: part.init(jax.random.key(0))), None]
            except Exception as e:  # noqa: BLE001 - the user's code: report, do not guess
                raise ModelError(f"{what}: init failed: {type(e).__name__}: {e}") from None
        if part.state_init is not None and out[i][1] is None:
            try:
                out[i][1] = jax.eval_shape(lambda part=part: part.state_init(jax.random.key(0)))
            except Exception as e:  # noqa: BLE001 - the user's code
                raise ModelError(f"{what}: state init failed: {type(e).__name__}: {e}") from None
    return [tuple(o) for o in out]


def describe(model: Any, *, name: str, factory: str, args: Mapping[str, Any]) -> ModelSpec:
    """The `ModelSpec` of a PipelineModel, by shape evaluation only.

    Raises ModelError naming the part when a part fails to initialise, cannot take the
    previous part's output, outputs a leaf without the batch dim first, or the loss is
    not a scalar.
    """
    import jax
    import numpy as np

    if not isinstance(model, PipelineModel):
        raise ModelError(f"the model factory returned {type(model).__name__}, not a PipelineModel "
                         "(build one with an adapter: meshpipe.nnx_model, linen_model, eqx_model or plain)")
    if not model.parts:
        raise ModelError("the model has no parts")
    b = DESCRIBE_BATCH
    inp, lab = model.input.leaf(), model.label.leaf()
    x = jax.ShapeDtypeStruct(inp.batched(b), np.dtype(inp.dtype))
    came_from = f"the model input {_struct(x)}"
    layers = []
    inits = abstract_inits(model.parts)
    for i, part in enumerate(model.parts):
        what = f"part {i} ({part.name})"
        params, state = inits[i]
        pdefs = {}
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
            p = key_path(path)
            pdefs[p] = ParamDef(tuple(leaf.shape), _axes_ok(f"{what} parameter {p}", part.axes(p, tuple(leaf.shape)),
                                                             leaf.shape), str(leaf.dtype))
        try:
            y, new = jax.eval_shape(lambda p, x, s: run_part(part, p, x, s, rng=jax.random.key(0), train=True),
                                    params, x, state)
        except Exception as e:  # noqa: BLE001
            raise ModelError(f"{what} cannot take {came_from}: {type(e).__name__}: {e}") from None
        if part.state_init is not None and (jax.tree.structure(new) != jax.tree.structure(state) or any(
                (a.shape, a.dtype) != (b.shape, b.dtype) for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(state)))):
            raise ModelError(f"{what}: the state it returns {_struct(new)} is not the state it takes {_struct(state)} "
                             "(a stateful part must return its state with the same structure, shapes and dtypes)")
        outs = []

        def leaf_spec(path, leaf, what=what, outs=outs, part=part):
            p = key_path(path)
            shape = tuple(getattr(leaf, "shape", ()))
            if not shape or shape[0] != b:
                raise ModelError(f"{what}: output leaf {p or '(array)'} has shape {shape}; every output "
                                 f"leaf must have the batch dim first (evaluated at batch {b})")
            spec = LeafSpec(p, shape[1:], str(leaf.dtype), _axes_ok(f"{what} output {p or '(array)'}",
                                                                   part.out_axes(p, shape), shape))
            outs.append(spec)
            return spec

        out_tree = jax.tree_util.tree_map_with_path(leaf_spec, y)
        if not outs:
            raise ModelError(f"{what}: outputs no arrays")
        sdefs = {} if state is None else {
            key_path(path): ParamDef(tuple(leaf.shape), (None,) * len(leaf.shape), str(leaf.dtype))
            for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}
        layers.append(LayerSpec(part.name, pdefs, tuple(outs), out_tree, tuple(part.paths), sdefs))
        x, came_from = y, f"the output of part {i} ({part.name}) {_struct(y)}"
    labels = jax.ShapeDtypeStruct(lab.batched(b), np.dtype(lab.dtype))
    try:
        loss = jax.eval_shape(model.loss, x, labels)
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"the loss cannot take {came_from} and labels {_struct(labels)}: "
                         f"{type(e).__name__}: {e}") from None
    if getattr(loss, "shape", None) != ():
        raise ModelError(f"the loss must return a scalar, got {_struct(loss)}")
    ties = resolve_ties(model.ties, layers)
    return ModelSpec(name, tuple(layers), factory, inp, lab, int(model.vocab), dict(args), ties=ties)


def resolve_ties(ties, layers: Sequence[LayerSpec]) -> tuple:
    """Tie names ("<part name>/<leaf path>") as ((layer, path), (layer, path)), the earlier side first.
    Raises ModelError naming the tie when a name is unknown, both name the same leaf, the two
    differ in shape or dtype, or a parameter is tied twice."""
    index = {layer.name: i for i, layer in enumerate(layers)}
    out, seen = [], {}
    for t, pair in enumerate(ties):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(isinstance(n, str) for n in pair):
            raise ModelError(f"ties[{t}] = {pair!r}: a tie is two parameter names \"<part>/<leaf path>\"")
        sides = []
        for name in pair:
            part, _, path = name.partition("/")
            if part not in index or path not in layers[index[part]].params:
                have = ", ".join(f"{layer.name}/{p}" for layer in layers for p in layer.params)
                raise ModelError(f"ties[{t}]: {name!r} is not a parameter of the model (parameters: {have})")
            sides.append((index[part], path))
        a, b = sorted(sides)
        if a == b:
            raise ModelError(f"ties[{t}] = {tuple(pair)!r}: ties a parameter to itself")
        pa, pb = layers[a[0]].params[a[1]], layers[b[0]].params[b[1]]
        if (pa.shape, pa.dtype) != (pb.shape, pb.dtype):
            raise ModelError(f"ties[{t}] = {tuple(pair)!r}: {pa.dtype}{list(pa.shape)} and {pb.dtype}{list(pb.shape)} "
                             "differ; tied parameters are one array (same shape and dtype)")
        for side in (a, b):
            if side in seen:
                raise ModelError(f"ties[{t}]: {layers[side[0]].name + '/' + side[1]!r} is already tied "
                                 f"(ties[{seen[side]}]); each parameter may be in one tie (two copies of an array)")
            seen[side] = t
        out.append((a, b))
    return tuple(out)
