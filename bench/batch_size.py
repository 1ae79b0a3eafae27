"""Batch limits: greedy generation throughput against the batch size, capture against a token budget.

Generation: each prompt set of ``--datasets`` is generated whole (greedy, the KV cache, the own decode
loop: finished rows leave the batch, the shared prefix is computed once) with every batch size in
``--batch-sizes``. Capture (last-token states, prefill only, as the harm gate's and the energy
models' training states): each set of ``--capture-datasets`` with batches of 32 rows and with
``--capture-rows`` rows under every token budget of ``--capture-budgets`` (padded tokens per batch,
``aligntax.generation.batching``). All arms interleaved over repetitions.

Reported per set: median wall seconds (generated tokens/s), and the time relative to the first
alternative (median of the per-repetition ratios). The demo's batch size and the default budgets
follow from it. In bf16 another batch composition rounds differently, so responses can differ a
little between batch sizes; how many differ from the first batch size's is reported too.

    python bench/batch_size.py --threads 2
    python bench/batch_size.py --threads 2 --datasets orbench-hard-test --batch-sizes 32,64,96,128
    python bench/batch_size.py --threads 2 --datasets "" --capture-budgets 1024,2048,4096,none
    python bench/batch_size.py --quick --model embedded:smollm2-135m-instruct   # smoke run
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib as bl  # noqa: E402

NAME = "batch_size"
DATASETS = "orbench-hard-test,jailbreakbench,oktest"
CAPTURE_DATASETS = "strongreject,do-not-answer"
QUICK = dict(
    datasets="jailbreakbench",
    prompts=8,
    batch_sizes="2,4",
    max_new_tokens=4,
    repeats=1,
    capture_datasets="strongreject",
    capture_rows=4,
    capture_budgets="64,none",
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    bl.add_common_args(p, repeats=2, out_name=NAME)
    p.add_argument("--datasets", default=DATASETS, help=f"comma-separated prompt sets (default {DATASETS})")
    p.add_argument("--prompts", type=int, default=None, help="first N prompts of each set (default: all)")
    p.add_argument(
        "--batch-sizes", default="32,64,96,128", help="default 32,64,96,128 (the first is the reference)"
    )
    p.add_argument("--max-new-tokens", type=int, default=48, help="default 48, as the demo's evaluations")
    p.add_argument(
        "--capture-datasets",
        default=CAPTURE_DATASETS,
        help=f"comma-separated prompt sets for capture (default {CAPTURE_DATASETS}; '' for none)",
    )
    p.add_argument(
        "--capture-rows", type=int, default=96, help="row cap of the budgeted capture batches (default 96)"
    )
    p.add_argument(
        "--capture-budgets",
        default="1024,2048,4096,none",
        help="padded tokens per capture batch; 'none': the row cap only (default 1024,2048,4096,none)",
    )
    p.add_argument(
        "--capture-layers",
        default="6-13",
        help="captured blocks, FIRST-LAST (default 6-13, as the harm gate's candidates)",
    )
    return bl.parse_with_quick(p, argv, QUICK)


def main(argv=None) -> dict:
    args = parse_args(argv)
    from aligntax.generation import GenerationConfig, generate

    lm, load_s = bl.start(args)
    sizes = bl.int_list(args.batch_sizes)
    sets = {
        name: bl.load_prompt_texts(name, args.prompts) for name in args.datasets.split(",") if name.strip()
    }
    capture_sets = {
        name: bl.load_prompt_texts(name, args.prompts)
        for name in args.capture_datasets.split(",")
        if name.strip()
    }
    responses: dict[str, list[str]] = {}

    def arm(name: str, prompts: list[str], size: int):
        cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, batch_size=size)

        def run() -> dict:
            t = time.perf_counter()
            out = generate(lm, prompts, cfg, progress=False)
            seconds = time.perf_counter() - t
            responses[f"{name} @ {size}"] = [g.response for g in out]
            return {"seconds": seconds, "tokens": sum(g.n_tokens for g in out)}

        return run

    arms = {f"{name} @ {size}": arm(name, prompts, size) for name, prompts in sets.items() for size in sizes}
    capture_alts = capture_alternatives(args)
    for name, prompts in capture_sets.items():
        for label, (rows, budget) in capture_alts.items():
            arms[f"capture {name} @ {label}"] = capture_arm(lm, prompts, args.capture_layers, rows, budget)
    print(
        f"sets {', '.join(f'{k} ({len(v)})' for k, v in sets.items())}; batch sizes {sizes}; "
        f"{args.max_new_tokens} new tokens; capture sets {', '.join(capture_sets)}",
        flush=True,
    )
    runs = bl.interleaved(arms, args.repeats, args.warmup)
    summary = {label: bl.summarize(r) for label, r in runs.items()}

    rows, ratios, differ = [], {}, {}
    totals = {size: 0.0 for size in sizes}
    for name in sets:
        ref = f"{name} @ {sizes[0]}"
        for size in sizes:
            label = f"{name} @ {size}"
            s = summary[label]
            totals[size] += s["median_s"]
            ratios[label] = bl.paired_ratio(runs[ref], runs[label])
            differ[label] = sum(a != b for a, b in zip(responses[ref], responses[label], strict=True))
            rows.append(
                [
                    name,
                    size,
                    bl.fmt(s["median_s"], 1),
                    bl.fmt(s["median_tok_s"], 1),
                    bl.fmt(ratios[label]["median_paired"]),
                    f"{differ[label]} / {len(sets[name])}",
                ]
            )
    total_rows = [[size, bl.fmt(totals[size], 1), bl.fmt(totals[size] / totals[sizes[0]])] for size in sizes]
    capture_rows, capture_totals = [], dict.fromkeys(capture_alts, 0.0)
    for name in capture_sets:
        ref = f"capture {name} @ {next(iter(capture_alts))}"
        for alt in capture_alts:
            label = f"capture {name} @ {alt}"
            capture_totals[alt] += summary[label]["median_s"]
            ratios[label] = bl.paired_ratio(runs[ref], runs[label])
            capture_rows.append(
                [name, alt, bl.fmt(summary[label]["median_s"], 2), bl.fmt(ratios[label]["median_paired"])]
            )
    env = bl.environment(lm)
    notes = [
        f"sets: {', '.join(f'`{k}` ({len(v)} prompts)' for k, v in sets.items())}; "
        f"{args.max_new_tokens} new tokens, greedy, own decode loop",
        f"{args.repeats} interleaved repetitions after {args.warmup} warm-up",
    ]
    md = "\n".join(
        bl.header("Batch limits: greedy generation and capture", env, notes)
        + [
            bl.md_table(
                [
                    "set",
                    "batch size",
                    "median s",
                    "generated tok/s",
                    f"time / batch {sizes[0]} (median of per-rep ratios)",
                    f"responses that differ from batch {sizes[0]}",
                ],
                rows,
            ),
            "",
            bl.md_table(["batch size", "all sets, sum of medians (s)", f"/ batch {sizes[0]}"], total_rows),
        ]
        + (
            [
                "",
                f"Capture (blocks {args.capture_layers}, last prompt token):",
                "",
                bl.md_table(
                    ["set", "batches", "median s", f"time / {next(iter(capture_alts))}"], capture_rows
                ),
                "",
                bl.md_table(
                    ["batches", "all capture sets, sum of medians (s)"],
                    [[k, bl.fmt(v, 2)] for k, v in capture_totals.items()],
                ),
            ]
            if capture_sets
            else []
        )
    )
    result = {
        "benchmark": NAME,
        "env": env,
        "args": vars(args),
        "model_load_seconds": load_s,
        "sets": {k: len(v) for k, v in sets.items()},
        "capture_sets": {k: len(v) for k, v in capture_sets.items()},
        "runs": runs,
        "summary": summary,
        "ratios": ratios,
        "responses_differ": differ,
        "totals": {str(k): v for k, v in totals.items()},
        "capture_totals": capture_totals,
    }
    bl.write_outputs(args.out, NAME, result, md)
    return result


def capture_alternatives(args) -> dict[str, tuple[int, int | None]]:
    """{label: (row cap, token budget)}: 32 rows without a budget first (the reference), then the
    budgets under ``--capture-rows``."""
    alts: dict[str, tuple[int, int | None]] = {"32 rows": (32, None)}
    for b in args.capture_budgets.split(","):
        budget = None if b.strip().lower() == "none" else int(b)
        alts[f"{args.capture_rows} rows, {budget or 'no'} token budget"] = (args.capture_rows, budget)
    return alts


def capture_arm(lm, prompts: list[str], layers: str, rows: int, budget: int | None):
    from aligntax.activations import capture

    first, last = (int(x) for x in layers.split("-"))

    def run() -> dict:
        t = time.perf_counter()
        capture(lm, prompts, list(range(first, last + 1)), batch_size=rows, progress=False, max_tokens=budget)
        return {"seconds": time.perf_counter() - t}

    return run


if __name__ == "__main__":
    main()
