"""`meshpipe calibrate`'s pure half: fit what the probes measured, write the cluster YAML. Pure.

The probes (`stages.calibrate_probe`, driven by `orchestrator.driver.calibrate`)
return timed samples; this module turns them into the cluster's `device:` and
`links:` sections:

  links      an α-β fit per link class. A sample is (kind, k, bytes, seconds) and the
             model is the ring formula `topology.collective_time` uses, so the fit
             inverts exactly what the cost model will charge:
               all-reduce  t = 2(k-1)·α + 2(k-1)/k · n / β
               all-gather  t =  (k-1)·α +  (k-1)/k · n / β
               send        t =        α +            n / β
             i.e. t = a·α + x/β, linear in (α, 1/β): least squares over every sample
             of the class; α < 0 (noise on a fast link) is clamped to 0 and 1/β refitted
             through the origin. A slope ≤ 0 is refused (the sweep saw no bandwidth).
             The collectives of a mesh axis spanning hosts (one multi-process JAX world)
             are fitted the same way, per cross-host class, into `links.<class>.collectives`.
             Each collectives fit also gets `per_array_us` (`fit_per_array`): what each further
             array of ONE combined all-reduce adds — a backward's gradient all-reduces, which
             XLA combines, are reduced array by array on CPU (in-process and gloo).
  device     per-device FLOP/s and memory bandwidth, timed twice (`all_busy`): on host 0
             alone (`device.lone_tflops`, `lone_memory_bandwidth_gbps`) and on EVERY host at
             once from a common start time, in several windows (`device.tflops`,
             `memory_bandwidth_gbps`: the slowest host's median over the windows; each host's
             own is in the report). A pipeline's steady
             state has every stage's hosts computing together, so the cost model charges
             the all-busy figure; on a real cluster it equals the lone one, but simulated
             hosts sharing one machine's cores compute about hosts× slower together. The
             cost model charges the all-busy figure to one-stage plans on ONE host too
             (`search`, step 3): the lone figure comes from big programs whose devices
             compute side by side, while a stage's small kernels on simulated CPU devices
             take turns, and it predicted those plans 42–54 % low (issue #22's runs).
             The per-kernel time (`device.kernel_overhead_us`, alone `lone_kernel_overhead_us`):
             two programs over the host's devices, chains of n and 4n tiny dots and tanhs
             (their flops and bytes negligible), timed the same two ways; the slope
             (t₂ − t₁) / (kernels₂ − kernels₁) (`fit_kernel_time`) is what one kernel costs
             beyond its flops and bytes — launch, thunk dispatch, and on simulated devices
             sharing a process the devices' kernels taking turns.
             `device.shared_slowdown` (`shared_slowdown`): a stage-sized program (residual
             MLP blocks of small matmuls) timed the same two ways, all-busy ÷ alone, ≥ 1; the
             cost model charges plans on more than one host that many times the device time
             (`Topology.shared`). Simulated hosts sharing cores slow each other at stage scale
             far more than the big programs show.
  overhead   the runtime's fixed costs: per action (`device.action_overhead_us`), the o
             for which the schedule simulator, every F, B and OPT costing o, replays the
             step a tiny ONE-stage real run measured; per stage-edge transfer
             (`device.transfer_overhead_us`), the extra e on each edge's α-β time for
             which it replays a tiny TWO-stage run's step with that o (`fit_overhead`,
             bisection: the simulated step grows monotonically with either). The tiny runs
             are repeated in rounds (`fit_rounds`): each round's e is fitted at that
             round's own o (its two runs ran back to back, so a load both saw cancels), and
             the figures kept are the MEDIANS of the rounds' fits — robust to one loaded
             round, where the minimum (the old rule) is biased low: e is a difference of two
             noisy steps and the smallest of several came out 0. Both are ≥ 0 (bisection
             from 0). e is then checked against the per-transfer time read directly off the
             runs' SEND/RECV spans less the link's α-β time (`direct_transfers`,
             `choose_transfer`). The spans' figure is a transfer's own cost, so a fit well
             BELOW it (under half and more than `slack_s` under) is implausible — noise
             pushed it down — and the spans' figure (≥ 0) is written instead. A fit ABOVE it
             is kept: it is what the simulator must charge per edge to replay the two-stage
             step, which also holds costs the spans do not show (on simulated hosts sharing
             cores, both stages' runtime busy at once); the report notes the disagreement.

`calibrated_raw` merges the figures into the cluster's raw YAML dict (everything the
user wrote is kept; `device.memory_gb` is not measured and stays as written) and
`write_calibrated` writes it as a NEW file — never over the input — and checks that it
loads back through the cluster parser.
"""
from __future__ import annotations

