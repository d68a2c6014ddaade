"""Deciding "plan A's step is within T× of plan B's" on a machine whose speed drifts. Pure.

On this VM one plan's three runs in one benchmark spread up to 79 %, far more than the
5 % a 1.05 target needs, so comparing two plans' medians from runs minutes apart decides
nothing. Run them in PAIRS instead, back to back (A then B, then B then A, …: a drift
that is linear over a pair cancels over two pairs), and take each pair's ratio A ÷ B. A
slowdown that hits both runs of a pair cancels in its ratio. With several challengers
B, C, … a block runs A and each of them once, in an order that rotates through their
permutations (`block_order`), and gives one ratio A ÷ each.

The claim is about the median ratio. Its confidence interval comes from order statistics
(distribution-free: only that the pairs' ratios are independent and share one median):
[x₍ₖ₎, x₍ₙ₊₁₋ₖ₎] of the n sorted ratios covers the median with probability
1 − 2·P(Binomial(n, ½) < k). The verdict against a target T:
  within   the interval's upper end ≤ T;
  beyond   its lower end > T;
  undecided otherwise, or too few pairs for the confidence asked (n = 4 reaches only 0.875).
"""
from __future__ import annotations

import itertools
import math
import statistics
from typing import Mapping, Sequence

__all__ = ["median_interval", "block_order", "verdict"]


def median_interval(xs: Sequence[float], confidence: float = 0.9) -> dict | None:
    """The narrowest order-statistic interval covering the median of `xs` with at least `confidence`.

    Returns {"lo", "hi", "k", "coverage"} (k: 1-based rank of `lo`), or None when even the
    full range covers less than `confidence`.

    Example:
        >>> r = median_interval([1.0, 1.1, 0.9, 1.2, 1.05, 0.95, 1.02, 0.98])
        >>> r["lo"], r["hi"], r["k"], round(r["coverage"], 3)
        (0.95, 1.1, 2, 0.93)
        >>> median_interval([1.0, 1.1, 0.9, 1.2]) is None       # 4 pairs: at most 0.875
        True
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence = {confidence!r}: must be between 0 and 1")
    x = sorted(float(v) for v in xs)
    n = len(x)
    best = None
    for k in range(1, n // 2 + 1):
        coverage = 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n
        if coverage < confidence:
            break
        best = {"lo": x[k - 1], "hi": x[n - k], "k": k, "coverage": coverage}
    return best


def block_order(i: int, names: Sequence) -> tuple:
    """The order block `i` runs `names` in: their permutations in turn, so that over
    len(names)! blocks each plan runs in each position equally often (two plans: A, B in even
    blocks, B, A in odd ones).

    Example:
        >>> [block_order(i, "ab") for i in range(3)]
        [('a', 'b'), ('b', 'a'), ('a', 'b')]
    """
    perms = list(itertools.permutations(names))
    return perms[i % len(perms)]


def verdict(ratios: Mapping[str, Sequence[float]], target: float, confidence: float = 0.9) -> dict:
    """The verdict on "A ÷ each challenger ≤ `target`" from each challenger's pair ratios (A ÷ it).

    Per challenger: the median ratio, its interval (`median_interval`) and "within" | "beyond" |
    "undecided" (module docstring). Overall: MET when every challenger is within, NOT MET when
    any is beyond, NOT DECIDED otherwise; `line` says it in one sentence.

    Example:
        >>> v = verdict({"#3": [1.01, 0.98, 1.02, 0.99, 1.0, 1.03, 0.97, 1.01]}, 1.05)
        >>> v["overall"], v["per"]["#3"]["status"]
        ('MET', 'within')
    """
    if not ratios:
        raise ValueError("no challenger's pair ratios: nothing to decide")
    per = {}
    for name, rs in ratios.items():
        bad = [r for r in rs if not (math.isfinite(r) and r > 0)]
        if bad or not rs:
            raise ValueError(f"challenger {name}: pair ratios {list(rs)!r} must be finite, positive and not empty")
        ci = median_interval(rs, confidence)
        status = ("undecided" if ci is None else "within" if ci["hi"] <= target
                  else "beyond" if ci["lo"] > target else "undecided")
        per[name] = {"pairs": len(rs), "median": statistics.median(rs), "interval": ci, "status": status,
                     "ratios": list(rs)}
    statuses = [p["status"] for p in per.values()]
    overall = "MET" if all(s == "within" for s in statuses) else "NOT MET" if "beyond" in statuses else "NOT DECIDED"

    def say(name, p):
        ci = p["interval"]
        span = "too few pairs for an interval" if ci is None else (
            f"{ci['coverage']:.0%} interval {ci['lo']:.3f}–{ci['hi']:.3f}")
        return f"÷ {name} median {p['median']:.3f} over {p['pairs']} pairs ({span}: {p['status']})"

    line = f"{overall} (target ≤ {target:g}): " + "; ".join(say(n, p) for n, p in per.items())
    return {"overall": overall, "target": target, "confidence": confidence, "per": per, "line": line}
