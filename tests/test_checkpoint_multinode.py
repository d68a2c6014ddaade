"""Checkpoints of a multi-host stage on a simulated multi-node cluster (`-m multinode`): resume, bytes.

Stage 0 spans 2 hosts × 2 devices ({data: 2, model: 2}, one jax.distributed world): each host
saves its own shards, and its share of the shards replicated over the hosts (orbax replica-parallel
saving, on only across hosts), into the stage's one orbax directory, host 0 finalises; the resumed
run's losses and parameters equal the uninterrupted run's exactly; and, read back from the
files, each array is written once (each host its half). Own pytest process (as
tests/test_multinode.py: it connects to its own cluster).
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.test_checkpoint import _resume_equals_uninterrupted, gpt_job
from tests.test_multinode import CLUSTER, cluster  # noqa: F401 - the module's cluster fixture

pytestmark = pytest.mark.multinode


def multihost_job(tmp_path, name, ckpt_dir, schedule="1f1b"):
    job = gpt_job(tmp_path, name, ckpt_dir, schedule)
    job["pipeline"]["stages"] = [{"layers": [0, 2], "hosts": 2, "mesh": {"data": 2, "model": 2}},
                                 {"layers": [2, 4], "hosts": 1, "mesh": {"model": 2}, "layout": {"batch": None}}]
    return job


def test_multihost_stage_resume_is_bit_exact(cluster, tmp_path):  # noqa: F811 - the fixture
    from orchestrator.core import checkpoint as ck

    full_dir, _ = _resume_equals_uninterrupted(tmp_path, "1f1b", multihost_job, cluster=CLUSTER)
    marker = ck.select(full_dir)
    assert marker["layout"][0]["hosts"] == 2
    assert any(name.startswith("ocdbt.process_1") for name in marker["stages"][0]["files"]), \
        "host 1 wrote its own shards into stage 0's directory"



def ocdbt_values(directory) -> dict[str, bytes]:
    """Every key -> value of the OCDBT database in `directory` (one host's own, or the merged one)."""
    import tensorstore as ts

    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{directory}"}).result()
    return {k.decode(): kv.read(k).result().value for k in kv.list().result()}


def chunk_nbytes(key: str, meta: dict) -> int:
    """Uncompressed bytes of zarr chunk `key` (`arrays.a00001/2.0`) of an array with `.zarray` `meta`."""
    import math

    array, index = key.rsplit("/", 1)
    m = meta[array]
    item = np.dtype(m["dtype"]).itemsize
    if not m["shape"]:
        return item
    return item * math.prod(min(c, s - int(i) * c) for i, c, s in zip(index.split("."), m["chunks"], m["shape"]))


def chunk_grid(meta: dict) -> set[str]:
    """Every chunk key of every array: what one complete copy of the arrays holds."""
    import itertools
    import math

    out = set()
    for array, m in meta.items():
        if not m["shape"]:
            out.add(f"{array}/0")
            continue
        counts = [math.ceil(s / c) for s, c in zip(m["shape"], m["chunks"])]
        out.update(f"{array}/" + ".".join(map(str, ix)) for ix in itertools.product(*map(range, counts)))
    return out


def test_multihost_stage_writes_each_array_once(cluster, tmp_path):  # noqa: F811 - the fixture
    """Stage 0 at d_model 128, vocab 1024 (3.95 MB of parameters + adam's moments, well above
    OCDBT's 1 KiB inline size), saved once by its 2 hosts; everything below is read back from
    the files: each host's own OCDBT database (`ocdbt.process_<i>`) and the merged index.

    Chunks: every chunk of every array is in exactly one host's database (a host writing a copy
    of another's, or every host writing what it holds, puts a chunk key in both), the chunks
    tile every array, and their uncompressed bytes add up to the stage's parameter + optimizer
    bytes exactly. Every array of stage 0 is replicated over its two hosts (`data` spans them),
    and orbax's replica-parallel saving gives each host one half of every shard: host 1 wrote
    exactly half the bytes, host 0 half plus adam's 4-byte count (not splittable).

    Disk: the data files (the d/ folders of both hosts and of the merged index) hold one compressed copy
    (zstd; each chunk once, as the merged index lists it) plus OCDBT's b-tree nodes: values up to
    1 KiB (array metadata, the small LayerNorm chunks) sit inline in the nodes, and the merged
    index repeats them: 19 and 46 KB over one copy in two runs. Bound: one copy <= files <=
    1.02 x one copy + 64 KiB (~120 KB of slack here). A second copy of one of the larger arrays
    (embed/tok 0.49 MB, w1 and w2 0.24 MB compressed) breaks it; smaller ones are caught by the
    chunk check, which is exact. (Checked by making every host write every shard it holds: both
    checks failed; the files held 5.60 MB for a 2.79 MB copy.)
    """
    import glob
    import json
    import os

    from orchestrator.core import checkpoint as ck
    from orchestrator.core.checkpoint import is_param_name
    from tests.test_checkpoint import _run

    job = multihost_job(tmp_path, "bytes", tmp_path / "ck")
    job["run"]["steps"] = 2                      # one save, after the last step
    job["model"]["args"].update(vocab=1024, d_model=128, d_mlp=512)
    full = _run(job, cluster=CLUSTER)
    marker = ck.select(tmp_path / "ck")
    rec = marker["stages"][0]
    params = sum(np.asarray(full["params"][n]).nbytes for n, m in marker["arrays"].items()
                 if m["stage"] == 0 and is_param_name(n))
    total = rec["array_bytes"]
    assert total == 3 * params + 4 > 3 << 20         # parameters + adam's mu, nu + the int32 count

    directory = ck.stage_dir(tmp_path / "ck", 2, 0)
    merged = ocdbt_values(directory)
    meta = {k.rsplit("/", 1)[0]: json.loads(v) for k, v in merged.items()
            if k.startswith("arrays.") and k.endswith("/.zarray")}
    assert len(meta) == len(rec["arrays"])
    hosts = [ocdbt_values(directory / f"ocdbt.process_{i}") for i in (0, 1)]
    chunks = [{k: v for k, v in h.items() if k.startswith("arrays.") and not k.endswith("/.zarray")}
              for h in hosts]
    both = sorted(chunks[0].keys() & chunks[1].keys())
    assert not both, f"chunks written by both hosts: {both[:5]}"
    assert chunks[0].keys() | chunks[1].keys() == chunk_grid(meta) == \
        {k for k in merged if k.startswith("arrays.") and not k.endswith("/.zarray")}
    raw = [sum(chunk_nbytes(k, meta) for k in c) for c in chunks]
    assert raw[0] + raw[1] == total, (raw, total)
    assert raw[0] - 4 == raw[1] == (total - 4) // 2, (raw, total)

    one_copy = sum(len(v) for k, v in merged.items() if k.startswith("arrays.") and not k.endswith("/.zarray"))
    files = [sum(os.path.getsize(f) for f in glob.glob(f"{directory}/ocdbt.process_{i}/d/*")) for i in (0, 1)]
    index = sum(os.path.getsize(f) for f in glob.glob(f"{directory}/d/*"))
    on_disk = sum(files) + index
    print(f"stage 0: {total} B of arrays; chunks per host {raw} B raw, {[sum(map(len, c.values())) for c in chunks]} "
          f"B compressed; data files per host {files} B, merged index {index} B")
    assert one_copy <= on_disk <= 1.02 * one_copy + (64 << 10), (on_disk, one_copy)
    for c, f in zip(chunks, files):           # each host's files hold its own chunks (those over 1 KiB out of line)
        assert sum(len(v) for v in c.values() if len(v) > 1024) <= f <= 1.02 * sum(map(len, c.values())) + (32 << 10)
