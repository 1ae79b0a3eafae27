"""Do the two backends score a prompt's surprisal alike on a real model? The Hugging Face hooks' score
(:func:`aligntax.activations.decisions.prompt_surprisal`: a forward of the model) against the vLLM
backend's (:meth:`aligntax.backends.vllm.engine.VllmModel.prompt_nll`: the engine's own log-probabilities
of the prompt tokens), per prompt of each ``--data`` set: the largest and median absolute difference, and
how many prompts the two put on different sides of the cut-off ``--cut`` (the ELS option
``max_prompt_surprisal``; the demo's is the 99% quantile of its training prompts).

Runs in ``.venv-vllm`` (both backends load the model):

    .venv-vllm/bin/python bench/surprisal_backends.py --cut 6.4981 --data orbench-hard-test jbb-attacks
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib as bl  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=bl.DEFAULT_MODEL)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--cut", type=float, required=True, help="the surprisal cut-off (nats per user token)")
    p.add_argument("--data", nargs="+", default=["orbench-hard-test", "jbb-attacks"])
    p.add_argument("--limit", type=int, default=None, help="prompts per set (default: all)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None, help="folder for surprisal_backends.json / .md")
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")

    from aligntax.activations.decisions import prompt_surprisal
    from aligntax.backends.vllm.engine import VllmModel, VllmOptions
    from aligntax.surprisal import template_span

    bl.set_threads(args.threads)
    lm, _ = bl.load_lm(args.model, args.dtype, None)
    vm = VllmModel(args.model, dtype=args.dtype, options=VllmOptions(max_model_len=2048, max_num_seqs=64))
    span = template_span(lm.tokenizer)
    rows = []
    for name in args.data:
        prompts = bl.load_prompt_texts(name, args.limit)
        hf = prompt_surprisal(lm, prompts, batch_size=16)
        vl = vm.prompt_nll(vm.encode(prompts)[1], span)
        diff = sorted(abs(a - b) for a, b in zip(hf, vl, strict=True))
        rows.append(
            {
                "data": name,
                "prompts": len(prompts),
                "max_abs_diff": diff[-1],
                "median_abs_diff": diff[len(diff) // 2],
                "above_cut_hf": sum(v > args.cut for v in hf),
                "above_cut_vllm": sum(v > args.cut for v in vl),
                "sides_differ": sum((a > args.cut) != (b > args.cut) for a, b in zip(hf, vl, strict=True)),
            }
        )
        print(rows[-1], flush=True)
    vm.close()
    res = {"env": bl.environment(lm), "cut": args.cut, "dtype": args.dtype, "rows": rows}
    md = bl.md_table(
        ["data", "prompts", "max |HF - vLLM|", "median", "above cut HF / vLLM", "other side"],
        [
            [
                r["data"],
                r["prompts"],
                f"{r['max_abs_diff']:.4f}",
                f"{r['median_abs_diff']:.4f}",
                f"{r['above_cut_hf']} / {r['above_cut_vllm']}",
                r["sides_differ"],
            ]
            for r in rows
        ],
    )
    if args.out:
        bl.write_outputs(args.out, "surprisal_backends", res, md)
    else:
        print(md)
    return res


if __name__ == "__main__":
    main()
