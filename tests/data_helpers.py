"""Shared by the data tests: a corpus nobody wrote by hand, prepared into token shards once."""
from __future__ import annotations

import json
import sys
from pathlib import Path

LICENSES = Path("/usr/share/common-licenses")


def corpus() -> list[str]:
    """The licence texts Debian installs; elsewhere the standard library's `email` sources."""
    if LICENSES.is_dir() and any(p.is_file() for p in LICENSES.iterdir()):
        return [str(LICENSES)]
    import email

    return [str(Path(email.__file__).parent)]


def prepared(root: Path, vocab: int = 320, shard_tokens: int = 30000) -> Path:
    """`meshpipe prepare` of the corpus into root/shards (trained BPE of `vocab` tokens), cached."""
    out = root / f"shards-{vocab}-{shard_tokens}"
    if (out / "index.json").is_file():
        return out
    from click.testing import CliRunner

    from orchestrator.driver.cli import main

    res = CliRunner().invoke(main, ["prepare", *corpus(), "--out", str(out), "--train-tokenizer", str(vocab),
                                    "--shard-tokens", str(shard_tokens)])
    if res.exit_code != 0:
        raise RuntimeError(f"prepare failed: {res.output} {res.exception!r}")
    doc = json.loads((out / "index.json").read_text())
    assert doc["vocab"] <= vocab and len(doc["shards"]) >= 2, doc
    return out


def gpt_job(tmp_path, data: dict, stages=None, steps=6, name="gpt-data", vocab=320, **run):
    return {
        "run": {"name": name, "steps": steps, "seed": 5, "output_dir": str(tmp_path), **run},
        "model": {"name": "gpt", "args": {"vocab": vocab, "d_model": 32, "heads": 4, "d_mlp": 64, "blocks": 2}},
        "data": {"global_batch": 16, "seq_len": 16, **data},
        "optimizer": {"name": "adam", "args": {"learning_rate": 0.01}},
        "pipeline": {"schedule": "1f1b", "microbatches": 4, "stages": stages or [
            {"layers": [0, 2], "mesh": {"data": 2}},
            {"layers": [2, 4], "mesh": {"model": 2}},
        ]},
        "layout": {"batch": "data", "heads": "model", "mlp": "model", "vocab": "model"},
    }


if __name__ == "__main__":
    print(prepared(Path(sys.argv[1])))
