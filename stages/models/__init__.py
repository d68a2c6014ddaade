"""The built-in models' jax code: plain-JAX `PipelineModel` factories (`gpt_impl:model`,
`mlp_impl:model`), named by `orchestrator.core.model.registry.BUILTIN`.
"""