import copy
import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import yaml

__all__ = ["CalibrationError", "Sample", "Fit", "fit_alpha_beta", "fit_per_array", "fit_overhead", "fit_rounds",
           "direct_transfers", "transfer_sanity", "choose_transfer", "all_busy", "fit_kernel_time", "shared_slowdown", "calibrated_raw", "default_out",
           "destination", "write_calibrated"]


class CalibrationError(ValueError):
    """The measurements cannot give a figure (or the output path is refused); the message says why."""


@dataclass(frozen=True)
class Sample:
    """One timed operation: `kind` (all-reduce | all-gather | send), k participants, bytes, seconds."""

    kind: str
    k: int
    nbytes: float
    seconds: float


@dataclass(frozen=True)
class Fit:
    """An α-β fit: latency (s), bandwidth (bytes/s), samples used, largest relative residual."""

    latency_s: float
    bandwidth: float
    samples: int
    max_rel_residual: float
    per_array_s: Optional[float] = None     # each further array of one combined all-reduce (`fit_per_array`)

    def link(self) -> dict[str, float]:
        """The `links.<class>` YAML entry (GB/s, µs)."""
        out = {"bandwidth_gbps": float(f"{self.bandwidth / 1e9:.6g}"), "latency_us": float(f"{self.latency_s * 1e6:.6g}")}
        if self.per_array_s is not None:
            out["per_array_us"] = float(f"{self.per_array_s * 1e6:.6g}")
        return out


def _terms(s: Sample) -> tuple[float, float]:
    """(a, x) of t = a·α + x/β for one sample (module docstring)."""
    k = s.k
    if s.kind == "all-reduce":
        return 2 * (k - 1), 2 * (k - 1) / k * s.nbytes
    if s.kind == "all-gather":
        return k - 1, (k - 1) / k * s.nbytes
    if s.kind == "send":
        return 1.0, float(s.nbytes)
    raise CalibrationError(f"unknown sample kind {s.kind!r} (all-reduce, all-gather, send)")


def fit_alpha_beta(samples: Sequence[Sample], what: str = "link") -> Fit:
    """Least-squares α-β fit of samples of one link class (see the module docstring).

    Raises:
      CalibrationError: fewer than two distinct sizes, a non-finite or non-positive time,
        a kind with k < 2, or times that do not grow with size (no bandwidth to fit).

    Example:
        >>> s = [Sample("send", 2, n, 1e-5 + n / 2e9) for n in (1e3, 1e5, 1e7)]
        >>> f = fit_alpha_beta(s)
        >>> round(f.latency_s * 1e6, 3), round(f.bandwidth / 1e9, 3)
        (10.0, 2.0)
    """
    import numpy as np

    rows = []
    for s in samples:
        if not (math.isfinite(s.seconds) and s.seconds > 0):
            raise CalibrationError(f"{what}: a {s.kind} of {s.nbytes:g} bytes took {s.seconds!r} s; "
                                   "times must be finite and positive")
        if s.kind != "send" and s.k < 2:
            raise CalibrationError(f"{what}: a {s.kind} over k = {s.k} device(s) moves nothing; need k ≥ 2")
        rows.append((*_terms(s), s.seconds))
    if len({x for _, x, _ in rows}) < 2:
        raise CalibrationError(f"{what}: need samples at two or more sizes to fit latency and bandwidth, "
                               f"got {len(rows)} sample(s) at {len({x for _, x, _ in rows})} size(s)")
    a, x, t = (np.array(c, dtype=float) for c in zip(*rows))
    (alpha, inv_beta), *_ = np.linalg.lstsq(np.stack([a, x], 1), t, rcond=None)
    if alpha < 0:
        alpha, inv_beta = 0.0, float((x @ t) / (x @ x))
    if not inv_beta > 0:
        raise CalibrationError(f"{what}: the time does not grow with the size over {len(rows)} samples "
                               f"({t.min():.3g}–{t.max():.3g} s for {x.min():.3g}–{x.max():.3g} bytes moved): "
                               "no bandwidth can be fitted; sweep larger sizes")
    pred = a * alpha + x * inv_beta
    return Fit(float(alpha), float(1.0 / inv_beta), len(rows), float(np.max(np.abs(pred - t) / t)))


