"""The statistics of an audit row: paired tests, the Holm correction over every row, the smallest change a
row could have detected at its size, and the verdict a policy gives it.

Pure functions on numbers (no model, no files). A row compares the baseline and the candidate over the
same items:

- a **rate** (compliance, refusal, accuracy): the exact McNemar test on the items that changed
  (:func:`aligntax.metrics.rates.paired_change`), the Wald interval of the paired difference
  (:func:`aligntax.metrics.rates.paired_interval`);
- a **score** (perplexity, a value's shift): the mean of the per-unit differences, a percentile interval
  from a paired bootstrap over the units, and a sign-flip permutation test
  (:func:`aligntax.vat.metrics.sign_flip_p`).

Changes are in the row's unit: percentage points for rates (``+2.5`` is 2.5 points), the metric's own unit
for scores.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist

import numpy as np

from aligntax.metrics.rates import paired_change, paired_interval

UP, DOWN, EITHER = "up", "down", "either"  # which way a row's metric is better (either: any move is a cost)
PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"


def holm(p_values: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjusted p-values (family-wise error over every p given); None stays None.
    Adjusted ``p_(i) = max_{j <= i} min(1, (m - j + 1) p_(j))`` over the m p-values sorted ascending."""
    idx = [i for i, p in enumerate(p_values) if p is not None and math.isfinite(float(p))]
    m = len(idx)
    out: list[float | None] = [None] * len(p_values)
    running = 0.0
    for rank, i in enumerate(sorted(idx, key=lambda i: (float(p_values[i]), i))):
        running = max(running, min(1.0, (m - rank) * float(p_values[i])))
        out[i] = running
    return out


def _binom_sf(k: int, n: int, q: float) -> float:
    """P(Binomial(n, q) >= k)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    if q <= 0.0:
        return 0.0
    if q >= 1.0:
        return 1.0
    lq, lr = math.log(q), math.log1p(-q)
    terms = [
        math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lq + (n - i) * lr
        for i in range(k, n + 1)
    ]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def min_discordant(alpha: float) -> int:
    """The fewest changed items, all changed the same way, that the two-sided exact McNemar test calls
    significant at ``alpha`` (``2 * 0.5**k <= alpha``)."""
    if not 0 < alpha < 1:
        raise ValueError("alpha must be in (0, 1)")
    return max(1, math.ceil(math.log2(2.0 / alpha) - 1e-12))


def detectable_rate(n: int, alpha: float, power: float = 0.8) -> float | None:
    """The smallest change of a rate over ``n`` paired items (a share, 0 to 1) that the exact McNemar test
    at ``alpha`` detects with probability ``power``, when the change turns each item the same way with
    probability equal to the change (the number turned is Binomial(n, change)) and no item the other way.
    None when ``n`` items cannot reach significance at all."""
    k = min_discordant(alpha)
    if n < k or _binom_sf(k, n, 1.0) < power:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if _binom_sf(k, n, mid) >= power:
            hi = mid
        else:
            lo = mid
    return hi


def detectable_score(sd: float, n: int, alpha: float, power: float = 0.8) -> float | None:
    """The smallest mean paired difference a two-sided test at ``alpha`` detects with probability ``power``
    over ``n`` units whose differences have standard deviation ``sd`` (normal approximation:
    ``(z_{1 - alpha/2} + z_power) * sd / sqrt(n)``). None for fewer than 2 units."""
    if n < 2 or not math.isfinite(sd):
        return None
    z = NormalDist()
    return (z.inv_cdf(1 - alpha / 2) + z.inv_cdf(power)) * sd / math.sqrt(n)


def rate_row(before: Sequence[bool], after: Sequence[bool]) -> dict:
    """A rate measured on the same items before and after: rates and change in percentage points, the
    items turned (``gained``: to true, ``lost``: to false), the 95% interval of the change and the
    exact McNemar p."""
    c = paired_change(before, after)
    n = c["n"]
    lo, hi = paired_interval(c["gained"], c["lost"], n)
    return {
        "n": n,
        "baseline": 100 * c["before"],
        "candidate": 100 * c["after"],
        "change": 100 * (c["gained"] - c["lost"]) / n if n else float("nan"),
        "ci95": [100 * lo, 100 * hi],
        "p": c["p_value"],
        "gained": c["gained"],
        "lost": c["lost"],
        "test": "exact McNemar",
    }


def bootstrap_mean_interval(x: Sequence[float], reps: int = 2000, seed: int = 0, level: float = 0.95) -> list:
    """Percentile interval of the mean of ``x`` from ``reps`` resamples with replacement; ``[m, m]`` when
    every value is the same."""
    x = np.asarray(x, dtype=float)
    if x.size == 0:
        return [float("nan"), float("nan")]
    if np.all(x == x[0]):
        return [float(x[0]), float(x[0])]
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(reps, x.size))].mean(axis=1)
    a = (1 - level) / 2 * 100
    return [float(np.percentile(means, a)), float(np.percentile(means, 100 - a))]


def score_row(before: Sequence[float], after: Sequence[float], reps: int = 2000, seed: int = 0) -> dict:
    """A score measured on the same units before and after: the means, the mean paired difference, its
    paired-bootstrap 95% interval and the sign-flip permutation p; ``sd``: the standard deviation of the
    differences (the scale of the detectable change), or of the baseline scores when no unit changed."""
    from aligntax.vat.metrics import sign_flip_p

    b, a = np.asarray(before, dtype=float), np.asarray(after, dtype=float)
    if b.shape != a.shape:
        raise ValueError(f"paired scores need the same units: {b.size} before, {a.size} after")
    d = a - b
    n = int(d.size)
    sd = float(d.std(ddof=1)) if n > 1 else float("nan")
    changed = bool(np.any(d != 0))
    return {
        "n": n,
        "baseline": float(b.mean()) if n else float("nan"),
        "candidate": float(a.mean()) if n else float("nan"),
        "change": float(d.mean()) if n else float("nan"),
        "ci95": bootstrap_mean_interval(d, reps, seed),
        "p": (float(sign_flip_p(d, seed=seed)) if changed else 1.0) if n else None,
        "sd": sd if changed else (float(b.std(ddof=1)) if n > 1 else float("nan")),
        "sd_of": "paired differences" if changed else "baseline scores (no unit changed)",
        "test": "sign-flip permutation",
    }


def loss(change: float, direction: str) -> float:
    """How much worse the candidate is, in the row's unit (negative: better)."""
    if direction == UP:
        return -change
    if direction == DOWN:
        return change
    return abs(change)


