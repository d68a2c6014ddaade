"""Pictures of schedules: a text grid, a Chrome/Perfetto trace and a PNG timeline.

* `render_grid` - step x stage text grid for terminals, golden files and error
  messages; marked cells are shown as ``[1B0]``.
* `to_chrome_trace` - simulated spans as Chrome-trace JSON (open in
  https://ui.perfetto.dev or chrome://tracing): one process per stage, compute
  on thread 0, sends/receive waits on thread 1.
* `render_png` - the simulated timeline drawn with matplotlib's Agg canvas (no
  global backend switch): stages as rows, one colour per kind, lighter shades
  for later chunks, the microbatch number in each box.
"""
from __future__ import annotations

from typing import Any

from orchestrator.core.schedule.grid import render_grid  # noqa: F401 - part of this module's API
from orchestrator.core.schedule.ir import COMPUTE, Kind, Schedule

COLORS = {Kind.F: "#2f6db5", Kind.B: "#e8812e", Kind.I: "#c73a3a",
          Kind.W: "#3f9a4a", Kind.OPT: "#6e6e6e"}


def to_chrome_trace(sim: Any, schedule: Schedule, time_scale: float = 1e6) -> dict:
    """Chrome-trace JSON of a simulation: a pid per stage, "X" events in microseconds.

    Args:
      sim: `SimResult` of `schedule`.
      schedule: the simulated (lowered) schedule.
      time_scale: microseconds per cost unit (1e6: costs are seconds).

    Example:
      >>> from orchestrator.core.schedule import generate, lower, simulate
      >>> low = lower(generate("gpipe", 2, 1))
      >>> trace = to_chrome_trace(simulate(low, {"F": 1, "B": 2}), low)
      >>> xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
      >>> [(e["name"], e["pid"], e["ts"], e["dur"]) for e in xs[:2]]
      [('F0', 0, 0.0, 1000000.0), ('SEND_F0', 0, 1000000.0, 0.0)]
    """
    events: list[dict] = []
    for s in range(schedule.p):
        events.append({"name": "process_name", "ph": "M", "pid": s,
                       "args": {"name": f"stage {s}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": s,
                       "args": {"sort_index": s}})
        for tid, label in ((0, "compute"), (1, "comm")):
            events.append({"name": "thread_name", "ph": "M", "pid": s, "tid": tid,
                           "args": {"name": label}})
    for a, start, end in sim.spans:
        name = str(a)[len(str(a.stage)):]
        events.append({
            "name": name, "cat": a.kind.value, "ph": "X", "pid": a.stage,
            "tid": 0 if a.kind in COMPUTE or a.kind is Kind.OPT else 1,
            "ts": float(start) * time_scale, "dur": float(end - start) * time_scale,
            "args": {"action": str(a), "microbatch": a.microbatch, "chunk": a.chunk},
        })
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"schedule": schedule.name, "p": schedule.p, "m": schedule.m,
                          "v": schedule.v, "step_time": float(sim.step_time),
                          "bubble_fraction": float(sim.bubble_fraction)}}


def render_png(sim: Any, schedule: Schedule, path: str, title: str | None = None) -> None:
    """Draw the simulated timeline to a PNG file.

    Stages are rows (stage 0 on top), time runs right; F/B/I/W/OPT have distinct
    colours, later chunks lighter shades; each box shows its microbatch number.
    The title carries the step time and the bubble fraction.

    Example:
      >>> import os, tempfile
      >>> from orchestrator.core.schedule import generate, lower, simulate
      >>> low = lower(generate("1f1b", 4, 8))
      >>> out = os.path.join(tempfile.mkdtemp(), "1f1b.png")
      >>> render_png(simulate(low, {"F": 1, "B": 2}), low, out)
      >>> os.path.getsize(out) > 0
      True
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    p, v = schedule.p, schedule.v
    boxes = [(a, float(t0), float(t1)) for a, t0, t1 in sim.spans
             if (a.kind in COMPUTE or a.kind is Kind.OPT) and t1 > t0]
    step = float(sim.step_time) or 1.0
    most = max([sum(1 for a, _, _ in boxes if a.stage == s) for s in range(p)] or [1])
    fig_w = min(max(8.0, 1.5 + 0.32 * most), 36.0)
    fig_h = 1.8 + 0.5 * p
    fig = Figure(figsize=(fig_w, fig_h), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    axes_w_in = fig_w - 1.2                       # minus the stage labels' margin
    used: dict[tuple[Kind, int], str] = {}
    for a, t0, t1 in boxes:
        color = _shade(COLORS[a.kind], a.chunk, v)
        used[(a.kind, a.chunk)] = color
        ax.barh(a.stage, t1 - t0, left=t0, height=0.8, color=color,
                edgecolor="white", linewidth=0.6)
        if a.kind is Kind.OPT:
            continue
        label = str(a.microbatch)
        box_pt = (t1 - t0) / step * axes_w_in * 72
        size = min(9.0, box_pt / (0.62 * len(label) + 0.4))
        if size >= 4:
            ax.text((t0 + t1) / 2, a.stage, label, ha="center", va="center", fontsize=size,
                    color="black" if _lightness(color) > 0.6 else "white")
    ax.set_yticks(range(p), [f"stage {s}" for s in range(p)])
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_xlim(0, step)
    ax.set_xlabel("time")
    ax.grid(axis="x", alpha=0.25)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    order = [Kind.F, Kind.B, Kind.I, Kind.W, Kind.OPT]
    handles = [Patch(color=color, label=_legend_label(k, c, v)) for (k, c), color
               in sorted(used.items(), key=lambda kc: (order.index(kc[0][0]), kc[0][1]))]
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 8),
               frameon=False, fontsize=8)
    head = title or f"{schedule.name}  p={p} m={schedule.m}" + (f" v={v}" if v > 1 else "")
    ax.set_title(f"{head}   step time {step:.4g}   bubble {float(sim.bubble_fraction):.1%}",
                 fontsize=11, loc="left")
    fig.savefig(path)


_NAMES = {Kind.F: "forward", Kind.B: "backward", Kind.I: "input grad (I)",
          Kind.W: "weight grad (W)", Kind.OPT: "optimizer"}


def _legend_label(kind: Kind, chunk: int, v: int) -> str:
    return _NAMES[kind] + (f" chunk {chunk}" if v > 1 and kind is not Kind.OPT else "")


def _lightness(color: str) -> float:
    r, g, b = (int(color[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return 0.299 * r + 0.587 * g + 0.114 * b


def _shade(color: str, chunk: int, v: int) -> str:
    """Mix `color` with white: chunk 0 full colour, later chunks lighter."""
    if v <= 1 or chunk == 0:
        return color
    mix = 0.6 * chunk / (v - 1)
    rgb = [int(color[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * mix):02x}" for c in rgb)
