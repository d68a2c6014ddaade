"""Model front end (pure): `pipeline` (the PipelineModel interface and its shape-only
description), `adapters` (plain JAX, flax.nnx), `spec` (the planner's description),
`layout` (logical axes → mesh axes), `registry` (built-in names and factory paths).
jax is imported inside functions only; nothing here needs a device.
"""