def fit_per_array(records: Sequence[Mapping]) -> Optional[float]:
    """Seconds each further array adds to one combined all-reduce, or None without such records.

    XLA combines a backward's gradient all-reduces into one all-reduce of many arrays; on CPU
    (in-process and gloo) the arrays are reduced one after another, so its time grows with the
    count beyond what its bytes explain. `records`: the probe's timings, those with `arrays`
    (n arrays of equal size, one program) used; grouped by (axis, k), the slope of time over n
    pooled across the groups (each its own intercept): Σ cov(n, t) / Σ var(n). Clamped at 0.

    Example:
        >>> recs = [{"axis": "all", "k": 2, "arrays": n, "seconds": 1e-4 + n * 3e-5} for n in (1, 4, 16)]
        >>> recs += [{"axis": "hosts", "k": 2, "arrays": n, "seconds": 5e-3 + n * 3e-5} for n in (1, 4, 16)]
        >>> round(fit_per_array(recs) * 1e6, 6)
        30.0
        >>> fit_per_array([{"kind": "all-reduce", "k": 2, "nbytes": 8, "seconds": 1e-4}]) is None
        True
    """
    groups: dict[tuple, list[tuple[float, float]]] = {}
    for r in records:
        if "arrays" in r:
            if not (math.isfinite(r["seconds"]) and r["seconds"] > 0):
                raise CalibrationError(f"a combined all-reduce of {r['arrays']} arrays took {r['seconds']!r} s; "
                                       "times must be finite and positive")
            groups.setdefault((r.get("axis"), r["k"]), []).append((float(r["arrays"]), float(r["seconds"])))
    cov = var = 0.0
    for pts in groups.values():
        n_mean = sum(n for n, _ in pts) / len(pts)
        t_mean = sum(t for _, t in pts) / len(pts)
        cov += sum((n - n_mean) * (t - t_mean) for n, t in pts)
        var += sum((n - n_mean) ** 2 for n, _ in pts)
    if var == 0:
        return None
    return max(0.0, cov / var)


