"""A schedule as a text grid: steps × stages, for terminals, golden files and error messages
(`Schedule.__str__`, the validator's faulty cell). Imports nothing of the IR: it reads the
schedule through its own methods (`grid`, `num_slots`), so the IR can print itself.
"""
from __future__ import annotations

from typing import Iterable


def render_grid(schedule, mark: Iterable[tuple[int, int]] | None = None, *,
                transpose: bool = False, width: int | None = 160) -> str:
    """Text grid: rows are stages, columns slots ('.' idle); marked cells in brackets.

    Args:
      schedule: any schedule.
      mark: (stage, slot) cells to bracket.
      transpose: rows are slots and columns stages instead (long schedules, diffs).
      width: wrap the columns into blocks at most this wide (None: never).

    Example:
      >>> from orchestrator.core.schedule import generate
      >>> print(render_grid(generate("1f1b", 2, 2), mark=[(1, 2)]))
      1f1b p=2 m=2 v=1 compute-only, 6 slots, [x] marks the faulty cell
      slot    0    1      2    3    4    5
      s0    0F0  0F1      .  0B0    .  0B1
      s1      .  1F0  [1B0]  1F1  1B1    .
    """
    marked = set(mark or ())
    grid = schedule.grid()
    cells = [[f"[{c}]" if (s, t) in marked else c for t, c in enumerate(row)]
             for s, row in enumerate(grid)]
    n = schedule.num_slots
    kind = "lowered" if schedule.lowered else "compute-only"
    head = f"{schedule.name} p={schedule.p} m={schedule.m} v={schedule.v} {kind}, {n} slots"
    if marked:
        head += ", [x] marks the faulty cell"
    if transpose:
        table = [["slot"] + [f"s{s}" for s in range(schedule.p)]]
        table += [[str(t)] + [cells[s][t] for s in range(schedule.p)] for t in range(n)]
        return "\n".join([head] + _align(table, left=True))
    labels = ["slot"] + [f"s{s}" for s in range(schedule.p)]
    columns = [[str(t)] + [cells[s][t] for s in range(schedule.p)] for t in range(n)]
    blocks, current, used = [], [], len(max(labels, key=len))
    for col in columns:
        w = max(map(len, col)) + 2
        if current and width is not None and used + w > width:
            blocks.append(current)
            current, used = [], len(max(labels, key=len))
        current.append(col)
        used += w
    blocks.append(current)
    lines = [head]
    for block in blocks:
        table = [[labels[r]] + [col[r] for col in block] for r in range(len(labels))]
        lines += _align(table, left=False)
    return "\n".join(lines)


def _align(table: list[list[str]], left: bool) -> list[str]:
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    out = []
    for row in table:
        first = row[0].ljust(widths[0])
        rest = [c.ljust(w) if left else c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        out.append("  ".join([first] + rest).rstrip())
    return out
