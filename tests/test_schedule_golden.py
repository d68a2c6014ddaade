"""Golden files pin every generator's compute grid and lowered program.

A change to a generator or a lowering pass shows up as a readable diff of
tests/golden/schedules/*.txt: the compute grid (rows = stages, columns = time
steps) and the lowered lists (one line per slot, one column per stage).

Regenerate after an intended change, then review the diff:

    MESHPIPE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_schedule_golden.py
"""
import os
from fractions import Fraction
from pathlib import Path

import pytest

from orchestrator.core.schedule import generate, lower, render_grid, simulate

GOLDEN = Path(__file__).parent / "golden" / "schedules"
UPDATE = os.environ.get("MESHPIPE_UPDATE_GOLDEN") == "1"

CASES = [
    ("gpipe", 2, 3, 1), ("gpipe", 4, 4, 1),
    ("1f1b", 4, 8, 1), ("1f1b", 4, 2, 1), ("1f1b", 1, 3, 1),
    ("eager-1f1b", 4, 8, 1), ("eager-1f1b", 3, 2, 1),
    ("interleaved-1f1b", 2, 4, 2), ("interleaved-1f1b", 4, 8, 2), ("interleaved-1f1b", 1, 2, 3),
    ("zb-h1", 4, 8, 1), ("zb-h1", 2, 3, 1),
]


def path_for(name, p, m, v):
    return GOLDEN / f"{name}_p{p}_m{m}_v{v}.txt"


def golden_text(name, p, m, v):
    sched = generate(name, p, m, v)
    low = lower(sched)
    costs = ({"F": Fraction(1), "I": Fraction(1, 2), "W": Fraction(1, 2)} if name == "zb-h1"
             else {"F": Fraction(1, v), "B": Fraction(1, v)})
    sim = simulate(low, costs)
    return "\n".join([
        f"# golden schedule: {name} p={p} m={m} v={v}",
        "# regenerate: MESHPIPE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest "
        "tests/test_schedule_golden.py",
        f"# unit costs ({'F=1, I=W=1/2' if name == 'zb-h1' else f'F=B=1/{v}'}, no transfer): "
        f"step_time={sim.step_time} bubble={sim.bubble_fraction} peak_inflight={sim.peak_inflight}",
        "",
        "## compute grid",
        render_grid(sched, width=None),
        "",
        "## lowered (one line per slot)",
        render_grid(low, transpose=True),
        "",
    ])


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_golden(name, p, m, v):
    path = path_for(name, p, m, v)
    text = golden_text(name, p, m, v)
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} missing; run with MESHPIPE_UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text(), (
        f"{name} p={p} m={m} v={v} differs from {path}; if intended, regenerate with "
        f"MESHPIPE_UPDATE_GOLDEN=1 and review the diff")


def test_no_stale_golden_files():
    expected = {path_for(*case).name for case in CASES}
    if UPDATE:
        for stale in set(p.name for p in GOLDEN.glob("*.txt")) - expected:
            (GOLDEN / stale).unlink()
    assert {p.name for p in GOLDEN.glob("*.txt")} == expected
