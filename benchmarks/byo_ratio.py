"""Bring-your-own-model step ratios (issue 17): the GPT through the model interface ÷ the previous
built-in path, and the Llama example in bfloat16 ÷ float32.

    PYTHONPATH=. python -m benchmarks.byo_ratio [--pairs 3] [--steps 30] [--warmup 5]
                                               [--only gpt|llama] [--previous d9e6206^] [--pin]

Each comparison is run as alternated pairs A B A B … (at least 3) driven from this one process;
every run is `meshpipe run` in its own child process (its own embedded Ray, its own jax), so both
sides of a pair see the same drift of the machine:

  gpt    A = the previous built-in path: `examples/gpt.yaml` in the tree at `--previous` (default
         d9e6206^, the commit before the PipelineModel interface; the built-in GPT was a ModelSpec
         `apply` then), extracted with `git archive` into a temporary directory; its children run
         there (cwd and PYTHONPATH), so the driver and the Ray actors import that tree, with that
         tree's own `cluster_configs/local.yaml`.
         B = the same YAML in this tree (the built-in GPT is a plain-JAX factory on the interface).
         Ratio B ÷ A (the issue's target: ≤ 1.05).
  llama  A = `examples/llama.yaml` (float32), B = the same with `precision.compute=bfloat16`.
         Ratio B ÷ A; and the planned bytes per stage edge of each (bf16 must be half).

A run's step time is the median of summary.json's `step_times_s` after the first `--warmup` steps
(the first compiles). A pair's ratio is B ÷ A of the pair; reported: every pair's ratio, their
median, min and max, and each side's step times. Observed conditions are recorded per run: the
load average before and after, this process's CPU affinity, the stage actors' CPU affinity and OS
thread count as they read them back (summary.json telemetry, where the tree records it), the
model section of the run's checked config (so the two GPT sides are shown to be the two paths:
`impl` vs `factory`). Nothing is asserted about the figures; a run that fails, or a step time that
is not positive, fails the benchmark. Writes benchmarks/results/byo_ratio.json.
On a shared machine, label the figures as such; the integrator runs this on a quiet one.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.common import RESULTS, ROOT, machine_info

PREVIOUS = "d9e6206^"       # the commit before the PipelineModel interface (d9e6206)


def extract(rev: str, dest: Path) -> Path:
    """The tree at `rev` as files under `dest` (git archive; nothing of this checkout changes)."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = dest / "tree.tar"
    with archive.open("wb") as f:
        subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev], stdout=f, check=True)
    with tarfile.open(archive) as t:
        t.extractall(dest / "tree", filter="data")
    archive.unlink()
    return dest / "tree"


def cluster_file(tree: Path, pin: bool, out: Path) -> Path:
    """That tree's own local cluster file, with `pin_cpus` as asked."""
    raw = yaml.safe_load((tree / "cluster_configs" / "local.yaml").read_text())
    raw["pin_cpus"] = bool(pin)
    path = out / f"cluster-{abs(hash(str(tree)))}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def affinities(tree) -> list:
    """Every `affinity` / `os_threads` record anywhere in a summary (the actors' own read-backs)."""
    found = []
    if isinstance(tree, dict):
        if "affinity" in tree:
            found.append({k: tree[k] for k in ("affinity", "os_threads") if k in tree})
        for v in tree.values():
            found += affinities(v)
    elif isinstance(tree, list):
        for v in tree:
            found += affinities(v)
    return found


