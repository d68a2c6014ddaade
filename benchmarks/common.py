"""Shared pieces of the pipeline benchmark: sizes, machine facts, span statistics, simulation, tables.

Pure except `machine_info` (reads /proc and package versions) and
`run_child` (starts a Python subprocess with a deadline). No ray, no jax, no
torch at import time.

Sizes: one GPT (`orchestrator/core/model/gpt.py`) per size, cut into two stages of
equal block count (stage 0 = embed + first half of the blocks, stage 1 = the
rest + head); the microbatch size is fixed per size, so the global batch is
m × microbatch. `small` and `large` aim at ≈ 4 ms and ≈ 30 ms per forward
action on one core of this 2-core machine; `tiny` makes every action ≈ free,
so a step's time is almost all orchestration.
"""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from collections.abc import Iterable, Sequence

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
SCHEDULES = ("gpipe", "1f1b", "eager-1f1b", "zb-h1", "interleaved-1f1b")
COMPUTE_KINDS = ("F", "B", "I", "W", "OPT")
LEARNING_RATE = 1e-3


@dataclass(frozen=True)
class Size:
    """One benchmark model size: GPT arguments, sequence length and microbatch size."""

    name: str
    d_model: int
    d_mlp: int
    heads: int
    vocab: int
    blocks: int
    seq: int
    mbs: int          # sequences per microbatch

    def model_args(self) -> dict:
        return {"vocab": self.vocab, "d_model": self.d_model, "heads": self.heads,
                "d_mlp": self.d_mlp, "blocks": self.blocks}

    def cut(self) -> int:
        """First layer of stage 1: layers are embed, block0 … block{n-1}, head."""
        return 1 + self.blocks // 2

    def num_layers(self) -> int:
        return self.blocks + 2

    def describe(self) -> str:
        return (f"GPT d_model={self.d_model} d_mlp={self.d_mlp} heads={self.heads} vocab={self.vocab} "
                f"blocks={self.blocks} seq={self.seq}, microbatch {self.mbs} sequences")


SIZES = {
    "tiny": Size("tiny", d_model=16, d_mlp=32, heads=2, vocab=32, blocks=4, seq=8, mbs=2),
    "small": Size("small", d_model=128, d_mlp=512, heads=4, vocab=256, blocks=4, seq=64, mbs=4),
    "large": Size("large", d_model=256, d_mlp=1024, heads=4, vocab=256, blocks=4, seq=64, mbs=12),
}


# ----------------------------------------------------------------------------- statistics

def median(xs: Iterable[float]) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def spread(xs: Sequence[float]) -> float:
    """(p90 − p10) / median: how noisy a series was (0 = steady)."""
    xs = sorted(xs)
    if len(xs) < 3:
        return float("nan")
    q = statistics.quantiles(xs, n=10)
    return (q[-1] - q[0]) / statistics.median(xs)


def kind_of(action_text: str) -> str:
    """'1SEND_F3' -> 'SEND_F', '0OPT' -> 'OPT', '1F3c1' -> 'F'."""
    from orchestrator.core.schedule import Action

    return Action.parse(action_text).kind.value


def span_costs(steps_spans: list[list[tuple]], p: int, stat=None) -> list[dict[str, float]]:
    """Per stage, the median (or `stat`) duration (s) of each compute kind over all given steps' spans.

    `steps_spans`: for each measured step, its spans (stage, host, action, start, end).
    Only host 0 of each stage counts (all hosts of a stage run the same actions).
    With virtual chunks (interleaved schedules) a kind's cost is the mean over the
    stage's chunks of each chunk's median: `simulate` takes one cost per stage and
    kind, and every chunk runs the same number of actions, so the stage's busy
    time is kept.
    """
    from orchestrator.core.schedule import Action

    per: list[dict[tuple[str, int], list[float]]] = [{} for _ in range(p)]
    for spans in steps_spans:
        for stage, host, text, start, end in spans:
            a = Action.parse(text)
            if host == 0 and a.kind.value in COMPUTE_KINDS:
                per[stage].setdefault((a.kind.value, a.chunk), []).append(end - start)
    out = []
    for d in per:
        by_kind: dict[str, list[float]] = {}
        for (kind, _chunk), values in d.items():
            by_kind.setdefault(kind, []).append((stat or median)(values))
        out.append({k: sum(v) / len(v) for k, v in by_kind.items()})
    return out


