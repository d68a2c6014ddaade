"""Pictures: text grid, Chrome trace, PNG; and the layer's import hygiene."""
import json
import subprocess
import sys

import pytest

from orchestrator.core.schedule import (
    generate, lower, render_grid, render_png, simulate, to_chrome_trace,
)


def test_grid_is_aligned_with_stages_as_rows():
    text = render_grid(generate("1f1b", 4, 8))
    lines = text.splitlines()
    assert lines[0] == "1f1b p=4 m=8 v=1 compute-only, 22 slots"
    assert [line.split()[0] for line in lines[1:]] == ["slot", "s0", "s1", "s2", "s3"]
    assert len({len(line) for line in lines[1:]}) == 1          # right-aligned columns
    assert lines[2].split()[1:] == [str(a) if a else "." for a in generate("1f1b", 4, 8).actions[0]]

def test_grid_wraps_into_blocks_but_keeps_every_cell():
    low = lower(generate("1f1b", 4, 8))
    text = render_grid(low, width=100)
    assert all(len(line) <= 100 for line in text.splitlines())
    assert sum(line.startswith("slot") for line in text.splitlines()) > 1
    for _, _, a in low.cells():
        assert str(a) in text
    assert len(render_grid(low, width=None).splitlines()) == 1 + 1 + low.p


def test_transposed_grid_has_one_line_per_slot():
    low = lower(generate("zb-h1", 3, 4))
    lines = render_grid(low, transpose=True).splitlines()
    assert lines[1].split() == ["slot", "s0", "s1", "s2"]
    assert len(lines) == 2 + low.num_slots
    assert lines[-1].split() == [str(low.num_slots - 1), "0OPT", "1OPT", "2OPT"]


def test_marked_cell_is_bracketed():
    assert "[1B0]" in render_grid(generate("1f1b", 2, 2), mark=[(1, 2)])


@pytest.mark.parametrize("name, p, m, v", [("1f1b", 4, 8, 1), ("interleaved-1f1b", 2, 4, 2)])
def test_chrome_trace(name, p, m, v):
    low = lower(generate(name, p, m, v))
    sim = simulate(low, {"F": 1.0, "B": 2.0}, transfer=0.1)
    trace = json.loads(json.dumps(to_chrome_trace(sim, low)))
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(sim.spans)
    assert {e["pid"] for e in xs} == set(range(p))
    names = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {(s, f"stage {s}") for s in range(p)}
    first_f = next(e for e in xs if e["args"]["action"] == "0F0")
    assert (first_f["ts"], first_f["dur"], first_f["tid"]) == (0.0, 1e6, 0)
    assert max(e["ts"] + e["dur"] for e in xs) == pytest.approx(sim.step_time * 1e6)
    assert all(e["tid"] == 1 for e in xs if "SEND" in e["name"] or "RECV" in e["name"])


@pytest.mark.parametrize("name, p, m, v, costs", [
    ("1f1b", 4, 8, 1, {"F": 1, "B": 2}),
    ("interleaved-1f1b", 2, 4, 2, {"F": 0.5, "B": 1}),
    ("zb-h1", 3, 6, 1, {"F": 1, "I": 1, "W": 1}),
])
def test_png(tmp_path, name, p, m, v, costs):
    low = lower(generate(name, p, m, v))
    out = tmp_path / f"{name}.png"
    render_png(simulate(low, costs, 0.1), low, str(out), title="my run")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pure_layer_imports_neither_ray_nor_jax_nor_matplotlib():
    code = ("import sys, orchestrator.core.schedule as s; "
            "s.simulate(s.lower(s.generate('1f1b', 2, 2)), {'F': 1, 'B': 1}); "
            "bad = [m for m in ('ray', 'jax', 'matplotlib') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
