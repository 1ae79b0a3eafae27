"""Per-token costs of a model here, and the same costs scaled to a larger model by parameter count.

Measured on ``--model`` (default the embedded 0.5B model), bf16, on this machine:

* **prefill**: seconds per prompt token of a forward pass over chat-templated prompts (ORB-H test), in
  batches of ``--prefill-batch``, without the cache: what activation capture, the harm gate's and the row
  decisions' prefills, and the first step of every generation cost;
* **decode**: seconds per generated token of greedy decoding at ``--batch-size`` rows (the demo's 96) with
  a forced number of new tokens, so that no row leaves the batch.

Scaled: a dense decoder's matmul work per token is about twice the parameters a token passes through (every
weight but the input embedding table, which is a look-up), so on the same machine both costs grow in
proportion to that count: the ``--target-params`` column is the measured cost times ``target / measured``
(an estimate, not a measurement of the larger model; Llama-3.1-8B-Instruct: 8.03B parameters, 7.50B of
them outside its input embeddings). With ``--timing`` (a demo's ``timing.json``) each stage's minutes are
scaled the same way.

    python bench/per_token_cost.py --threads 2
    python bench/per_token_cost.py --threads 2 --target-params 7.50e9 --timing runs/demo/timing.json
    python bench/per_token_cost.py --quick --model embedded:smollm2-135m-instruct   # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib as bl  # noqa: E402
from gen_throughput import decode  # noqa: E402

NAME = "per_token_cost"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bl.add_common_args(p, repeats=3, out_name=NAME)
    p.add_argument("--dataset", default="orbench-hard-test")
    p.add_argument("--batch-size", type=int, default=96, help="decode rows (default 96, the demo's batch)")
    p.add_argument("--new-tokens", type=int, default=24, help="forced new tokens per row (default 24)")
    p.add_argument("--prefill-batch", type=int, default=32, help="prompts per prefill forward (default 32)")
    p.add_argument("--prefill-prompts", type=int, default=128, help="prompts in the prefill measurement")
    p.add_argument(
        "--target-params",
        type=float,
        default=7.50e9,
        help="parameters outside the input embeddings of the larger model (default 7.50e9: Llama-3.1-8B)",
    )
    p.add_argument("--timing", default=None, help="a demo's timing.json: its stage minutes scaled too")
    args = p.parse_args(argv)
    if args.quick:
        args.batch_size, args.new_tokens, args.repeats = 4, 4, 1
        args.prefill_batch, args.prefill_prompts = 4, 8
    return args


def prefill_seconds(lm, prompts: list[str], batch: int) -> tuple[float, int]:
    """Seconds of forward passes over ``prompts`` in batches (left-padded, no cache), and the prompt
    tokens they hold (padding not counted)."""
    import torch

    from aligntax.generation.chat import build_messages, render_chat
    from aligntax.hooks import pad_left

    texts = [render_chat(lm.tokenizer, build_messages(p, None, None)) for p in prompts]
    seqs = lm.tokenizer(texts, add_special_tokens=False)["input_ids"]
    total, tokens = 0.0, 0
    for i in range(0, len(seqs), batch):
        part = seqs[i : i + batch]
        ids, mask = pad_left(part, lm.tokenizer.pad_token_id or 0, lm.device)
        t = time.perf_counter()
        with torch.no_grad():
            lm.model(input_ids=ids, attention_mask=mask, use_cache=False)
        total += time.perf_counter() - t
        tokens += sum(len(s) for s in part)
    return total, tokens


def main(argv=None) -> dict:
    args = parse_args(argv)
    lm, load_s = bl.start(args)
    # the parameters a token's matmuls pass through: all but the input embedding table (a look-up)
    params = sum(p.numel() for p in lm.model.parameters()) - lm.model.get_input_embeddings().weight.numel()
    ratio = args.target_params / params
    env = bl.environment(lm)
    prompts = bl.load_prompt_texts(args.dataset, max(args.batch_size, args.prefill_prompts))
    for _ in range(args.warmup):
        prefill_seconds(lm, prompts[: args.prefill_batch], args.prefill_batch)
        decode(lm, prompts[: min(4, args.batch_size)], 2)
    runs = []
    for rep in range(args.repeats):
        pre_s, pre_tokens = prefill_seconds(lm, prompts[: args.prefill_prompts], args.prefill_batch)
        dec_s, _ = decode(lm, prompts[: args.batch_size], args.new_tokens)
        runs.append(
            {
                "repeat": rep,
                "prefill_seconds": pre_s,
                "prefill_tokens": pre_tokens,
                "decode_seconds": dec_s,
                "decode_tokens": args.batch_size * args.new_tokens,
            }
        )
        print(f"repeat {rep}: prefill {pre_s:.2f} s / {pre_tokens} tokens, decode {dec_s:.2f} s", flush=True)
    prefill = statistics.median(r["prefill_seconds"] / r["prefill_tokens"] for r in runs)
    dec = statistics.median(r["decode_seconds"] / r["decode_tokens"] for r in runs)
    result = {
        "model": args.model,
        "parameters": params,
        "target_parameters": args.target_params,
        "ratio": ratio,
        "load_seconds": load_s,
        "prefill_ms_per_token": 1000 * prefill,
        "decode_ms_per_token": 1000 * dec,
        "batch_size": args.batch_size,
        "new_tokens": args.new_tokens,
        "runs": runs,
        "environment": env,
    }
    rows = [
        ["prefill (per prompt token)", bl.fmt(1000 * prefill), bl.fmt(1000 * prefill * ratio)],
        [
            f"decode at batch {args.batch_size} (per new token)",
            bl.fmt(1000 * dec),
            bl.fmt(1000 * dec * ratio),
        ],
    ]
    md = bl.header(
        f"Per-token costs of {args.model} ({params / 1e9:.3f}B parameters outside the input embeddings), "
        f"scaled to {args.target_params / 1e9:.2f}B",
        env,
        [
            f"median of {args.repeats} repetitions; the scaled column is an estimate (x {ratio:.2f}), not measured"
        ],
    )
    md += [
        bl.md_table(
            ["cost", "ms, measured", f"ms, scaled to {args.target_params / 1e9:.2f}B"], rows, align="lrr"
        )
    ]
    if args.timing:
        timing = json.loads(Path(args.timing).read_text())
        stages = {
            k: v for k, v in timing.items() if isinstance(v, (int, float)) and k != "calibration_seconds"
        }
        result["stages_minutes"] = {k: {"measured": v, "scaled": v * ratio} for k, v in stages.items()}
        md += [
            "",
            bl.md_table(
                ["stage", "minutes, measured", f"minutes, scaled to {args.target_params / 1e9:.2f}B"],
                [[k, bl.fmt(v, 1), bl.fmt(v * ratio, 1)] for k, v in stages.items()],
                align="lrr",
            ),
        ]
    bl.write_outputs(args.out, NAME, result, "\n".join(md))
    return result


if __name__ == "__main__":
    main()
