"""The over-refusal / safety front on the test sets: each steering mechanism as one point beside the
unsteered model and the demo's selection, with paired changes per test set and on the known answers.

    ALIGNTAX_DATA=../shared/data python bench/front_mechanisms.py --demo runs/demo --out runs/bench/front \
        --point 'ELS, harm-orth 4=els:{"path": "runs/demo/els", "harm_orth": 4}' \
        --point 'els-lora 0.5=els-lora:{"path": "runs/els-lora", "scale": 0.5}'

``--demo DIR`` is a demo folder: its ``baseline`` and ``knowns-baseline`` runs are the unsteered
reference, and its ``steered`` / ``knowns-steered`` runs (the demo's selected setting) and every
``test-baselines/*`` run found there are points too. Each ``--point 'LABEL=INTERVENTION:JSON'`` is evaluated
on the demo's test sets (rows the intervention holds back are copied from the unsteered run) and on the
known-answer questions (test split), into ``OUT/<label>`` and ``OUT/<label>-knowns``; both resume.
An ELS point's unset options come from the folder's tuned setting (``sweep/best.json``) as everywhere.

Writes ``OUT/front.md`` (one row per point: benign compliance per set, harmful refusal per set, each with
its paired change against unsteered and the exact McNemar p, known answers the same way, rows steered),
``OUT/front.json`` and ``OUT/front.png`` (mean benign compliance against mean harmful refusal).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from benchlib import md_table, write_outputs

BENIGN = [
    ("orbench-hard-test", "benign", "ORB-H"),
    ("xstest", "benign", "XSTest safe"),
    ("oktest", "benign", "OKTest"),
]
HARMFUL = [
    ("xstest", "harmful", "XSTest unsafe"),
    ("jailbreakbench", "harmful", "JBB"),
    ("harmbench-test", "harmful", "HarmBench"),
]


def parse_point(text: str) -> tuple[str, str, dict]:
    """``LABEL=INTERVENTION:JSON`` -> (label, intervention, args)."""
    label, sep, rest = text.partition("=")
    name, sep2, args = rest.partition(":")
    if not (sep and sep2 and label.strip() and name.strip()):
        raise SystemExit(f"--point {text!r}: expected 'LABEL=INTERVENTION:JSON'")
    return label.strip(), name.strip(), json.loads(args or "{}")


def slug(label: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def evaluate(
    label: str, name: str, args: dict, demo: Path, out: Path, batch_size: int, lm
) -> tuple[Path, Path]:
    """The point's test-set run and known-answer run (generated here, or resumed)."""
    from aligntax.runs.eval import EvalConfig, run_eval
    from aligntax.runs.knowns import KnownsConfig, run_knowns

    base = _json(demo / "baseline" / "config.json")
    run, kn = out / slug(label), out / f"{slug(label)}-knowns"
    run_eval(
        EvalConfig(
            data=base["data"],
            out=str(run),
            model=base["model"],
            judge=base["judge"],
            max_new_tokens=base["max_new_tokens"],
            batch_size=batch_size,
            dtype=base["dtype"],
            intervention=name,
            intervention_args=args,
            reuse_unsteered=str(demo / "baseline"),
        ),
        lm=lm,
    )
    kbase = _json(demo / "knowns-baseline" / "config.json")
    run_knowns(
        KnownsConfig(
            out=str(kn),
            model=kbase["model"],
            data=kbase["data"],
            split=kbase["split"],
            max_new_tokens=kbase["max_new_tokens"],
            batch_size=batch_size,
            dtype=kbase["dtype"],
            intervention=name,
            intervention_args=args,
            compare_to=str(demo / "knowns-baseline"),
            reuse_unsteered=str(demo / "knowns-baseline"),
        ),
        lm=lm,
    )
    return run, kn


def _change(results: dict, source: str, label: str) -> dict | None:
    return results.get("paired", {}).get("datasets", {}).get(source, {}).get(label)


