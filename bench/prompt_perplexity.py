"""Does a prompt's own perplexity tell jailbreak suffix attacks from the prompts ELS was trained on?

The length domain (ELS ``max_prompt_tokens``) keeps the long attacks (JBC, random search) unsteered, but
the GCG and DSN prompts are a short request plus an optimised suffix of odd tokens, inside the domain,
and the harm gate rates most of them benign (docs/RESULTS.md 3.1). A second in-distribution check would
be the prompt's mean token surprisal under the model itself: this script measures whether it separates.

For every prompt of each set, the mean negative log-likelihood (nats per token) of the user message's
tokens, inside the chat template, under the model (one batched forward per chunk, no generation). The
cut-off is taken on the training side only: the ``--quantile`` of the training prompts' values
(``--train`` sets, the ELS folder's benign and harmful training prompts). Reported per set: the median
and 90th percentile, and the share of prompts above the cut-off (they would be held back). A check
worth shipping holds back most GCG/DSN prompts and almost no benign test prompts.

    .venv/bin/python bench/prompt_perplexity.py --out runs/bench/
    .venv/bin/python bench/prompt_perplexity.py --quick --model embedded:smollm2-135m-instruct  # smoke
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib as bl  # noqa: E402

TRAIN = ["orbench-hard-train", "phtest-harmless-train", "harmful-train"]
SETS = [
    "orbench-hard-test",
    "xstest-safe",
    "oktest",
    "xstest-unsafe",
    "jailbreakbench",
    "jbb-attacks",
    "gsm8k-test",
    "wildguard-adv-val",
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=bl.DEFAULT_MODEL)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--train", default=",".join(TRAIN), help="training sets (comma-separated)")
    p.add_argument("--sets", default=",".join(SETS), help="sets to score (comma-separated)")
    p.add_argument("--limit", type=int, default=300, help="prompts per set, sampled per source (default 300)")
    p.add_argument("--quantile", type=float, default=0.99, help="training quantile of the cut-off")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--quick", action="store_true", help="20 prompts per set (a smoke run)")
    p.add_argument("--out", default=None, help="folder or .json path for the results")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    from aligntax.activations.decisions import prompt_surprisal
    from aligntax.runs.eval import load_prompt_sets, sampled
    from aligntax.surprisal import nearest_rank as quantile

    limit = 20 if args.quick else args.limit
    bl.set_threads(args.threads)
    lm, _ = bl.load_lm(args.model, args.dtype, args.device)
    env = bl.environment(lm)

    def by_source(specs: list[str]) -> dict[str, list[str]]:
        groups: dict[str, list] = {}
        for it in load_prompt_sets(specs):
            groups.setdefault(it.source, []).append(it)
        return {src: [it.prompt for it in sampled(items, limit, 0)] for src, items in groups.items()}

    train = by_source(args.train.split(","))
    train_vals = [v for ps in train.values() for v in prompt_surprisal(lm, ps, batch_size=args.batch_size)]
    cut = quantile(train_vals, args.quantile)
    rows = []
    scored = {
        src: prompt_surprisal(lm, ps, batch_size=args.batch_size)
        for src, ps in by_source(args.sets.split(",")).items()
    }
    for src, vals in {**scored, "(training)": train_vals}.items():
        above = sum(v > cut for v in vals)
        rows.append(
            {
                "set": src,
                "n": len(vals),
                "median": quantile(vals, 0.5),
                "p90": quantile(vals, 0.9),
                "above_cut": above,
                "share_above": above / len(vals),
            }
        )
        print(f"{src:24s} n={len(vals):4d} median {rows[-1]['median']:.2f} above {above}", flush=True)
    res = {"env": env, "cut": cut, "quantile": args.quantile, "limit": limit, "rows": rows}
    md = "\n".join(
        [
            *bl.header("Prompt surprisal (mean NLL of the user tokens, nats/token)", env),
            f"Cut-off: the {args.quantile:.0%} quantile of {len(train_vals)} training prompts = {cut:.2f}.",
            "",
            bl.md_table(
                ["set", "n", "median", "p90", "above the cut-off"],
                [
                    [r["set"], r["n"], f"{r['median']:.2f}", f"{r['p90']:.2f}", f"{r['share_above']:.1%}"]
                    for r in rows
                ],
            ),
        ]
    )
    print(md)
    if args.out:
        bl.write_outputs(args.out, "prompt_perplexity", res, md)
    return res


if __name__ == "__main__":
    main()
