"""Generate examples/data/tiny_shakespeare_like.txt: a small, learnable English-like corpus.

A tiny grammar (subjects, verbs, objects, places) written out deterministically,
so the GPT example trains on real characters without downloading anything.
    python examples/make_text.py
"""
from __future__ import annotations

import random
from pathlib import Path

SUBJECTS = ["the king", "a fool", "the queen", "my lord", "the ghost", "a player", "the soldier",
            "her sister", "the old man", "good friend"]
VERBS = ["speaks of", "dreams of", "weeps for", "calls upon", "fears", "loves", "remembers",
         "waits for", "sings to", "forgets"]
OBJECTS = ["the crown", "a storm", "the night", "his father", "the sea", "a letter", "the moon",
           "an old song", "the castle", "a secret"]
PLACES = ["in the hall", "by the river", "at the gate", "upon the hill", "within the tower",
          "under the stars", "beside the fire", "in the garden"]


def corpus(lines: int = 1200, seed: int = 3) -> str:
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(PLACES)}"
        if rng.random() < 0.3:
            s += f", and {rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
        out.append(s[0].upper() + s[1:] + rng.choice([".", ".", "!", "?"]))
        if i % 7 == 6:
            out.append("")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    path = Path(__file__).parent / "data" / "tiny_shakespeare_like.txt"
    path.write_text(corpus())
    print(f"wrote {path} ({path.stat().st_size} bytes)")