def run_once(tree: Path, job: str, cluster: Path, name: str, out: Path, steps: int, sets: list[str],
             timeout: float) -> dict:
    """One `meshpipe run` of `job` from `tree` in a child process; its summary.json, read back."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", PYTHONPATH=str(tree))
    env.pop("XLA_FLAGS", None)
    args = [sys.executable, "-m", "orchestrator.driver.cli", "run", job, "--cluster", str(cluster),
            "--set", f"run.steps={steps}", "--set", f"run.name={name}", "--set", f"run.output_dir={out}"]
    for s in sets:
        args += ["--set", s]
    load_before, t0 = os.getloadavg(), time.perf_counter()
    proc = subprocess.run(args, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-12:])
        raise RuntimeError(f"{name}: `meshpipe run {job}` in {tree} exited {proc.returncode}:\n{tail}")
    run_dir = out / name / "latest"      # a tree with per-run directories (rundir); an older one writes flat
    summary = json.loads(((run_dir if run_dir.exists() else out / name) / "summary.json").read_text())
    return {"summary": summary, "wall_s": wall, "load_before": load_before, "load_after": os.getloadavg()}


def step_time(times: list[float], warmup: int, name: str) -> float:
    kept = times[warmup:]
    if not kept:
        raise RuntimeError(f"{name}: {len(times)} steps, none after the {warmup} warm-up steps")
    t = statistics.median(kept)
    if not t > 0:
        raise RuntimeError(f"{name}: median step time {t} s is not positive: the run cannot be measured")
    return t


def record(res: dict, warmup: int, name: str) -> dict:
    s = res["summary"]
    config = json.loads(s["config"]) if isinstance(s.get("config"), str) else {}
    model = config.get("model", {})
    edges = s.get("plan", {}).get("edges", [])
    return {
        "run": name,
        "step_time_s": step_time(s["step_times_s"], warmup, name),
        "step_times_s": s["step_times_s"],
        "wall_s": res["wall_s"],
        "load_before": res["load_before"], "load_after": res["load_after"],
        "model": {k: model.get(k) for k in ("name", "impl", "factory", "num_layers") if k in model},
        "compute_dtype": config.get("job", {}).get("precision", {}).get("compute"),
        "edge_bytes_forward": [e.get("forward", {}).get("lower_bound_bytes") for e in edges],
        "actors": affinities(s.get("telemetry", {})) or affinities(s.get("workers", [])),
    }


def compare(label: str, a: tuple, b: tuple, pairs: int, steps: int, warmup: int, out: Path, timeout: float,
            echo=print) -> dict:
    """`pairs` alternated pairs of side a (tree, job, cluster, sets) and side b: A B A B …"""
    runs = {"A": [], "B": []}
    for i in range(pairs):
        for side, (tree, job, cluster, sets) in (("A", a), ("B", b)):
            name = f"{label}-{side}{i}"
            rec = record(run_once(tree, job, cluster, name, out, steps, sets, timeout), warmup, name)
            runs[side].append(rec)
            echo(f"{name}: step {rec['step_time_s'] * 1e3:.2f} ms  load {rec['load_before'][0]:.2f}"
                 f"→{rec['load_after'][0]:.2f}  wall {rec['wall_s']:.0f} s")
    ratios = [rb["step_time_s"] / ra["step_time_s"] for ra, rb in zip(runs["A"], runs["B"])]
    return {"pairs": pairs, "steps": steps, "warmup": warmup, "runs": runs, "pair_ratios": ratios,
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="leading steps left out of each run's median (compile)")
    ap.add_argument("--only", choices=("gpt", "llama"), default=None)
    ap.add_argument("--previous", default=PREVIOUS, help="git revision of the previous built-in GPT path")
    ap.add_argument("--pin", action="store_true", help="pin_cpus: true in both sides' cluster files")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    ap.add_argument("--out", type=Path, default=RESULTS / "byo_ratio.json")
    args = ap.parse_args(argv)
    if args.pairs < 1 or args.steps <= args.warmup:
        ap.error("need --pairs ≥ 1 and --steps > --warmup")
    result = {"machine": machine_info(), "this_affinity": sorted(os.sched_getaffinity(0)),
              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "note": "alternated pairs A B A B … in one driver process, each run its own child and Ray; "
                      "ratio = B ÷ A per pair"}
    with tempfile.TemporaryDirectory(prefix="byo-ratio-") as tmp:
        tmp = Path(tmp)
        here = ROOT
        here_cluster = cluster_file(here, args.pin, tmp)
        if args.only in (None, "gpt"):
            prev = extract(args.previous, tmp / "previous")
            result["previous_rev"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", args.previous],
                                                    capture_output=True, text=True, check=True).stdout.strip()
            result["gpt"] = compare("gpt", (prev, "examples/gpt.yaml", cluster_file(prev, args.pin, tmp), []),
                                    (here, "examples/gpt.yaml", here_cluster, []),
                                    args.pairs, args.steps, args.warmup, tmp / "runs", args.timeout)
            result["gpt"]["meaning"] = "B = model interface (this tree), A = previous built-in path"
        if args.only in (None, "llama"):
            result["llama"] = compare("llama", (here, "examples/llama.yaml", here_cluster, []),
                                      (here, "examples/llama.yaml", here_cluster, ["precision.compute=bfloat16"]),
                                      args.pairs, args.steps, args.warmup, tmp / "runs", args.timeout)
            result["llama"]["meaning"] = "B = bfloat16 compute, A = float32"
    result["load_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for key in ("gpt", "llama"):
        if key in result:
            r = result[key]
            print(f"{key}: {r['meaning']}: ratio median {r['ratio_median']:.3f} "
                  f"(pairs {', '.join(f'{x:.3f}' for x in r['pair_ratios'])})")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
