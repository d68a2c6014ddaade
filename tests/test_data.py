"""Data loading, pure and in-process: sampler math, token shards, the host loader and its
prefetch thread, determinism across pipeline layouts, resumable state, `meshpipe prepare`,
and bad data refused at plan time (key, value, rule) and again by the loader.

The corpus is one no test wrote: the licence texts Debian installs (or the standard
library's `email` sources where those are absent), prepared into shards by `meshpipe prepare`.
"""
from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest

from orchestrator.core.config import ConfigError, check_job, parse_cluster, parse_job
from orchestrator.core.data import WindowSampler, affine, host_rows
from stages.data import HostLoader, global_batch, open_reader
from tests.data_helpers import gpt_job, prepared

CLUSTER = {"address": None, "platform": "cpu", "hosts": 4, "devices_per_host": 2, "cpus_per_host": 0.5}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return prepared(tmp_path_factory.mktemp("corpus"))


def checked(tmp_path, data, stages=None, cluster=None, **kw):
    return check_job(parse_job(gpt_job(tmp_path, data, stages, **kw)), parse_cluster(cluster or CLUSTER))


# ----------------------------------------------------------------------------- pure index math

@pytest.mark.parametrize("n", [1, 2, 7, 64, 1000])
def test_affine_order_is_a_permutation_per_epoch(n):
    for epoch in range(3):
        a, b = affine(11, epoch, n)
        assert sorted((a * j + b) % n for j in range(n)) == list(range(n))


