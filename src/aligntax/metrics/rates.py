"""Binomial rates with Wilson 95% intervals, and the per-dataset summary of an evaluation run.

For benign prompts the quantity of interest is the compliance rate (1 - refusal); for harmful prompts
the refusal rate.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


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


def _block(rows: list[Mapping[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    benign = [r for r in rows if r["label"] == "benign"]
    harmful = [r for r in rows if r["label"] == "harmful"]
    if benign:
        r = rate(not x["refused"] for x in benign)
        out["benign"] = {"n": r.n, "compliance_rate": r.value, "ci95": list(r.ci95)}
        if all("response" in x for x in benign):  # compliance that is not an empty or looping answer
            from aligntax.metrics.degeneration import degenerate

            bad = [degenerate(x["response"]) for x in benign]
            u = rate(not x["refused"] and not d for x, d in zip(benign, bad, strict=True))
            out["benign"].update(
                useful_compliance_rate=u.value, useful_ci95=list(u.ci95), degenerate_rate=rate(bad).value
            )
    if harmful:
        r = rate(x["refused"] for x in harmful)
        out["harmful"] = {"n": r.n, "refusal_rate": r.value, "ci95": list(r.ci95)}
    return out


def source_groups(sources: Iterable[str]) -> dict[str, list[str]]:
    """{group: its parts' sources} for every group dataset (e.g. ``jbb-attacks``, the five JailbreakBench
    attacks) whose parts are all among ``sources``: a run holding them reports the group as one more set."""
    from aligntax.data.catalog import DATASETS

    have = set(sources)
    out = {}
    for name, spec in DATASETS.items():
        parts = [DATASETS[p].source for p in spec.parts]
        if parts and all(p in have for p in parts) and name not in have:
            out[name] = parts
    return out


def summarize_refusals(rows: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Overall and per-source compliance (benign) and refusal (harmful) rates with 95% intervals; a group
    dataset whose parts are all present (:func:`source_groups`) gets a block over all of them too."""
    rows = list(rows)
    by_source: dict[str, list[Any]] = defaultdict(list)
    for r in rows:
        by_source[r["source"]].append(r)
    for group, parts in source_groups(by_source).items():
        by_source[group] = [r for p in parts for r in by_source[p]]
    summary = _block(rows)
    summary["datasets"] = {src: _block(rs) for src, rs in sorted(by_source.items())}
    return summary


def mcnemar_exact(gained: int, lost: int) -> float:
    """Two-sided exact McNemar p-value: the binomial test (p = 1/2) on the discordant pairs."""
    n = gained + lost
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(gained, lost) + 1)) / 2**n
    return float(min(1.0, 2 * tail))


def paired_interval(gained: int, lost: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wald 95% interval of a paired difference of proportions, ``(gained - lost) / n`` (the variance of
    the per-item differences; 0 wide when no item changed)."""
    if n <= 0:
        return (float("nan"), float("nan"))
    d = (gained - lost) / n
    se = math.sqrt(max(gained + lost - (gained - lost) ** 2 / n, 0.0)) / n
    return d - z * se, d + z * se


def paired_change(before: Iterable[bool], after: Iterable[bool]) -> dict[str, Any]:
    """The change of a rate measured twice on the same items (e.g. refusal without and with an
    intervention): both rates, the difference, how many items turned true (``gained``) and false
    (``lost``), and the exact McNemar p-value, which only the discordant items decide."""
    before, after = [bool(x) for x in before], [bool(x) for x in after]
    if len(before) != len(after):
        raise ValueError(f"paired rates need the same items: {len(before)} before, {len(after)} after")
    gained = sum(a and not b for b, a in zip(before, after, strict=True))
    lost = sum(b and not a for b, a in zip(before, after, strict=True))
    n = len(before)
    rb, ra = (sum(before) / n, sum(after) / n) if n else (float("nan"), float("nan"))
    return {
        "n": n,
        "before": rb,
        "after": ra,
        "diff": ra - rb,
        "gained": gained,
        "lost": lost,
        "p_value": mcnemar_exact(gained, lost),
    }


def paired_changes(
    before_rows: Iterable[Mapping[str, Any]], after_rows: Iterable[Mapping[str, Any]]
) -> dict[str, Any]:
    """Per source and overall, per label: the paired change of compliance (benign) and refusal
    (harmful) between two runs over the same items, matched by (source, id). Items in only one run
    are left out and counted under ``unmatched``."""
    after = {(r["source"], r["id"]): r for r in after_rows}
    before_rows = list(before_rows)
    groups = source_groups({r["source"] for r in before_rows})
    group_of = {p: g for g, parts in groups.items() for p in parts}
    pairs: dict[tuple[str, str], list[tuple[bool, bool]]] = defaultdict(list)
    unmatched = 0
    seen = set()
    for r in before_rows:
        key = (r["source"], r["id"])
        seen.add(key)
        if key not in after:
            unmatched += 1
            continue
        harmful = r["label"] == "harmful"
        flags = (bool(r["refused"]), bool(after[key]["refused"]))
        flags = flags if harmful else (not flags[0], not flags[1])
        for src in (r["source"], group_of.get(r["source"]), "all"):
            if src is not None:
                pairs[(src, "harmful" if harmful else "benign")].append(flags)
    unmatched += sum(key not in seen for key in after)
    out: dict[str, Any] = {"unmatched": unmatched, "datasets": defaultdict(dict)}
    for (src, label), fl in sorted(pairs.items()):
        change = paired_change([b for b, _ in fl], [a for _, a in fl])
        change["metric"] = "refusal" if label == "harmful" else "compliance"
        out["datasets"][src][label] = change
    out["datasets"] = dict(out["datasets"])
    return out
