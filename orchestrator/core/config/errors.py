"""ConfigError and the helpers that phrase problems as `key.path = value: rule`.

Every configuration problem is one line naming the key path (as the user
writes it: `pipeline.stages[1].mesh.model`), the offending value and the rule
it breaks. A `ConfigError` carries all problems found in one pass, one per line.

Secrets never reach a message: `problem` redacts the value of a key that looks
secret (`env_vars.HF_TOKEN`, `model.args.api_key`) and secret-looking values
anywhere, and `ConfigError` scrubs every line once more (`orchestrator.core.redact`).
"""
from __future__ import annotations

import difflib
from typing import Any, Iterable, Sequence

from orchestrator.core.redact import redact, redact_text

__all__ = ["ConfigError", "Problem", "fmt_path", "fmt_value", "problem", "problem_nv", "suggest"]

_MISSING = object()


class ConfigError(ValueError):
    """An invalid job or cluster configuration.

    Attributes:
      problems: one line per problem, each `key.path = value: rule`.
      source: the file (or "<dict>") the configuration came from, if known.
    """

    def __init__(self, problems: str | Sequence[str], source: str | None = None):
        lines = (problems,) if isinstance(problems, str) else tuple(problems)
        self.problems: tuple[str, ...] = tuple(redact_text(p) for p in lines)
        self.source = redact_text(source) if source else source
        super().__init__(self._format())

    def _format(self) -> str:
        head = f"{self.source}: " if self.source else ""
        if len(self.problems) == 1:
            return head + self.problems[0]
        lines = "\n".join(f"  - {p}" for p in self.problems)
        return f"{head}{len(self.problems)} configuration problems:\n{lines}"


class Problem(ValueError):
    """Raised inside validators: a rule broken at `sub` (a path below the field)."""

    def __init__(self, rule: str, sub: Sequence[str | int] = (), value: Any = _MISSING):
        super().__init__(rule)
        self.rule, self.sub, self.value = rule, tuple(sub), value

    @property
    def has_value(self) -> bool:
        return self.value is not _MISSING


def fmt_path(loc: Iterable[str | int]) -> str:
    """`('pipeline', 'stages', 1, 'mesh')` → `pipeline.stages[1].mesh`."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "<top level>"


def fmt_value(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def problem(loc: Iterable[str | int] | str, value: Any, rule: str) -> str:
    """One problem line: `key.path = value: rule` (see `problem_nv` for lines without a value).

    Example:
        >>> problem(("pipeline", "stages", 1, "mesh", "model"), 0, "must be >= 1")
        'pipeline.stages[1].mesh.model = 0: must be >= 1'
    """
    path = loc if isinstance(loc, str) else fmt_path(loc)
    if value is _MISSING:
        return f"{path}: {rule}"
    return f"{path} = {fmt_value(redact(value, _last_key(loc)))}: {rule}"


def _last_key(loc: Iterable[str | int] | str) -> str | None:
    """The last named key of a location (`env_vars.HF_TOKEN` → `HF_TOKEN`)."""
    parts = loc.replace("[", ".").split(".") if isinstance(loc, str) else [str(p) for p in loc]
    names = [p for p in parts if p and not p.rstrip("]").isdigit()]
    return names[-1] if names else None


def problem_nv(loc: Iterable[str | int] | str, rule: str) -> str:
    """One problem line without a value: `key.path: rule` (missing or unknown keys)."""
    return problem(loc, _MISSING, rule)


def suggest(word: Any, choices: Iterable[str], prefix: str = "; ") -> str:
    """`"; did you mean 'x'?"` for the closest choice, or "" when nothing is close."""
    close = difflib.get_close_matches(str(word), sorted(set(choices)), n=1, cutoff=0.6)
    return f"{prefix}did you mean {close[0]!r}?" if close else ""
