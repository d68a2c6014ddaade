"""The Benchmarks section, generated from `benchmarks/results/` (one page per published run).

Basic flow: `runs()` groups the results files by stem (`pipeline.md` + `pipeline.json` +
`pipeline_*.png` is the run `pipeline`; `pipeline.quick.*` is another run). `page(run)` is
its page: the command that reproduces it, the conditions the benchmark recorded (date,
machine, load, affinity), then the benchmark's own markdown (a run that wrote only JSON:
its scalars and tables, rendered as they are), then the reading written for that run, when
`docs/benchmarks/notes/<stem>.md` holds one. `index()` lists every run.

Invariants: the tables on these pages come from the results files, never typed in; a reading
names the run it was written for (`<!-- run: 2026-12-05 01:40 -->`), and when the results
file is from another run the page says so above the reading instead of passing it off.
"""
from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
NOTES = ROOT / "docs" / "benchmarks" / "notes"

# how to reproduce each run (the benchmark's own `command` / `argv`, where it recorded one, wins)
COMMANDS = {
    "pipeline": "python -m benchmarks.run",
    "pipeline.quick": "python -m benchmarks.run --quick",
    "pipeline_side_by_side": "python -m benchmarks.side_by_side",
    "reshard": "python -m benchmarks.reshard",
    "reshard.quick": "python -m benchmarks.reshard --quick",
    "planner": "python -m benchmarks.planner",
    "planner_error": "python -m benchmarks.planner --measure 3",
    "planner_measure": "meshpipe plan examples/mlp.yaml --auto --explain --measure 3 --max-model 2 --microbatches 2,4",
    "planner_exhaustive.quick": "python -m benchmarks.planner_exhaustive --quick --recalibrate --pairs 16",
    "planner_h2h": "python -m benchmarks.planner_h2h --pairs 100",
    "recovery": "python -m benchmarks.recovery",
    "checkpoint": "python -m benchmarks.checkpoint --size large --steps 60 --every 20",
    "data_loader": "python -m benchmarks.data_loader --steps 60 --step-ms 1070",
    "byo_ratio": "PYTHONPATH=. python -m benchmarks.byo_ratio --pin",
    "gpu_stage_check": "PYTHONPATH=. python3 benchmarks/gpu_stage_check.py --size small",
    "gpu_stage_check.h200": "PYTHONPATH=. python3 benchmarks/gpu_stage_check.py --size gpu",
    "gpu_stage_check.h200_f32_highest": "PYTHONPATH=. python3 benchmarks/gpu_stage_check.py --size gpu "
                                        "--matmul-precision highest",
    "meshtf_fc": "python -m benchmarks.meshtf_fc",
    "tls_overhead": "python -m benchmarks.tls_overhead",
    "transport": "python -m benchmarks.transport",
    "transport.quick": "python -m benchmarks.transport --quick",
    "tls_overhead.first": "python -m benchmarks.tls_overhead",
    "wake_latency": "python -m benchmarks.wake_latency",
    "zb_check": "python -m benchmarks.zb_check",
    "trees.large": "python -m benchmarks.trees --before DIR --sizes large --pairs 12 --steps 20 --warmup 4",
    "trees.tiny": "python -m benchmarks.trees --before DIR --sizes tiny --pairs 12 --steps 40 --warmup 8",
    "trees.tiny.steps400": "python -m benchmarks.trees --before DIR --sizes tiny --pairs 4 --steps 400 --warmup 8",
    "trees.large.second": "python -m benchmarks.trees --before DIR --sizes large --pairs 4 --steps 20 --warmup 4",
    "trees.large.first": "python -m benchmarks.trees --before DIR --sizes large --pairs 4 --steps 20 --warmup 4",
    "same_programs.large": "python -m benchmarks.same_programs --before DIR --size large",
    "same_programs.tiny": "python -m benchmarks.same_programs --before DIR --size tiny",
    "interleaved.tiny": "python -m benchmarks.interleaved --before DIR --sizes tiny --sessions 12 --rounds 100",
    "interleaved.tiny.same_tree": "python -m benchmarks.interleaved --before . --sizes tiny --sessions 8 --rounds 100",
    "interleaved.large": "python -m benchmarks.interleaved --before DIR --sizes large --sessions 6 --rounds 10 --warmup 4",
}
TITLES = {     # runs whose files carry no title of their own
    "byo_ratio": "Bring-your-own-model step times (alternated pairs)",
    "checkpoint": "Checkpoint cost: blocking time, overhead, restore",
    "data_loader": "Data loader cost",
    "gpu_stage_check": "One stage's programs alone (CPU smoke test; not a measurement)",
    "gpu_stage_check.h200": "One stage's programs alone on an NVIDIA H200",
    "gpu_stage_check.h200_f32_highest": "One stage's programs alone on an NVIDIA H200 (float32, highest precision)",
    "planner_measure": "plan --auto --measure before calibration",
    "tls_overhead": "TLS on the transport's TCP links: overhead",
    "tls_overhead.first": "TLS on the transport's TCP links: overhead (first run)",
    "wake_latency": "Wake-up latency of a blocking receiver",
    "zb_check": "Zero-bubble check: ZB-H1 against 1F1B, live memory",
    "trees.large": "A refactor's step time: two source trees, alternated pairs (large)",
    "trees.tiny": "A refactor's step time: two source trees, alternated pairs (tiny)",
    "trees.tiny.steps400": "A refactor's step time (tiny, 4 pairs of 400 steps)",
    "trees.large.second": "A refactor's step time (large, 4 pairs with the CPU by role)",
    "trees.large.first": "A refactor's step time (large, first 4 pairs)",
    "same_programs.large": "Same XLA programs in two source trees (large)",
    "same_programs.tiny": "Same XLA programs in two source trees (tiny)",
    "interleaved.tiny": "A refactor's step time: two source trees taking turns (tiny)",
    "interleaved.tiny.same_tree": "The interleaved harness against itself: one tree on both sides (tiny)",
    "interleaved.large": "A refactor's step time: two source trees taking turns (large)",
}
DATE = re.compile(r"\d{4}-\d{2}-\d{2}(?:[ T]\d{2}:\d{2})?")


