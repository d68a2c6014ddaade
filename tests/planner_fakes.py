"""Synthetic layer profiles for the planner's pure tests (a test helper, not product code).

`fake_model(costs, ...)` builds a `PlanModel` whose layer i costs `costs[i]` flops per
example; `FakeProfiles` answers `ProfileRequest`s the way a compiled tensor-parallel
layer would: flops and residuals linear in the batch and divided by the model-axis
size when the layer's rules use it, plus one forward and one backward all-reduce of
the activation over the `model` group. With `split=(i, w)` each profile also has the
zero-bubble I and W phases, `i` and `w` × the backward's flops, and `held_per_example`
bytes kept from I to W.
"""
from __future__ import annotations

from orchestrator.core.planner.model import ParamInfo, PlanLayer, PlanModel
from orchestrator.core.planner.profile import LayerProfile


def fake_model(costs, d=64, h=256, name="fake", param_scale=1):
    layers = []
    for i, c in enumerate(costs):
        params = (ParamInfo("w1", (d, h * param_scale), ("embed", "mlp")), ParamInfo("w2", (h * param_scale, d), ("mlp", "embed")))
        layers.append(PlanLayer(i, f"l{i}", params, ("batch", "embed"), (d,), 4, signature=f"sig{c}-{i == 0}-{i == len(costs) - 1}"))
    return PlanModel(name, tuple(layers), ("batch", "embed"), {"kind": "fake"})


class FakeProfiles:
    """Callable(requests) -> {request: LayerProfile}; counts how often each was asked."""

    def __init__(self, model, costs, act_bytes=256, resid_per_example=1024, comm_scale=1.0,
                 head_resid_per_example=None, head_fused_temp_per_example=None, split=None,
                 held_per_example=0):
        self.model, self.costs = model, costs
        self.act, self.resid, self.comm = act_bytes, resid_per_example, comm_scale
        # the last layer's residuals (a head's logits) and its fused F+B program's temp, per example
        self.head_resid, self.head_fused = head_resid_per_example, head_fused_temp_per_example
        self.split, self.held = split, held_per_example
        self.calls = 0

    def __call__(self, requests):
        self.calls += 1
        out = {}
        for r in requests:
            m = r.model_size
            f = self.costs[r.layer] * r.batch / m
            colls = ()
            if m > 1:
                g = (tuple(range(m)),)
                nb = self.act * r.batch * self.comm
                colls = (("fwd", "all-reduce", nb, g), ("bwd", "all-reduce", nb, g))
            last = r.layer == self.model.num_layers - 1
            resid = self.head_resid if last and self.head_resid is not None else self.resid
            fused = self.head_fused * r.batch / m if last and self.head_fused is not None else None
            flops = {"fwd": f, "bwd": 2 * f}
            held = None
            if self.split is not None:
                flops.update(i=2 * f * self.split[0], w=2 * f * self.split[1])
                held = self.held * r.batch / m
            out[r] = LayerProfile(flops, dict.fromkeys(flops, 0.0), resid * r.batch / m, 0.0, colls,
                                  fused_temp_bytes=fused, held_bytes=held,
                                  split_temp_bytes=None if held is None else 0.0)
        return out
