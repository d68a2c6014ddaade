"""Model descriptions (pure): `spec` (layers and parameters), `layout` (logical axes →
mesh axes), the built-in models `gpt` and `mlp`, and the `registry` that resolves a
job's `model.name`. Their jax implementations run on the actors (`stages.models`).
"""
