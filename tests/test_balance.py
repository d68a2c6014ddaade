"""The cost-balanced default stage cut (`orchestrator.core.model.balance`): pure cut search,
the jaxpr FLOP count, and `check_job` filling in stages that give no layers."""
from __future__ import annotations

import itertools
import random

import pytest

from orchestrator.core.config import ConfigError, check_job, parse_cluster, parse_job
from orchestrator.core.model.balance import balanced_ranges, even_ranges, jaxpr_flops

CLUSTER = {"address": None, "platform": "cpu", "hosts": 2, "devices_per_host": 1, "cpus_per_host": 0.5}


def _cuts(n, k):
    for bounds in itertools.combinations(range(1, n), k - 1):
        edges = (0, *bounds, n)
        yield [(a, b) for a, b in zip(edges, edges[1:])]


@pytest.mark.parametrize("n,k", [(4, 2), (6, 4), (7, 3), (10, 3), (5, 5), (9, 1)])
def test_uniform_costs_keep_the_even_cut(n, k):
    assert balanced_ranges([3.0] * n, k) == even_ranges(n, k)


def test_one_heavy_layer_gets_a_stage_to_itself():
    assert balanced_ranges([1] * 7 + [10], 2) == [(0, 7), (7, 8)]
    assert balanced_ranges([10] + [1] * 6, 3) == [(0, 1), (1, 4), (4, 7)]


def test_the_cut_minimises_the_busiest_range_against_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 8)
        k = rng.randint(1, n)
        costs = [rng.choice([0.0, 1.0, 2.5, rng.random() * 10]) for _ in range(n)]
        got = balanced_ranges(costs, k)
        assert [a for a, _ in got] == [0] + [b for _, b in got[:-1]] and got[-1][1] == n
        assert all(a < b for a, b in got)
        best = min(max(sum(costs[a:b]) for a, b in cut) for cut in _cuts(n, k))
        assert max(sum(costs[a:b]) for a, b in got) <= best * (1 + 1e-5) + 1e-9, (costs, k, got)


def test_bad_cuts_are_refused_with_the_rule():
    with pytest.raises(ValueError, match=r"cannot cut 2 layers into 3 non-empty ranges"):
        balanced_ranges([1, 1], 3)
    with pytest.raises(ValueError, match=r"finite and >= 0"):
        balanced_ranges([1, -1], 2)


def test_jaxpr_flops_counts_matmuls_and_scans():
    import jax
    import jax.numpy as jnp

    a, b = jax.ShapeDtypeStruct((4, 8), jnp.float32), jax.ShapeDtypeStruct((8, 3), jnp.float32)
    assert jaxpr_flops(jax.make_jaxpr(lambda x, y: x @ y)(a, b)) == 2 * 4 * 8 * 3

    def scanned(x, y):
        return jax.lax.scan(lambda c, _: (c, c @ y), x, None, length=5)[1]
    assert jaxpr_flops(jax.make_jaxpr(scanned)(a, b)) == 5 * 2 * 4 * 8 * 3


def _job(mlps, stages, layers=None, virtual=1):
    st = [{"mesh": {"data": 1}} for _ in range(stages)]
    if layers is not None:
        for s, r in zip(st, layers):
            s["layers"] = r
    return {"run": {"name": "balance", "steps": 1, "output_dir": "/tmp/meshpipe-test-balance"},
            "model": {"factory": "tests.balance_models:widths_mlp", "args": {"mlps": list(mlps)}},
            "data": {"source": "synthetic", "global_batch": 4},
            "optimizer": {"name": "sgd", "args": {"learning_rate": 0.1}},
            "pipeline": {"schedule": "gpipe" if virtual == 1 else "interleaved-1f1b", "microbatches": 2,
                         "virtual_stages": virtual, "stages": st},
            "layout": {"batch": "data"}}


def _layers(job):
    return [st.layers for st in check_job(parse_job(job), parse_cluster(CLUSTER)).job.pipeline.stages]


def test_check_job_cuts_a_uniform_model_evenly_and_a_heavy_layer_unevenly():
    assert _layers(_job([16] * 6, 2)) == [(0, 3), (3, 6)]
    assert _layers(_job([16, 16, 16, 16, 16, 512], 2)) == [(0, 5), (5, 6)]
    assert _layers(_job([16] * 4, 2, virtual=2)) == [((0, 1), (2, 3)), ((1, 2), (3, 4))]


def test_explicit_layers_are_kept_as_given():
    assert _layers(_job([16, 16, 16, 16, 16, 512], 2, layers=[[0, 3], [3, 6]])) == [(0, 3), (3, 6)]


def test_layers_on_some_stages_only_or_too_many_stages_are_errors_naming_the_key():
    with pytest.raises(ConfigError, match=r"pipeline\.stages\[1\]\.layers = .*required key is missing.*given for stage\(s\) \[0\]"):
        parse_job(_job([16] * 4, 2, layers=[[0, 2]]))
    with pytest.raises(ConfigError, match=r"pipeline\.stages = '3 \(virtual\) stages'.*at least one layer"):
        check_job(parse_job(_job([16, 16], 3)), parse_cluster({**CLUSTER, "hosts": 3}))


def test_a_model_that_cannot_be_traced_falls_back_to_parameter_counts():
    """A loss that needs concrete values cannot be traced for FLOPs: the cut is then ordered by
    each layer's parameter count (the wide block holds 8·512·2 of them, the others 8·16·2)."""
    import dataclasses

    import jax.numpy as jnp

    from orchestrator.core.model.balance import layer_costs
    from orchestrator.core.model.registry import build_model, build_spec

    args = {"mlps": [16, 16, 16, 512]}
    model = build_model("tests.balance_models:widths_mlp", args)
    spec = build_spec("tests.balance_models:widths_mlp", args)
    assert layer_costs(model, spec)[1] == "flops"
    broken = dataclasses.replace(model, loss=lambda y, t: float(jnp.mean(y - t)))
    costs, kind = layer_costs(broken, spec)
    assert kind == "params" and costs == [8 * 16 * 2] * 3 + [8 * 512 * 2]
    assert balanced_ranges(costs, 2) == [(0, 3), (3, 4)]
    import jax

    with pytest.raises(jax.errors.ConcretizationTypeError):   # no spec to count: the trace's error stands
        layer_costs(broken)
