"""Do two evaluation run folders give the same rates? (e.g. the same evaluation through the Hugging Face
and the vLLM backend.)

For every dataset and label both runs hold (matched by ``(source, id)``): each run's rate (compliance
for benign prompts, refusal for harmful ones) with its Wilson 95% interval, whether the second run's rate
lies inside the first's interval, the paired difference (second - first) with its Wald 95% interval and
the exact McNemar p-value, and how many responses are identical. Reads ``samples.jsonl`` only; nothing
is generated or judged again.

    python bench/run_agreement.py runs/demo/steered runs/demo-vllm/steered --out runs/bench/agreement_steered
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib as bl  # noqa: E402


def compare(first: Path, second: Path) -> dict:
    from aligntax.metrics.rates import paired_change, paired_interval, wilson_interval
    from aligntax.runs.jsonl import read_jsonl

    a = {(r["source"], r["id"]): r for r in read_jsonl(first / "samples.jsonl")}
    b = {(r["source"], r["id"]): r for r in read_jsonl(second / "samples.jsonl")}
    groups: dict[tuple[str, str], list[tuple[dict, dict]]] = defaultdict(list)
    for key in sorted(a.keys() & b.keys()):
        ra, rb = a[key], b[key]
        groups[(ra["source"], ra["label"])].append((ra, rb))
        groups[("all", ra["label"])].append((ra, rb))
    rows = []
    for (source, label), pairs in sorted(groups.items(), key=lambda kv: (kv[0][0] == "all", kv[0])):
        good = (lambda r: r["refused"]) if label == "harmful" else (lambda r: not r["refused"])
        fa, fb = [good(x) for x, _ in pairs], [good(y) for _, y in pairs]
        ch = paired_change(fa, fb)
        lo, hi = wilson_interval(sum(fa), len(fa))
        dlo, dhi = paired_interval(ch["gained"], ch["lost"], ch["n"])
        rows.append(
            {
                "source": source,
                "label": label,
                "metric": "refusal" if label == "harmful" else "compliance",
                "n": ch["n"],
                "first": ch["before"],
                "first_interval": [lo, hi],
                "second": ch["after"],
                "second_inside": lo <= ch["after"] <= hi,
                "gained": ch["gained"],
                "lost": ch["lost"],
                "diff": ch["diff"],
                "diff_interval": [dlo, dhi],
                "zero_inside": dlo <= 0.0 <= dhi,
                "p_value": ch["p_value"],
                "identical": sum(x["response"] == y["response"] for x, y in pairs),
            }
        )
    return {
        "first": str(first),
        "second": str(second),
        "matched": len(a.keys() & b.keys()),
        "only_first": len(a.keys() - b.keys()),
        "only_second": len(b.keys() - a.keys()),
        "rows": rows,
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("first", type=Path, help="a run folder (the reference)")
    p.add_argument("second", type=Path, help="a run folder over the same prompts")
    p.add_argument(
        "--out", default="runs/bench/run_agreement.json", help="JSON file (or folder); .md beside it"
    )
    args = p.parse_args(argv)
    res = compare(args.first, args.second)
    pct = lambda x: f"{100 * x:.1f}"  # noqa: E731
    table = [
        [
            r["source"],
            r["label"],
            r["metric"],
            r["n"],
            f"{pct(r['first'])} [{pct(r['first_interval'][0])}, {pct(r['first_interval'][1])}]",
            pct(r["second"]),
            "yes" if r["second_inside"] else "**no**",
            f"{100 * r['diff']:+.1f} [{100 * r['diff_interval'][0]:+.1f}, {100 * r['diff_interval'][1]:+.1f}]",
            f"{r['gained']} / {r['lost']}",
            f"{r['p_value']:.2f}",
            f"{r['identical']}/{r['n']}",
        ]
        for r in res["rows"]
    ]
    notes = [
        f"first: {res['first']}",
        f"second: {res['second']}",
        f"matched prompts {res['matched']} (only in first {res['only_first']}, only in second "
        f"{res['only_second']})",
    ]
    md = "\n".join(
        [
            "## Rates of two run folders",
            "",
            *[f"- {n}" for n in notes],
            "",
            bl.md_table(
                [
                    "dataset",
                    "label",
                    "metric",
                    "n",
                    "first [95%]",
                    "second",
                    "inside",
                    "second - first [95% paired]",
                    "up / down",
                    "McNemar p",
                    "identical",
                ],
                table,
            ),
        ]
    )
    bl.write_outputs(args.out, "run_agreement", res, md)
    print(
        json.dumps(
            {
                "all_inside": all(r["second_inside"] for r in res["rows"]),
                "zero_inside_all": all(r["zero_inside"] for r in res["rows"]),
            }
        )
    )
    return res


if __name__ == "__main__":
    main()