def span_totals(steps_spans: list[list[tuple]], p: int) -> list[dict[str, float]]:
    """Per stage, the median over steps of the summed span time of each kind (s per step)."""
    per: list[dict[str, list[float]]] = [{} for _ in range(p)]
    for spans in steps_spans:
        sums: list[dict[str, float]] = [{} for _ in range(p)]
        for stage, host, text, start, end in spans:
            if host == 0:
                k = kind_of(text)
                sums[stage][k] = sums[stage].get(k, 0.0) + (end - start)
        for s in range(p):
            for k, v in sums[s].items():
                per[s].setdefault(k, []).append(v)
    return [{k: median(v) for k, v in d.items()} for d in per]


# ----------------------------------------------------------------------------- simulation

def sim_costs(costs: list[dict[str, float]], opt: bool = True) -> list[dict[str, float]]:
    """Measured per-stage costs in the form `simulate` accepts (F, and B or I+W; OPT optional)."""
    out = []
    for c in costs:
        d = {k: v for k, v in c.items() if k in ("F", "B", "I", "W")}
        if "B" not in d and not ("I" in d and "W" in d):
            d["B"] = 0.0
        d.setdefault("F", 0.0)
        if opt:
            d["OPT"] = c.get("OPT", 0.0)
        out.append(d)
    return out


def compute_actions_per_stage(lowered) -> int:
    """The most compute actions (F, B, I, W, OPT) any one stage runs in a step."""
    return max(sum(1 for a in row if a is not None and a.kind.value in COMPUTE_KINDS)
               for row in lowered.actions)


def critical_path_actions(sim, lowered) -> int:
    """Compute actions on the simulated critical path (walk back from the last action to finish).

    From an action, the path goes to the previous action of the same stage,
    except at a RECV that waited: there it jumps to the matching SEND.
    """
    from orchestrator.core.schedule.ir import RECVS, comm_peer

    rows: list[list] = [[] for _ in range(lowered.p)]
    where = {}
    for a, start, end in sim.spans:
        where[a] = (a.stage, len(rows[a.stage]))
        rows[a.stage].append((a, start, end))
    stage = max(range(lowered.p), key=lambda s: rows[s][-1][2] if rows[s] else 0)
    i, count = len(rows[stage]) - 1, 0
    while i >= 0:
        a, start, end = rows[stage][i]
        if a.kind.value in COMPUTE_KINDS:
            count += 1
        if a.kind in RECVS and end > start:
            stage, i = where[comm_peer(a, lowered.p, lowered.v)]
        else:
            i -= 1
    return count


# ----------------------------------------------------------------------------- machine, output

def machine_info() -> dict:
    mem_gib = float("nan")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = int(line.split()[1]) / 2**20
    except OSError:
        pass
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass

    def version(mod: str) -> str:
        from importlib import metadata

        try:
            return metadata.version(mod)
        except metadata.PackageNotFoundError:
            return "not installed"

    return {"when": time.strftime("%Y-%m-%d %H:%M"), "nproc": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)), "mem_gib": round(mem_gib, 1), "cpu": cpu,
            "python": platform.python_version(), "jax": version("jax"), "jaxlib": version("jaxlib"),
            "ray": version("ray"), "optax": version("optax"), "torch": version("torch"),
            "load_start": os.getloadavg()}


