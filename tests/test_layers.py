"""The import rule (docs/design/how-it-works.md): three layers, imports in one direction.

  orchestrator.core    pure description and planning: imports neither ray, nor
                       stages, nor orchestrator.driver (not even inside a function)
  stages               the actor runtime: may import orchestrator.core, never the driver
  orchestrator.driver  the driver runtime: may import both
  meshpipe             the public API, a facade above the three: re-exports what users write
                       against and wraps the driver's run/plan; no layer below imports it

Inside the pure layer, the config checks do not import the planner (the planner builds on the
config, not the other way). Around the product: `benchmarks` may import the product and nothing
of `tests`; `tests` may import both; the product imports neither.

The check reads every module's imports from its source (module level and inside
functions), so a lazy import cannot hide an upward edge; and every string constant that is a
module path (`"stages.models.gpt_impl:model"`, what `importlib` would be given) counts as an
import too. No two modules import each other, directly or around a longer cycle.
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
FORBIDDEN = {1: ("ray", "stages", "orchestrator.driver", "meshpipe", "benchmarks", "tests"),
             2: ("orchestrator.driver", "meshpipe", "benchmarks", "tests"), 3: ("meshpipe", "benchmarks", "tests"),
             4: ("ray", "benchmarks", "tests")}
# finer rules: (module prefix, what it may not import)
WITHIN = (("orchestrator.core.config", "orchestrator.core.planner"),     # the planner builds on the config
          ("benchmarks", "tests"))                                        # tests use benchmarks, not back
# a string constant that is a module path (optionally `:attribute`), as importlib is given it
MODULE_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+(:[A-Za-z_]\w*)?$|^[A-Za-z_]\w*:[A-Za-z_]\w*$")


def layer_of(module: str) -> int | None:
    best = None
    for prefix, layer in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            best = layer
    return best


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


PROJECT = ("orchestrator", "stages", "meshpipe", "benchmarks", "tests")


def module_path(text: str) -> bool:
    """Whether a string constant is a module path as importlib is given it: `pkg.mod:attr`, or a
    dotted name that names one of the project's modules (`"meshpipe.tokens"`, a format's name, and
    `"meshpipe.json"`, a file's, are words), or a dotted name outside the project (`"ray.util"`)."""
    if not MODULE_PATH.match(text):
        return False
    name, colon, _ = text.partition(":")
    if colon or name.split(".")[0] not in PROJECT:
        return True
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported_names(source: str, module: str, package: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `source` (relative ones resolved; `package`:
    `source` is the package's `__init__`), and of every string constant that is a module path."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and module_path(node.value):
            out.append((node.lineno, node.value.partition(":")[0]))
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".") + ([""] if package else [])
                parent = parts[: -node.level]
                base = ".".join(parent + ([base] if base else []))
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names if a.name != "*"]
    return out


def violations(module: str, source: str) -> list[str]:
    """The forbidden imports of `module` (empty when it keeps the rule)."""
    layer = layer_of(module)
    rules = [(f, f"layer {layer} may not import {f}") for f in FORBIDDEN.get(layer, ())]
    rules += [(f, f"{prefix} may not import {f}") for prefix, f in WITHIN if _under(module, prefix)]
    bad = []
    for line, name in imported_names(source, module):
        for f, why in rules:
            if _under(name, f):
                bad.append(f"{module}:{line} imports {name} ({why})")
                break
    return sorted(set(bad))


def package_modules(tops=("orchestrator", "stages", "meshpipe")):
    for top in tops:
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
    bad = [v for m, p in package_modules(("orchestrator", "stages", "meshpipe", "benchmarks")) for v in violations(m, p.read_text())]
    assert bad == [], "\n".join(bad)


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports (a name resolves to the longest module it names)."""
    graph = {}
    for module, path in modules.items():
        edges = set()
        for _, name in imported_names(path.read_text(), module, package=path.name == "__init__.py"):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                edges.add(name)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of `graph`: its strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []

    def visit(v: str) -> None:        # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_module_imports_one_that_imports_it_back():
    modules = dict(package_modules(("orchestrator", "stages", "meshpipe", "benchmarks", "tests")))
    found = cycles(import_graph(modules))
    assert found == [], "import cycles (each a group of modules that import each other):\n" + \
        "\n".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("module, source", [
    ("orchestrator.core.model.registry", 'BUILTIN = {"gpt": "stages.models.gpt_impl:model"}\n'),   # a string import
    ("orchestrator.core.plan", 'importlib.import_module("orchestrator.driver.runner")\n'),
    ("orchestrator.core.config.check", "from orchestrator.core.planner.search import search\n"),
    ("benchmarks.data_loader", "from tests.data_helpers import prepared\n"),
    ("stages.worker", "import tests.faults\n"),
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
    ("orchestrator.core.contract", 'KIND = "ray"\nDOC = "see stages.worker for how"\n'),   # words, not module paths
    ("orchestrator.core.data.shards", 'FORMAT = "meshpipe.tokens"\nINFO = "meshpipe.json"\n'),   # names, not modules
    ("orchestrator.core.planner.search", "from orchestrator.core.config.check import ZB_MIN_JAX\n"),
    ("tests.test_x", "from benchmarks.common import job_dict\n"),
    ("meshpipe._api", "from orchestrator.driver.runner import run_job\nimport stages.hooks\n"),
])
def test_the_check_allows_downward_imports(module, source):
    assert violations(module, source) == []


def test_the_cycle_check_finds_a_cycle_and_passes_a_chain(tmp_path):
    """Checked by breaking it once: two modules that import each other (one lazily, as
    `planner/interleave` and `planner/search` did), and a three-module ring, are found; a chain is not."""
    files = {"a": "from pkg import b\n", "b": "def f():\n    from pkg.a import x\n",
             "c": "import pkg.d\n", "d": "from . import e\n", "e": "import pkg.c\n", "f": "import pkg.a\n"}
    modules = {}
    for name, source in files.items():
        (tmp_path / f"{name}.py").write_text(source)
        modules[f"pkg.{name}"] = tmp_path / f"{name}.py"
    assert cycles(import_graph(modules)) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d", "pkg.e"]]
    del modules["pkg.b"], modules["pkg.e"]
    assert cycles(import_graph(modules)) == []


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


# -- short functions in the runtime and the driver ------------------------------------------------
# The actor runtime and the driver read top to bottom: no function (docstring included) longer than
# a screen. The pure layer's searches and adapters are tables of cases and are not held to it.
MAX_FUNCTION_LINES = 80


def long_functions(source: str, where: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """`where:line name (n lines)` of each function in `source` longer than `limit` lines."""
    return [f"{where}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > limit]


def test_runtime_and_driver_functions_fit_a_screen():
    bad = [f for m, p in package_modules(("orchestrator", "stages", "meshpipe")) if layer_of(m) in (2, 3, 4)
           for f in long_functions(p.read_text(), str(p.relative_to(ROOT)))]
    assert bad == [], f"functions over {MAX_FUNCTION_LINES} lines (split them):\n" + "\n".join(bad)


def test_the_length_check_finds_a_long_function():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"def f():\n{body}", "m.py") == [f"m.py:1 f ({MAX_FUNCTION_LINES + 1} lines)"]
    assert long_functions(f"def f():\n{body[:-len('    x79 = 79')-1]}", "m.py") == []
