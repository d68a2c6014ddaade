"""Shared by the data tests: a corpus nobody wrote by hand, prepared into token shards once."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.corpus import corpus, prepared  # noqa: F401 - the data tests' shared corpus

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


def grain_windows(path: str, seq_len: int, dtype: str = "uint16", offset: int = 0):
    """A grain MapDataset whose record i is window i of a token shard (a user's grain pipeline)."""
    import grain
    import numpy as np

    arr = np.memmap(path, dtype=dtype, mode="r")
    n = (len(arr) - 1) // seq_len
    return grain.MapDataset.range(n).map(
        lambda i: np.asarray(arr[i * seq_len: i * seq_len + seq_len + 1], dtype=np.int64) + offset)


def write_docs(root: Path, shards_dir: Path) -> tuple[Path, Path, list[str]]:
    """The corpus files as documents in a JSONL and a Parquet file (column 'text', plus 'name')."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from orchestrator.driver.prepare import list_inputs

    docs = [(p.name, p.read_bytes().decode("utf-8", errors="replace")) for p in list_inputs(corpus())][:12]
    jsonl = root / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"name": n, "text": t}) + "\n" for n, t in docs))
    parquet = root / "docs.parquet"
    pq.write_table(pa.table({"name": [n for n, _ in docs], "text": [t for _, t in docs]}), parquet)
    return jsonl, parquet, [t for _, t in docs]
