"""Cost of activation capture: ``aligntax.activations.capture`` at every layer versus a plain forward pass.

The same prompts (ORB-H test by default), in the same length-sorted, left-padded batches, run through:

* ``forward``: ``model(input_ids, attention_mask, position_ids, use_cache=False)`` with no hooks, on
  batches tokenised beforehand; this is exactly the forward that capture runs;
* ``capture_ids``: :func:`aligntax.activations.capture.capture_ids` on the same token ids (pre-hooks on
  every block, picking the position, the float32 copy to the CPU) -> target ``capture_ids / forward <= 1.05``;
* ``tokenize+forward``: chat templating + tokenisation + sorting + the plain forward, from prompt text;
* ``capture``: :func:`aligntax.activations.capture.capture` from prompt text (what ``els train`` calls)
  -> ``capture / tokenize+forward``;
* ``base forward`` (for information): the decoder stack alone (``model.model``, no ``lm_head``): what
  a capture could cost if it skipped the vocabulary projection that a full forward computes.

All alternatives run in one process, interleaved and reversed every repetition, after an untimed
warm-up; medians and median per-repetition ratios are reported.

    python bench/capture_overhead.py --threads 2
    python bench/capture_overhead.py --quick --model embedded:smollm2-135m-instruct   # smoke run
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib as bl  # noqa: E402

NAME = "capture_overhead"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    bl.add_common_args(p, repeats=5, out_name=NAME)
    bl.add_prompt_args(p, dataset="orbench-hard-test", prompts=128)
    p.add_argument("--layers", default="all", help="captured layers: 'all' (default) or a comma list")
    p.add_argument("--position", default="last", choices=("last", "mean"), help="default last")
    args = bl.parse_with_quick(p, argv, dict(prompts=8, batch_size=4, repeats=1))
    args.layers = "all" if args.layers == "all" else bl.int_list(args.layers)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from aligntax.activations.capture import capture, capture_ids, chat_ids, pad_left, position_ids_from_mask

    lm, load_s = bl.start(args)
    model = lm.model
    prompts = bl.load_prompt_texts(args.dataset, args.prompts)
    pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
    bs = args.batch_size

    def tokenize() -> list[list[int]]:
        seqs, _ = chat_ids(lm, prompts)
        return sorted(seqs, key=len, reverse=True)  # capture() sorts the same way (stable, by -len)

    def encode(seqs: list[list[int]]) -> list[tuple]:
        out = []
        for s in range(0, len(seqs), bs):
            ids, mask = pad_left(seqs[s : s + bs], pad, lm.device)
            out.append((ids, mask, position_ids_from_mask(mask)))
        return out

    seqs = tokenize()
    batches = encode(seqs)
    n_tokens = sum(len(s) for s in seqs)
    base = getattr(model, "model", None)

    @torch.no_grad()
    def forward(bat, module) -> dict:
        t = time.perf_counter()
        for ids, mask, pos in bat:
            module(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
        return {"seconds": time.perf_counter() - t, "tokens": n_tokens}

    def run_capture_ids() -> dict:
        t = time.perf_counter()
        acts, _ = capture_ids(model, seqs, args.layers, args.position, batch_size=bs, pad_id=pad)
        res = {"seconds": time.perf_counter() - t, "tokens": n_tokens}
        res["layers"] = len(acts)
        return res

    def run_tokenize_forward() -> dict:
        t = time.perf_counter()
        forward(encode(tokenize()), model)
        return {"seconds": time.perf_counter() - t, "tokens": n_tokens}

    def run_capture() -> dict:
        t = time.perf_counter()
        acts = capture(lm, prompts, args.layers, args.position, batch_size=bs, progress=False)
        return {"seconds": time.perf_counter() - t, "tokens": n_tokens, "layers": len(acts)}

    arms = {
        "forward": lambda: forward(batches, model),
        "capture_ids": run_capture_ids,
        "tokenize+forward": run_tokenize_forward,
        "capture": run_capture,
    }
    if base is not None:
        arms["base forward"] = lambda: forward(batches, base)
    print(
        f"{len(prompts)} prompts ({n_tokens} tokens) in batches of {bs}, layers {args.layers}, "
        f"position {args.position}",
        flush=True,
    )
    runs = bl.interleaved(arms, args.repeats, args.warmup)
    summary = {name: bl.summarize(r) for name, r in runs.items()}
    ratios = {
        "capture_ids / forward": bl.paired_ratio(runs["forward"], runs["capture_ids"]),
        "capture / tokenize+forward": bl.paired_ratio(runs["tokenize+forward"], runs["capture"]),
    }
    if base is not None:
        ratios["base forward / forward"] = bl.paired_ratio(runs["forward"], runs["base forward"])

    headers = ["alternative", "median s", "min s", "prompt tok/s"]
    rows = [[name, s["median_s"], s["min_s"], bl.fmt(s["median_tok_s"], 1)] for name, s in summary.items()]
    ratio_rows = [
        [
            name,
            r["median_paired"],
            r["of_medians"],
            ("yes" if r["median_paired"] <= 1.05 else "no") if "capture" in name else "(info)",
        ]
        for name, r in ratios.items()
    ]
    env = bl.environment(lm)
    n_layers = lm.num_layers if args.layers == "all" else len(args.layers)
    notes = [
        f"{len(prompts)} prompts from `{args.dataset}` ({n_tokens} prompt tokens), batches of {bs}, "
        f"capture at {n_layers} layers, position {args.position}",
        f"{args.repeats} interleaved repetitions after {args.warmup} warm-up",
    ]
    md = "\n".join(
        bl.header("Activation capture overhead", env, notes)
        + [
            bl.md_table(headers, rows),
            "",
            bl.md_table(["ratio", "median of per-rep ratios", "ratio of medians", "<= 1.05"], ratio_rows),
        ]
    )
    result = {
        "benchmark": NAME,
        "env": env,
        "args": vars(args),
        "model_load_seconds": load_s,
        "n_prompts": len(prompts),
        "prompt_tokens": n_tokens,
        "runs": runs,
        "summary": summary,
        "ratios": ratios,
    }
    bl.write_outputs(args.out, NAME, result, md)
    return result


if __name__ == "__main__":
    main()
