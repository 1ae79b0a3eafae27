"""Generation speed against this machine's own matrix-multiply limit.

Measured in one run, side by side:

* the bf16 matmul throughput of the model's own linear shapes (every projection of one decoder block and
  the LM head) at each batch size, as ``torch.nn.functional.linear`` runs them here: the limit that
  greedy decoding of one token per row can reach;
* greedy decoding of the same prompts at each batch size (ORB-H test prompts, a forced number of new
  tokens so that no row leaves the batch): generated tokens/s, the FLOP/s that implies (2 x the weights
  a token passes through, plus attention over its context), and its fraction of the matmul limit;
* with ``--alternatives``, the same decoding under other settings: ``int8-dynamic`` (weight-only int8
  linear layers of ``torch.ao`` dynamic quantisation, float32 activations) and ``fp32``, with the share
  of greedy tokens equal to the bf16 run's.

    python bench/gen_throughput.py --threads 2 --batch-sizes 32,64,96,128
    python bench/gen_throughput.py --threads 2 --batch-sizes 96 --alternatives int8-dynamic,fp32
    python bench/gen_throughput.py --quick --model embedded:smollm2-135m-instruct   # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib as bl  # noqa: E402

NAME = "gen_throughput"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bl.add_common_args(p, repeats=2, out_name=NAME)
    p.add_argument("--dataset", default="orbench-hard-test")
    p.add_argument("--batch-sizes", type=bl.int_list, default=[32, 64, 96, 128])
    p.add_argument("--new-tokens", type=int, default=24, help="forced new tokens per row (default 24)")
    p.add_argument("--alternatives", default="", help="comma list: int8-dynamic, fp32")
    args = p.parse_args(argv)
    if args.quick:
        args.batch_sizes, args.new_tokens, args.repeats = [4], 4, 1
    return args


def linear_shapes(model) -> list[tuple[int, int]]:
    """(in, out) of every linear layer one token passes through: one decoder block's, times the block
    count, and the LM head."""
    import torch

    blocks = model.model.layers
    shapes = [(m.in_features, m.out_features) for m in blocks[0].modules() if isinstance(m, torch.nn.Linear)]
    head = model.get_output_embeddings()
    return shapes * len(blocks) + [(head.in_features, head.out_features)]


def matmul_seconds(shapes: list[tuple[int, int]], rows: int, dtype, repeats: int) -> float:
    """Seconds for one pass of ``rows`` rows through every shape (each timed alone, fastest of repeats)."""
    import torch

    total = 0.0
    for k, n in sorted(set(shapes)):
        x, w = torch.randn(rows, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
        torch.nn.functional.linear(x, w)
        best = min(_timed(lambda x=x, w=w: torch.nn.functional.linear(x, w)) for _ in range(max(3, repeats)))
        total += best * shapes.count((k, n))
    return total


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def decode(lm, prompts: list[str], new_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds of greedy decoding of ``new_tokens`` per row (none ends early) after the prefill, and the tokens."""
    import torch

    from aligntax.generation.chat import build_messages, render_chat
    from aligntax.generation.generate import decode_loop
    from aligntax.hooks import pad_left

    texts = [render_chat(lm.tokenizer, build_messages(p, None, None)) for p in prompts]
    seqs = lm.tokenizer(texts, add_special_tokens=False)["input_ids"]
    ids, mask = pad_left(seqs, lm.tokenizer.pad_token_id or 0, lm.device)

    def never(alive, tokens, step):
        return torch.zeros(len(alive), dtype=torch.bool)

    first = {}

    def choose(logits, alive):  # the prefill's step is timed apart
        if "t" not in first:
            first["t"] = time.perf_counter()
        return logits.argmax(-1)

    out = decode_loop(lm.model, ids, mask, new_tokens + 1, set(), choose=choose, ended=never)
    return time.perf_counter() - first["t"], out


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    lm, _ = bl.start(args)
    model = lm.model
    shapes = linear_shapes(model)
    weights = sum(k * n for k, n in shapes)
    cfg = model.config
    prompts_all = bl.load_prompt_texts(args.dataset, max(args.batch_sizes))
    rows = []
    ref_tokens: dict[int, list[list[int]]] = {}
    for b in args.batch_sizes:
        prompts = prompts_all[:b]
        mm = statistics.median(matmul_seconds(shapes, b, lm.dtype, args.repeats) for _ in range(args.repeats))
        runs = [decode(lm, prompts, args.new_tokens) for _ in range(args.repeats + args.warmup)][
            args.warmup :
        ]
        secs = statistics.median(r[0] for r in runs)
        ref_tokens[b] = runs[0][1]
        # attention: 2 x 2 x context x hidden per layer and token, context about prompt + half the new tokens
        ctx = statistics.mean(len(x) for x in lm.tokenizer(prompts)["input_ids"]) + 30 + args.new_tokens / 2
        attn = 4 * ctx * cfg.hidden_size * cfg.num_hidden_layers
        flop_token = 2 * weights + attn
        tok_s = b * args.new_tokens / secs
        limit = 2 * weights * b / mm  # FLOP/s of the linear layers alone at this many rows
        rows.append(
            {
                "setting": str(lm.dtype).replace("torch.", ""),
                "batch": b,
                "tokens_per_s": round(tok_s, 1),
                "gflop_per_s": round(tok_s * flop_token / 1e9, 1),
                "matmul_gflop_per_s": round(limit / 1e9, 1),
                "fraction_of_limit": round(tok_s * 2 * weights / limit, 3),
                "matmul_tokens_per_s": round(b / mm, 1),
            }
        )
        print(rows[-1], flush=True)
    for alt in [a for a in args.alternatives.split(",") if a]:
        alt_lm = _alternative(args, alt)
        for b in args.batch_sizes:
            runs = [
                decode(alt_lm, prompts_all[:b], args.new_tokens) for _ in range(args.repeats + args.warmup)
            ][args.warmup :]
            secs = statistics.median(r[0] for r in runs)
            same = sum(x == y for x, y in zip(runs[0][1], ref_tokens[b], strict=True)) / b
            rows.append(
                {
                    "setting": alt,
                    "batch": b,
                    "tokens_per_s": round(b * args.new_tokens / secs, 1),
                    "greedy_rows_equal": round(same, 3),
                }
            )
            print(rows[-1], flush=True)
        del alt_lm
    env = bl.environment(lm)
    env["torch_matmul_backend"] = torch.backends.mkldnn.is_available()
    result = {"rows": rows, "new_tokens": args.new_tokens, "dataset": args.dataset, "environment": env}
    table = bl.md_table(
        ["setting", "batch", "tokens/s", "GFLOP/s", "matmul limit GFLOP/s", "fraction", "rows equal"],
        [
            [
                r["setting"],
                r["batch"],
                str(r["tokens_per_s"]),
                str(r.get("gflop_per_s", "")),
                str(r.get("matmul_gflop_per_s", "")),
                str(r.get("fraction_of_limit", "")),
                str(r.get("greedy_rows_equal", "")),
            ]
            for r in rows
        ],
    )
    bl.write_outputs(args.out, NAME, result, table)
    return result


def _alternative(args, name: str):
    import torch

    if name == "fp32":
        lm, _ = bl.load_lm(args.model, "fp32", args.device)
        return lm
    if name == "int8-dynamic":
        lm, _ = bl.load_lm(args.model, "fp32", args.device)
        lm.model = torch.ao.quantization.quantize_dynamic(lm.model, {torch.nn.Linear}, dtype=torch.qint8)
        return lm
    raise SystemExit(f"unknown alternative {name!r} (int8-dynamic, fp32)")


if __name__ == "__main__":
    main()