def point_row(label: str, run: Path, knowns: Path | None) -> dict:
    """One point's numbers from its run folders."""
    from aligntax.runs.demo import pareto_point, set_rate
    from aligntax.runs.jsonl import read_jsonl

    res = _json(run / "results.json")
    row = {"label": label, "run": str(run), "rates": {}, "changes": {}}
    for source, lab, short in BENIGN + HARMFUL:
        row["rates"][short] = set_rate(res, f"{source}/{lab}")
        row["changes"][short] = _change(res, source, lab)
    rows = read_jsonl(run / "samples.jsonl")
    # rows with a per-row decision count when steered; an intervention without one (a prompt, a LoRA
    # adapter) acts on every row it generated
    intervened = bool((_json(run / "config.json")).get("intervention"))
    row["rows_steered"] = sum(
        1
        for r in rows
        if (r["steering"].get("steered") if "steering" in r else intervened and not r.get("reused"))
    )
    row["rows"] = len(rows)
    row["harmful_refusal"], row["benign_compliance"] = pareto_point(res)  # the demo's test-set plot axes
    if knowns is not None and (knowns / "results.json").is_file():
        k = _json(knowns / "results.json")
        row["known_accuracy"] = k.get("accuracy")
        row["known_change"] = k.get("paired") or {}
    return row


def _cell(row: dict, short: str) -> str:
    rate, ch = row["rates"][short], row["changes"][short]
    if rate is None:
        return ""
    text = f"{100 * rate:.1f}"
    if ch:
        p = ch["p_value"]
        text += f" ({100 * ch['diff']:+.1f}; {ch['gained']} up {ch['lost']} down; p {'< 0.001' if p < 1e-3 else f'= {p:.3f}'})"
    return text


def _known_cell(row: dict) -> str:
    if row.get("known_accuracy") is None:
        return ""
    ch = row.get("known_change") or {}
    text = f"{100 * row['known_accuracy']:.1f}"
    if "diff" in ch:
        text += f" ({100 * ch['diff']:+.1f}; {ch.get('gained', 0)} up {ch.get('lost', 0)} down; p = {ch.get('p_value', 1):.3f})"
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo", required=True, help="demo folder (baseline, knowns-baseline, steered, ...)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--point", action="append", default=[], help="'LABEL=INTERVENTION:JSON' (repeatable)")
    ap.add_argument("--batch-size", type=int, default=96)
    opts = ap.parse_args()
    demo, out = Path(opts.demo), Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    points = [parse_point(p) for p in opts.point]
    lm = None
    if points:
        from aligntax.models import load_model

        base = _json(demo / "baseline" / "config.json")
        lm = load_model(base["model"], dtype=base["dtype"])
    rows = [point_row("unsteered", demo / "baseline", demo / "knowns-baseline")]
    if (demo / "steered" / "results.json").is_file():
        rows.append(point_row("ELS (demo's selection)", demo / "steered", demo / "knowns-steered"))
    for run in sorted((demo / "test-baselines").glob("*/results.json")):
        rows.append(point_row(run.parent.name, run.parent, None))
    for label, name, args in points:
        print(f"[front] {label}: {name} {json.dumps(args)}", file=sys.stderr, flush=True)
        run, kn = evaluate(label, name, args, demo, out, opts.batch_size, lm)
        rows.append(point_row(label, run, kn))

    from aligntax.reports.plots import pareto_plot

    pareto_plot(
        [
            {
                "name": "none" if r["label"] == "unsteered" else r["label"],
                "harmful_refusal": r["harmful_refusal"],
                "benign_compliance": r["benign_compliance"],
            }
            for r in rows
        ],
        out / "front.png",
        title="test sets: each mechanism against unsteered",
    )
    shorts = [s for *_, s in BENIGN + HARMFUL]
    table = md_table(
        [
            "point",
            *[f"{s} {'compliance' if i < 3 else 'refusal'}" for i, s in enumerate(shorts)],
            "known answers",
            "rows steered",
        ],
        [
            [r["label"], *[_cell(r, s) for s in shorts], _known_cell(r), f"{r['rows_steered']} / {r['rows']}"]
            for r in rows
        ],
    )
    write_outputs(str(out), "front", {"demo": str(demo), "points": rows}, table)


if __name__ == "__main__":
    main()
