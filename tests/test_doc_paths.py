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


def generated_docs() -> set[Path]:
    """The pages the docs site generates at build time (docs/hooks/generate.py): they exist in the
    site, not on disk — the job and cluster references and one page per benchmark run."""
    import sys

    sys.path.insert(0, str(ROOT / "docs" / "hooks"))
    try:
        import benchmark_pages
    finally:
        sys.path.remove(str(ROOT / "docs" / "hooks"))
    names = ["reference/job.md", "reference/cluster.md", *benchmark_pages.pages()]
    return {(ROOT / "docs" / n).resolve() for n in names}


def missing_paths(text: str, base: Path | None = None, generated: frozenset = frozenset()) -> list[str]:
    """Paths `text` names that do not exist under the repository root. In a docs page (`base`: its
    directory) a `*.md` name may also be a link relative to the page, to a page on disk or to one the
    site generates (`generated`); mkdocs build --strict checks those links and their anchors."""
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
        if not found and base is not None:
            target = (base / name).resolve()
            found = target.exists() or target in generated
        if not found:
            out.append(name)
    return sorted(set(out))


def page_dir(path: Path) -> Path:
    """The directory a docs file's relative links start from: its own, or for a benchmark reading
    (`docs/benchmarks/notes/`, embedded into the run's generated page) the Benchmarks section's."""
    notes = ROOT / "docs" / "benchmarks" / "notes"
    return notes.parent if path.parent == notes else path.parent


def test_every_cited_path_exists():
    docs, generated = ROOT / "docs", frozenset(generated_docs())
    bad = [f"{p.relative_to(ROOT)}: {name}" for p in sources() if p.name != Path(__file__).name
           for name in missing_paths(p.read_text(), page_dir(p) if docs in p.parents else None, generated)]
    assert bad == [], "cited but not in the repository:\n" + "\n".join(bad)


@pytest.mark.parametrize("text, expected", [
    ("see `orchestrator/redact.py`", ["orchestrator/redact.py"]),          # moved to orchestrator/core/
    ("(see ARCHITECTURE.md, the VJP note)", ["ARCHITECTURE.md"]),
    ("the plan (`orchestrator/core/reshard/`)", []),
    ("`stages/worker.py` and README.md", []),
    ("[the guide](guides/no-such-page.md)", ["guides/no-such-page.md"]),
    ("label `ray.io/tpu-worker-id`", []),
    ("saved as `OUT/tokenizer.json`", []),
])
def test_the_check_catches_a_missing_path(text, expected):
    assert missing_paths(text) == expected


def test_a_docs_link_resolves_from_its_page_or_a_generated_page():
    design = ROOT / "docs" / "design"
    generated = frozenset({(ROOT / "docs" / "reference" / "job.md").resolve()})
    reference = ROOT / "docs" / "reference"
    assert missing_paths("[schedules](schedules.md) [the keys](reference/job.md)", design, generated) == [
        "reference/job.md"]                # not under docs/design/
    assert missing_paths("[keys](job.md) [api](api.md)", reference, generated) == []
    assert missing_paths("[keys](job.md)", reference) == ["job.md"]          # generated pages only when known
    assert missing_paths("[x](no-such-page.md)", design, generated) == ["no-such-page.md"]
