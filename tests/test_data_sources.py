"""The `text`, `hf` and `grain` sources, in-process: what each reads, and what each refuses at
plan time (key, value, rule). The pipeline runs them through the same `HostLoader` as `tokens`
(tests/test_data_ray.py trains on tokens); here each reader is checked against what it must
return. Needs the `data` extra (datasets, tokenizers, grain), which the `test` extra installs.
"""
from __future__ import annotations

import pickle

import numpy as np
import pytest

from orchestrator.core.config import ConfigError, check_job, parse_cluster, parse_job
from stages.data import HostLoader, global_batch, open_reader
from stages.data.readers import hf_tokens
from tests.data_helpers import gpt_job, prepared, write_docs

CLUSTER = {"address": None, "platform": "cpu", "hosts": 4, "devices_per_host": 2, "cpus_per_host": 0.5}
REPO_TEXT = "examples/data/tiny_shakespeare_like.txt"


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return prepared(tmp_path_factory.mktemp("corpus"))


def checked(tmp_path, data, **kw):
    return check_job(parse_job(gpt_job(tmp_path, data, **kw)), parse_cluster(CLUSTER))


def test_text_is_read_by_the_host_from_its_path_not_shipped(tmp_path):
    c = checked(tmp_path, {"source": "text", "path": REPO_TEXT}, vocab=128)
    raw = open(REPO_TEXT, "rb").read()
    assert raw[1000:1040] not in pickle.dumps(c.data)          # the plan names the file, holds none of it
    assert len(pickle.dumps(c.data)) < 2000
    x, y = global_batch(open_reader(c.data), c.data, 2)
    text = np.minimum(np.frombuffer(raw, np.uint8), 127).astype(np.int32)
    for row_x, row_y in zip(x, y):                           # every row is a window of the file
        w = np.r_[row_x, row_y[-1]]
        starts = np.flatnonzero(text[:-16] == w[0])
        assert any(np.array_equal(text[s:s + 17], w) for s in starts)


def test_hf_jsonl_and_parquet_tokenize_the_column_offline(tmp_path, shards, monkeypatch):
    from tokenizers import Tokenizer

    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    jsonl, parquet, texts = write_docs(tmp_path, shards)
    tok = Tokenizer.from_file(str(shards / "tokenizer.json"))
    ids0 = tok.encode(texts[0]).ids
    streams = []
    for path in (jsonl, parquet):
        c = checked(tmp_path, {"source": "hf", "path": str(path), "tokenizer": str(shards / "tokenizer.json"),
                               "column": "text"})
        stream = hf_tokens(c.data)
        assert stream[:len(ids0)].tolist() == ids0 and stream[len(ids0)] == tok.token_to_id("<|endoftext|>")
        streams.append(stream)
        x, y = global_batch(open_reader(c.data), c.data, 1)
        assert x.shape == (16, 16) and (x[:, 1:] == y[:, :-1]).all() and x.max() < 320
    assert np.array_equal(streams[0], streams[1])
    import os

    assert os.environ["HF_DATASETS_OFFLINE"] == "1"


def test_hf_refuses_an_unknown_column_and_a_too_large_tokenizer(tmp_path, shards):
    jsonl, parquet, _ = write_docs(tmp_path, shards)
    tok = str(shards / "tokenizer.json")
    for path in (jsonl, parquet):
        with pytest.raises(ConfigError) as e:
            checked(tmp_path, {"source": "hf", "path": str(path), "tokenizer": tok, "column": "body"})
        assert f"data.column = 'body': not a column of {path.resolve()} (columns: name, text)" in str(e.value)
    with pytest.raises(ConfigError) as e:
        checked(tmp_path, {"source": "hf", "path": str(jsonl), "tokenizer": tok}, vocab=256)
    assert "data.tokenizer" in str(e.value) and "320 tokens, more than the model's vocab 256" in str(e.value)
    with pytest.raises(ConfigError, match=r"data.tokenizer = None: required when data.source is 'hf'"):
        checked(tmp_path, {"source": "hf", "path": str(jsonl)})


def test_grain_pipeline_by_import_path(tmp_path, shards):
    shard = sorted(shards.glob("*.bin"))[0]
    data = {"source": "grain", "factory": "tests.data_helpers:grain_windows",
            "args": {"path": str(shard), "seq_len": 16}}
    c = checked(tmp_path, data)
    x, y = global_batch(open_reader(c.data), c.data, 0)
    arr = np.fromfile(shard, dtype=np.uint16).astype(np.int32)
    for row_x, row_y in zip(x, y):
        w = np.r_[row_x, row_y[-1]]
        assert any(np.array_equal(arr[k * 16:k * 16 + 17], w) for k in range((len(arr) - 1) // 16))
    rows = np.arange(2)
    b = HostLoader(c.data, rows, None, 4).load(0)
    assert np.array_equal(b.xs[0], x[:2]) and np.array_equal(b.xs[1], x[4:6])
    with pytest.raises(ConfigError) as e:       # token ids past the vocab, found in the first records
        checked(tmp_path, {**data, "args": {**data["args"], "offset": 300}})
    assert "data.factory" in str(e.value) and ">= the model's vocab 320" in str(e.value)
    with pytest.raises(ConfigError, match="data.factory = 'tests.data_helpers:nope': cannot import"):
        checked(tmp_path, {**data, "factory": "tests.data_helpers:nope"})
    with pytest.raises(ConfigError, match=r"record 0 is int64\[9\]; each record must be .* at least "
                                          r"data.seq_len \+ 1 = 17"):
        checked(tmp_path, {**data, "args": {"path": str(shard), "seq_len": 8}})     # 9-token records


def test_held_out_eval_split_by_files(tmp_path, shards):
    files = sorted(str(p) for p in shards.glob("*.bin"))
    c = checked(tmp_path, {"source": "tokens", "path": files[:-1], "dtype": "uint16",
                           "eval": {"path": files[-1:], "batches": 3}})
    assert c.data.eval.files == (str(shards.joinpath(files[-1]).resolve()),) and c.data.eval_batches == 3
    assert set(c.data.files).isdisjoint(c.data.eval.files)
    x, _ = global_batch(open_reader(c.data.eval), c.data.eval, 0)
    assert x.shape == (16, 16)
    with pytest.raises(ConfigError, match="give exactly one of data.eval.path"):
        checked(tmp_path, {"source": "tokens", "path": str(shards), "eval": {"batches": 2}})


def test_every_source_the_schema_accepts_has_one_planner_and_one_reader():
    """The sources are told apart in one table per layer (the planner's, the readers'): a source
    added to the schema without its entries fails here, not at a user's first run."""
    import typing

    from orchestrator.core.config.schema import DataConfig
    from orchestrator.core.data.plan import SOURCES
    from stages.data.readers import READERS

    accepted = set(typing.get_args(DataConfig.model_fields["source"].annotation))
    assert accepted == {"synthetic", "text", "tokens", "hf", "grain"}
    assert set(SOURCES) == accepted - {"synthetic"}          # synthetic: the base plan, nothing to check
    assert set(READERS) == accepted