@dataclass
class Run:
    stem: str
    files: list[Path] = field(default_factory=list)

    def file(self, suffix: str) -> Path | None:
        return next((f for f in self.files if f.name == self.stem + suffix), None)

    @property
    def slug(self) -> str:
        return self.stem.replace(".", "-").replace("_", "-")

    def data(self) -> dict | list | None:
        f = self.file(".json")
        return json.loads(f.read_text()) if f else None

    def markdown(self) -> str | None:
        f = self.file(".md")
        if f is None and (ROOT / "docs" / f"{self.stem}.md").exists():   # benchmarks.meshtf_fc writes docs/
            f = ROOT / "docs" / f"{self.stem}.md"
        return f.read_text() if f else None

    def title(self) -> str:
        md = self.markdown()
        m = re.search(r"^# (.+)$", md or "", re.M)
        return m.group(1).strip() if m else TITLES.get(self.stem, self.stem.replace("_", " ").replace(".", " "))

    def when(self) -> str:
        """The run's date (and time, where recorded), read from its files."""
        data = self.data()
        for d in (data, data.get("machine") if isinstance(data, dict) else None,
                  data.get("conditions", {}).get("machine") if isinstance(data, dict) else None):
            if isinstance(d, dict) and isinstance(d.get("when"), str):
                m = DATE.search(d["when"])
                if m:
                    return m.group(0)
        for text in (self.markdown(), *(f.read_text() for f in self.files if f.suffix == ".txt")):
            m = DATE.search((text or "")[:2000])
            if m:
                return m.group(0)
        return "not recorded"

    def machine(self) -> str:
        data = self.data()
        if isinstance(data, dict):
            for d in (data.get("machine"), data.get("conditions", {}).get("machine")):
                if isinstance(d, dict) and d.get("cpu"):
                    return f"{d['cpu']}, {d.get('nproc', '?')} CPUs"
            if data.get("device"):
                return str(data["device"])
        md = self.markdown() or ""
        m = re.search(r"(AMD EPYC|Intel\(R\) Xeon\(R\) Processor|x86_64)", md[:3000])
        return m.group(1) if m else "see the page"


def runs() -> list[Run]:
    found: dict[str, Run] = {}
    for f in sorted(RESULTS.iterdir()):
        if f.suffix not in (".md", ".json", ".txt"):
            continue
        stem = f.name[: -len(f.suffix)]
        found.setdefault(stem, Run(stem)).files.append(f)
    for run in found.values():       # the pictures a run's markdown shows
        md = run.markdown() or ""
        run.files += [RESULTS / name for name in re.findall(r"\]\(([\w.\-]+\.png)\)", md) if (RESULTS / name).exists()]
    return list(found.values())


# ----------------------------------------------------------------------------- JSON as tables

def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)) and all(not isinstance(x, (dict, list)) for x in v):
        if len(v) > 8:
            nums = [x for x in v if isinstance(x, (int, float))]
            return f"{len(v)} values" + (f", median {_fmt(float(statistics.median(nums)))}" if nums else "")
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    if isinstance(v, dict):
        return json.dumps(v, default=str)[:200]
    return str(v).replace("|", "\\|").replace("\n", " ")


