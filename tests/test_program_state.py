"""`StageProgram.init_state` lays the optimizer state out as the parameters are: on a stage mesh
of 2 simulated CPU devices (a subprocess, so the device count is its own), each Adam moment has
its parameter's sharding and the step count is replicated — `jax.jit(tx.init)` alone put the
whole state on one device (a `model: 8` stage would hold all of Adam on its first chip)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

CODE = textwrap.dedent("""
    import jax, numpy as np, optax
    from jax.sharding import NamedSharding
    from orchestrator.core.model.registry import build_model, build_spec
    from stages.program import StageProgram

    spec = build_spec("gpt", {"vocab": 32, "d_model": 16, "heads": 2, "d_mlp": 32, "blocks": 2}, seq_len=8)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("model",))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    prog = StageProgram(spec, build_model(spec.factory, spec.args), 0, spec.num_layers, microbatches=1,
                        optimizer=tx, mesh=mesh, layout={"mlp": "model", "heads": "model"})
    params = prog.init_params(0)
    opt_state, zeros = prog.init_state(params)
    plain = jax.jit(tx.init)(params)
    psh = jax.tree.leaves(params)
    split = sum(not p.sharding.is_fully_replicated for p in psh)
    assert split > 0, "the layout split no parameter: the test would check nothing"
    moments = optax.tree_map_params(tx, lambda x: x, opt_state)
    for state in (optax.tree_utils.tree_get(moments, "mu"), optax.tree_utils.tree_get(moments, "nu")):
        for p, m in zip(psh, jax.tree.leaves(state)):
            assert m.sharding.is_equivalent_to(p.sharding, p.ndim), (p.sharding, m.sharding)
    count = optax.tree_utils.tree_get(opt_state, "count")
    assert isinstance(count.sharding, NamedSharding) and count.sharding.is_fully_replicated, count.sharding
    assert len(count.sharding.device_set) == 2, count.sharding
    for z, p in zip(jax.tree.leaves(zeros), psh):
        assert z.sharding.is_equivalent_to(p.sharding, p.ndim)
    for a, b in zip(jax.tree.leaves(opt_state), jax.tree.leaves(plain)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))      # the same values, laid out
    print("split", split)
""")


def test_optimizer_state_takes_the_parameters_shardings():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "split" in out.stdout