def fit_overhead(simulate_step, measured_s: float, hi: float = 1.0, tol: float = 1e-7) -> float:
    """The per-action overhead o ≥ 0 with `simulate_step(o) == measured_s` (bisection).

    `simulate_step(o)` is the simulated step (seconds) when every F, B and OPT action costs
    o more; it must grow with o. A measured step at or below `simulate_step(0)` gives 0.

    Raises:
      CalibrationError: the measured step is not finite and positive, or beyond `simulate_step(hi)`.

    Example:
        >>> round(fit_overhead(lambda o: 0.002 + 9 * o, 0.011), 6)
        0.001
    """
    if not (math.isfinite(measured_s) and measured_s > 0):
        raise CalibrationError(f"the tiny run's measured step is {measured_s!r} s; need a finite positive time")
    lo_t = simulate_step(0.0)
    if measured_s <= lo_t:
        return 0.0
    if simulate_step(hi) < measured_s:
        raise CalibrationError(f"the tiny run's step ({measured_s:.3g} s) needs more than {hi:g} s per action; "
                               "the machine is too loaded to calibrate")
    lo = 0.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if simulate_step(mid) < measured_s:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def fit_rounds(one_stage_s: Sequence[float], two_stage_s: Sequence[float], sim_one: Callable[[float], float],
               sim_two: Callable[[float, float], float], hi: float = 10.0) -> dict[str, Any]:
    """The per-action overhead o and per-transfer overhead e from rounds of the tiny runs.

    `one_stage_s[r]`, `two_stage_s[r]`: round r's measured steps (seconds; `two_stage_s` empty on
    one host); `sim_one(o)`: the simulated one-stage step with every action costing o;
    `sim_two(o, e)`: the two-stage step with that o and every edge e more. Round r's o_r is
    fitted to its one-stage step and its e_r to its two-stage step at o_r; o and e are the
    medians of the rounds' figures (module docstring), each ≥ 0. Returns {"action_overhead_s",
    "transfer_overhead_s" (None without two-stage rounds), "rounds": [{"action_overhead_s",
    "transfer_overhead_s"}] (each round's own fits, for the record)}.

    Raises:
      CalibrationError: no round, or two-stage rounds given but not one per one-stage round.

    Example (round 1 ran under load: both its steps 50 % slower):
        >>> r = fit_rounds([0.009, 0.0135, 0.009], [0.02, 0.03, 0.02], lambda o: 9 * o,
        ...                lambda o, e: 9 * o + 2 * e)
        >>> round(r["action_overhead_s"], 6), round(r["transfer_overhead_s"], 6)
        (0.001, 0.0055)
    """
    if not one_stage_s:
        raise CalibrationError("no round of the tiny one-stage run was measured")
    if two_stage_s and len(two_stage_s) != len(one_stage_s):
        raise CalibrationError(f"{len(two_stage_s)} two-stage round(s) for {len(one_stage_s)} one-stage round(s); "
                               "each round runs both")
    rounds = []
    for r, m1 in enumerate(one_stage_s):
        o_r = fit_overhead(sim_one, m1, hi=hi)
        e_r = fit_overhead(lambda x, o_r=o_r: sim_two(o_r, x), two_stage_s[r], hi=hi) if two_stage_s else None
        rounds.append({"action_overhead_s": o_r, "transfer_overhead_s": e_r})
    o = statistics.median(r["action_overhead_s"] for r in rounds)
    e = statistics.median(r["transfer_overhead_s"] for r in rounds) if two_stage_s else None
    return {"action_overhead_s": o, "transfer_overhead_s": e, "rounds": rounds}


def direct_transfers(spans: Sequence[Sequence[Any]]) -> list[float]:
    """Per stage-edge transfer of one step, the seconds from its SEND's start to its RECV's end.

    `spans`: (stage, host, action text, start, end) per executed action (a run summary's
    `last_step_spans`; wall-clock seconds). Only transfers whose RECV began before the SEND
    count (the receiver was waiting, so the time is the transfer's own, not the receiver's
    backlog); one host per stage is enough (host 0 of each).

    Example:
        >>> ts = direct_transfers([(0, 0, "0SEND_F0", 1.0, 1.001), (1, 0, "1RECV_F0", 0.5, 1.004),
        ...                        (1, 0, "1SEND_B0", 2.0, 2.001), (0, 0, "0RECV_B0", 2.5, 2.6)])
        >>> [round(t, 6) for t in ts]      # the B0 transfer's receiver was not waiting yet: left out
        [0.004]
    """
    from orchestrator.core.schedule import Action, Kind

    sends, recvs = {}, {}
    for stage, host, text, t0, t1 in spans:
        if host != 0:
            continue
        try:
            a = Action.parse(str(text))
        except Exception:  # noqa: BLE001 - a span of something else (no action text)
            continue
        if a.kind in (Kind.SEND_F, Kind.SEND_B):
            dst = a.stage + (1 if a.kind is Kind.SEND_F else -1)
            sends[(a.kind.value[-1], a.microbatch, a.chunk, a.stage, dst)] = float(t0)
        elif a.kind in (Kind.RECV_F, Kind.RECV_B):
            src = a.stage - (1 if a.kind is Kind.RECV_F else -1)
            recvs[(a.kind.value[-1], a.microbatch, a.chunk, src, a.stage)] = (float(t0), float(t1))
    out = []
    for key, s0 in sorted(sends.items(), key=lambda kv: kv[1]):
        if key in recvs and recvs[key][0] <= s0:
            out.append(recvs[key][1] - s0)
    return out


