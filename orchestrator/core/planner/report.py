"""What `meshpipe plan --auto` prints and writes: the candidates table, `--explain`, the job YAML. Pure.

`job_dict(raw_job, candidate, dph)` rewrites a job's `pipeline` and `layout`
sections with the winner's stages (layers, hosts, mesh in axis order, per-stage
layout and remat), microbatches and schedule; everything else in the job is kept as written.
"""
from __future__ import annotations

import copy
from typing import Any, Mapping

from orchestrator.core.plan import cross_host_axes
from orchestrator.core.planner.search import Candidate, SearchResult

__all__ = ["table", "explain", "job_dict", "candidate_json", "terms"]


def _mb(x: float) -> str:
    return f"{x / 2**20:.2f}"


def _stage_text(c: Candidate) -> str:
    return " | ".join("+".join(f"[{a},{b})" for a, b in (s.chunks or (s.layers,))) + f" h{s.hosts[0]}"
                      + (f"-{s.hosts[0] + s.hosts[1] - 1}" if s.hosts[1] > 1 else "")
                      + f" {s.choice.label()}" for s in c.stages)


def table(result: SearchResult) -> str:
    """The best candidates, one row each, and per-stage communication of each."""
    lines = [f"{'#':>2} {'step ms':>9} {'MiB/dev':>8} {'bubble':>6} {'sched':>6} {'m':>3}  stages (layers hosts mesh rules)"]
    for i, c in enumerate(result.candidates):
        sched = c.schedule if c.virtual_stages == 1 else f"{c.schedule} v={c.virtual_stages}"
        lines.append(f"{i:>2} {c.step_s * 1e3:>9.3f} {_mb(c.memory_bytes):>8} {c.bubble:>6.3f} {sched:>6} "
                     f"{c.microbatches:>3}  {_stage_text(c)}")
        edges = ", ".join(f"{e['edge'][0]}→{e['edge'][1]} {e['bytes']:,} B ({e['link']}"
                          + (f", {e['transport']} {e['time_s'] * 1e3:.3g} ms, sender held {e['send_block_s'] * 1e3:.3g} ms"
                             if "transport" in e else "") + ")" for e in c.edges)
        colls = ", ".join(f"s{k}: tp {s.tp_bytes:,.0f} B, dp {s.dp_bytes:,.0f} B"
                          + (f", fsdp {s.fsdp_bytes:,.0f} B" if s.fsdp_bytes else "") for k, s in enumerate(c.stages))
        lines.append(f"{'':>3} per microbatch: edges {edges or '-'}; collectives per device {colls}")
    return "\n".join(lines)


def terms(c: Candidate) -> dict[str, float]:
    """A candidate's predicted step split into terms (seconds): where the time goes."""
    m, v = c.microbatches, c.virtual_stages
    bottleneck = max(c.stages, key=lambda s: s.fwd_s + s.bwd_s)
    return {"compute": m * bottleneck.compute_s, "tensor-parallel collectives": m * bottleneck.tp_comm_s,
            "data-parallel gradient all-reduce": m * bottleneck.dp_comm_s,
            "fsdp all-gathers and reduce-scatters": m * bottleneck.fsdp_comm_s,
            "pipeline bubble": c.bubble * c.step_s,
            # each way once along the critical path: every (virtual) boundary an edge carries
            "stage-edge transfers": 2 * sum(len(e.get("boundaries", (0,))) * e["time_s"] for e in c.edges),
            # a blocking SEND / an H2D on the compute thread, every microbatch, each way
            "compute threads held by transfers": 2 * m * v * sum(e.get("send_block_s", 0.0) + e.get("recv_block_s", 0.0)
                                                                 for e in c.edges),
            "per-action runtime overhead": (2 * m * v + 1) * bottleneck.overhead_s,
            "optimizer update": max(s.opt_s - s.overhead_s for s in c.stages)}