def _table(rows: list[dict]) -> list[str]:
    cols = [k for k in dict.fromkeys(k for r in rows for k in r) if all(not isinstance(r.get(k), (dict, list))
                                                                        or k in ("loadavg", "affinity") for r in rows)]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(_fmt(r.get(k, "–")) for k in cols) + " |" for r in rows]
    return out


def json_body(data: Any, depth: int = 3) -> list[str]:
    """A results JSON as markdown: its scalars in one table, each list of records as a table."""
    if isinstance(data, list):
        return _table(data) if data and all(isinstance(r, dict) for r in data) else [_fmt(data)]
    scalars = [(k, v) for k, v in data.items() if not isinstance(v, (dict, list))
               or (isinstance(v, list) and all(not isinstance(x, (dict, list)) for x in v))]
    out: list[str] = []
    if scalars:
        out += ["| field | value |", "|---|---|"] + [f"| `{k}` | {_fmt(v)} |" for k, v in scalars]
    for k, v in data.items():
        if isinstance(v, list) and v and all(isinstance(r, dict) for r in v):
            out += ["", f"{'#' * depth} `{k}`", ""] + _table(v)
        elif isinstance(v, dict) and v:
            out += ["", f"{'#' * depth} `{k}`", ""] + json_body(v, min(depth + 1, 6))
    return out


# ----------------------------------------------------------------------------- pages

def _demoted(md: str) -> str:
    """The benchmark's markdown under the page's own title: its headings one level down, its title dropped."""
    lines = md.splitlines()
    out, fenced = [], False
    for i, line in enumerate(lines):
        fenced ^= line.startswith("```")
        if not fenced and line.startswith("# ") and not any(x.startswith("# ") for x in lines[:i]):
            continue
        out.append("#" + line if not fenced and line.startswith("#") else line)
    return "\n".join(out)


def reading(run: Run) -> list[str]:
    """The reading written for this run, with a warning when the results are from another run."""
    f = NOTES / f"{run.stem}.md"
    if not f.exists():
        return []
    text = f.read_text()
    m = re.search(r"<!-- run: (.+?) -->", text)
    out = ["", "## Reading this run", ""]
    if m is None or m.group(1).strip() != run.when():
        out += ['!!! warning "Written for another run"',
                f"    This reading was written for the run of {m.group(1) if m else 'an unnamed date'}; "
                f"the results above are from {run.when()}. Its figures may not be the ones above.", ""]
    return out + [text.strip()]


def page(run: Run) -> str:
    data = run.data()
    cmd = data.get("command") if isinstance(data, dict) and isinstance(data.get("command"), str) else None
    if cmd is None and isinstance(data, dict) and isinstance(data.get("argv"), list):
        cmd = "python3 " + " ".join(str(a) for a in data["argv"])
    cmd = cmd or COMMANDS.get(run.stem, "(not recorded: see the benchmark module's docstring)")
    files = ", ".join(f"`{f.relative_to(ROOT)}`" for f in run.files if f.suffix != ".png")
    out = [f"# {run.title()}", "",
           f"**Run:** {run.when()} · **machine:** {run.machine()} · **files:** {files}", "",
           "Reproduce (from the repository root, with the `test` extra installed):", "",
           "```bash", cmd, "```", ""]
    md = run.markdown()
    if md is not None:
        out.append(_demoted(md))
    elif data is not None:
        out += ["## Results", "", "Rendered from the JSON the benchmark wrote, as it is.", ""] + json_body(data)
    for f in run.files:
        if f.suffix == ".txt":
            out += ["", f"## `{f.name}`", "", "```text", f.read_text().rstrip(), "```"]
    out += reading(run)
    return "\n".join(out) + "\n"


def index() -> str:
    intro = (NOTES / "index.md").read_text().strip() if (NOTES / "index.md").exists() else "# Benchmarks"
    rows = ["| run | date | machine |", "|---|---|---|"]
    for run in sorted(runs(), key=lambda r: DATE.match(r.when()) and r.when() or "", reverse=True):
        rows.append(f"| [{run.title()}]({run.slug}.md) | {run.when()} | {run.machine()} |")
    return intro + "\n\n" + "\n".join(rows) + "\n"


def pages() -> dict[str, str | bytes]:
    """Site path -> content of every generated Benchmarks file (pages and the pictures they show)."""
    out: dict[str, str | bytes] = {"benchmarks/index.md": index()}
    for run in runs():
        out[f"benchmarks/{run.slug}.md"] = page(run)
        for f in run.files:
            if f.suffix == ".png":
                out[f"benchmarks/{f.name}"] = f.read_bytes()
    return out
