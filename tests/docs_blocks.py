"""The fenced code blocks of a markdown page, with the snippet marker above each (for the docs tests).

A block preceded by `<!-- snippet: NAME -->` is a named example; `<!-- snippet: NAME, verbatim
from PATH -->` also says the block is PATH's text, character for character.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"(?:<!-- snippet: (\w+)(?:, verbatim from (\S+))? -->\n)?^```(\w+)\n(.*?)^```", re.S | re.M)


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    code: str
    name: str | None = None
    verbatim_from: str | None = None

    def __str__(self) -> str:
        return f"{self.page}:{self.line} ({self.lang}{', ' + self.name if self.name else ''})"


def blocks(page: str, lang: str | None = None) -> list[Block]:
    """Every fenced block of `page` (a path under the repository root), in order; `lang`: only those."""
    text = (ROOT / page).read_text()
    out = [Block(page, text.count("\n", 0, m.start(3)) + 1, m.group(3), m.group(4), m.group(1), m.group(2))
           for m in FENCE.finditer(text)]
    return [b for b in out if lang is None or b.lang == lang]
