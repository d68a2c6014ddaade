"""The built-in residual MLP's arguments (its jax code, a plain-JAX factory: `stages/models/mlp_impl.py`).

Parts: `in` (d_in → embed), `block0..` residual blocks (embed → mlp → embed),
`out` (embed → d_out). Loss: mean squared error against a fixed random teacher.
"""
DEFAULTS = {"d_in": 32, "d_model": 64, "d_mlp": 256, "d_out": 8, "blocks": 2}
