"""Plots of `benchmarks.run`: efficiency bars, the 1F1B loss breakdown, one measured step's timeline."""
from __future__ import annotations

from benchmarks import common
from benchmarks.common import RESULTS, SCHEDULES, SIZES
from benchmarks.derive import find as _find

BREAKDOWN_KEYS = ("useful", "split", "imbalance", "bubble", "optimizer", "transfers", "orchestration")


def make_plots(raw: dict, der: dict, suffix: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    if der["pipeline"] or der["torch"]:
        groups = sorted({(d["key"][0], d["key"][2]) for d in der["pipeline"] + der["torch"] if d["key"][0] != "tiny"},
                        key=lambda g: (list(SIZES).index(g[0]), g[1]))
        series = [("meshpipe " + s, der["pipeline"], s) for s in SCHEDULES] + \
                 [("torch " + s, der["torch"], s) for s in ("1f1b", "gpipe")]
        series = [x for x in series if any(d["key"][1] == x[2] for d in x[1])]
        fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups) * max(1, len(series)) / 3), 4))
        w = 0.8 / max(1, len(series))
        for j, (label, items, sched) in enumerate(series):
            xs, ys = [], []
            for i, (size, m) in enumerate(groups):
                d = _find(items, size, sched, m)
                if d:
                    xs.append(i + j * w)
                    ys.append(d["efficiency"])
            ax.bar(xs, ys, w, label=label, hatch="//" if label.startswith("torch") else None)
        ax.axhline(0.95, color="k", ls="--", lw=1, label="target 0.95")
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(groups))], [f"{s}, m={m}" for s, m in groups])
        ax.set_ylabel("efficiency = ideal / measured step")
        ax.set_ylim(0, 1.1)
        ax.legend(fontsize=7, ncol=2)
        ax.set_title("Pipeline efficiency (2 stages)")
        fig.tight_layout()
        files.append(_save(fig, f"pipeline_efficiency{suffix}.png"))
    rows = [d for d in der["pipeline"] if d["key"][1] == "1f1b"]
    if rows:
        fig, ax = plt.subplots(figsize=(8.5, 0.5 * len(rows) + 1.8))
        keys = [k for k in BREAKDOWN_KEYS if any(d["breakdown_share"].get(k) is not None for d in rows)]
        if "useful" not in keys:
            keys = ["compute"] + keys
        left = [0.0] * len(rows)
        for k in keys:
            vals = [max(0.0, d["breakdown_share"].get(k) or 0.0) for d in rows]
            ax.barh(range(len(rows)), vals, left=left, label=k)
            left = [a + b for a, b in zip(left, vals)]
        ax.set_yticks(range(len(rows)), [f"{d['key'][0]} m={d['key'][2]}" for d in rows])
        ax.set_xlabel("share of the measured 1F1B step")
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
        ax.set_title("Where a pipelined step goes")
        fig.tight_layout()
        files.append(_save(fig, f"pipeline_breakdown{suffix}.png"))
    ok = [r for r in raw.get("pipeline", {}).get("records", []) if r.get("status") == "ok" and r["schedule"] == "1f1b"]
    if ok:
        r = max(ok, key=lambda x: (list(SIZES).index(x["size"]), x["m"]))
        files.append(_timeline(plt, r, f"pipeline_timeline{suffix}.png"))
    return files


COLORS = {"F": "tab:blue", "B": "tab:orange", "I": "tab:orange", "W": "tab:olive", "OPT": "tab:red",
          "SEND_F": "tab:gray", "SEND_B": "tab:gray", "RECV_F": "lightgray", "RECV_B": "lightgray"}


def _timeline(plt, rec: dict, name: str) -> str:
    spans = rec["example_spans"]
    t0 = min(s[3] for s in spans)
    fig, ax = plt.subplots(figsize=(10, 2.6))
    for stage, _host, text, start, end in spans:
        k = common.kind_of(text)
        ax.barh(2 * stage + 1, (end - start) * 1e3, left=(start - t0) * 1e3, color=COLORS.get(k, "k"),
                edgecolor="white", lw=0.3)
    for stage, text, start, end in rec["ideal_spans"]:
        k = common.kind_of(text)
        if end > start:
            ax.barh(2 * stage, (end - start) * 1e3, left=start * 1e3, color=COLORS.get(k, "k"),
                    edgecolor="white", lw=0.3, alpha=0.6)
    ax.set_yticks(range(4), ["stage 0 ideal", "stage 0 measured", "stage 1 ideal", "stage 1 measured"])
    ax.invert_yaxis()
    ax.set_xlabel("ms (blue F, orange B, red OPT, grey send/recv)")
    ax.set_title(f"One measured step vs the ideal: {rec['size']}, 1F1B, m={rec['m']} "
                 f"(step {rec['step_s'] * 1e3:.0f} ms, ideal {rec['ideal_s'] * 1e3:.0f} ms)")
    fig.tight_layout()
    return _save(fig, name)


def _save(fig, name: str) -> str:
    import matplotlib.pyplot as plt

    path = RESULTS / name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
