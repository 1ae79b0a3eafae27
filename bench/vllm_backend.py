"""The vLLM backend against the Hugging Face backend: offline greedy throughput, unsteered and ELS-steered.

Four arms on the same prompts, interleaved in one process (the vLLM engine runs in this process too,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so both backends use the same torch threads):

- ``hf``: aligntax's own batched decode loop (``aligntax.generation.generate``), ``--batch-size`` rows a batch;
- ``hf+els``: the same with ELS from ``--steer DIR`` (settings from ``DIR/sweep/best.json`` unless given);
- ``vllm``: one ``VllmModel.generate`` call (continuous batching, ``--batch-size`` sequence slots);
- ``vllm+els``: the same with the ELS folder registered as a steering preset.

vLLM's prefix cache is off unless ``--prefix-caching`` (repeated runs of the same prompts would skip
their prefill after the first). Reported per arm: median wall seconds, generated tokens/s, and the time
relative to ``hf`` and of each steered arm relative to its unsteered one (median of per-repetition
ratios); plus how many responses the two backends give identically and how many rows ELS steers.
Needs ``.venv-vllm`` (``./run setup-vllm``):

    OMP_NUM_THREADS=1 .venv-vllm/bin/python bench/vllm_backend.py --steer runs/demo/els --threads 1
    .venv-vllm/bin/python bench/vllm_backend.py --steer runs/demo/els --quick   # smoke run

``--arms vllm,vllm+els --fixed-length`` measures the steering's own cost inside vLLM: both arms generate
exactly ``--max-new-tokens`` tokens per prompt, so a steered answer that runs longer than its unsteered
one (a refusal turned into an answer) does not count as overhead.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import benchlib as bl  # noqa: E402

NAME = "vllm_backend"
QUICK = dict(prompts=8, batch_size=8, max_new_tokens=4, repeats=1, warmup=1)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    bl.add_common_args(p, repeats=2, out_name=NAME)
    bl.add_prompt_args(p, dataset="orbench-hard-test", prompts=48, batch_size=48)
    p.add_argument("--max-new-tokens", type=int, default=32, help="default 32")
    p.add_argument("--steer", required=True, help="an ELS folder written by `aligntax els train`")
    p.add_argument("--prefix-caching", action="store_true", help="keep vLLM's prefix cache on")
    p.add_argument("--kv-cache-gib", type=int, default=2, help="vLLM's CPU KV cache (default 2)")
    p.add_argument(
        "--arms",
        default="hf,hf+els,vllm,vllm+els",
        help="comma-separated arms to run (default all four; e.g. vllm,vllm+els)",
    )
    p.add_argument(
        "--fixed-length",
        action="store_true",
        help="vLLM arms generate exactly --max-new-tokens tokens per prompt (end tokens ignored), so "
        "the steered and unsteered arms do the same work: their time ratio is the steering's cost",
    )
    return bl.parse_with_quick(p, argv, QUICK)


def main(argv=None) -> dict:
    args = parse_args(argv)
    from aligntax.activations.decisions import row_info
    from aligntax.backends.vllm.engine import VllmModel, VllmOptions
    from aligntax.generation import GenerationConfig, generate
    from aligntax.interventions.registry import make_intervention

    lm, load_s = bl.start(args)
    prompts = bl.load_prompt_texts(args.dataset, args.prompts)
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    iv = make_intervention("els", lm, path=args.steer)
    vm = VllmModel(
        args.model,
        dtype=args.dtype,
        options=VllmOptions(
            max_model_len=2048,
            max_num_seqs=args.batch_size,
            enable_prefix_caching=args.prefix_caching,
            kv_cache_gib=args.kv_cache_gib,
        ),
    )
    vm.register("els", args.steer)
    info = row_info(iv, lm, prompts, None, args.batch_size)
    steered_rows = sum(r["steered"] for r in info) if info else len(prompts)
    answers: dict[str, list[str]] = {}

    def arm(name, fn):
        def run() -> dict:
            secs, gens = bl.timed(fn)
            answers[name] = [g.response for g in gens]
            return {"seconds": secs, "tokens": sum(g.n_tokens for g in gens)}

        return run

    fixed = args.fixed_length
    arms = {
        "hf": arm("hf", lambda: generate(lm, prompts, cfg, None, progress=False)),
        "hf+els": arm("hf+els", lambda: generate(lm, prompts, cfg, iv, progress=False)),
        "vllm": arm("vllm", lambda: vm.generate(prompts, cfg, ignore_eos=fixed)[0]),
        "vllm+els": arm("vllm+els", lambda: vm.generate(prompts, cfg, steer="els", ignore_eos=fixed)[0]),
    }
    wanted = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(wanted) - set(arms))
    if unknown or not wanted:
        raise SystemExit(f"unknown arms {unknown}; choose from {', '.join(arms)}")
    arms = {k: v for k, v in arms.items() if k in wanted}
    env = {**bl.environment(lm), "vllm": __import__("vllm").__version__}
    runs = bl.interleaved(arms, args.repeats, args.warmup)
    summary = {name: bl.summarize(r) for name, r in runs.items()}
    ratios = {
        f"{b}/{a}": bl.paired_ratio(runs[a], runs[b])
        for a, b in (("hf", "hf+els"), ("vllm", "vllm+els"), ("hf", "vllm"), ("hf+els", "vllm+els"))
        if a in runs and b in runs
    }
    same = {
        k: sum(x == y for x, y in zip(answers[k], answers[f"vllm{k[2:]}"], strict=True))
        for k in ("hf", "hf+els")
        if k in answers and f"vllm{k[2:]}" in answers
    }
    rows = [
        [
            name,
            s["median_s"],
            s["median_tok_s"],
            s["tokens"] if not isinstance(s["tokens"], list) else "varies",
        ]
        for name, s in summary.items()
    ]
    ratio_rows = [
        [k, v["median_paired"], ", ".join(f"{x:.3f}" for x in v["per_repeat"])] for k, v in ratios.items()
    ]
    notes = [
        f"{len(prompts)} prompts of {args.dataset}, {args.max_new_tokens} new tokens, greedy; batch size / "
        f"sequence slots {args.batch_size}; vllm {env['vllm']}, prefix cache "
        f"{'on' if args.prefix_caching else 'off'}",
        f"ELS {args.steer}: {iv.config()}; steered rows {steered_rows}/{len(prompts)}",
        *(
            [f"vLLM arms: exactly {args.max_new_tokens} tokens per prompt (end tokens ignored)"]
            if fixed
            else []
        ),
        *[f"identical responses, {k} vs vllm{k[2:]}: {v}/{len(prompts)}" for k, v in same.items()],
        f"HF model load {load_s:.1f} s",
    ]
    md = "\n".join(
        [
            *bl.header("vLLM backend vs Hugging Face backend", env, notes),
            "",
            bl.md_table(["arm", "median s", "tok/s", "tokens"], rows),
            "",
            bl.md_table(["ratio (time)", "median of per-repeat", "per repeat"], ratio_rows),
        ]
    )
    result = {
        "args": vars(args),
        "env": env,
        "summary": summary,
        "ratios": ratios,
        "runs": runs,
        "identical": same,
        "steered_rows": steered_rows,
    }
    bl.write_outputs(args.out, NAME, result, md)
    return result


if __name__ == "__main__":
    main()
