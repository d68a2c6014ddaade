"""The built-in small GPT as a plain-JAX `PipelineModel` (arguments: `orchestrator.core.model.gpt`).

Attention is causal multi-head, heads sharded along `heads`; the MLP hidden
dimension along `mlp`; logits along `vocab`. Activations are constrained inside
the blocks so GSPMD keeps the layout the job asked for (`stages.sharding.constrain`
is a no-op outside a stage's mesh). Part i is initialised from fold_in(key, i).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from orchestrator.core.model.adapters import plain
from orchestrator.core.model.gpt import DEFAULTS
from stages.models.base import init_params, rms
from stages.sharding import constrain

ACT = ("batch", "seq", "embed")

AXES = [("embed/tok", ("vocab", "embed")), ("embed/pos", (None, "embed")),
        ("*/ln*", ("embed",)), ("head/lnf", ("embed",)),
        ("*/w[qkv]", ("embed", "heads", "head_dim")), ("*/wo", ("heads", "head_dim", "embed")),
        ("*/w1", ("embed", "mlp")), ("*/w2", ("mlp", "embed")), ("head/unembed", ("embed", "vocab"))]


def _attention(p, x):
    q = jnp.einsum("bsd,dhk->bshk", x, p["wq"])
    k = jnp.einsum("bsd,dhk->bshk", x, p["wk"])
    v = jnp.einsum("bsd,dhk->bshk", x, p["wv"])
    q = constrain(q, ("batch", "seq", "heads", "head_dim"))
    # Python-float constants are weakly typed: they keep the compute dtype (a float32 scalar here
    # would promote bfloat16 scores, and with them softmax's residuals, to float32)
    scores = jnp.einsum("bqhk,bthk->bhqt", q, k) / (q.shape[-1] ** 0.5)
    seq = x.shape[1]
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    scores = jnp.where(causal, scores, -1e30)
    w = jax.nn.softmax(scores, axis=-1)
    o = jnp.einsum("bhqt,bthk->bqhk", w, v)
    return jnp.einsum("bshk,hkd->bsd", o, p["wo"])


def embed(p, x):
    return constrain(jnp.take(p["tok"], x, axis=0) + p["pos"][None, : x.shape[1]], ACT)


def block(p, x):
    x = constrain(x + _attention(p, rms(x, p["ln1"])), ACT)
    h = constrain(jax.nn.gelu(rms(x, p["ln2"]) @ p["w1"]), ("batch", "seq", "mlp"))
    return constrain(x + h @ p["w2"], ACT)


def head(p, x):
    return constrain(rms(x, p["lnf"]) @ p["unembed"], ("batch", "seq", "vocab"))


def loss(logits, labels):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    return -jnp.mean(picked)


def model(seq_len: int | None = None, **args):
    """The GPT of `args` (keys and defaults: `DEFAULTS`) over sequences of `seq_len` tokens."""
    a = {**DEFAULTS, **args}
    if seq_len is None:
        raise ValueError("gpt needs data.seq_len")
    v, d, nh, h, n = a["vocab"], a["d_model"], a["heads"], a["d_mlp"], a["blocks"]
    if d % nh:
        raise ValueError(f"model.args.d_model={d} is not divisible by model.args.heads={nh}")
    hd = d // nh
    defs = {"embed": {"tok": ((v, d), "normal", 0.02), "pos": ((seq_len, d), "normal", 0.01)}}
    for i in range(n):
        defs[f"block{i}"] = {"ln1": ((d,), "ones", 1.0), "ln2": ((d,), "ones", 1.0),
                             "wq": ((d, nh, hd), "normal", d**-0.5), "wk": ((d, nh, hd), "normal", d**-0.5),
                             "wv": ((d, nh, hd), "normal", d**-0.5), "wo": ((nh, hd, d), "normal", d**-0.5 / 2),
                             "w1": ((d, h), "normal", d**-0.5), "w2": ((h, d), "normal", h**-0.5 / 2)}
    defs["head"] = {"lnf": ((d,), "ones", 1.0), "unembed": ((d, v), "normal", d**-0.5)}
    names = list(defs)

    def init(key):
        return {name: init_params(defs[name], jax.random.fold_in(key, i)) for i, name in enumerate(names)}

    parts = [("embed", embed)] + [(f"block{i}", block) for i in range(n)] + [("head", head)]
    return plain(init, parts, loss=loss, input=((seq_len,), "int32", ("batch", "seq")),
                 label=((seq_len,), "int32", ("batch", "seq")), axes=AXES,
                 out_axes=[("head/*", ("batch", "seq", "vocab")), ("*", ACT)], vocab=v)
