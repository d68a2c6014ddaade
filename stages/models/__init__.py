"""jax implementations of the built-in models (`ModelImpl`), resolved on the actors
from `ModelSpec.impl`; their pure descriptions live in `orchestrator.core.model`.
"""
