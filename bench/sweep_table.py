"""Markdown table of an els sweep folder's rows (sweep.jsonl): python bench/sweep_table.py DIR/sweep."""

from __future__ import annotations

import json
import sys
from pathlib import Path

latest = {}  # one row per setting: a row scored again later replaces the earlier one
for line in (Path(sys.argv[1]) / "sweep.jsonl").read_text().splitlines():
    if line.strip():
        r = json.loads(line)
        latest[r["key"]] = r
print(
    "| setting | benign score | ORB-H val | PHTest val | harmful refusal | known acc (lost) | rows steered | leak passed | leak refused unsteered -> steered | s |"
)
print("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|")
for r in latest.values():
    a = r["args"]
    name = (
        "unsteered"
        if r["name"] == "none"
        else ", ".join(
            f"{k}={v}"
            for k, v in a.items()
            if k in ("top_k", "layers", "gate", "row_threshold", "harm_orth", "row_strength")
        )
    )
    by = r.get("benign_by_set", {})
    leak = f"{r['leak_refused_unsteered']} -> {r['leak_refused']}" if "leak_passed" in r else ""
    print(
        f"| {name} | {100 * r['benign_compliance']:.1f} | "
        + " | ".join(f"{100 * v:.1f}" for v in by.values())
        + f" | {100 * r['harmful_refusal']:.1f} | {100 * r.get('known_accuracy', float('nan')):.1f} ({r.get('known_lost', '')})"
        + f" | {r.get('steered_rows', '')} | {r.get('leak_passed', '')} | {leak} | {r['seconds']:.0f} |"
    )
