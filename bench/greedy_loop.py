"""Greedy generation: aligntax's own decode loop versus ``model.generate``.

The same prompts in the same batches, greedy, with the KV cache, run as:

* ``model.generate``: ``GenerationConfig(drop_finished=False)``; finished rows stay in the batch to
  its end, and the prefill holds every prompt whole;
* ``drops rows``: :func:`aligntax.generation.generate.greedy_decode` with ``share_prefix=False``: a
  row leaves the batch, its KV cache and the steering context when it produces an end token;
* ``drops rows + shared prefix``: the default; also the prefix every prompt of a batch shares (the
  chat template's system turn) is computed once and the prefill holds only the rest of each prompt.

With ``--steer DIR`` (a folder of ``aligntax els train``) all three run ELS-steered too, with the
folder's tuned setting (``DIR/sweep/best.json``) unless flags say otherwise: the harm gate's per-row
decisions then leave with their rows.

Reported: median wall time and generated tokens/s of each, per-repetition ratios against
``model.generate``, the share of row-steps ``model.generate`` spends on rows that have already
finished, and how many responses differ from ``model.generate``'s (bf16: a shrinking batch and a
prefix computed apart round differently, as another batch composition would).

    python bench/greedy_loop.py --threads 2 --dataset jailbreakbench --prompts 96
    python bench/greedy_loop.py --threads 2 --steer runs/demo/els
    python bench/greedy_loop.py --quick --model embedded:smollm2-135m-instruct   # smoke run
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib as bl  # noqa: E402

NAME = "greedy_loop"
LOOPS = {
    "model.generate": dict(drop_finished=False),
    "drops rows": dict(share_prefix=False),
    "drops rows + shared prefix": {},
}


def parse_args(argv=None) -> argparse.Namespace:
    p = bl.generation_parser(__doc__, NAME, dataset="orbench-hard-test", note="as the demo's evaluations")
    bl.add_steer_args(p)
    return bl.parse_with_quick(p, argv, bl.GENERATION_QUICK)


def main(argv=None) -> dict:
    args = parse_args(argv)
    from aligntax.generation import GenerationConfig, iter_generate
    from aligntax.interventions import NoIntervention

    lm, load_s = bl.start(args)
    prompts = bl.load_prompt_texts(args.dataset, args.prompts)
    interventions = {"unsteered": NoIntervention()}
    steer_info = None
    if args.steer:
        ivs, steer_info = bl.build_els(lm, args)
        interventions["ELS"] = ivs["closed"]
    responses: dict[str, list] = {}
    batch_tokens: dict[str, list[list[int]]] = {}

    def arm(label: str, iv, loop: dict):
        cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, **loop)

        def run() -> dict:
            t = time.perf_counter()
            out, batches = [None] * len(prompts), []
            for idx, gens in iter_generate(lm, prompts, cfg, iv, progress=False):
                batches.append([g.n_tokens for g in gens])
                for i, g in zip(idx, gens, strict=True):
                    out[i] = (g.response, g.n_tokens)
            seconds = time.perf_counter() - t
            responses[label], batch_tokens[label] = out, batches
            return {"seconds": seconds, "tokens": sum(n for _, n in out)}

        return run

    arms = {
        f"{name}: {loop}": arm(f"{name}: {loop}", iv, kw)
        for name, iv in interventions.items()
        for loop, kw in LOOPS.items()
    }
    print(
        f"{len(prompts)} prompts, {args.max_new_tokens} new tokens, batches of {args.batch_size}", flush=True
    )
    runs = bl.interleaved(arms, args.repeats, args.warmup)
    summary = {name: bl.summarize(r) for name, r in runs.items()}

    rows, ratio_rows, ratios, agreement = [], [], {}, {}
    for name in interventions:
        ref = f"{name}: model.generate"
        waste = finished_row_share(batch_tokens[ref], args.max_new_tokens)
        agreement[name] = {"finished_row_step_share": waste}
        for loop in LOOPS:
            label = f"{name}: {loop}"
            s = summary[label]
            rows.append([label, s["median_s"], s["min_s"], bl.fmt(s["median_tok_s"], 1)])
            if label == ref:
                continue
            ratios[label] = bl.paired_ratio(runs[ref], runs[label])
            differ = sum(a != b for a, b in zip(responses[ref], responses[label], strict=True))
            agreement[label] = {"responses_differ": differ}
            ratio_rows.append(
                [
                    label,
                    ratios[label]["median_paired"],
                    ratios[label]["of_medians"],
                    f"{differ} / {len(prompts)}",
                    bl.fmt(waste, 3),
                ]
            )
    env = bl.environment(lm)
    notes = [
        f"{len(prompts)} prompts from `{args.dataset}`, {args.max_new_tokens} new tokens (greedy), batches "
        f"of {args.batch_size}",
        f"{args.repeats} interleaved repetitions after {args.warmup} warm-up",
    ]
    if steer_info:
        notes.append(
            f"ELS: {steer_info['source']}, settings {steer_info['settings']} "
            f"(from {steer_info['settings_from']})"
        )
    md = "\n".join(
        bl.header("Greedy generation: own decode loop vs model.generate", env, notes)
        + [
            bl.md_table(["alternative", "median s", "min s", "generated tok/s"], rows),
            "",
            bl.md_table(
                [
                    "loop",
                    "time / model.generate (median of per-rep ratios)",
                    "ratio of medians",
                    "responses that differ from model.generate",
                    "row-steps model.generate spends on finished rows",
                ],
                ratio_rows,
            ),
        ]
    )
    result = {
        "benchmark": NAME,
        "env": env,
        "args": vars(args),
        "model_load_seconds": load_s,
        "n_prompts": len(prompts),
        "steer": steer_info,
        "runs": runs,
        "summary": summary,
        "ratios": ratios,
        "agreement": agreement,
    }
    bl.write_outputs(args.out, NAME, result, md)
    return result


def finished_row_share(batches: list[list[int]], max_new_tokens: int) -> float:
    """Share of the row-steps ``model.generate`` runs that belong to rows already finished, from each
    batch's response token counts (end token not counted: a row that stops ran one step more)."""
    total = wasted = 0
    for batch in batches:
        ran = [min(max_new_tokens, n + 1) for n in batch]
        total += max(ran) * len(ran)
        wasted += sum(max(ran) - r for r in ran)
    return wasted / total if total else 0.0


if __name__ == "__main__":
    main()
