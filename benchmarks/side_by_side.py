"""Step times and device memory straight from one `benchmarks.run` measurement, nothing derived.

    python -m benchmarks.side_by_side RAW.json

RAW.json is the `raw` of a `benchmarks.run` run (its pipeline.json, or the pipeline.rejected.json
it leaves when a derived figure fails its check). Where the derivation refused to publish (an
efficiency above 1 from standalone costs that drifted), the measured step times of meshpipe and
torch.distributed.pipelining, taken in that one run on the same pinned cores, are still a fair
side-by-side; so are the live device bytes the actors read back. This writes them, with the
conditions read back from the processes, to benchmarks/results/pipeline_side_by_side.{md,json}.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.common import RESULTS, fmt, md_table

MIB = 2 ** 20


def _by_key(recs: list[dict], *keys: str) -> dict:
    return {tuple(r[k] for k in keys): r for r in recs if r.get("status", "ok") == "ok"}


def step_rows(raw: dict) -> list[list]:
    mine = _by_key(raw["pipeline"]["records"], "size", "m", "schedule")
    torch = _by_key(raw.get("torch", {}).get("pipe", []), "size", "m", "schedule")
    rows = []
    for (size, m, sched), r in sorted(mine.items()):
        t = torch.get((size, m, sched))
        rows.append([size, m, sched, fmt(r["step_s"] * 1e3, 1), fmt(r["step_spread"]),
                     fmt(t["step_s"] * 1e3, 1) if t else "–", fmt(t["step_spread"]) if t else "–",
                     fmt(r["step_s"] / t["step_s"]) if t else "–"])
    return rows


def plain_rows(raw: dict) -> list[list]:
    jax = _by_key(raw.get("jax", {}).get("records", []), "size", "m", "cores")
    torch = _by_key(raw.get("torch", {}).get("plain", []), "size", "m", "cores")
    return [[size, m, cores, fmt(r["step_s"] * 1e3, 1),
             fmt(torch[(size, m, cores)]["step_s"] * 1e3, 1) if (size, m, cores) in torch else "–"]
            for (size, m, cores), r in sorted(jax.items())]


def memory_rows(raw: dict) -> list[list]:
    """Per stage: predicted live bytes (params + grads + 2 adam moments = 4 × params, plus the
    schedule's peak stash of activations) beside the live device bytes the actor measured."""
    pred = {(r["size"], r["m"], r["schedule"], r["stage"]): r for r in raw.get("memory", {}).get("records", [])}
    rows = []
    for r in raw["pipeline"]["records"]:
        if r.get("status") != "ok":
            continue
        for s, live in enumerate(r.get("live_peak_bytes") or []):
            p = pred.get((r["size"], r["m"], r["schedule"], s))
            if p is None or live is None:
                continue
            want = 4 * p["param_bytes"] + p["peak_activation_bytes"]
            rows.append([r["size"], r["m"], r["schedule"], s, fmt(want / MIB, 1), fmt(live / MIB, 1),
                         fmt(live / want), fmt(r["stash_peak_bytes"][s] / MIB, 1),
                         fmt(p["peak_activation_bytes"] / MIB, 1)])
    return rows


def conditions(raw: dict) -> str:
    m = raw["machine"]
    seen: dict = {}
    for r in raw["pipeline"]["records"]:
        for o in r["observed"] if r.get("status") == "ok" else []:
            seen.setdefault((o["stage"], tuple(o["affinity"])), []).append(o.get("os_threads") or 0)
    pins = "; ".join(f"stage {s} on {{{','.join(map(str, a))}}} ({min(t)}-{max(t)} OS threads)"
                     for (s, a), t in sorted(seen.items()))
    return (f"{m['when']} UTC, {m['cpu']}, {m['nproc']} CPUs, {m['mem_gib']} GiB; jax {m['jax']}, ray {m['ray']}, "
            f"torch {m.get('torch', '–')}; load average {fmt(m['load_start'][0])} at the start, "
            f"{fmt(raw['load_end'][0])} at the end; read back from the actors in every run: {pins}.")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit(__doc__)
    raw = json.loads(Path(argv[0]).read_text())["raw"]
    md = ["# Step times and live memory, one run (nothing derived)", "", conditions(raw), "",
          "## meshpipe beside torch.distributed.pipelining (2 stages, 1 core each, same shapes)", "",
          "Median step over the measured steps; spread = (max − min) ÷ median of those steps; "
          "ratio < 1: meshpipe faster.", "",
          md_table(["size", "m", "schedule", "meshpipe ms", "spread", "torch ms", "spread", "meshpipe ÷ torch"],
                   step_rows(raw), "rrl" + "r" * 5), "",
          "## One process, no pipeline: plain JAX and plain torch", "",
          md_table(["size", "m", "cores", "plain JAX ms", "plain torch ms"], plain_rows(raw)), "",
          "## Device memory per stage: predicted live bytes beside the measured", "",
          "predicted live = 4 × the stage's parameter bytes (params, grads, two adam moments) + the "
          "schedule's peak stash of activations (shapes only); live = every buffer `jax.live_arrays()` "
          "listed on the stage's device at its peak; stash = the activations the actor kept at its peak.", "",
          md_table(["size", "m", "schedule", "stage", "predicted live MiB", "live MiB", "live ÷ predicted",
                    "stash MiB", "predicted stash MiB"], memory_rows(raw), "rrlr" + "r" * 5), ""]
    (RESULTS / "pipeline_side_by_side.md").write_text("\n".join(md))
    keep = {k: raw[k] for k in ("machine", "load_end", "config") if k in raw}
    keep["pipeline"] = [{k: r.get(k) for k in ("size", "m", "schedule", "step_s", "step_spread", "walls_s",
                                               "observed", "live_peak_bytes", "stash_peak_bytes", "status")}
                        for r in raw["pipeline"]["records"]]
    keep["torch"] = {k: raw.get("torch", {}).get(k) for k in ("when", "load", "pipe", "plain")}
    keep["jax"], keep["memory"] = raw.get("jax"), raw.get("memory")
    (RESULTS / "pipeline_side_by_side.json").write_text(json.dumps(keep, indent=1))
    print("\n".join(md))


if __name__ == "__main__":
    main()
