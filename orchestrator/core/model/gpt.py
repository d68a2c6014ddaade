"""The built-in small GPT's arguments (its jax code, a plain-JAX factory: `stages/models/gpt_impl.py`).

Parts: `embed` (token + position), `block0..` pre-norm transformer blocks
(attention split over `heads`, MLP over `mlp`), `head` (final norm + LM head over
`vocab`). Loss: next-token cross-entropy, mean over tokens. Needs `data.seq_len`.
"""
DEFAULTS = {"vocab": 128, "d_model": 64, "heads": 4, "d_mlp": 256, "blocks": 2}
