"""Cost of the ELS training states: label generation plus a capture pass, versus recording the states
during the label generation's prefill (:class:`aligntax.activations.recorder.PrefillRecorder`).

The same prompts (OR-Bench-Hard train by default, the energy models' training prompts), greedy, in the
same batches, run as:

* ``generate``: the label generation alone (for reference);
* ``generate + capture``: the label generation, then :func:`aligntax.activations.capture.capture` of
  the last prompt token at every layer (what ELS training did before);
* ``generate (recording)``: the label generation with a ``PrefillRecorder`` on every layer (what it does
  now) -> ``recording / generate + capture`` is the saving, ``recording / generate`` the recorder's cost.

The recorded and captured states are compared too (they differ only by bf16 batch rounding).
All alternatives run in one process, interleaved and reversed every repetition, after an untimed
warm-up; medians and median per-repetition ratios are reported.

    python bench/label_states.py --threads 2
    python bench/label_states.py --quick --model embedded:smollm2-135m-instruct   # smoke run
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib as bl  # noqa: E402

NAME = "label_states"


def parse_args(argv=None) -> argparse.Namespace:
    p = bl.generation_parser(__doc__, NAME, dataset="orbench-hard-train", note="as ELS training labels")
    return bl.parse_with_quick(p, argv, bl.GENERATION_QUICK)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from aligntax.activations.capture import capture
    from aligntax.activations.recorder import PrefillRecorder
    from aligntax.generation import GenerationConfig, generate, iter_generate

    lm, load_s = bl.start(args)
    prompts = bl.load_prompt_texts(args.dataset, args.prompts)
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    states: dict[str, dict] = {}

    def run_generate() -> dict:
        t = time.perf_counter()
        gens = generate(lm, prompts, cfg, progress=False)
        return {"seconds": time.perf_counter() - t, "tokens": sum(g.n_tokens for g in gens)}

    def run_generate_capture() -> dict:
        t = time.perf_counter()
        gens = generate(lm, prompts, cfg, progress=False)
        states["captured"] = capture(lm, prompts, "all", batch_size=args.batch_size, progress=False)
        return {"seconds": time.perf_counter() - t, "tokens": sum(g.n_tokens for g in gens)}

    def run_recording() -> dict:
        t = time.perf_counter()
        rec, n = PrefillRecorder(lm.model, "all"), 0
        for idx, gens in iter_generate(lm, prompts, cfg, rec, progress=False):
            rec.keep([str(i) for i in idx])
            n += sum(g.n_tokens for g in gens)
        order = torch.tensor([int(p) for p in rec.prompt_ids]).argsort()
        states["recorded"] = {layer: h[order] for layer, h in rec.states().items()}
        return {"seconds": time.perf_counter() - t, "tokens": n}

    arms = {
        "generate": run_generate,
        "generate + capture": run_generate_capture,
        "generate (recording)": run_recording,
    }
    print(
        f"{len(prompts)} prompts, {args.max_new_tokens} new tokens, batches of {args.batch_size}, "
        f"{lm.num_layers} layers",
        flush=True,
    )
    runs = bl.interleaved(arms, args.repeats, args.warmup)
    summary = {name: bl.summarize(r) for name, r in runs.items()}
    ratios = {
        "recording / generate + capture": bl.paired_ratio(
            runs["generate + capture"], runs["generate (recording)"]
        ),
        "recording / generate": bl.paired_ratio(runs["generate"], runs["generate (recording)"]),
    }
    rel = torch.cat(
        [
            ((states["recorded"][layer] - h).norm(dim=1) / h.norm(dim=1).clamp_min(1e-12))
            for layer, h in states["captured"].items()
            if layer > 0
        ]
    )
    agreement = {
        "median_relative_difference": float(rel.median()),
        "max_relative_difference": float(rel.max()),
    }

    headers = ["alternative", "median s", "min s", "generated tok/s"]
    rows = [[name, s["median_s"], s["min_s"], bl.fmt(s["median_tok_s"], 1)] for name, s in summary.items()]
    ratio_rows = [[name, r["median_paired"], r["of_medians"]] for name, r in ratios.items()]
    env = bl.environment(lm)
    notes = [
        f"{len(prompts)} prompts from `{args.dataset}`, {args.max_new_tokens} new tokens (greedy), batches "
        f"of {args.batch_size}, states at all {lm.num_layers} layers",
        f"{args.repeats} interleaved repetitions after {args.warmup} warm-up",
        f"recorded vs captured states (layers 1+): median relative difference "
        f"{agreement['median_relative_difference']:.4f}, max {agreement['max_relative_difference']:.4f}",
    ]
    md = "\n".join(
        bl.header("ELS training states: recorded during label generation vs a second pass", env, notes)
        + [
            bl.md_table(headers, rows),
            "",
            bl.md_table(["ratio", "median of per-rep ratios", "ratio of medians"], ratio_rows),
        ]
    )
    result = {
        "benchmark": NAME,
        "env": env,
        "args": vars(args),
        "model_load_seconds": load_s,
        "n_prompts": len(prompts),
        "runs": runs,
        "summary": summary,
        "ratios": ratios,
        "state_agreement": agreement,
    }
    bl.write_outputs(args.out, NAME, result, md)
    return result


if __name__ == "__main__":
    main()
