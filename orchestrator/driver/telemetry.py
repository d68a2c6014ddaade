"""Telemetry: measured spans → step statistics, a Chrome trace, a PNG timeline, progress text.

Basic flow (driver side, `orchestrator.driver.runner`):
  tel = RunTelemetry(run, schedule, simulated_bubble, global_batch)
  per step:  stats = tel.add(step, wall_s, loss, spans, host_stats)   # StepStats
  at the end: tel.write(run_dir) → trace.json + timeline.png; tel.summary() → dict
  per-step records: `StepLog` appends one JSON line per step to metrics.jsonl as it happens.
Actor side: `stages.telemetry` (compile time, memory, bytes sent per edge).

A span is (stage, host, action_text, start, end): one per executed action of the
lowered schedule, times in seconds since the epoch from the actor's clock (one
machine: one clock; across nodes the clocks are only as close as NTP keeps them).

Definitions (as the simulator's, `orchestrator.core.schedule.simulate`, where all
stages start at 0):
  wall      of a step: from the earliest start of a compute action (F/B/I/W/OPT)
            to the latest end of any action, over all hosts. Not from the
            earliest span: the executor queues the next step while one runs, so
            a later stage may already sit in the new step's first RECV while
            stage 0 still finishes the previous step; that wait is the previous
            step's tail, not this step's bubble. (trace.json keeps raw spans.)
  busy      of a host: sum of its F, B, I, W and OPT durations. SEND/RECV time
            (packing, pushing, waiting for a neighbour) is not busy: it is bubble.
  busy fraction of a host: busy / wall.
  measured bubble = 1 − Σ_stages busy(stage) / (stages × wall), busy(stage) =
            the mean over the stage's hosts (they run the same SPMD actions).

Decisions:
  - trace.json keeps step 0 (it shows compilation) and the last `TRACE_STEPS`
    steps, so a long run writes a bounded file (~60 events per stage host per
    step for 1F1B with m=8). Perfetto: a process per stage, a thread per host,
    plus a "steps" process with one span per step.
  - timeline.png shows the LAST step (warm, representative), one row per stage
    (host 0 of each stage), drawn by the schedule layer's `render_png` so it looks
    like `meshpipe plan --png`; times in milliseconds.
Driver side: no ray, no jax (matplotlib only inside `write`).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterable, TextIO

from orchestrator.core.private_fs import FILE_MODE, append_fd, write_private
from orchestrator.core.schedule import Action, Kind

TRACE_STEPS = 20
BUSY = frozenset({Kind.F, Kind.B, Kind.I, Kind.W, Kind.OPT})

Span = tuple  # (stage, host, action_text, start, end)


@dataclass
class StepStats:
    step: int
    loss: float
    wall_s: float                 # driver-measured step time (what a user waits)
    span_s: float                 # earliest span start → latest span end on the actors
    samples_per_s: float
    measured_bubble: float
    busy: dict[tuple[int, int], float]   # (stage, host) → busy fraction of span_s
    hosts: list[dict] = field(default_factory=list)   # per-actor stats (stage_stats), if any


def step_stats(spans: Iterable[Span], stages: int) -> tuple[float, float, dict[tuple[int, int], float]]:
    """(span_s, measured bubble, busy fraction per (stage, host)) of one step's spans.

    Example:
      >>> spans = [(0, 0, "0F0", 0.0, 1.0), (0, 0, "0SEND_F0", 1.0, 1.0),
      ...          (1, 0, "1RECV_F0", 0.0, 1.0), (1, 0, "1F0", 1.0, 2.0)]
      >>> step_stats(spans, 2)
      (2.0, 0.5, {(0, 0): 0.5, (1, 0): 0.5})
    """
    spans = list(spans)
    if not spans:
        return 0.0, 0.0, {}
    t0 = step_start(spans)
    wall = max(s[4] for s in spans) - t0
    busy: dict[tuple[int, int], float] = {}
    for stage, host, text, start, end in spans:
        key = (stage, host)
        busy.setdefault(key, 0.0)
        if Action.parse(text).kind in BUSY:
            busy[key] += end - start
    if wall <= 0:
        return 0.0, 0.0, {k: 0.0 for k in busy}
    per_stage: dict[int, list[float]] = {}
    for (stage, _), b in busy.items():
        per_stage.setdefault(stage, []).append(b)
    used = sum(sum(v) / len(v) for v in per_stage.values())
    return wall, 1.0 - used / (stages * wall), {k: b / wall for k, b in sorted(busy.items())}


def step_start(spans: list[Span]) -> float:
    """The earliest start of a busy (compute or OPT) action; the earliest span if there is none."""
    busy = [s[3] for s in spans if Action.parse(s[2]).kind in BUSY]
    return min(busy) if busy else min(s[3] for s in spans)


def chrome_trace(steps: list[tuple[int, list[Span]]], run: str = "", meta: dict | None = None) -> dict:
    """Measured spans of several steps as Chrome-trace JSON (Perfetto, chrome://tracing).

    pid = stage, tid = host; one more process ("steps", pid = number of stages)
    holds one span per step. Times in microseconds from the first span kept.

    Example:
      >>> t = chrome_trace([(0, [(0, 0, "0F0", 10.0, 10.5), (1, 0, "1F0", 10.5, 11.0)])])
      >>> [(e["name"], e["pid"], e["tid"], e["ts"], e["dur"]) for e in t["traceEvents"] if e["ph"] == "X"]
      [('F0', 0, 0, 0.0, 500000.0), ('F0', 1, 0, 500000.0, 500000.0), ('step 0', 2, 0, 0.0, 1000000.0)]
    """
    all_spans = [s for _, spans in steps for s in spans]
    origin = min((s[3] for s in all_spans), default=0.0)
    stages = 1 + max((s[0] for s in all_spans), default=-1)
    hosts = sorted({(s[0], s[1]) for s in all_spans})
    events: list[dict] = []
    for s in range(stages):
        events.append({"name": "process_name", "ph": "M", "pid": s, "args": {"name": f"stage {s}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": s, "args": {"sort_index": s}})
    for s, h in hosts:
        events.append({"name": "thread_name", "ph": "M", "pid": s, "tid": h, "args": {"name": f"host {h}"}})
    events.append({"name": "process_name", "ph": "M", "pid": stages, "args": {"name": "steps"}})
    events.append({"name": "process_sort_index", "ph": "M", "pid": stages, "args": {"sort_index": stages}})
    us = 1e6
    for step, spans in steps:
        for stage, host, text, start, end in sorted(spans, key=lambda x: (x[0], x[1], x[3])):
            a = Action.parse(text)
            events.append({
                "name": text[len(str(a.stage)):], "cat": a.kind.value, "ph": "X", "pid": stage, "tid": host,
                "ts": (start - origin) * us, "dur": max(0.0, end - start) * us,
                "args": {"step": step, "action": text, "microbatch": a.microbatch, "chunk": a.chunk},
            })
        if spans:
            t0, t1 = min(s[3] for s in spans), max(s[4] for s in spans)
            events.append({"name": f"step {step}", "cat": "step", "ph": "X", "pid": stages, "tid": 0,
                           "ts": (t0 - origin) * us, "dur": (t1 - t0) * us, "args": {"step": step}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"run": run, "clock": "actor wall clock (time.time), origin = first span",
                          **(meta or {})}}


def render_step_png(spans: list[Span], schedule, path: str | os.PathLike, title: str) -> float:
    """Draw one measured step like the simulated timeline (host 0 of each stage); returns its bubble.

    Times are shown in milliseconds from the step's start (`step_start`).
    """
    from orchestrator.core.schedule import render_png

    wall, bubble, _ = step_stats(spans, schedule.p)
    t0 = step_start(spans)
    first_host = {}
    for stage, host, *_ in spans:
        first_host[stage] = min(host, first_host.get(stage, host))
    drawn = [(Action.parse(text), (max(start, t0) - t0) * 1e3, (end - t0) * 1e3)
             for stage, host, text, start, end in spans if host == first_host[stage] and end > t0]
    sim = SimpleNamespace(spans=drawn, step_time=wall * 1e3, bubble_fraction=bubble)
    render_png(sim, schedule, str(path), title=title)
    return bubble


class RunTelemetry:
    """Collects the spans and stats of a run; writes trace.json and timeline.png.

    Example:
      >>> from orchestrator.core.schedule import generate, lower
      >>> tel = RunTelemetry("demo", lower(generate("gpipe", 2, 1)), simulated_bubble=0.25, global_batch=8)
      >>> st = tel.add(0, 1.0, 0.5, [(0, 0, "0F0", 0.0, 0.4), (0, 0, "0SEND_F0", 0.4, 0.4),
      ...                            (1, 0, "1RECV_F0", 0.0, 0.4), (1, 0, "1F0", 0.4, 0.8)])
      >>> round(st.measured_bubble, 3), st.samples_per_s
      (0.5, 8.0)
    """

    def __init__(self, run: str, schedule, simulated_bubble: float, global_batch: int,
                 keep_steps: int = TRACE_STEPS):
        self.run, self.schedule = run, schedule
        self.simulated_bubble = float(simulated_bubble)
        self.global_batch = global_batch
        self.first: tuple[int, list[Span]] | None = None
        self.recent: deque[tuple[int, list[Span]]] = deque(maxlen=keep_steps)
        self.steps: list[StepStats] = []
        self.paths: dict[str, str] = {}

    def replan(self, schedule, simulated_bubble: float) -> None:
        """The run goes on under another plan (`failure.elastic`): later steps are measured against
        its schedule, and the pictures show its steps (the earlier plan's spans are dropped)."""
        self.schedule, self.simulated_bubble = schedule, float(simulated_bubble)
        self.first = None
        self.recent.clear()

    def add(self, step: int, wall_s: float, loss: float, spans: list[Span],
            hosts: list[dict] | None = None) -> StepStats:
        spans = [tuple(s) for s in spans]
        span_s, bubble, busy = step_stats(spans, self.schedule.p)
        st = StepStats(step=step, loss=float(loss), wall_s=float(wall_s), span_s=span_s,
                       samples_per_s=self.global_batch / wall_s if wall_s > 0 else 0.0,
                       measured_bubble=bubble, busy=busy, hosts=list(hosts or []))
        if self.steps:   # earlier steps keep their scalars only: driver memory per step stays small
            last = self.steps[-1]
            last.busy, last.hosts = {}, []
        self.steps.append(st)
        if self.first is None:
            self.first = (step, spans)
        else:
            self.recent.append((step, spans))
        return st

    def kept_steps(self) -> list[tuple[int, list[Span]]]:
        return ([self.first] if self.first else []) + list(self.recent)

    def write(self, run_dir: str | os.PathLike) -> dict[str, str]:
        """Write trace.json and timeline.png (the last step) into run_dir; returns their paths."""
        run_dir = Path(run_dir)
        kept = self.kept_steps()
        if not kept:
            return {}
        trace = chrome_trace(kept, self.run, {"simulated_bubble": self.simulated_bubble,
                                               "schedule": self.schedule.name,
                                               "steps_kept": [s for s, _ in kept]})
        trace_path = write_private(run_dir / "trace.json", json.dumps(trace))
        step, spans = kept[-1]
        png_path = run_dir / "timeline.png"
        tmp = run_dir / ".timeline.tmp.png"
        try:
            render_step_png(spans, self.schedule, tmp,
                            title=f"{self.run}: step {step} as measured (times in ms)\n"
                                  f"simulated bubble {self.simulated_bubble:.1%}; measured:")
            os.chmod(tmp, FILE_MODE)
            os.replace(tmp, png_path)
        except BaseException:
            tmp.unlink(missing_ok=True)   # a full disk leaves no half-written picture behind
            raise
        self.paths = {"trace": str(trace_path), "timeline": str(png_path)}
        return self.paths

    def summary(self) -> dict:
        """Numbers for summary.json: steady-state figures exclude step 0 (compilation) when possible."""
        steady = self.steps[1:] or self.steps
        if not steady:
            return {}
        median = statistics.median(s.wall_s for s in steady)
        hosts = {}
        for h in self.steps[-1].hosts:
            hosts[f"stage{h.get('stage')}/host{h.get('host')}"] = {k: v for k, v in h.items()
                                                                  if k not in ("stage", "host")}
        waits = [max((h.get("data_wait_s", 0.0) for h in s.hosts), default=0.0) / s.wall_s
                 for s in steady if s.wall_s > 0]
        return {
            "first_step_s": self.steps[0].wall_s,
            # the longest wait of any host on its loader, as a share of the step (mean over steady steps)
            "data_wait_share": sum(waits) / len(waits) if waits else 0.0,
            "median_step_s": median,
            "samples_per_s": self.global_batch / median if median > 0 else 0.0,
            "measured_bubble_mean": sum(s.measured_bubble for s in steady) / len(steady),
            "measured_bubble_last": self.steps[-1].measured_bubble,
            "measured_bubble_per_step": [s.measured_bubble for s in self.steps],
            "simulated_bubble": self.simulated_bubble,
            "busy_fraction_last": {f"stage{s}/host{h}": b for (s, h), b in self.steps[-1].busy.items()},
            "hosts_last": hosts,
            **self.paths,
        }


class StepLog:
    """Per-step records appended to a JSON-lines file (`metrics.jsonl`) as the steps complete.

    One JSON object per line (step, loss, step_time_s, samples_per_s, time, …). The file is
    created owner-only (0o600) and only ever appended to (a resumed invocation continues the
    run's file, `orchestrator.driver.record`; nothing truncates it). Each record is written
    whole by `os.write` on an O_APPEND descriptor (looping only on a short write;
    `private_fs.append_fd`), so a run that dies keeps every record written before it; nothing
    is buffered in the process. A full disk raises `DiskFullError` (the run stops with a clear
    message) and leaves no partial line. A
    temp file + rename per record would keep the same promise at O(steps²) bytes written.

    Example:
      >>> import tempfile, pathlib
      >>> log = StepLog(pathlib.Path(tempfile.mkdtemp()) / "metrics.jsonl")
      >>> log.append({"step": 0, "loss": 1.5}); log.append({"step": 1, "loss": 1.25}); log.close()
      >>> [json.loads(line)["loss"] for line in log.path.read_text().splitlines()]
      [1.5, 1.25]
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0)
        self._fd = os.open(self.path, flags, FILE_MODE)
        os.fchmod(self._fd, FILE_MODE)   # the mode given to open() is masked by the umask
        self.count = 0

    def append(self, record: dict) -> None:
        """Write one record as one line.

        Raises:
          DiskFullError: the disk is full; the file keeps every whole record before this one.
        """
        append_fd(self._fd, self.path, json.dumps(record) + "\n")
        self.count += 1

    def close(self) -> None:
        """Close the file (idempotent)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


def summary_block(summary: dict, run_dir: str | os.PathLike) -> str:
    """The final text block printed after a run."""
    t = summary.get("telemetry") or {}
    lines = [f"── {summary.get('run', '')} done " + "─" * 40]
    if t:
        lines.append(f"  step time   median {t['median_step_s'] * 1e3:.1f} ms (first step, with compilation: "
                     f"{t['first_step_s'] * 1e3:.0f} ms)")
        lines.append(f"  throughput  {t['samples_per_s']:.1f} samples/s")
        lines.append(f"  bubble      measured {t['measured_bubble_mean']:.1%} (mean after step 0; last "
                     f"{t['measured_bubble_last']:.1%}), simulated {t['simulated_bubble']:.1%}")
    elif summary.get("step_times_s"):
        times = summary["step_times_s"]
        lines.append(f"  step time   last {times[-1] * 1e3:.1f} ms over {len(times)} steps")
    if summary.get("losses"):
        lines.append(f"  loss        {summary['losses'][0]:.5f} → {summary['losses'][-1]:.5f}")
    if t.get("trace"):
        lines.append(f"  trace       {t['trace']}  (open in https://ui.perfetto.dev)")
    if t.get("timeline"):
        lines.append(f"  timeline    {t['timeline']}")
    lines.append(f"  summary     {Path(run_dir) / 'summary.json'}")
    return "\n".join(lines)


class Progress:
    """One line per step (not a terminal: Ray Jobs logs, files) or a redrawn bar (terminal).

    Example:
      >>> lines = []
      >>> p = Progress(2, tty=False, echo=lines.append, line=lambda r: f"step {r['step']}")
      >>> p.update({"step": 0, "loss": 1.0, "step_time_s": 0.5, "samples_per_s": 8.0}); p.close()
      >>> lines
      ['step 0']
    """

    def __init__(self, total: int, *, tty: bool, echo: Callable[[str], None],
                 line: Callable[[dict], str], stream: TextIO | None = None, width: int = 30,
                 columns: Callable[[], int] | None = None):
        self.total, self.tty, self.echo, self.line = total, tty, echo, line
        self.stream = stream or sys.stdout
        self.width = width
        self.columns = columns or _terminal_columns(self.stream)
        self.done = 0
        self._drawn = False
        self.eval_loss = None        # the latest evaluation's loss, kept on the bar
        self.tag: str | None = None  # what else each line shows (an elastic run's plan in use)

    def update(self, rec: dict) -> None:
        self.done = rec["step"] + 1
        if rec.get("eval_loss") is not None:
            self.eval_loss = rec["eval_loss"]
        if not self.tty:
            self.echo(self.line(rec) + (f"  [{self.tag}]" if self.tag else ""))
            return
        self.stream.write("\r" + self.text(rec, self.columns()))
        self.stream.flush()
        self._drawn = True

    def text(self, rec: dict, columns: int) -> str:
        """The bar line, at most `columns - 1` characters (a full last column wraps on some
        terminals): fields are dropped from the right, then the bar shrinks, to fit.

        Example:
          >>> p = Progress(100, tty=True, echo=print, line=str)
          >>> rec = {"step": 41, "loss": 0.5, "step_time_s": 0.1, "samples_per_s": 320.0}
          >>> len(p.text(rec, 80)) <= 79, len(p.text(rec, 40)) <= 39
          (True, True)
        """
        limit = max(10, columns - 1)
        eta = rec["step_time_s"] * (self.total - self.done)   # at the latest pace (startup excluded)
        fields = [f"{self.done}/{self.total}", f"loss {rec['loss']:.4f}"]
        if self.eval_loss is not None:
            fields.append(f"eval {self.eval_loss:.4f}")
        fields += [f"{rec['step_time_s'] * 1e3:.0f} ms/step", f"eta {eta:.0f}s", f"{rec['samples_per_s']:.1f} samples/s"]
        if self.tag:
            fields.append(self.tag)
        frac = min(1.0, self.done / max(1, self.total))
        while True:
            tail = "  ".join(fields)
            bar_w = min(self.width, limit - len(tail) - 1)
            if bar_w >= 10 or len(fields) == 1:
                break
            fields.pop()
        bar_w = max(0, bar_w)
        filled = int(round(frac * bar_w))
        bar = "█" * filled + "░" * (bar_w - filled)
        out = f"{bar} {tail}" if bar_w else tail
        return out[:limit].ljust(limit)

    def close(self) -> None:
        if self.tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


def _terminal_columns(stream) -> Callable[[], int]:
    """Columns of the terminal `stream` writes to, read at each redraw (a resized window)."""
    import os
    import shutil

    def columns() -> int:
        try:
            return os.get_terminal_size(stream.fileno()).columns
        except (AttributeError, ValueError, OSError):
            return shutil.get_terminal_size((80, 24)).columns

    return columns
