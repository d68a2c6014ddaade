"""Deterministic data: the same (seed, step) gives the same global batch everywhere.

The first stage needs the inputs and the last stage the labels; each computes
the batch itself from (seed, step) instead of receiving it from the driver, so
the driver stays out of the data path. numpy only.

Sources:
  - `synthetic` for token models (`vocab` > 0, labels shaped like inputs, e.g.
    `gpt`): token sequences that follow a hidden rule (a start token and a stride
    per row, modulo the vocabulary), so loss can fall;
  - `synthetic` otherwise (e.g. `mlp`): Gaussian inputs, labels from a fixed random teacher;
  - `text`: character-level windows of a text file (bytes clipped to the vocab).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from orchestrator.core.model.spec import ModelSpec


@dataclass(frozen=True)
class DataSource:
    kind: str            # "synthetic" | "text"
    model: str           # "mlp" | "gpt" | factory path
    global_batch: int
    seed: int
    input_shape: tuple[int, ...]
    label_shape: tuple[int, ...]
    vocab: int = 0
    text: bytes | None = None

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, labels) of the global batch for this step."""
        rng = np.random.default_rng([self.seed, step, 7])
        n = self.global_batch
        if self.kind == "text":
            tokens = np.minimum(np.frombuffer(self.text, dtype=np.uint8), self.vocab - 1).astype(np.int32)
            seq = self.input_shape[0]
            if len(tokens) < seq + 2:
                raise ValueError(f"data.path holds {len(tokens)} characters; need at least seq_len+2 = {seq + 2}")
            starts = rng.integers(0, len(tokens) - seq - 1, size=n)
            windows = np.stack([tokens[s: s + seq + 1] for s in starts])
            return windows[:, :-1], windows[:, 1:]
        if self.input_shape and len(self.label_shape) == 1 and self.label_shape == self.input_shape \
                and self.vocab:
            seq = self.input_shape[0]
            start = rng.integers(0, self.vocab, size=(n, 1))
            stride = rng.integers(1, 4, size=(n, 1))
            rows = (start + stride * np.arange(seq + 1)[None, :]) % self.vocab
            rows = rows.astype(np.int32)
            return rows[:, :-1], rows[:, 1:]
        teacher = np.random.default_rng([self.seed, 99991])
        d_in, d_out = self.input_shape[0], self.label_shape[0]
        t1 = teacher.normal(size=(d_in, 16)).astype(np.float32) / np.sqrt(d_in)
        t2 = teacher.normal(size=(16, d_out)).astype(np.float32) / 4.0
        x = rng.normal(size=(n, d_in)).astype(np.float32)
        return x, np.tanh(x @ t1) @ t2


def make_source(spec: ModelSpec, kind: str, global_batch: int, seed: int,
                text: bytes | None = None) -> DataSource:
    return DataSource(kind=kind, model=spec.name, global_batch=global_batch, seed=seed,
                      input_shape=tuple(spec.input_shape), label_shape=tuple(spec.label_shape),
                      vocab=int(spec.vocab), text=text)


def microbatch(arr: np.ndarray, index: int, count: int) -> np.ndarray:
    size = arr.shape[0] // count
    return arr[index * size: (index + 1) * size]
