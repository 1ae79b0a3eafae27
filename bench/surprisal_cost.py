"""What the prompt-surprisal domain of ELS costs per batch: one forward of the batch's prompts with the
output layer on the last token only (a prefill) against :func:`aligntax.surprisal.span_nll` on the same
batch (the forward again, plus the output layer on every user token), each the mean of ``--repeats``
calls after one warm-up call.

    .venv/bin/python bench/surprisal_cost.py --batch 32
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib as bl  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=bl.DEFAULT_MODEL)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--data", default="orbench-hard-test", help="the prompts (the first --batch of them)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)

    import torch

    from aligntax.activations.capture import chat_ids
    from aligntax.hooks import pad_left, position_ids_from_mask
    from aligntax.runs.eval import load_prompt_sets
    from aligntax.surprisal import span_nll, template_span

    bl.set_threads(args.threads)
    lm, _ = bl.load_lm(args.model, args.dtype, args.device)
    prompts = [it.prompt for it in load_prompt_sets([args.data], args.batch)]
    seqs, lens = chat_ids(lm, prompts)
    pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
    ids, mask = pad_left(seqs, pad, lm.device)
    lens_t, span = torch.tensor(lens), template_span(lm.tokenizer)

    def prefill() -> None:
        with torch.no_grad():
            lm.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=position_ids_from_mask(mask),
                logits_to_keep=1,
            )

    def surprisal() -> None:
        span_nll(lm.model, ids, lens_t, span)

    res = {
        "env": bl.environment(lm),
        "batch": list(ids.shape),
        "scored_tokens": sum(n - sum(span) for n in lens),
    }
    for name, f in (("prefill_s", prefill), ("span_nll_s", surprisal)):
        f()
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            f()
        res[name] = (time.perf_counter() - t0) / args.repeats
    print(
        f"batch {tuple(ids.shape)}: prefill {res['prefill_s']:.2f} s, span_nll {res['span_nll_s']:.2f} s "
        f"({res['span_nll_s'] / res['prefill_s']:.2f}x)"
    )
    return res


if __name__ == "__main__":
    main()
