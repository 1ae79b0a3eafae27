"""ORB-H test end to end: wall time of generating and judging every prompt, unsteered and ELS-steered.

Each measured run is a full ``aligntax.runs.run_eval`` (what ``aligntax eval`` runs: batched greedy
generation, the classifier refusal judge per batch, samples.jsonl, results.json and report.md written
to a fresh temporary folder), on the already loaded model and judge; model and judge loading are timed
once, separately, and reported as the cold-start cost. Unsteered and steered runs are interleaved
(order reversed every repetition) after an untimed warm-up on a few prompts.

Steering (``--steer DIR``, a folder of ``aligntax els train``): the settings come from the flags
(``--eta``, ``--top-k``, ``--steps``, ``--threshold``), else ``DIR/sweep/best.json`` (``aligntax els
sweep``), else top_k 2, eta 0.3, steps 3, no threshold. ``--steer synthetic`` uses a random-label bank
built on the fly (timing only: its compliance numbers mean nothing).

Reported per alternative: median wall time, generation and judge time, generated tokens/s, the
steered/unsteered wall-time ratio, and the ORB-H compliance rate (as a sanity check that the runs did
what they should; see docs/RESULTS.md for the evaluated numbers).

    python bench/orbh_end_to_end.py --threads 2                     # unsteered only
    python bench/orbh_end_to_end.py --threads 2 --steer runs/els    # + steered (best.json settings)
    python bench/orbh_end_to_end.py --quick --model embedded:smollm2-135m-instruct --steer synthetic
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib as bl  # noqa: E402

NAME = "orbh_end_to_end"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    bl.add_common_args(p, repeats=3, out_name=NAME)
    bl.add_steer_args(p, required_note=" (default: unsteered only)")
    p.add_argument("--dataset", default="orbench-hard-test", help="default orbench-hard-test (132 prompts)")
    p.add_argument("--limit", type=int, default=None, help="first N prompts (default: all)")
    p.add_argument("--judge", default="classifier", help="refusal judge (default classifier)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="default 64 (the `aligntax eval` default)")
    p.add_argument("--batch-size", type=int, default=32, help="default 32")
    p.add_argument("--warmup-prompts", type=int, default=8, help="prompts per warm-up run (default 8)")
    args = bl.parse_with_quick(
        p, argv, dict(limit=4, max_new_tokens=4, repeats=1, warmup_prompts=2, synthetic_prompts=16)
    )
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    from aligntax.judges import get_judge
    from aligntax.runs.eval import EvalConfig, run_eval

    lm, load_s = bl.start(args)
    t = time.perf_counter()
    judge = get_judge(args.judge)
    judge.judge(["Hello?"], ["Hello! How can I help you today?"])  # loads the embedding model
    judge_load_s = time.perf_counter() - t
    print(f"model loaded in {load_s:.1f} s, judge '{args.judge}' in {judge_load_s:.1f} s", flush=True)
    ivs: dict = {"unsteered": (None, None, {})}
    els_info = None
    if args.steer:
        built, els_info = bl.build_els(lm, args, ("closed",))
        ivs["els"] = (built["closed"], "els", {"dir": str(args.steer), **els_info["settings"]})
        print(
            f"ELS: {els_info['source']}; layers {els_info['layers']}; settings {els_info['settings']} "
            f"({els_info['settings_from']})",
            flush=True,
        )
    items = bl.load_items(args.dataset, args.limit)
    warm_items = items[: max(1, min(args.warmup_prompts, len(items)))]

    def run(arm: str, its) -> dict:
        iv, iv_name, iv_args = ivs[arm]
        with tempfile.TemporaryDirectory(prefix="aligntax-bench-") as tmp:
            cfg = EvalConfig(
                data=[args.dataset],
                out=tmp,
                model=args.model,
                judge=args.judge,
                max_new_tokens=args.max_new_tokens,
                batch_size=args.batch_size,
                dtype=args.dtype,
                intervention=iv_name,
                intervention_args=iv_args,
                progress=False,
            )
            t0 = time.perf_counter()
            res = run_eval(cfg, lm=lm, judge=judge, intervention=iv, items=its)
            seconds = time.perf_counter() - t0
        timing = res["timing"]
        benign = res.get("benign") or {}
        harmful = res.get("harmful") or {}
        return {
            "seconds": seconds,
            "tokens": timing["generated_tokens"],
            "generation_s": timing["generation_seconds"],
            "judge_and_io_s": seconds - timing["generation_seconds"],
            "n": len(its),
            "compliance_rate": benign.get("compliance_rate"),
            "harmful_refusal_rate": harmful.get("refusal_rate"),
        }

    arms = {arm: (lambda arm=arm: run(arm, items)) for arm in ivs}
    warm = {arm: (lambda arm=arm: run(arm, warm_items)) for arm in ivs}
    print(
        f"{len(items)} prompts from {args.dataset}, max_new_tokens {args.max_new_tokens}, batch "
        f"{args.batch_size}; alternatives: {', '.join(arms)}",
        flush=True,
    )
    runs = bl.interleaved(arms, args.repeats, args.warmup, warm)
    summary = {k: bl.summarize(r) for k, r in runs.items()}
    for k, r in runs.items():
        summary[k]["median_generation_s"] = bl.median([x["generation_s"] for x in r])
        summary[k]["median_judge_and_io_s"] = bl.median([x["judge_and_io_s"] for x in r])
        summary[k]["median_gen_tok_s"] = bl.median(
            [x["tokens"] / x["generation_s"] for x in r if x["generation_s"]]
        )
        summary[k]["compliance_rate"] = r[-1]["compliance_rate"]
    ratio = bl.paired_ratio(runs["unsteered"], runs["els"]) if "els" in runs else None
    headers = [
        "alternative",
        "wall s",
        "generation s",
        "judge + I/O s",
        "generated tokens",
        "gen tok/s",
        "wall / unsteered",
        "ORB-H compliance",
    ]
    rows = []
    for k, s in summary.items():
        rows.append(
            [
                k,
                s["median_s"],
                s["median_generation_s"],
                s["median_judge_and_io_s"],
                bl.median([x["tokens"] for x in runs[k]]),
                bl.fmt(s["median_gen_tok_s"], 1),
                ratio["median_paired"]
                if (k == "els" and ratio)
                else ("1 (reference)" if k == "unsteered" else "-"),
                s["compliance_rate"],
            ]
        )
    env = bl.environment(lm)
    notes = [
        f"{len(items)} prompts from `{args.dataset}`, greedy, max_new_tokens {args.max_new_tokens}, batch "
        f"{args.batch_size}, judge `{args.judge}`; each run is a full `run_eval` (generate + judge + "
        "write the run folder)",
        f"cold start (once, not in the table): model load {load_s:.1f} s, judge load {judge_load_s:.1f} s",
        f"{args.repeats} interleaved repetitions after {args.warmup} warm-up of {len(warm_items)} prompts; "
        "times are medians, the ratio the median of per-repetition ratios",
    ]
    if els_info:
        notes.append(
            f"ELS: {els_info['source']}; layers {els_info['layers']}, settings {els_info['settings']} "
            f"(from {els_info['settings_from']})"
        )
    md = "\n".join(
        bl.header("ORB-H test end to end (generate + judge)", env, notes) + [bl.md_table(headers, rows)]
    )
    result = {
        "benchmark": NAME,
        "env": env,
        "args": vars(args),
        "model_load_seconds": load_s,
        "judge_load_seconds": judge_load_s,
        "els": els_info,
        "n_prompts": len(items),
        "runs": runs,
        "summary": summary,
        "ratio_els_vs_unsteered": ratio,
    }
    bl.write_outputs(args.out, NAME, result, md)
    return result


if __name__ == "__main__":
    main()