def transfer_sanity(fitted_s: float, direct_s: float, slack_s: float = 5e-4) -> tuple[bool, str]:
    """Whether the fitted per-transfer overhead agrees with the direct one (within `slack_s`, or 2× either way).

    `direct_s`: the directly measured per-transfer time less the link's α-β time. Returns
    (ok, a sentence for the report).

    Example:
        >>> transfer_sanity(0.0053, 0.0011)[0], transfer_sanity(0.0012, 0.0009)[0], transfer_sanity(0.0, 0.0015)[0]
        (False, True, False)
    """
    ok = abs(fitted_s - direct_s) <= slack_s or (direct_s > 0 and direct_s / 2 <= fitted_s <= 2 * direct_s)
    word = "agrees with" if ok else "DISAGREES with"
    return ok, (f"the fitted per-transfer overhead {fitted_s * 1e6:.0f} µs {word} the one read off the run's "
                f"SEND/RECV spans, {direct_s * 1e6:.0f} µs (within 2× or {slack_s * 1e6:.0f} µs)")


def choose_transfer(fitted_s: float, direct_s: Sequence[float], link_s: float,
                    slack_s: float = 5e-4) -> dict[str, Any]:
    """The per-transfer overhead to write: the fit, or the SEND/RECV spans' figure where the fit is implausible.

    `direct_s`: transfers read off the runs' spans (`direct_transfers`, every round pooled);
    `link_s`: the edge's α-β time in the tiny run. The span figure is median(direct_s) − link_s
    (a median: one transfer delayed by a busy core does not move it). A fit implausibly below it
    (under half of it and more than `slack_s` under: module docstring) gives way to the span
    figure (clamped to ≥ 0); otherwise the fit is kept, and `transfer_sanity` records whether the
    two agree. Without spans, the fit, unchecked. Returns {"transfer_overhead_s", "source"
    ("fit" | "spans"), "fitted_s", and with spans "transfer_s", "link_alpha_beta_s", "overhead_s",
    "agrees", "check"}.

    Example:
        >>> choose_transfer(0.0, [0.0021, 0.0019, 0.0020], 0.0005)["source"]         # fit 0, spans 1.5 ms
        'spans'
        >>> round(choose_transfer(0.0004, [0.0009, 0.0008], 0.0005)["transfer_overhead_s"], 6)
        0.0004
        >>> choose_transfer(0.003, [0.0009, 0.0008], 0.0005)["source"]     # above the spans: the fit
        'fit'
    """
    out: dict[str, Any] = {"transfer_overhead_s": fitted_s, "source": "fit", "fitted_s": fitted_s}
    if not direct_s:
        return out
    d = statistics.median(direct_s)
    ok, line = transfer_sanity(fitted_s, d - link_s, slack_s)
    out.update({"transfer_s": d, "link_alpha_beta_s": link_s, "overhead_s": d - link_s, "agrees": ok})
    span = d - link_s
    if fitted_s < span / 2 and span - fitted_s > slack_s:
        out.update({"transfer_overhead_s": max(0.0, span), "source": "spans"})
        line += f"; the fit is implausibly low: the spans' figure, {max(0.0, span) * 1e6:.0f} µs, is written"
    elif not ok:
        line += ("; the fit is kept: it replays the two-stage step, which holds costs the spans do not show "
                 "(or a loaded round)")
    out["check"] = line
    return out


def _overlap(windows: Sequence[Sequence[float]]) -> float:
    """The fraction of the longest window during which every window was open."""
    longest = max(b - a for a, b in windows)
    common = min(b for _, b in windows) - max(a for a, _ in windows)
    return max(0.0, common) / longest if longest > 0 else 0.0