def test_sampler_reads_every_window_once_per_epoch_and_depends_only_on_seed_and_step():
    s = WindowSampler((5, 3, 9), seed=2, global_batch=4)
    seen = np.concatenate([s.windows(step, np.arange(4)) for step in range(17 * 4 // 4)])
    per_epoch = seen[:17 * 4 // 4 * 4 // 17 * 17].reshape(-1, 17)
    for row in per_epoch:
        assert sorted(row.tolist()) == list(range(17))
    again = WindowSampler((5, 3, 9), seed=2, global_batch=4)
    assert (again.windows(9, [3, 0]) == s.windows(9, np.arange(4))[[3, 0]]).all()
    assert not (WindowSampler((5, 3, 9), seed=3, global_batch=4).windows(0, np.arange(4))
                == s.windows(0, np.arange(4))).all()
    shard, local = s.locate(np.array([0, 4, 5, 7, 8, 16]))
    assert shard.tolist() == [0, 0, 1, 1, 2, 2] and local.tolist() == [0, 4, 0, 2, 0, 8]


def test_head_and_tail_splits_are_disjoint():
    head = WindowSampler((50, 50), 0, 8, 0, 95)
    tail = WindowSampler((50, 50), 0, 8, 95, None)
    a = {int(w) for step in range(40) for w in head.windows(step, np.arange(8))}
    b = {int(w) for step in range(5) for w in tail.windows(step, np.arange(8))}
    assert a == set(range(95)) and b == set(range(95, 100))


@pytest.mark.parametrize("mesh,rule,dph,per_host", [
    ({"data": 4}, "data", 2, 4),                      # batch split across the two hosts
    ({"data": 2, "model": 2}, "data", 2, 4),          # data major: each host one data shard
    ({"model": 2, "data": 2}, "data", 2, 8),          # data minor: each host holds both data shards
    ({"data": 2, "model": 4}, ("data", "model"), 4, 4),
    ({"data": 2}, None, 1, 8)])                       # replicated batch: every host every row
def test_host_rows_partition_the_microbatch(mesh, rule, dph, per_host):
    rows = [host_rows(mesh, rule, dph, h, 8) for h in range(2)]
    assert set(np.concatenate(rows).tolist()) == set(range(8))
    assert [len(r) for r in rows] == [per_host, per_host]
    if per_host == 4:
        assert rows[0].tolist() == [0, 1, 2, 3] and rows[1].tolist() == [4, 5, 6, 7]


# ----------------------------------------------------------------------------- shards and readers

def test_prepared_shards_plan_and_read(tmp_path, shards):
    c = checked(tmp_path, {"source": "tokens", "path": str(shards)})
    doc = json.loads((shards / "index.json").read_text())
    assert c.data.files == tuple(str((shards / s["file"]).resolve()) for s in doc["shards"])
    assert c.data.counts == tuple((s["tokens"] - 1) // 16 for s in doc["shards"])
    reader = open_reader(c.data)
    x, y = global_batch(reader, c.data, 3)
    assert x.shape == y.shape == (16, 16) and x.dtype == np.int32
    assert (x[:, 1:] == y[:, :-1]).all()                    # labels are the inputs shifted by one
    # each row is a real window of the shards: find row 0 in the concatenated token stream
    flat = np.concatenate([np.fromfile(f, dtype=np.uint16) for f in c.data.files]).astype(np.int32)
    w = c.data.counts
    found = [np.array_equal(np.fromfile(c.data.files[s], dtype=np.uint16)[k * 16: k * 16 + 17], np.r_[x[0], y[0, -1]])
             for s in range(len(w)) for k in range(w[s])]
    assert sum(found) >= 1 and flat.max() < 320


def test_a_single_bin_file_takes_dtype_from_the_job(tmp_path):
    f = tmp_path / "a.bin"
    np.arange(100, dtype=np.uint32).tofile(f)
    with pytest.raises(ConfigError) as e:
        checked(tmp_path, {"source": "tokens", "path": str(f)})
    assert "data.dtype" in str(e.value)
    c = checked(tmp_path, {"source": "tokens", "path": [str(f)], "dtype": "uint32"}, vocab=128)
    x, y = global_batch(open_reader(c.data), c.data, 0)
    assert (np.diff(x, axis=1) == 1).all() and (y[:, -1] == x[:, -1] + 1).all()


# ----------------------------------------------------------------------------- layouts and hosts

LAYOUTS = {
    "1 stage": [{"layers": [0, 4], "mesh": {"data": 2, "model": 1}}],
    "2 stages": None,
    "3 stages, 2-host data-parallel first": [
        {"layers": [0, 1], "hosts": 2, "mesh": {"data": 4}},
        {"layers": [1, 3], "mesh": {"model": 2}},
        {"layers": [3, 4], "mesh": {"data": 2}}],
    "2 stages, 2-host {data, model}": [
        {"layers": [0, 2], "hosts": 2, "mesh": {"data": 2, "model": 2}},
        {"layers": [2, 4], "hosts": 2, "mesh": {"model": 2, "data": 2}}],
}


def _host_loaders(c, which):
    stage = c.stages[0] if which == "in" else c.stages[-1]
    mbs, m = c.microbatch_size, c.job.pipeline.microbatches
    for h in range(len(stage.hosts)):
        rows = host_rows(stage.mesh, stage.layout.get("batch"), stage.devices_per_host, h, mbs)
        yield rows, HostLoader(c.data, rows if which == "in" else None, rows if which == "lab" else None, m)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_same_seed_and_step_give_the_same_batch_under_every_layout(tmp_path, shards, layout):
    c = checked(tmp_path, {"source": "tokens", "path": str(shards), "prefetch": 0}, LAYOUTS[layout])
    ref = open_reader(c.data)
    mbs, m = c.microbatch_size, c.job.pipeline.microbatches
    for step in (0, 7):
        x_all, y_all = global_batch(ref, c.data, step)
        for which, want in (("in", x_all), ("lab", y_all)):
            got = np.full_like(want, -1)
            for rows, loader in _host_loaders(c, which):
                b = loader.load(step)
                for i in range(m):
                    got[i * mbs + rows] = (b.xs if which == "in" else b.ys)[i]
            np.testing.assert_array_equal(got, want)


def test_each_host_reads_only_its_share(tmp_path, shards):
    c = checked(tmp_path, {"source": "tokens", "path": str(shards), "prefetch": 0},
                LAYOUTS["2 stages, 2-host {data, model}"])
    whole = 16 * 17 * 2                                   # global batch × (seq_len + 1) × uint16
    loaders = [lo for _, lo in _host_loaders(c, "in")]
    for lo in loaders:
        lo.load(0)
        lo.load(1)
    assert [lo.bytes_read for lo in loaders] == [whole, whole]      # half of 2 steps each
    assert sum(lo.bytes_read for lo in loaders) == 2 * whole


# ----------------------------------------------------------------------------- prefetch and state

def test_prefetch_matches_direct_reads_resumes_from_state_and_shuts_down(tmp_path, shards):
    c = checked(tmp_path, {"source": "tokens", "path": str(shards), "prefetch": 3})
    rows = np.arange(c.microbatch_size)
    lo = HostLoader(c.data, rows, rows, 4, who="test loader")
    direct = HostLoader(c.data, rows, rows, 4)
    before = threading.active_count()
    got = [lo.get(s, timeout=30) for s in range(5)]
    for s, b in enumerate(got):
        want = direct.load(s)
        assert b.step == s and all(np.array_equal(p, q) for p, q in zip(b.xs + b.ys, want.xs + want.ys))
    state = lo.state()
    assert state == {"source": "tokens", "seed": 5, "next_step": 5, "samples": 80}
    lo.close()
    fresh = HostLoader(c.data, rows, rows, 4)
    fresh.load_state(json.loads(json.dumps(state)))        # a checkpoint stores it as JSON
    b5 = fresh.get(5, timeout=30)
    assert all(np.array_equal(p, q) for p, q in zip(b5.xs, direct.load(5).xs))
    b2 = fresh.get(2, timeout=30)                          # a seek restarts the thread there
    assert all(np.array_equal(p, q) for p, q in zip(b2.xs, got[2].xs))
    fresh.close()
    assert threading.active_count() <= before
    with pytest.raises(ValueError, match="not of this data set"):
        fresh.load_state({**state, "seed": 6})


def test_loader_errors_reach_the_step_not_a_hang(tmp_path):
    f = tmp_path / "big.bin"
    ids = np.zeros(6_000_000, dtype=np.uint16)
    ids.tofile(f)
    c = checked(tmp_path, {"source": "tokens", "path": str(f), "dtype": "uint16", "prefetch": 2,
                           "global_batch": 64})
    ids[2_500_000:3_500_000] = 400                          # >= vocab 320, written after the plan read the file
    ids.tofile(f)
    lo = HostLoader(c.data, np.arange(16), None, 4, who="test loader")
    with pytest.raises(RuntimeError, match=r"token id 400 >= the model.s vocab 320 in .*big.bin, window"):
        for s in range(4):
            lo.get(s, timeout=30)
    lo.close()


# ----------------------------------------------------------------------------- bad input

def _problems(tmp_path, data, **kw) -> str:
    with pytest.raises(ConfigError) as e:
        checked(tmp_path, data, **kw)
    return str(e.value)


def test_bad_token_data_is_refused_with_key_value_rule(tmp_path, shards):
    d = tmp_path / "bad"
    d.mkdir()
    doc = json.loads((shards / "index.json").read_text())
    for s in doc["shards"]:
        (d / s["file"]).write_bytes((shards / s["file"]).read_bytes())
    (d / "index.json").write_text(json.dumps(doc))
    first = doc["shards"][0]["file"]
    (d / first).unlink()
    msg = _problems(tmp_path, {"source": "tokens", "path": str(d)})
    assert f"data.path = '{d / first}': shard not found" in msg
    (d / first).write_bytes(b"")
    assert f"data.path = '{(d / first).resolve()}': is empty" in _problems(tmp_path, {"source": "tokens", "path": str(d)})
    (d / first).write_bytes((shards / first).read_bytes())
    checked(tmp_path, {"source": "tokens", "path": str(d)})                 # whole again: fine
    # token ids >= the model's vocab: the index's max_token names the shard, a scan the first id too large
    msg = _problems(tmp_path, {"source": "tokens", "path": str(d)}, vocab=128)
    ids = np.fromfile(d / first, dtype=np.uint16)
    pos = int(np.argmax(ids >= 128))
    assert (f"data.path = '{(d / first).resolve()}': token id {ids[pos]} at position {pos} (of {len(ids)} tokens) "
            "does not fit the model's vocab 128 (index.json records max_token") in msg, msg
    # seq_len longer than a shard
    tiny = tmp_path / "tiny.bin"
    np.arange(10, dtype=np.uint16).tofile(tiny)
    msg = _problems(tmp_path, {"source": "tokens", "path": [str(tiny)], "dtype": "uint16"})
    assert f"data.path = '{tiny.resolve()}': shard holds 10 tokens, fewer than data.seq_len + 1 = 17" in msg
    # odd byte count for the dtype
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01" * 101)
    assert "not a multiple of 2" in _problems(tmp_path, {"source": "tokens", "path": [str(odd)], "dtype": "uint16"})


def test_text_bytes_that_do_not_fit_the_vocab_are_refused_not_clamped(tmp_path):
    """The issue's inputs: `vocab: 64` on ASCII text clamped every lowercase letter to id 63, and
    non-ASCII bytes with `vocab: 128` likewise; now the plan names the file, the offset, the byte."""
    text = tmp_path / "t.txt"
    text.write_bytes(b"HELLO WORLD, " * 8 + b"lower" + "caf\u00e9".encode() * 4)
    msg = _problems(tmp_path, {"source": "text", "path": str(text)}, vocab=64)
    assert f"data.path = '{text.resolve()}': byte 72 at offset 0 does not fit the model's vocab 64" in msg, msg
    assert "never clamped" in msg
    text.write_bytes(b"HELLO WORLD, " * 8 + "caf\u00e9".encode() * 4)
    msg = _problems(tmp_path, {"source": "text", "path": str(text)}, vocab=128)
    assert f"byte 195 at offset {13 * 8 + 3} does not fit the model's vocab 128 (the whole file read)" in msg, msg
    checked(tmp_path, {"source": "text", "path": str(text)}, vocab=256)        # any byte fits 256


def test_a_shard_without_max_token_is_read_in_full_within_the_budget(tmp_path, monkeypatch):
    """A bare .bin (no index): read in full at plan time (an id in the middle, beyond the first and
    last 4 MiB, is found with its position); past SCAN_BUDGET only its ends, and the loader checks
    every window it reads."""
    from orchestrator.core.data import plan as plan_mod

    f = tmp_path / "big.bin"
    ids = np.zeros(6_000_000, dtype=np.uint16)              # 12 MB: beyond the first and last 4 MiB
    ids[3_000_001] = 400
    ids.tofile(f)
    data = {"source": "tokens", "path": str(f), "dtype": "uint16"}
    msg = _problems(tmp_path, data)
    assert (f"data.path = '{f.resolve()}': token id 400 at position 3000001 (of 6000000 tokens) does not fit "
            "the model's vocab 320 (the whole shard read)") in msg, msg
    monkeypatch.setattr(plan_mod, "SCAN_BUDGET", 1 << 20)
    checked(tmp_path, data)                                  # beyond the budget: the ends only (the loader's)
    ids[-1] = 500
    ids.tofile(f)
    msg = _problems(tmp_path, data)
    assert "token id 400 at position 3000001" in msg and "first and last 4 MiB read" in msg, msg


def test_text_read_after_a_change_stops_at_the_byte_instead_of_clamping_it(tmp_path):
    text = tmp_path / "t.txt"
    text.write_bytes(b"A" * 400)
    c = checked(tmp_path, {"source": "text", "path": str(text)}, vocab=66)
    text.write_bytes(b"A" * 100 + b"z" + b"A" * 299)       # 'z' = 122 >= 66, same size: the plan still holds
    reader = open_reader(c.data)
    with pytest.raises(ValueError, match=r"byte 122 >= the model's vocab 66 in .*t.txt, window \d+, at position 100 "):
        for step in range(8):
            global_batch(reader, c.data, step)


def test_directories_fifos_and_devices_are_refused_as_files(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for path, what in ((str(tmp_path), "is a directory"), (str(fifo), "is a FIFO"),
                       ("/dev/zero", "is a character device")):
        msg = _problems(tmp_path, {"source": "text", "path": path})
        assert f"data.path = {path!r}" in msg and what in msg, msg
    msg = _problems(tmp_path, {"source": "tokens", "path": [str(fifo)], "dtype": "uint16"})
    assert "is a FIFO" in msg
    msg = _problems(tmp_path, {"source": "tokens", "path": str(tmp_path)})   # a directory without index.json
    assert "index.json not found" in msg


def test_source_keys_are_checked(tmp_path):
    with pytest.raises(ConfigError, match=r"data.path = None: required when data.source is 'tokens'"):
        checked(tmp_path, {"source": "tokens"})
    with pytest.raises(ConfigError, match=r"data.column = 'text': only used when data.source is 'hf'"):
        checked(tmp_path, {"source": "tokens", "path": "x", "column": "text"})
    with pytest.raises(ConfigError, match=r"run.eval_every = 2: needs data.eval"):
        checked(tmp_path, {"source": "synthetic"}, eval_every=2)


# ----------------------------------------------------------------------------- eval schedule

@pytest.mark.parametrize("p,m,v", [(1, 2, 1), (2, 4, 1), (3, 4, 1), (2, 4, 2)])
def test_forward_only_schedule_lowers_and_validates(p, m, v):
    from orchestrator.core.schedule import Kind, Schedule, add_comms, forward_only, validate

    low = add_comms(forward_only(p, m, v))
    validate(low)
    kinds = {a.kind for _, _, a in low.cells()}
    assert kinds <= {Kind.F, Kind.SEND_F, Kind.RECV_F} and low.forward_only
    assert sum(a.kind is Kind.F for _, _, a in low.cells()) == p * m * v
    assert Schedule.from_json(low.to_json()) == low


def test_validator_holds_a_forward_only_schedule_to_forwards():
    from orchestrator.core.schedule import Action, Schedule, ScheduleError, validate

    bad = Schedule("forward-only", 1, 1, 1, ((Action.parse("0F0"), Action.parse("0B0")),), forward_only=True)
    with pytest.raises(ScheduleError) as e:
        validate(bad)
    assert e.value.rule == "forward-only"
    missing = Schedule("forward-only", 1, 2, 1, ((Action.parse("0F0"),),), forward_only=True)
    with pytest.raises(ScheduleError, match="forward 0F1 is missing"):
        validate(missing)


def test_plan_has_the_eval_schedule_and_the_step_line_shows_eval(tmp_path, shards):
    from orchestrator.core.plan import make_plan
    from orchestrator.driver.runner import step_line

    c = checked(tmp_path, {"source": "tokens", "path": str(shards), "eval": {"holdout": 0.1}}, eval_every=3)
    plan = make_plan(c)
    assert plan.eval_schedule.forward_only and plan.eval_schedule.p == 2
    assert c.data.split == ("head", 0.1) and c.data.eval.split == ("tail", 0.1) and c.data.eval_batches == 2
    rec = {"step": 3, "loss": 2.0, "step_time_s": 0.5}
    assert "eval" not in step_line(rec, 16)
    assert step_line({**rec, "eval_loss": 1.5}, 16).endswith("eval loss 1.50000")
    assert make_plan(checked(tmp_path, {"source": "tokens", "path": str(shards)})).eval_schedule is None


def test_the_eval_program_has_forward_handlers_only():
    from orchestrator.core.schedule import Action
    from stages import actions

    assert actions.handler_for(Action.parse("1F0"), "w", actions.EVAL_HANDLERS) is actions.eval_forward
    assert actions.handler_for(Action.parse("0SEND_F1"), "w", actions.EVAL_HANDLERS) is actions.send_forward
    with pytest.raises(ValueError, match=r"w: cannot execute action 0B1 .*kind B has no handler"):
        actions.handler_for(Action.parse("0B1"), "w", actions.EVAL_HANDLERS)


def test_prepare_encodes_each_file_as_a_document_and_refuses_bad_inputs(tmp_path, shards):
    from click.testing import CliRunner
    from tokenizers import Tokenizer

    from orchestrator.driver.cli import main

    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("Permission is hereby granted, free of charge")
    b.write_text("THE SOFTWARE IS PROVIDED AS IS")
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["prepare", str(a), str(b), "--out", str(out),
                                    "--tokenizer", str(shards / "tokenizer.json"), "--shard-tokens", "8"])
    assert res.exit_code == 0, res.output
    tok = Tokenizer.from_file(str(shards / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    want = tok.encode(a.read_text()).ids + [eos] + tok.encode(b.read_text()).ids + [eos]
    doc = json.loads((out / "index.json").read_text())
    got = np.concatenate([np.fromfile(out / s["file"], dtype=doc["dtype"]) for s in doc["shards"]])
    assert got.tolist() == want and all(s["tokens"] <= 8 for s in doc["shards"])
    assert doc["eos"] == eos and doc["vocab"] == 320 and f"wrote {len(doc['shards'])} shard(s)" in res.output
    both = CliRunner().invoke(main, ["prepare", str(a), "--out", str(tmp_path / "x"), "--tokenizer",
                                     str(shards / "tokenizer.json"), "--train-tokenizer", "300"])
    assert both.exit_code == 2 and "exactly one of a tokenizer file or a vocabulary size" in both.output
    fifo_dir = tmp_path / "fifos"
    fifo_dir.mkdir()
    os.mkfifo(fifo_dir / "p")
    none = CliRunner().invoke(main, ["prepare", str(fifo_dir), "--out", str(tmp_path / "y"), "--train-tokenizer", "300"])
    assert none.exit_code == 2 and "no non-empty regular files" in none.output
