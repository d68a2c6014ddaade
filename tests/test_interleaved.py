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


def test_this_tree_against_itself_needs_no_python_named(monkeypatch):
    """`--before .` from the repository root: this python, whatever venv it lives in."""
    import argparse
    import sys

    from benchmarks.common import ROOT, before_tree, two_tree_args

    ap = argparse.ArgumentParser()
    two_tree_args(ap)
    monkeypatch.chdir(ROOT)
    tree, python = before_tree(ap, ap.parse_args(["--before", "."]))
    assert tree == ROOT
    assert python in (sys.executable, str(ROOT / ".venv/bin/python"))
