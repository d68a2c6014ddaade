"""Layer 1: pure description and planning (no ray, no actor runtime, no devices).

Config types and checks (`config`), model descriptions and layouts (`model`),
the schedule IR, passes and simulator (`schedule`), reshard plans and stream
layouts (`reshard`), per-platform placement answers (`backends`), stage edges
and the printable plan (`edges`, `plan`). jax may be used inside functions for
shape work on the CPU, never as a side effect of importing or on the caller's
process configuration.
"""