def worst_loss(ci: Sequence[float], direction: str) -> float:
    """The largest loss the row's 95% interval allows."""
    lo, hi = float(ci[0]), float(ci[1])
    if direction == UP:
        return -lo
    if direction == DOWN:
        return hi
    return max(abs(lo), abs(hi))


def verdict(row: dict, max_loss: float, alpha: float) -> tuple[str, str]:
    """``(verdict, reason)`` of one row under a tolerated loss and a significance level:

    - **fail**: the candidate is worse, significantly after Holm (``p_adj <= alpha``), and its loss
      exceeds ``max_loss``;
    - **pass**: the 95% interval rules out a loss beyond ``max_loss``;
    - **inconclusive**: neither (too few items to tell).
    """
    direction, change = row["direction"], row["change"]
    if change is None or not math.isfinite(change):
        return INCONCLUSIVE, "no paired items"
    lost = loss(change, direction)
    p_adj = row.get("p_adj")
    if p_adj is not None and p_adj <= alpha and lost > max_loss and lost > 0:
        return FAIL, f"loss {lost:.3g} > {max_loss:g}, adjusted p = {p_adj:.2g} <= {alpha:g}"
    ci = row.get("ci95")
    if ci is not None and all(v is not None and math.isfinite(v) for v in ci):
        bound = worst_loss(ci, direction)
        if bound <= max_loss:
            return PASS, f"the interval allows a loss of at most {max(bound, 0.0):.3g} <= {max_loss:g}"
        return INCONCLUSIVE, f"the interval allows a loss of {bound:.3g} > {max_loss:g}, not significant"
    return INCONCLUSIVE, "no interval"


def overall(verdicts: Sequence[str]) -> str:
    """fail if any row fails, pass if every row passes, else inconclusive."""
    if any(v == FAIL for v in verdicts):
        return FAIL
    if verdicts and all(v == PASS for v in verdicts):
        return PASS
    return INCONCLUSIVE
