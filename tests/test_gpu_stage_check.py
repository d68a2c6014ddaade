"""benchmarks/gpu_stage_check.py runs where there is no ray, and its CPU figures hold.

The script is meant for a GPU machine with jax but no ray: here it runs as a file in a fresh
interpreter in which `import ray` fails, on a tiny GPT stage, float32 only. On XLA:CPU the
bytes in use are those of `jax.live_arrays()`, so each program's retained bytes must equal
the prediction from its outputs' shapes exactly, and so must what I leaves for W once the
residuals are dropped (ZB-H1's stash); the gradients of B, I+W, F+B and plain
`jax.value_and_grad` must agree within the script's own tolerance.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--d-model", "16", "--heads", "2", "--d-mlp", "32", "--vocab", "32", "--layers", "1", "--seq", "8",
        "--mbs", "2", "--reps", "1", "--warmup", "1", "--dtypes", "float32"]


NO_RAY = "import sys; sys.modules['ray'] = None; "       # any `import ray` now raises ImportError


def _python(code: str, timeout: float):
    return subprocess.run([sys.executable, "-c", NO_RAY + code], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})


@pytest.mark.jax_min_0_10
def test_the_stage_builds_without_ray():
    """Everything up to compiling (the imports inside functions too): the spec, the stage program, its
    forward traced and its backward cut into I and W, the sizes of what each keeps."""
    run = _python("import runpy; g = runpy.run_path('benchmarks/gpu_stage_check.py'); "
                  "st = g['Stage'](g['parse_args'](" + repr(TINY) + ").dims, 'last', 'bfloat16'); "
                  "st.jitted(); print(st.kept['F'] > st.kept['I'] > 0, sys.modules.get('ray'))", 60)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.split() == ["True", "None"]


@pytest.mark.slow
def test_runs_without_ray_and_the_cpu_memory_is_the_predicted(tmp_path):
    out = tmp_path / "check.json"
    run = _python(f"import runpy; sys.argv = ['gpu_stage_check'] + {TINY + ['--out', str(out)]!r}; "
                  "runpy.run_path('benchmarks/gpu_stage_check.py', run_name='__main__')", 120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    got = json.loads(out.read_text())
    assert got["ray_imported"] is False and got["backend"] == "cpu" and got["smoke_test"] is True
    r = got["results"]["float32"]
    assert set(r["time_s"]) == {"F", "B", "I", "W", "FB", "ref"}
    assert r["ratios"]["IW_over_B"] > 0 and r["ratios"]["FB_over_F_plus_B"] > 0
    assert r["numerics"]["ok"], r["numerics"]
    for name, m in r["memory"].items():
        assert m["source"] == "live_arrays" and m["peak_after"] is None
        assert m["retained"] == m["predicted_retained"], (name, m)
        assert m["xla"]["peak_estimate"] > 0
    i = r["memory"]["I"]
    assert i["held_after_release"] == i["predicted_held"] == r["predicted_bytes"]["I"] + r["predicted_bytes"]["dx"]
    assert r["predicted_bytes"]["I"] < r["predicted_bytes"]["F"]      # I released residuals only it read
