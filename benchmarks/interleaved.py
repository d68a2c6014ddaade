"""Two source trees' step time, interleaved: both pipelines up at once, taking turns a few steps at a time.

Run:  python -m benchmarks.interleaved --before DIR [--before-python PY] [--sizes tiny]
                                       [--sessions 12] [--rounds 100] [--burst 4] [--warmup 8]
                                       [--quiet-s 5] [--out FILE]
      (`--before .`: this tree against itself, the harness's own bias)

Why: on this 2-core VM the speed of the same code moves by up to 2× over seconds (a pure
Python loop pinned to one core, timed every ~30 ms: 26 ms or 50 ms, in phases of seconds,
2026-12-07), so two trees measured one child after the other (`benchmarks.trees`) compare two
stretches of the machine as much as two trees: at `tiny` one pair's ratio moves by ±25 %, far
more than a 3 % rule. Here both trees' pipelines are up at once; the parent lets them run in
turns — one call of `--burst` steps (the executor's own `steps_per_call`, 4: one Ray task per
stage host) of one tree, then the other's — so each round's two turns see the same seconds of
the machine. A pair of processes also keeps a speed of its own for its life (this tree against
itself read 0.953 over one session's 300 rounds), so the benchmark runs `--sessions` sessions,
each with fresh children (which tree's starts first alternates), and the sessions are the
samples: the result is the median of the sessions' median round ratios, with its
order-statistic interval (`benchmarks.paired.median_interval`) and spread.

Each tree runs in a child process of its own (`TREE/… python -m benchmarks.interleaved child
SIZE BURST WARMUP ROUNDS`, that tree first on the path, its own venv's python): an embedded Ray,
the pipeline benchmark's job (`benchmarks.pipeline.checked_job`: the GPT of
`benchmarks.common.SIZES`, 2 stages × 1 host × 1 CPU device, 1F1B, m=8, stage actors pinned
one core each), run by the tree's own `PipelineExecutor` (`steps(burst, start)` per turn). A
turn's time is the driver's clock around that call over its steps: the Ray call, the stages'
work and the driver's own handling of the results, as a training run pays them. The idle
tree's actors wait in Ray's task queue meanwhile; both trees have the other's idle Ray beside
them the whole time. The children answer the parent on their stdout in lines that start with
`RESULT_MARK` (Ray's logs share that stream); every read has a deadline (`--timeout`).
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
M, SCHEDULE = 8, "1f1b"
RESULT_MARK = "@@interleaved "


def _say(obj) -> None:
    print(RESULT_MARK + json.dumps(obj), flush=True)


def child(size_name: str, burst: int, warmup: int, rounds: int) -> None:
    """One tree's pipeline, kept up between turns (see the module docstring): says "ready" after the
    warm-up steps, then runs `burst` steps per "run" line on stdin; "stop" (or EOF) ends it."""
    import ray

    from benchmarks.common import SIZES
    from orchestrator.core.plan import make_plan
    from orchestrator.driver import placement
    from orchestrator.driver.executor import PipelineExecutor
    from benchmarks.pipeline import checked_job

    total = warmup + burst * rounds + 1       # never the run's last step (which may evaluate)
    checked = checked_job(SIZES[size_name], SCHEDULE, M, total)
    placement.connect(checked.cluster, namespace=f"meshpipe-interleaved-{os.getpid()}")
    ex = PipelineExecutor(checked, make_plan(checked).schedule, checked.data, f"interleaved-{size_name}")
    affinity, step = {}, 0
    try:
        ex.start()
        for _ in ex.steps(warmup, 0):
            pass
        step = warmup
        _say({"ready": True, "per_call": checked.cluster.calls_of_steps})
        for line in sys.stdin:
            if line.strip() != "run":
                break
            t0 = time.perf_counter()
            for r in ex.steps(burst, step):
                for st in r.stats:
                    if "affinity" in st:
                        affinity[f"{st['stage']}/{st.get('host', 0)}"] = st["affinity"]
            _say({"turn_s": (time.perf_counter() - t0) / burst})
            step += burst
    finally:
        ex.shutdown()
        ray.shutdown()
    _say({"done": True, "affinity": affinity, "steps": step})


class Child:
    """A child process of one tree and a reader of its marked lines (each read has a deadline)."""

    def __init__(self, tree: Path, python: str, argv: list[str]):
        from benchmarks.common import tree_env

        self.stderr = tempfile.TemporaryFile(mode="w+")      # a file, not a pipe: nothing reads it until the end
        self.proc = subprocess.Popen([python, str(Path(__file__).resolve()), "child", *argv], cwd=tree,
                                     env=tree_env(tree), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, text=True, bufsize=1)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(RESULT_MARK):
                self.lines.put(json.loads(line[len(RESULT_MARK):]))
        self.lines.put(None)

    def get(self, timeout: float) -> dict:
        try:
            got = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no answer from the child of pid {self.proc.pid} within {timeout:.0f} s") from None
        if got is None:
            code = self.proc.wait(timeout)
            self.stderr.seek(0)
            raise RuntimeError(f"the child of pid {self.proc.pid} ended (exit {code}):\n{self.stderr.read()[-3000:]}")
        return got

    def send(self, text: str) -> None:
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def close(self, timeout: float) -> dict | None:
        try:
            self.send("stop")
            self.proc.stdin.close()
            return self.get(timeout)
        except (OSError, RuntimeError, TimeoutError):
            return None
        finally:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.stderr.close()


def session(trees: dict, size: str, rounds: int, burst: int, warmup: int, timeout: float, first: str) -> dict:
    """One session: both trees' children up (`first`'s first, then the other's: their compiles do not
    overlap), then `rounds` rounds of one turn each, alternating which goes first."""
    from benchmarks.paired import block_order

    children: dict = {}
    try:
        for name in (first, *(n for n in trees if n != first)):
            tree, python = trees[name]
            children[name] = Child(tree, python, [size, str(burst), str(warmup), str(rounds)])
            children[name].get(timeout)            # "ready": compiled and warm
        turns: dict = {name: [] for name in trees}
        for i in range(rounds):
            for name in block_order(i, ("before", "after")):
                children[name].send("run")
                turns[name].append(children[name].get(timeout)["turn_s"])
    finally:
        ends = {name: c.close(timeout) for name, c in children.items()}
    ratios = [a / b for a, b in zip(turns["after"], turns["before"])]
    return {"started_first": first, "ratio_median": statistics.median(ratios), "ratios": ratios,
            "turns_ms": {k: [t * 1e3 for t in v] for k, v in turns.items()}, "children": ends}


def compare(trees: dict, size: str, sessions: int, rounds: int, burst: int, warmup: int, timeout: float,
            settle=None) -> dict:
    """`sessions` sessions (`session`), alternating which tree's child starts first; the result is the
    median over sessions of each session's median round ratio: a process pair keeps a speed of its
    own for its life (the same tree against itself read 0.953 over one session's 300 rounds,
    2026-12-07), so the sessions, not the rounds, are the samples."""
    from benchmarks.paired import block_order

    runs = []
    for k in range(sessions):
        if settle is not None:
            settle()
        runs.append(session(trees, size, rounds, burst, warmup, timeout, block_order(k, ("before", "after"))[0]))
        print(f"{size} session {k}: after ÷ before {runs[-1]['ratio_median']:.3f} (median of {rounds} rounds; "
              f"{runs[-1]['started_first']} started first)", file=sys.stderr, flush=True)
    return {"size": size, "m": M, "schedule": SCHEDULE, "sessions": sessions, "rounds": rounds, "burst": burst,
            "warmup": warmup, **summary(runs), "runs": runs}


def summary(runs: list[dict]) -> dict:
    """The sessions' verdict: the median of their median round ratios (the samples: see the module
    docstring), the narrowest order-statistic interval covering it with at least 90 %, the
    spread, how many are above 1, the median of the sessions each tree's child started first
    in, and the pooled rounds' median and quartiles.

    Example:
        >>> runs = [{"ratio_median": r, "ratios": [r, r], "started_first": f}
        ...         for r, f in ((1.0, "before"), (1.1, "after"), (0.9, "before"), (1.02, "after"), (0.99, "before"))]
        >>> s = summary(runs)
        >>> s["ratio_median"], s["above_1"], s["ratio_median_before_started_first"], s["ratio_spread"]
        (1.0, 2, 0.99, [0.9, 1.1])
    """
    from benchmarks.paired import median_interval

    per = [r["ratio_median"] for r in runs]
    pooled = [x for r in runs for x in r["ratios"]]
    by_first = {f: [r["ratio_median"] for r in runs if r["started_first"] == f] for f in ("before", "after")}
    return {"ratio_median": statistics.median(per), "session_ratios": per, "interval": median_interval(per, 0.9),
            "ratio_spread": [min(per), max(per)], "above_1": sum(r > 1 for r in per),
            "ratio_median_before_started_first": statistics.median(by_first["before"]) if by_first["before"] else None,
            "ratio_median_after_started_first": statistics.median(by_first["after"]) if by_first["after"] else None,
            "rounds_pooled_median": statistics.median(pooled),
            "rounds_quartiles": statistics.quantiles(pooled, n=4) if len(pooled) > 1 else None}


def main(argv: list[str]) -> None:
    if argv and argv[0] == "child":
        child(argv[1], int(argv[2]), int(argv[3]), int(argv[4]))
        return
    from benchmarks.common import before_tree, emit, machine_info, settle, two_tree_args

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    two_tree_args(ap)
    ap.add_argument("--sizes", default="tiny")
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=100, help="rounds per session")
    ap.add_argument("--burst", type=int, default=4, help="steps per turn (one executor call at the default 4)")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds any one answer of a child may take")
    ap.add_argument("--quiet-s", type=float, default=5.0, help="seconds to wait once the previous session's Ray is gone")
    args = ap.parse_args(argv)
    if args.sessions < 1 or args.rounds < 2 or args.burst < 1 or args.warmup < 1:
        ap.error(f"--sessions {args.sessions}, --rounds {args.rounds}, --burst {args.burst}, --warmup {args.warmup}: "
                 "need sessions >= 1, rounds >= 2, burst >= 1, warmup >= 1")
    trees = {"before": before_tree(ap, args),
             "after": (HERE, sys.executable)}
    t0, machine = time.time(), machine_info()
    sizes = {}
    for size in args.sizes.split(","):
        sizes[size] = r = compare(trees, size, args.sessions, args.rounds, args.burst, args.warmup, args.timeout,
                                  settle=lambda: settle(quiet_s=args.quiet_s))
        print(f"{size}: after ÷ before median {r['ratio_median']:.3f} over {args.sessions} sessions "
              f"(spread {r['ratio_spread'][0]:.3f}–{r['ratio_spread'][1]:.3f})", file=sys.stderr, flush=True)
    emit({"machine": machine, "sizes": sizes, "trees": {k: str(v[0]) for k, v in trees.items()},
          "wall_s": time.time() - t0, "nproc": os.cpu_count()}, args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
