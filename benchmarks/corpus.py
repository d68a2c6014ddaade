"""A corpus nobody wrote by hand, prepared into token shards once: for the data tests and
`benchmarks.data_loader`."""
from __future__ import annotations

import json
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