def explain(result: SearchResult, dph: int) -> str:
    """Why the winner wins: its terms, the dominant extra term of each runner-up, and the host-crossing variant."""
    best = result.best
    t = terms(best)
    lines = [f"winner: {best.step_s * 1e3:.3f} ms per step ({len(best.stages)} stages, {best.schedule}, "
             f"m={best.microbatches}); terms (bottleneck stage × m, bubble, transfers):"]
    lines += [f"  {k:<36} {v * 1e3:10.3f} ms" for k, v in t.items()]
    for i, c in enumerate(result.candidates[1:], start=1):
        tc = terms(c)
        worst = max(tc, key=lambda k: tc[k] - t[k])
        lines.append(f"#{i} loses by {(c.step_s - best.step_s) * 1e3:.3f} ms: mostly {worst} "
                     f"(+{(tc[worst] - t[worst]) * 1e3:.3f} ms)")

    def crosses(c: Candidate) -> bool:
        return any("model" in cross_host_axes(s.choice.mesh(), dph) for s in c.stages)

    inside = next((c for c in result.ranked if not crosses(c) and any(s.choice.model > 1 for s in c.stages)), None)
    across = next((c for c in result.ranked if crosses(c)), None)
    lines.append("model axis inside hosts vs across hosts (best of each among all plans evaluated):")
    for name, c in (("inside", inside), ("across", across)):
        if c is None:
            lines.append(f"  {name:<7} none evaluated")
        else:
            lines.append(f"  {name:<7} {c.step_s * 1e3:.3f} ms ({c.step_s / best.step_s:.2f}× the winner): {_stage_text(c)}")
    for n in result.topology.notes if result.topology is not None else ():
        lines.append(f"note: {n}")
    return "\n".join(lines)


def candidate_json(c: Candidate) -> dict[str, Any]:
    return {"step_s": c.step_s, "memory_bytes_per_device": c.memory_bytes, "bubble": c.bubble,
            "schedule": c.schedule, "microbatches": c.microbatches, "virtual_stages": c.virtual_stages,
            "edges": list(c.edges),
            "stages": [{"layers": list(s.layers), "first_host": s.hosts[0], "hosts": s.hosts[1],
                        "mesh": s.choice.mesh(), "layout": s.choice.layout(), "rules": s.choice.rules_name,
                        "remat": s.choice.remat,
                        "fwd_s": s.fwd_s, "bwd_s": s.bwd_s, "opt_s": s.opt_s, "memory_bytes": s.memory_bytes,
                        "inflight": s.inflight, "tp_bytes": s.tp_bytes, "dp_bytes": s.dp_bytes,
                        "fsdp_bytes": s.fsdp_bytes, "fsdp_comm_s": s.fsdp_comm_s,
                        **({"chunks": [list(r) for r in s.chunks]} if s.chunks else {}),
                        **({"i_s": s.i_s, "w_s": s.w_s, "held_bytes": s.held_bytes} if c.schedule == "zb-h1" else {}),
                        "overhead_s": s.overhead_s,
                        "compute_s": s.compute_s, "tp_comm_s": s.tp_comm_s, "dp_comm_s": s.dp_comm_s}
                       for s in c.stages],
            "terms_s": terms(c)}


def job_dict(raw_job: Mapping[str, Any], c: Candidate) -> dict[str, Any]:
    """The job (as loaded from YAML) with the candidate's pipeline and per-stage layouts."""
    out = copy.deepcopy(dict(raw_job))
    pipeline = dict(out.get("pipeline") or {})
    pipeline["schedule"] = c.schedule
    pipeline["microbatches"] = c.microbatches
    pipeline["virtual_stages"] = c.virtual_stages
    pipeline.pop("split_at", None)
    inherited = pipeline.get("remat", "none")      # a stage without `remat:` takes pipeline.remat
    pipeline["stages"] = [{"layers": [list(r) for r in s.chunks] if s.chunks else list(s.layers),
                           "mesh": s.choice.mesh(), "hosts": s.hosts[1],
                           **({"layout": s.choice.layout()} if s.choice.layout() else {}),
                           **({"remat": s.choice.remat} if s.choice.remat != inherited else {})} for s in c.stages]
    out["pipeline"] = pipeline
    out["layout"] = {}
    return out
