"""The safe YAML loader: safe_load semantics, no code execution, limits, duplicate keys.

Plus property tests: JSON-like documents round-trip, and any contiguous cut of
a model's layers into stages passes `check_job` while a shifted cut fails.
"""
from __future__ import annotations

import re

import pytest
import yaml
from hypothesis import given, settings, strategies as st

from orchestrator.core.config import ConfigError, check_job, load_job, parse_cluster, parse_job
from orchestrator.core.config.overrides import parse_key_path
from orchestrator.core.safe_yaml import YamlError, safe_load_file, safe_load_text, safe_load_value


def err(text: str, **kw) -> str:
    with pytest.raises(YamlError) as ei:
        safe_load_text(text, **kw)
    assert isinstance(ei.value, ValueError) and "\n" not in str(ei.value)
    return str(ei.value)


@pytest.mark.parametrize("tag", [
    "!!python/object/apply:os.system ['touch {s}']",
    "!!python/object/new:os.system ['touch {s}']",
    "!!python/object/apply:subprocess.check_call [['touch', '{s}']]",
    "!!python/name:os.system",
    "!!python/module:os",
])
def test_python_tags_rejected_and_never_run(tmp_path, tag):
    sentinel = tmp_path / "SENTINEL"
    text = f"run:\n  name: {tag.format(s=sentinel)}\n"
    msg = err(text, source="job.yaml")
    assert "job.yaml:2:" in msg and "run.name" in msg and "not allowed" in msg and "python/" in msg
    p = tmp_path / "job.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as ei:
        load_job(p)
    assert "not allowed" in str(ei.value)
    assert not sentinel.exists()


def test_unknown_tags_rejected():
    assert "'!include'" in err("a: !include other.yaml")
    assert "not allowed" in err("a: !!foo 3")


def test_safe_values_and_exponent_floats():
    doc = safe_load_text("i: 3\nf: 1.5\ne: 3e-3\nE: 1E5\nneg: -2.5e+2\ns: e5\nb: true\nn: null\n"
                         "l: [0, 2]\nm: {a: 1}\nq: '3'\n")
    assert doc == {"i": 3, "f": 1.5, "e": 0.003, "E": 100000.0, "neg": -250.0, "s": "e5", "b": True,
                   "n": None, "l": [0, 2], "m": {"a": 1}, "q": "3"}
    assert safe_load_value("3") == 3 and safe_load_value("") is None and safe_load_value("[0,2]") == [0, 2]
    assert yaml.safe_load("e: 3e-3")["e"] == "3e-3"  # what plain PyYAML does (why we add the resolver)


def test_merge_keys_still_work():
    assert safe_load_text("b: &b {x: 1, y: 2}\nd: {<<: *b, x: 3}")["d"] == {"x": 3, "y": 2}


def test_duplicate_keys_rejected_anywhere():
    msg = err("run: {name: a}\nrun: {name: b}\n")
    assert "duplicate key 'run'" in msg and "first at line 1" in msg
    msg = err("pipeline:\n  stages:\n    - mesh: {data: 2, data: 4}\n")
    assert "pipeline.stages[0].mesh.data" in msg and "duplicate key 'data'" in msg


def test_top_level_must_be_mapping():
    assert "must be a mapping" in err("- 1\n- 2\n") and "a list" in err("[1]")
    assert "empty document" in err("")
    assert "a str" in err("just text")


def test_size_limit(tmp_path):
    assert "max_bytes" in err("a: " + "x" * 100, max_bytes=50)
    p = tmp_path / "big.yaml"
    p.write_text("a: " + "x" * 1_000_001)
    with pytest.raises(YamlError) as ei:
        safe_load_file(p)
    assert "over the limit of 1000000 bytes" in str(ei.value)
    with pytest.raises(ConfigError):
        load_job(p)


def test_alias_bomb_rejected():
    lines = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    msg = err("\n".join(lines))
    assert "alias bomb" in msg and "max_nodes" in msg
    many = "a: &a 1\nb: [" + ", ".join(["*a"] * 101) + "]"
    assert "max_aliases=100" in err(many)
    assert safe_load_text("a: &a 1\nb: [" + ", ".join(["*a"] * 100) + "]")["b"][-1] == 1


