"""The built-in models' jax code: plain-JAX `PipelineModel` factories (`gpt_impl:model`,
`mlp_impl:model`), registered as the entry points `gpt` and `mlp` of the group `meshpipe.models`
(pyproject.toml), which `orchestrator.core.model.registry.BUILTIN` reads.
"""
