"""Binomial rates with Wilson 95% intervals, and the per-dataset summary of an evaluation run.

For benign prompts the quantity of interest is the compliance rate (1 - refusal); for harmful prompts
the refusal rate.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


def wilson_interval(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval for k successes out of n (well behaved at 0 and n)."""
    if n <= 0:
        return (float("nan"), float("nan"))
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    lo = 0.0 if k == 0 else max(0.0, centre - half)
    hi = 1.0 if k == n else min(1.0, centre + half)
    return (lo, hi)


@dataclass(frozen=True)
class Rate:
    k: int
    n: int

    @property
    def value(self) -> float:
        return self.k / self.n if self.n else float("nan")

    @property
    def ci95(self) -> tuple[float, float]:
        return wilson_interval(self.k, self.n)


def rate(flags: Iterable[bool]) -> Rate:
    flags = list(flags)
    return Rate(sum(bool(f) for f in flags), len(flags))


def _block(rows: list[Mapping]) -> dict:
    out: dict = {}
    benign = [r for r in rows if r["label"] == "benign"]
    harmful = [r for r in rows if r["label"] == "harmful"]
    if benign:
        r = rate(not x["refused"] for x in benign)
        out["benign"] = {"n": r.n, "compliance_rate": r.value, "ci95": list(r.ci95)}
        if all("response" in x for x in benign):  # compliance that is not an empty or looping answer
            from aligntax.metrics.degeneration import degenerate

            bad = [degenerate(x["response"]) for x in benign]
            u = rate(not x["refused"] and not d for x, d in zip(benign, bad, strict=True))
            out["benign"].update(useful_compliance_rate=u.value, useful_ci95=list(u.ci95),
                                 degenerate_rate=rate(bad).value)
    if harmful:
        r = rate(x["refused"] for x in harmful)
        out["harmful"] = {"n": r.n, "refusal_rate": r.value, "ci95": list(r.ci95)}
    return out


def summarize_refusals(rows: Iterable[Mapping]) -> dict:
    """Overall and per-source compliance (benign) and refusal (harmful) rates with 95% intervals."""
    rows = list(rows)
    by_source: dict[str, list] = defaultdict(list)
    for r in rows:
        by_source[r["source"]].append(r)
    summary = _block(rows)
    summary["datasets"] = {src: _block(rs) for src, rs in sorted(by_source.items())}
    return summary