def test_recursive_alias_rejected():
    assert "recursive alias" in err("a: &a [1, *a]")


def test_depth_limit():
    assert "max_depth=50" in err("a: " + "[" * 60 + "]" * 60)
    assert "max_depth=5" in err("a: {b: {c: {d: {e: {f: 1}}}}}", max_depth=5)
    deep = "x: &x " + "[" * 30 + "]" * 30 + "\ny: " + "[" * 30 + "*x" + "]" * 30
    assert "once aliases are expanded" in err(deep)


def test_malformed_yaml_reports_location():
    msg = err("a: [1, 2\n", source="f.yaml")
    assert msg.startswith("f.yaml:") and "invalid YAML" in msg
    assert "invalid YAML value" in err("a: " + "1" * 5000)  # int with too many digits


def test_missing_file():
    with pytest.raises(YamlError, match="file not found"):
        safe_load_file("/nonexistent/job.yaml")


def test_parse_rejects_non_mapping():
    with pytest.raises(ConfigError, match="must be a mapping"):
        parse_job(["not", "a", "mapping"])  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- properties

# Strings such as "1e5" are excluded: PyYAML's dumper writes them unquoted and the safe
# loader (like YAML 1.2) reads them back as floats; see orchestrator/core/safe_yaml.py.
_CHARS = st.characters(exclude_categories=("Cc", "Cs", "Zl", "Zp"))  # PyYAML's dumper mangles these
_EXP_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")


def _text(n: int):
    return st.text(_CHARS, max_size=n).filter(lambda s: not _EXP_FLOAT.match(s))


json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-10**9, 10**9)
    | st.floats(allow_nan=False, allow_infinity=False, width=32)
    | _text(8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(_text(6), kids, max_size=4),
    max_leaves=12)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(_text(6), json_like, max_size=4))
def test_roundtrip_plain_documents(doc):
    text = yaml.safe_dump(doc, allow_unicode=True)
    assert safe_load_text(text) == yaml.safe_load(text) == doc


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(["run", "pipeline", "mesh", "a_b"]) | st.integers(0, 9), min_size=1,
                max_size=5).filter(lambda t: isinstance(t[0], str)))
def test_key_path_forms_agree(tokens):
    dotted = ".".join(str(t) for t in tokens)
    bracketed = "".join(f"[{t}]" if isinstance(t, int) else f".{t}" for t in tokens).lstrip(".")
    assert parse_key_path(dotted) == parse_key_path(bracketed) == tokens


def _mlp_job(blocks: int, cuts: list[int]) -> dict:
    bounds = [0, *cuts, blocks + 2]
    return {"run": {"name": "p", "steps": 1}, "model": {"name": "mlp", "args": {"blocks": blocks}},
            "data": {"global_batch": 4}, "optimizer": {"name": "sgd", "args": {"learning_rate": 0.1}},
            "pipeline": {"schedule": "gpipe", "microbatches": 2,
                         "stages": [{"layers": [a, b], "mesh": {"data": 1}} for a, b in zip(bounds, bounds[1:])]}}


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 5).flatmap(lambda b: st.tuples(
    st.just(b), st.lists(st.integers(1, b + 1), max_size=3, unique=True).map(sorted))))
def test_any_contiguous_cut_passes_and_a_shifted_one_fails(case):
    blocks, cuts = case
    cluster = parse_cluster({"hosts": 4, "devices_per_host": 1, "num_cpus": 4})
    checked = check_job(parse_job(_mlp_job(blocks, cuts)), cluster)
    assert [i for s in checked.stages for i in s.layer_indices()] == list(range(blocks + 2))
    bad = _mlp_job(blocks, cuts)
    bad["pipeline"]["stages"][-1]["layers"][1] += 1  # one past the last layer
    with pytest.raises(ConfigError, match="past the model's last layer"):
        check_job(parse_job(bad), cluster)
    if len(bad["pipeline"]["stages"]) > 1:
        bad = _mlp_job(blocks, cuts)
        bad["pipeline"]["stages"][1]["layers"][0] -= 1  # overlaps stage 0 by one layer
        with pytest.raises(ConfigError, match="overlap"):
            check_job(parse_job(bad), cluster)

