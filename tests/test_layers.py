"""The import rule (docs/design/how-it-works.md): three layers, imports in one direction.

  orchestrator.core    pure description and planning: imports neither ray, nor
                       stages, nor orchestrator.driver (not even inside a function)
  stages               the actor runtime: may import orchestrator.core, never the driver
  orchestrator.driver  the driver runtime: may import both
  meshpipe             the public API, a facade above the three: re-exports what users write
                       against and wraps the driver's run/plan; no layer below imports it

The check reads every module's imports from its source (module level and inside
functions), so a lazy import cannot hide an upward edge.
"""
from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# layer of a module prefix, and what each layer may not import
LAYERS = {"orchestrator.core": 1, "stages": 2, "orchestrator.driver": 3, "meshpipe": 4}
FORBIDDEN = {1: ("ray", "stages", "orchestrator.driver", "meshpipe"), 2: ("orchestrator.driver", "meshpipe"),
             3: ("meshpipe",), 4: ("ray",)}


def layer_of(module: str) -> int | None:
    best = None
    for prefix, layer in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            best = layer
    return best


def imported_names(source: str, module: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `source` (relative ones resolved)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")[: -node.level]
                base = ".".join(parent + ([base] if base else []))
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names if a.name != "*"]
    return out


def violations(module: str, source: str) -> list[str]:
    """The forbidden imports of `module` (empty when it keeps the rule)."""
    layer = layer_of(module)
    if layer is None:
        return []
    bad = []
    for line, name in imported_names(source, module):
        for f in FORBIDDEN[layer]:
            if name == f or name.startswith(f + "."):
                bad.append(f"{module}:{line} imports {name} (layer {layer} may not import {f})")
                break
    return sorted(set(bad))


def package_modules():
    for top in ("orchestrator", "stages", "meshpipe"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join(parts), path


def test_every_module_belongs_to_a_layer():
    loose = [m for m, _ in package_modules() if layer_of(m) is None and m != "orchestrator"]
    assert loose == [], f"modules outside orchestrator.core / stages / orchestrator.driver: {loose}"


def test_imports_point_one_way():
    bad = [v for m, p in package_modules() for v in violations(m, p.read_text())]
    assert bad == [], "\n".join(bad)


@pytest.mark.parametrize("module, source", [
    ("orchestrator.core.plan", "def f():\n    from orchestrator.driver import placement\n"),
    ("orchestrator.core.config.check", "from ...driver.runner import run_job\n"),
    ("orchestrator.core.edges", "import stages.worker\n"),
    ("orchestrator.core.schedule.ir", "import ray\n"),
    ("stages.worker", "from orchestrator.driver.telemetry import Progress\n"),
    ("stages.program", "from orchestrator import driver\n"),
    ("orchestrator.driver.cli", "from meshpipe import run\n"),
    ("stages.worker", "import meshpipe\n"),
    ("orchestrator.core.model.adapters", "def f():\n    from meshpipe._api import describe\n"),
    ("meshpipe._api", "import ray\n"),
])
def test_the_check_catches_an_upward_import(module, source):
    assert violations(module, source), f"{source!r} in {module} should break the rule"


@pytest.mark.parametrize("module, source", [
    ("stages.worker", "from orchestrator.core.schedule import Action\nimport ray\n"),
    ("orchestrator.driver.runner", "import stages.worker\nimport ray\n"),
    ("meshpipe._api", "from orchestrator.driver.runner import run_job\nimport stages.hooks\n"),
])
def test_the_check_allows_downward_imports(module, source):
    assert violations(module, source) == []


def test_pure_packages_import_neither_ray_nor_jax():
    code = ("import sys, json\n"
            "import orchestrator.core.config, orchestrator.core.schedule, orchestrator.core.reshard, "
            "orchestrator.core.plan, orchestrator.core.edges, orchestrator.core.model.registry, "
            "orchestrator.core.hosts\n"
            "print(json.dumps(sorted(m for m in ('ray', 'jax', 'jaxlib', 'optax', 'stages') if m in sys.modules)))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == []


# -- no test switches in the product ------------------------------------------------------------
# Tests inject faults through the worker hook interface (`stages.hooks`, `tests/faults.py`);
# an environment switch read by product code (the old MESHPIPE_TEST_FAIL_*) must not come back.
TEST_SWITCH = re.compile(r"MESHPIPE_TEST_\w*")


def switches_in(source: str) -> list[str]:
    return sorted(set(TEST_SWITCH.findall(source)))


def test_product_code_reads_no_test_switches():
    bad = [f"{p.relative_to(ROOT)}: {name}" for _, p in package_modules() for name in switches_in(p.read_text())]
    assert bad == [], "test-only switches in product code (use a stages.hooks.WorkerHook in tests/):\n" + "\n".join(bad)


@pytest.mark.parametrize("source, found", [
    ('target = os.environ.get("MESHPIPE_TEST_FAIL_STEP", "")\n', ["MESHPIPE_TEST_FAIL_STEP"]),
    ('if os.getenv("MESHPIPE_TEST_SLOW"):\n    pass\n', ["MESHPIPE_TEST_SLOW"]),
    ('for hook in cfg.hooks:\n    hook.on_step(cfg, step)\n', []),
])
def test_the_switch_check_catches_an_env_read(source, found):
    assert switches_in(source) == found
