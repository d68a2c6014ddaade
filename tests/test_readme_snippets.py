"""The README's adapter examples run (JAX on CPU, no Ray): docs that cannot rot.

A code block in README.md preceded by `<!-- snippet: NAME -->` is one of these examples;
`<!-- snippet: NAME, verbatim from PATH -->` also says the block is PATH's text, character
for character. Each block is executed, its factory called, and the PipelineModel it returns
checked the way a job would (`describe`: shapes, part chaining, loss) and numerically: its
parts, initialised from one key and applied in order, compute the whole model's own output
from the model's own init (rtol 1e-5 / atol 1e-6, float32), so an adapter that splits the
model wrongly fails here.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
SNIPPET = re.compile(r"<!-- snippet: (\w+)(?:, verbatim from (\S+))? -->\n```python\n(.*?)```", re.S)


def snippets() -> dict:
    """name -> (verbatim source path or None, code) for each marked README block."""
    return {m.group(1): (m.group(2), m.group(3)) for m in SNIPPET.finditer((ROOT / "README.md").read_text())}


def test_the_readme_marks_an_example_for_each_framework():
    assert sorted(snippets()) == ["equinox", "linen", "nnx", "plain"]


def test_a_verbatim_snippet_is_its_files_text():
    for name, (path, code) in snippets().items():
        if path is not None:
            assert code in (ROOT / path).read_text(), f"README snippet {name!r} is not verbatim in {path}"


def chained(model, key, x):
    """The parts of a PipelineModel, each initialised from `key`, applied in order."""
    for part in model.parts:
        x = part.apply(part.init(key), x, rng=None, train=True)
    return x


def whole_linen(ns, key, x):
    from flax import linen as nn

    module = ns["Model"]()
    return module.apply(nn.unbox(module.init(key, x)), x)


def whole_plain(ns, key, x):
    p = ns["init"](key)
    h = x @ p["in"]["w"]
    for i in range(2):
        h = ns["block"](p[f"block{i}"], h)
    return h @ p["out"]["w"]


def whole_equinox(ns, key, x):
    import jax

    return jax.vmap(ns["Decoder"](64, 32, 4, 64, 2, key))(x)


def whole_nnx(ns, key, x):
    from flax import nnx

    with nnx.use_eager_sharding(False):     # axis names only: no mesh here
        return ns["Llama"](64, 32, 4, 2, 64, 2, nnx.Rngs(key))(x)     # pipeline()'s defaults


CASES = {"linen": ("linen_pipeline", whole_linen), "plain": ("plain_pipeline", whole_plain),
         "equinox": ("pipeline", whole_equinox), "nnx": ("pipeline", whole_nnx)}


# equinox: its attention compiles slowly (24-52 s on 2 loaded cores); its README text is checked
# verbatim above and its adapter planned in tests/test_byo_eqx_example.py in the default suite
@pytest.mark.parametrize("name", [pytest.param("linen", marks=pytest.mark.needs_models),
                                  pytest.param("nnx", marks=pytest.mark.needs_models), "plain",
                                  pytest.param("equinox", marks=pytest.mark.slow)])
def test_readme_snippet_runs_and_its_parts_compute_the_whole_model(name):
    import jax
    import jax.numpy as jnp

    from orchestrator.core.model.pipeline import describe

    path, code = snippets()[name]
    namespace: dict = {}
    if path is not None:        # a verbatim snippet runs among its file's definitions (its imports, its model)
        import importlib

        namespace.update(vars(importlib.import_module(path[:-len(".py")].replace("/", "."))))
    exec(compile(code, f"README.md snippet {name}", "exec"), namespace)
    factory, whole = CASES[name]
    model = namespace[factory]()
    spec = describe(model, name=name, factory=f"README:{factory}", args={})
    assert len(spec.layers) == 4
    key = jax.random.key(7)
    if model.input.dtype == "int32":
        x = jax.random.randint(jax.random.key(1), (3, *model.input.shape), 0, 64, jnp.int32)
    else:
        x = jax.random.normal(jax.random.key(1), (3, *model.input.shape))
    got = jax.jit(lambda k, x: chained(model, k, x))(key, x)
    want = jax.jit(lambda k, x: whole(namespace, k, x))(key, x)
    assert got.shape == want.shape == (3, *spec.layers[-1].outputs[0].shape)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    labels = jnp.zeros((3, *model.label.shape), model.label.dtype)
    assert np.isfinite(float(model.loss(got, labels)))
