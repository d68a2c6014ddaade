"""benchmarks.interleaved's pure parts: the sessions' verdict and the arguments it refuses."""
from __future__ import annotations

import doctest

import pytest

from benchmarks import interleaved


def test_docstring_examples_hold():
    result = doctest.testmod(interleaved)
    assert result.attempted >= 3 and result.failed == 0


def test_the_verdict_is_the_median_over_sessions_not_over_pooled_rounds():
    # one long session with many rounds must not outvote the others: sessions are the samples
    runs = [{"ratio_median": 1.2, "ratios": [1.2] * 1000, "started_first": "before"},
            {"ratio_median": 0.99, "ratios": [0.99] * 10, "started_first": "after"},
            {"ratio_median": 1.01, "ratios": [1.01] * 10, "started_first": "before"}]
    s = interleaved.summary(runs)
    assert s["ratio_median"] == 1.01
    assert s["rounds_pooled_median"] == 1.2
    assert s["ratio_median_after_started_first"] == 0.99
    assert s["interval"] is None          # 3 sessions cannot cover the median with 90 %


@pytest.mark.parametrize("flag, value", [("--sessions", "0"), ("--rounds", "1"), ("--burst", "0"), ("--warmup", "0")])
def test_out_of_range_arguments_are_refused_naming_them(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        interleaved.main(["--before", ".", flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag} {value}" in err and "need sessions >= 1" in err


def test_a_before_tree_without_its_python_is_refused_naming_the_flag(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        interleaved.main(["--before", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--before-python" in err and str(tmp_path / ".venv/bin/python") in err


def test_this_tree_against_itself_needs_no_python_named(tmp_path, monkeypatch):
    """`--before .` from the repository root when the tree has no .venv: this python."""
    import argparse
    import sys

    from benchmarks import common

    monkeypatch.setattr(common, "ROOT", tmp_path)      # a tree without .venv/bin/python
    monkeypatch.chdir(tmp_path)
    ap = argparse.ArgumentParser()
    common.two_tree_args(ap)
    assert common.before_tree(ap, ap.parse_args(["--before", "."])) == (tmp_path, sys.executable)
