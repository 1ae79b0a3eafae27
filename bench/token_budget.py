"""How many new tokens the refusal judge needs: answers of a finished run cut to fewer tokens, re-judged.

Greedy decoding makes the first N tokens of a 48-token answer the answer a 32-token run would give
(up to bf16 rounding of another batch composition), so cutting the answers of one run measures, with
no generation, how often the judge's verdict at N tokens agrees with its verdict at the run's own
length, per dataset and label, and how the rates move. The demo uses a shorter budget only where the
agreement is high enough (``--min-agreement``, default 0.98).

    python bench/token_budget.py --run runs/demo/baseline --budgets 16,24,32
    python bench/token_budget.py --run runs/demo/els/labels --budgets 32   # the ELS training labels

Reported per (dataset, label): rows, rows that reached the run's token cap (only those can change),
agreement of the verdicts, the rate at the run's length and at each budget, and the generated tokens
a budget saves (the sum over rows of what is cut).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib as bl  # noqa: E402

NAME = "token_budget"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="a run folder (samples.jsonl) generated with more tokens")
    p.add_argument(
        "--budgets", type=bl.int_list, default=[16, 24, 32], help="token budgets (default 16,24,32)"
    )
    p.add_argument("--judge", default=None, help="judge (default: the run's)")
    p.add_argument("--model", default=None, help="tokenizer's model (default: the run's)")
    p.add_argument("--min-agreement", type=float, default=0.98, help="agreement a budget must reach (0.98)")
    p.add_argument("--out", default=f"runs/bench/{NAME}.json", help="JSON of the results; .md beside it")
    return p.parse_args(argv)


def cut(tokenizer, text: str, n: int) -> str:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return text if len(ids) <= n else tokenizer.decode(ids[:n], skip_special_tokens=True).strip()


def main(argv=None) -> dict:
    args = parse_args(argv)
    import json

    from aligntax.judges import get_judge
    from aligntax.models import load_model
    from aligntax.runs.jsonl import read_jsonl

    run = Path(args.run)
    cfg = json.loads((run / "config.json").read_text())
    rows = read_jsonl(run / "samples.jsonl")
    cap = int(cfg["max_new_tokens"])
    lm = load_model(args.model or cfg["model"], dtype="bf16")
    judge = get_judge(args.judge or cfg.get("judge", "classifier"))
    prompts = [r["prompt"] for r in rows]
    full = [bool(v.refused) for v in judge.judge(prompts, [r["response"] for r in rows])]
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        groups[(r["source"], r["label"])].append(i)
    groups[("all", "all")] = list(range(len(rows)))
    result = {"run": str(run), "cap": cap, "budgets": {}, "environment": bl.environment()}
    for n in sorted(args.budgets):
        if n >= cap:
            continue
        texts = [
            cut(lm.tokenizer, r["response"], n) if r.get("n_tokens", cap) > n else r["response"] for r in rows
        ]
        short = [bool(v.refused) for v in judge.judge(prompts, texts)]
        per = {}
        for (source, label), idx in sorted(groups.items()):
            agree = sum(full[i] == short[i] for i in idx) / len(idx)
            per[f"{source}/{label}"] = {
                "n": len(idx),
                "at_cap": sum(rows[i].get("n_tokens", cap) >= cap for i in idx),
                "agreement": round(agree, 4),
                "refusal_full": round(sum(full[i] for i in idx) / len(idx), 4),
                "refusal_cut": round(sum(short[i] for i in idx) / len(idx), 4),
                "tokens_saved": sum(max(0, rows[i].get("n_tokens", cap) - n) for i in idx),
                "tokens_full": sum(rows[i].get("n_tokens", cap) for i in idx),
            }
        result["budgets"][n] = per
    rows_md = []
    for n, per in result["budgets"].items():
        for key, r in per.items():
            flag = "" if r["agreement"] >= args.min_agreement else " (below)"
            rows_md.append(
                [
                    str(n),
                    key,
                    str(r["n"]),
                    str(r["at_cap"]),
                    f"{100 * r['agreement']:.1f}%{flag}",
                    f"{100 * r['refusal_full']:.1f}%",
                    f"{100 * r['refusal_cut']:.1f}%",
                    f"{r['tokens_saved']} of {r['tokens_full']}",
                ]
            )
    table = bl.md_table(
        ["budget", "set", "n", "at cap", "agreement", "refusal at cap", "refusal cut", "tokens saved"],
        rows_md,
        align="rlrrrrrr",
    )
    bl.write_outputs(
        args.out,
        NAME,
        result,
        f"Answers of `{run}` ({cap} new tokens) cut to fewer tokens and re-judged; agreement of the "
        "refusal verdicts, refusal rate at the cap and cut, generated tokens the budget saves.\n\n" + table,
    )
    return result


if __name__ == "__main__":
    main()
