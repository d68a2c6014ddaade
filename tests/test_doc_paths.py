"""Docs cite only what the repository has: every file path named in a docstring, comment,
the README or docs/ exists (pure; reads sources, imports nothing of the product).

Checked: backticked paths with a directory part (`stages/worker.py`,
`orchestrator/core/schedule/`; an upper-case first part is a placeholder for the
user's directory), and every `*.md` file named anywhere (a design note
outside the repository is not something a reader can open).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

BACKTICKED = re.compile(r"`([A-Za-z0-9_.\-]+(?:/[A-Za-z0-9_.\-]+)*/(?:[A-Za-z0-9_.\-]+\.[a-z]{1,5})?)`")
MARKDOWN = re.compile(r"(?<![\w/.\-])([A-Za-z0-9_\-]+(?:/[A-Za-z0-9_.\-]+)*\.md)\b")


def sources() -> list[Path]:
    files = [p for top in ("orchestrator", "stages", "benchmarks", "tests", "examples")
             for p in sorted((ROOT / top).rglob("*.py"))]
    return files + [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def missing_paths(text: str) -> list[str]:
    """Paths `text` names that do not exist under the repository root."""
    out = []
    for m in BACKTICKED.finditer(text):
        path = m.group(1)
        first = path.split("/")[0]
        if "." in first and not path.startswith("."):
            continue                       # a host or label (`ray.io/tpu-worker-id`), not a file
        if first.isupper():
            continue                       # a placeholder (`OUT/tokenizer.json`: the user's directory)
        if not (ROOT / path).exists():
            out.append(path)
    for m in MARKDOWN.finditer(text):
        name = m.group(1)
        found = (ROOT / name).exists() if "/" in name else any(ROOT.glob(f"**/{name}"))
        if not found:
            out.append(name)
    return sorted(set(out))


def test_every_cited_path_exists():
    bad = [f"{p.relative_to(ROOT)}: {name}" for p in sources() if p.name != Path(__file__).name
           for name in missing_paths(p.read_text())]
    assert bad == [], "cited but not in the repository:\n" + "\n".join(bad)


@pytest.mark.parametrize("text, expected", [
    ("see `orchestrator/redact.py`", ["orchestrator/redact.py"]),          # moved to orchestrator/core/
    ("(see ARCHITECTURE.md, the VJP note)", ["ARCHITECTURE.md"]),
    ("the plan (`orchestrator/core/reshard/`)", []),
    ("`stages/worker.py` and README.md", []),
    ("label `ray.io/tpu-worker-id`", []),
    ("saved as `OUT/tokenizer.json`", []),
])
def test_the_check_catches_a_missing_path(text, expected):
    assert missing_paths(text) == expected