def _windows(rec: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """One program's timing records on one host: a record, or one per window."""
    return [rec] if isinstance(rec, Mapping) else list(rec)


def _median_seconds(host: Any, which: str, recs: Sequence[Mapping[str, Any]]) -> float:
    for r in recs:
        t = r["seconds"]
        if not (math.isfinite(t) and t > 0):
            raise CalibrationError(f"host {host}: its concurrent {which} took {t!r} s; "
                                   "times must be finite and positive")
    if not recs:
        raise CalibrationError(f"host {host}: no window of its concurrent {which} came back")
    return statistics.median(r["seconds"] for r in recs)


def all_busy(hosts: Sequence[Mapping[str, Any]], matmul_n: int, elementwise_bytes: float,
             kernel_counts: Sequence[int] | None = None) -> dict[str, Any]:
    """The device figures with every host computing at once, from each host's concurrent timings.

    `hosts[i]`: {"host", "matmul": ..., "elementwise": ...}, each a probe's `time_device` record
    (seconds, start, end) or a list of them, one per timing window (every host times the program
    at once in each window; the driver takes several, since one window on a shared machine can
    catch a host descheduled: seen here, one host's bandwidth 6× below the other's in the same
    window). A host's figure is the median over its windows; `matmul_n`, `elementwise_bytes`: the
    programs' sizes per device. Returns per host its FLOP/s and bytes/s per device, the slowest
    host's figures (what the cost model charges: a pipeline's step waits for its slowest stage),
    and per program how much of the longest timing window every host was busy in (`overlap`, 1 =
    fully concurrent; with several windows, the least-overlapped one). With `kernel_counts` (the
    short and long kernel chains' counts) and each host's `kernels_short` / `kernels_long`
    records, also each host's and the slowest host's seconds per kernel (`kernel_s`).

    Raises:
      CalibrationError: no host, a window missing, or a time that is not finite and positive.

    Example:
        >>> t = lambda s, a, b: {"seconds": s, "start": a, "end": b}
        >>> r = all_busy([{"host": 0, "matmul": t(2e-3, 0.0, 1.0), "elementwise": t(1e-3, 1.0, 2.0)},
        ...               {"host": 1, "matmul": t(4e-3, 0.5, 1.5), "elementwise": t(1e-3, 1.0, 2.0)}], 100, 8e6)
        >>> r["flops_per_device"], r["bandwidth_per_device"], r["overlap"]
        (500000000.0, 8000000000.0, {'matmul': 0.5, 'elementwise': 1.0})
    """
    if not hosts:
        raise CalibrationError("no host's concurrent device timing came back")
    recs = [{w: _windows(h[w]) for w in ("matmul", "elementwise")} for h in hosts]
    n_windows = {w: {len(r[w]) for r in recs} for w in ("matmul", "elementwise")}
    for w, ns in n_windows.items():
        if len(ns) != 1:
            raise CalibrationError(f"{w}: the hosts timed different numbers of windows {sorted(ns)}; "
                                   "each window times every host at once")
    per = []
    for h, r in zip(hosts, recs):
        mm, ew = _median_seconds(h["host"], "matmul", r["matmul"]), _median_seconds(h["host"], "elementwise", r["elementwise"])
        per.append({"host": h["host"], "flops_per_device": 2 * matmul_n ** 3 / mm,
                    "bandwidth_per_device": elementwise_bytes / ew, "matmul_s": mm, "elementwise_s": ew,
                    "window_s": {w: [x["seconds"] for x in r[w]] for w in ("matmul", "elementwise")},
                    "windows": {w: [[x["start"], x["end"]] for x in r[w]] for w in ("matmul", "elementwise")}})
    out = {"hosts": per, "flops_per_device": min(p["flops_per_device"] for p in per),
           "bandwidth_per_device": min(p["bandwidth_per_device"] for p in per),
           "overlap": {w: min(_overlap([p["windows"][w][i] for p in per]) for i in range(len(per[0]["windows"][w])))
                       for w in ("matmul", "elementwise")}}
    if all("stage_sized" in h for h in hosts):
        for p, h in zip(per, hosts):
            p["stage_sized_s"] = _median_seconds(h["host"], "stage_sized", _windows(h["stage_sized"]))
        out["stage_sized_s"] = max(p["stage_sized_s"] for p in per)
    if kernel_counts is not None:
        for p, h in zip(per, hosts):
            short = _median_seconds(h["host"], "kernels_short", _windows(h["kernels_short"]))
            long_ = _median_seconds(h["host"], "kernels_long", _windows(h["kernels_long"]))
            p["kernel_s"] = fit_kernel_time(kernel_counts, [short, long_])
        out["kernel_s"] = max(p["kernel_s"] for p in per)
    return out


def shared_slowdown(lone: Mapping[str, Any], busy: Optional[Mapping[str, Any]]) -> Optional[float]:
    """`device.shared_slowdown`: the stage-sized program's time with every host busy (the slowest
    host's median, `all_busy`) ÷ host 0's alone, at least 1; None on one host or when not timed.

    Raises:
      CalibrationError: host 0's time is not finite and positive.

    Example:
        >>> shared_slowdown({"stage_sized_s": 2e-3}, {"stage_sized_s": 5e-3}), shared_slowdown({"stage_sized_s": 2e-3}, None)
        (2.5, None)
        >>> shared_slowdown({"stage_sized_s": 2e-3}, {"stage_sized_s": 1.9e-3})    # noise: never below 1
        1.0
    """
    if busy is None or "stage_sized_s" not in busy or "stage_sized_s" not in lone:
        return None
    t = lone["stage_sized_s"]
    if not (math.isfinite(t) and t > 0):
        raise CalibrationError(f"the stage-sized program took {t!r} s on host 0 alone; need a finite positive time")
    return max(1.0, busy["stage_sized_s"] / t)


def fit_kernel_time(counts: Sequence[int], seconds: Sequence[float]) -> float:
    """Seconds per kernel: the slope between two programs of `counts[0]` < `counts[1]` kernels that
    took `seconds` (clamped at 0: noise can make the longer chain no slower).

    Raises:
      CalibrationError: not two programs, counts not increasing, or a time not finite and positive.

    Example:
        >>> fit_kernel_time([64, 256], [40e-6, 136e-6])
        5e-07
    """
    if len(counts) != 2 or len(seconds) != 2:
        raise CalibrationError(f"kernel timing: {len(counts)} counts and {len(seconds)} times; need two of each")
    (n1, n2), (t1, t2) = counts, seconds
    if not n2 > n1 > 0:
        raise CalibrationError(f"kernel timing: kernel counts {n1}, {n2} must be positive and increasing")
    for t in (t1, t2):
        if not (math.isfinite(t) and t > 0):
            raise CalibrationError(f"kernel timing: a chain took {t!r} s; times must be finite and positive")
    return max(0.0, (t2 - t1) / (n2 - n1))


def calibrated_raw(raw: Mapping[str, Any], *, tflops: float, memory_bandwidth_gbps: float,
                   action_overhead_us: float, links: Mapping[str, Fit],
                   transfer_overhead_us: Optional[float] = None,
                   collective_links: Mapping[str, Fit] | None = None, lone_tflops: Optional[float] = None,
                   lone_memory_bandwidth_gbps: Optional[float] = None, kernel_overhead_us: Optional[float] = None,
                   lone_kernel_overhead_us: Optional[float] = None,
                   shared_slowdown: Optional[float] = None) -> dict[str, Any]:
    """The cluster's raw YAML dict with measured `device:` and `links:` figures merged in.

    `tflops`, `memory_bandwidth_gbps`, `kernel_overhead_us`: with every host busy; `lone_*`: host 0
    alone; `shared_slowdown` (≥ 1): a stage-sized program all hosts busy ÷ alone (each written when given).

    Keys the user wrote are kept (`device.memory_gb`, `links.hosts_per_group`, every other
    section); only the measured figures are replaced. Link classes not measured stay as written.
    `collective_links`: per cross-host class, the fit of collectives over a mesh axis spanning its
    hosts → `links.<class>.collectives` (the class itself must be measured or written).
    """
    for name, v in (("device.tflops", tflops), ("device.memory_bandwidth_gbps", memory_bandwidth_gbps),
                    ("device.lone_tflops", lone_tflops),
                    ("device.lone_memory_bandwidth_gbps", lone_memory_bandwidth_gbps)):
        if v is not None and not (math.isfinite(v) and v > 0):
            raise CalibrationError(f"{name} = {v!r}: a measured figure must be finite and positive")
    for name, v in (("device.action_overhead_us", action_overhead_us),
                    ("device.transfer_overhead_us", transfer_overhead_us),
                    ("device.kernel_overhead_us", kernel_overhead_us),
                    ("device.lone_kernel_overhead_us", lone_kernel_overhead_us)):
        if v is not None and not (math.isfinite(v) and v >= 0):
            raise CalibrationError(f"{name} = {v!r}: must be finite and ≥ 0")
    if shared_slowdown is not None and not (math.isfinite(shared_slowdown) and shared_slowdown >= 1):
        raise CalibrationError(f"device.shared_slowdown = {shared_slowdown!r}: must be finite and ≥ 1")
    out = copy.deepcopy(dict(raw))
    dev = dict(out.get("device") or {})
    dev.update({"tflops": float(f"{tflops:.6g}"), "memory_bandwidth_gbps": float(f"{memory_bandwidth_gbps:.6g}"),
                "action_overhead_us": float(f"{action_overhead_us:.6g}")})
    for key, v in (("lone_tflops", lone_tflops), ("lone_memory_bandwidth_gbps", lone_memory_bandwidth_gbps),
                   ("transfer_overhead_us", transfer_overhead_us), ("kernel_overhead_us", kernel_overhead_us),
                   ("lone_kernel_overhead_us", lone_kernel_overhead_us), ("shared_slowdown", shared_slowdown)):
        if v is not None:
            dev[key] = float(f"{v:.6g}")
    out["device"] = dev
    lk = dict(out.get("links") or {})
    for name, fit in links.items():
        if name not in ("host", "group", "dcn"):
            raise CalibrationError(f"links.{name}: unknown link class (host, group, dcn)")
        lk[name] = {**dict(lk.get(name) or {}), **fit.link()}
    for name, fit in (collective_links or {}).items():
        if name not in ("group", "dcn"):
            raise CalibrationError(f"links.{name}.collectives: only a cross-host class (group, dcn) has separate "
                                   "collective figures; within a host the class's own figures are its collectives'")
        if not lk.get(name):
            raise CalibrationError(f"links.{name}.collectives: links.{name} itself was neither measured nor written")
        lk[name] = {**dict(lk[name]), "collectives": fit.link()}
    out["links"] = lk
    return out


def default_out(cluster_path: str | os.PathLike) -> Path:
    """`C.yaml` → `C.calibrated.yaml` beside it."""
    p = Path(cluster_path)
    return p.with_name(p.stem + ".calibrated.yaml")


def _same_file(a: Path, b: Path) -> bool:
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return a.resolve() == b.resolve()


def destination(cluster_path: Optional[str | os.PathLike], out: Optional[str | os.PathLike] = None,
                force: bool = False) -> Path:
    """Where `write_calibrated` will write, checked now (before anything is measured).

    Raises:
      CalibrationError: `out` is the input cluster file (refused even with `force`), an
        existing file without `force`, or a directory.
    """
    if out is None:
        if cluster_path is None:
            raise CalibrationError("no --out given and no cluster file to name the output after")
        dest = default_out(cluster_path)
    else:
        dest = Path(out)
    if cluster_path is not None and _same_file(dest, Path(cluster_path)):
        raise CalibrationError(f"--out {dest} is the input cluster file {cluster_path}: calibrate writes a new "
                               "file and never replaces the YAML it read; give another --out")
    if dest.is_dir():
        raise CalibrationError(f"--out {dest} is a directory; give a file path")
    if dest.exists() and not force:
        raise CalibrationError(f"{dest} exists; calibrate does not replace a file silently (pass --force to "
                               "replace it, or give another --out)")
    return dest


def write_calibrated(raw: Mapping[str, Any], cluster_path: Optional[str | os.PathLike],
                     out: Optional[str | os.PathLike] = None, *, force: bool = False, header: str = "") -> Path:
    """Write the calibrated cluster to `out` (default `default_out(cluster_path)`); return the path.

    Refuses (CalibrationError, nothing written; see `destination`) to write over the input
    cluster file, even with `force`, and to replace an existing file without `force`. The text is
    `yaml.safe_dump`ed after `header` (comment lines), then loaded back with the cluster
    loader: what is written is a valid cluster YAML.
    """
    from orchestrator.core.config import load_cluster

    dest = destination(cluster_path, out, force)
    text = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    text += yaml.safe_dump(dict(raw), sort_keys=False)
    tmp = dest.with_name(f".{dest.stem}.tmp{os.getpid()}{dest.suffix}")
    tmp.write_text(text)
    try:
        load_cluster(tmp)        # raises ConfigError naming the key if a figure broke the schema
    except Exception:
        tmp.unlink()
        raise
    os.replace(tmp, dest)
    return dest