def cpu_times() -> list[int]:
    """The machine's CPU time counters from /proc/stat's `cpu` line (user, nice, system, idle,
    iowait, irq, softirq, steal, …; in clock ticks); [] where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return []


def steal_share(before: Sequence[int], after: Sequence[int]) -> float | None:
    """The share of CPU time the hypervisor took (steal) between two `cpu_times()` readings — a
    condition of a VM the load average does not show; None without the counters.

    >>> steal_share([100, 0, 10, 800, 0, 0, 0, 5], [180, 0, 20, 890, 0, 0, 0, 25])
    0.1
    """
    if len(before) < 8 or len(after) < 8:
        return None
    total = sum(after[:8]) - sum(before[:8])
    return (after[7] - before[7]) / total if total > 0 else None


def load_note(before: Sequence[float], after: Sequence[float], cores: int | None = None) -> str:
    """What the observed 1-minute load averages say about the conditions — read, not assumed.

    A benchmark's own processes load the machine too (up to its cores' worth); a 1-minute load
    above the cores + 1, before or after, means something else was running as well.

    >>> load_note((0.4, 0.3, 0.2), (2.1, 1.0, 0.5), cores=2)
    'load average 0.4 before, 2.1 after (1-minute): no more than the benchmark itself on 2 cores'
    >>> load_note((9.0, 5.0, 2.0), (3.0, 4.0, 2.0), cores=2).endswith("busier than the benchmark alone: read magnitudes, not digits")
    True
    """
    cores = cores or len(os.sched_getaffinity(0))
    head = f"load average {before[0]:.1f} before, {after[0]:.1f} after (1-minute): "
    if max(before[0], after[0]) > cores + 1:
        return head + f"the {cores}-core machine was busier than the benchmark alone: read magnitudes, not digits"
    return head + f"no more than the benchmark itself on {cores} cores"


def md_table(headers: Sequence[str], rows: Iterable[Sequence], align: str | None = None) -> str:
    """A markdown table; `align` is one char per column ('l' or 'r'; default: first left, rest right)."""
    align = align or "l" + "r" * (len(headers) - 1)
    lines = ["| " + " | ".join(headers) + " |",
             "|" + "|".join(":---" if a == "l" else "---:" for a in align) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(lines)


def fmt(x, digits: int = 2, unit: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{digits}f}{unit}"


def run_child(args: list[str], timeout: float, cpus: Sequence[int] | None = None,
              env: dict[str, str] | None = None) -> dict:
    """Run `python -m <args>` from the repo root; its last stdout line is JSON, returned parsed.

    `cpus` pins the child (sched_setaffinity before exec, so before jax or torch
    start their thread pools); `env` adds environment variables. Raises RuntimeError with the child's stderr tail
    on failure, subprocess.TimeoutExpired at the deadline (the child is killed).
    """
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **(env or {}))
    env.pop("XLA_FLAGS", None)
    pre = (lambda: os.sched_setaffinity(0, set(cpus))) if cpus else None
    proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=pre, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
        raise RuntimeError(f"`python -m {' '.join(args)}` exited {proc.returncode}: {tail}")
    return json.loads(lines[-1])


def to_jsonable(x):
    if hasattr(x, "__dataclass_fields__"):
        return asdict(x)
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {str(k): to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_jsonable(v) for v in x]
    return x


# ----------------------------------------------------------------------------- two source trees

def two_tree_args(ap) -> None:
    """`--before DIR`, `--before-python PY` and `--out FILE` of a benchmark that compares two trees."""
    ap.add_argument("--before", required=True, type=Path, help="the other source tree (e.g. a git archive of main)")
    ap.add_argument("--before-python", default=None, help="its venv's python (default: DIR/.venv/bin/python)")
    ap.add_argument("--out", default=None)


def settle(deadline_s: float = 60.0, quiet_s: float = 5.0) -> float:
    """Wait until the previous child's Ray is gone (no raylet, GCS or worker process left, at most
    `deadline_s`), then `quiet_s` more; returns the seconds waited (`benchmarks.trees`,
    `benchmarks.interleaved`). Without it the second run of
    every pair was the slower one (tiny, 2026-12-06: before-first pairs 1.10-1.34, after-first
    0.76-0.78): the first child's Ray was still tearing down on the same two cores."""
    import psutil

    t0 = time.monotonic()
    names = ("raylet", "gcs_server", "ray::", "dashboard", "log_monitor")
    while time.monotonic() - t0 < deadline_s:
        left = [p for p in psutil.process_iter(["name", "cmdline"])
                if any(n in (p.info["name"] or "") or n in " ".join(p.info["cmdline"] or [])[:200] for n in names)
                and p.pid != os.getpid()]
        if not left:
            break
        time.sleep(0.5)
    time.sleep(quiet_s)
    return time.monotonic() - t0


def before_tree(ap, args) -> tuple[Path, str]:
    """The other tree and its python from `two_tree_args`' arguments: `--before-python`, else
    DIR/.venv/bin/python, else — DIR being this tree — this python. A python that is not there
    is refused naming the flag, before anything starts."""
    tree = args.before.resolve()
    python = args.before_python or str(tree / ".venv/bin/python")
    if args.before_python is None and not Path(python).exists() and tree == ROOT:
        python = sys.executable
    if not tree.is_dir() or not Path(python).exists():
        ap.error(f"--before {args.before} / --before-python {python}: need the other tree's directory and "
                 "its venv's python (default DIR/.venv/bin/python)")
    return tree, python


def tree_env(tree: Path) -> dict:
    """The environment of a child run in `tree`: that tree first on the path (this tree after it,
    for what the other tree lacks), CPU JAX. Its working directory is `tree` too."""
    return {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{ROOT}", "JAX_PLATFORMS": "cpu"}


def run_in_tree(script: str, tree: Path, python: str, argv: list[str], timeout: float) -> dict:
    """`python script child …argv` in `tree` (`tree_env`); the JSON of its last stdout line."""
    r = subprocess.run([python, script, "child", *argv], cwd=tree, env=tree_env(tree), capture_output=True,
                       text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{tree} {' '.join(argv)}: exit {r.returncode}\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def emit(result: dict, out: str | None) -> None:
    """Print a benchmark's JSON result, and write it to `out` when given."""
    text = json.dumps(result, indent=1)
    if out:
        Path(out).write_text(text)
    print(text)
