"""Cost of Energy Landscape Steering during generation: ELS-steered versus unsteered greedy decoding.

The same prompts (ORB-H test by default) are generated at each batch size with and without steering,
in one process, interleaved (unsteered, ELS, ELS-autograd, then reversed, ...), after an untimed
warm-up. Every row generates exactly ``--max-new-tokens`` tokens (``min_new_tokens`` = ``max_new_tokens``,
so eos cannot end a row early and steered and unsteered runs do the same amount of work). The timed loop
is what ``aligntax.generation.generate`` does per batch (``SteerContext`` + ``intervention.attach`` +
``model.generate`` with its greedy settings), on batches tokenised beforehand (prompts sorted by length,
as ``generate`` does), so only generation is timed.

Reported per batch size: median wall time, tokens/s, steered/unsteered time ratios (median of the
per-repetition ratios; target <= 1.05), and the share of the steered run's wall time spent inside the
steering step itself (the hook's energy descent, timed around each call: unlike the ratio, this does
not move when other jobs share the machine) for the closed-form energy gradient (``grad_method='closed'``,
the default) and, for comparison, ``grad_method='autograd'``.

The energy bank comes from ``--steer DIR`` (a folder of ``aligntax els train``; steering settings from
the flags, else ``DIR/sweep/best.json``, else top_k 2, eta 0.3, steps 3, no threshold). Without
``--steer`` a synthetic bank is built on the fly (random labels; timing only), and the output says so.

    python bench/steering_overhead.py --threads 2                       # synthetic bank
    python bench/steering_overhead.py --threads 2 --steer runs/els      # a trained bank
    python bench/steering_overhead.py --quick --model embedded:smollm2-135m-instruct   # smoke run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib as bl  # noqa: E402

NAME = "steering_overhead"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    bl.add_common_args(p, repeats=5, out_name=NAME)
    bl.add_steer_args(p, required_note=" (default: synthetic)")
    p.add_argument("--dataset", default="orbench-hard-test", help="prompt set (default orbench-hard-test)")
    p.add_argument("--batch-sizes", type=bl.int_list, default=[1, 8, 32], help="default 1,8,32")
    p.add_argument(
        "--prompts",
        type=int,
        default=32,
        help="prompts generated per measurement at every batch size (default 32)",
    )
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per row (default 32)")
    p.add_argument("--no-autograd", action="store_true", help="skip the grad_method='autograd' variant")
    p.add_argument(
        "--loop",
        choices=("generate", "own"),
        default="generate",
        help="model.generate (default) or aligntax's greedy loop (greedy_decode, shared prompt "
        "prefix computed once; no end token, so every row runs to the limit)",
    )
    args = bl.parse_with_quick(
        p, argv, dict(batch_sizes=[1, 4], prompts=4, max_new_tokens=4, repeats=1, synthetic_prompts=16)
    )
    args.steer = args.steer or "synthetic"
    return args


def make_batches(lm, prompts: list[str], batch_size: int) -> list[dict]:
    from aligntax.generation.chat import build_messages, encode_chats, render_chat

    texts = [render_chat(lm.tokenizer, build_messages(p)) for p in prompts]
    lengths = [len(lm.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    order = sorted(range(len(texts)), key=lambda i: (-lengths[i], i))
    return [
        encode_chats(lm.tokenizer, [texts[i] for i in order[s : s + batch_size]], lm.device)
        for s in range(0, len(order), batch_size)
    ]


def run_batches(lm, batches: list[dict], intervention, max_new_tokens: int, loop: str = "generate") -> dict:
    """Generate every batch (exactly max_new_tokens per row) under the intervention; time it all."""
    import time

    import torch

    from aligntax.generation.generate import decode_batch
    from aligntax.interventions.base import SteerContext

    model, tok = lm.model, lm.tokenizer
    kwargs = dict(
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        use_cache=True,
        pad_token_id=tok.pad_token_id,
        temperature=None,
        top_p=None,
        top_k=None,
    )
    tokens, positions, steered = 0, 0, 0
    in_steer = [0.0]
    inner = getattr(intervention, "steer", None)
    if inner is not None:  # time spent inside the steering step itself (robust to other load on the machine)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                in_steer[0] += time.perf_counter() - t0

        intervention.steer = timed
    t = time.perf_counter()
    for enc in batches:
        if loop == "own":  # what generate runs for greedy decoding, with no end token
            rows, ctx = decode_batch(model, enc, intervention, max_new_tokens, set())
            n_rows, new = len(rows), min(len(r) for r in rows)
        else:
            ctx = SteerContext(prompt_len=enc["input_ids"].shape[1])
            with torch.no_grad(), intervention.attach(model, ctx):
                out = model.generate(**enc, **kwargs)
            n_rows, new = out.shape[0], out.shape[1] - enc["input_ids"].shape[1]
        if new != max_new_tokens:
            raise RuntimeError(f"generated {new} tokens instead of {max_new_tokens}")
        tokens += n_rows * new
        for s in (ctx.stats.get("els") or {}).values():
            positions += s["positions"]
            steered += s["steered"]
    res = {"seconds": time.perf_counter() - t, "tokens": tokens, "batches": len(batches)}
    if inner is not None:
        del intervention.steer
        res["steer_seconds"] = in_steer[0]
    if positions:
        res.update(els_positions=positions, els_steered=steered)
    return res


def main(argv=None) -> dict:
    args = parse_args(argv)
    from aligntax.interventions.base import NoIntervention

    lm, load_s = bl.start(args)
    grad_methods = ("closed",) if args.no_autograd else ("closed", "autograd")
    ivs, els_info = bl.build_els(lm, args, grad_methods)
    print(
        f"ELS: {els_info['source']}; layers {els_info['layers']}; settings {els_info['settings']} "
        f"({els_info['settings_from']})",
        flush=True,
    )
    arms_iv = {"unsteered": NoIntervention(), "els": ivs["closed"]}
    if "autograd" in ivs:
        arms_iv["els-autograd"] = ivs["autograd"]
    prompts = bl.load_prompt_texts(args.dataset, args.prompts)

    results: dict = {}
    for b in args.batch_sizes:
        print(f"batch size {b}: {len(prompts)} prompts x {args.max_new_tokens} tokens", flush=True)
        batches = make_batches(lm, prompts, b)
        arms = {
            name: (lambda iv=iv, bt=batches: run_batches(lm, bt, iv, args.max_new_tokens, args.loop))
            for name, iv in arms_iv.items()
        }
        warm = {
            name: (lambda iv=iv, bt=batches[:1]: run_batches(lm, bt, iv, args.max_new_tokens, args.loop))
            for name, iv in arms_iv.items()
        }
        runs = bl.interleaved(arms, args.repeats, args.warmup, warm)
        results[str(b)] = {
            "runs": runs,
            "summary": {name: bl.summarize(r) for name, r in runs.items()},
            "ratios": {
                name: bl.paired_ratio(runs["unsteered"], runs[name]) for name in runs if name != "unsteered"
            },
        }

    has_ag = "els-autograd" in arms_iv
    headers = ["batch", "unsteered s", "ELS s", "ELS / unsteered", "unsteered tok/s", "ELS tok/s"]
    if has_ag:
        headers += ["autograd s", "autograd / unsteered"]
    headers += ["time in steering step", "ELS <= 1.05"]
    rows = []
    for b, r in results.items():
        s, ratio = r["summary"], r["ratios"]
        row = [
            b,
            s["unsteered"]["median_s"],
            s["els"]["median_s"],
            ratio["els"]["median_paired"],
            bl.fmt(s["unsteered"]["median_tok_s"], 1),
            bl.fmt(s["els"]["median_tok_s"], 1),
        ]
        if has_ag:
            row += [s["els-autograd"]["median_s"], ratio["els-autograd"]["median_paired"]]
        shares = sorted(x["steer_seconds"] / x["seconds"] for x in r["runs"]["els"] if "steer_seconds" in x)
        r["steer_share_median"] = shares[len(shares) // 2] if shares else None
        row.append(f"{100 * shares[len(shares) // 2]:.1f}%" if shares else "")
        row.append("yes" if ratio["els"]["median_paired"] <= 1.05 else "no")
        rows.append(row)
    env = bl.environment(lm)
    notes = [
        f"ORB-H prompts: {len(prompts)} from `{args.dataset}` per measurement, "
        f"{args.max_new_tokens} new tokens per row (forced: min_new_tokens = max_new_tokens), greedy",
        "decode loop: "
        + (
            "aligntax's greedy_decode, shared prompt prefix computed once"
            if args.loop == "own"
            else "model.generate"
        ),
        f"ELS: {els_info['source']}",
        f"ELS layers {els_info['layers']}, settings {els_info['settings']} (from {els_info['settings_from']})",
        f"{args.repeats} interleaved repetitions after {args.warmup} warm-up; times are medians, ratios "
        "the median of per-repetition ratios",
    ]
    md = "\n".join(
        bl.header("ELS steering overhead (steered vs unsteered generation)", env, notes)
        + [bl.md_table(headers, rows)]
    )
    result = {
        "benchmark": NAME,
        "env": env,
        "args": vars(args),
        "model_load_seconds": load_s,
        "els": els_info,
        "n_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "batch_sizes": results,
    }
    bl.write_outputs(args.out, NAME, result, md)
    return result


if __name__ == "__main__":
    main()
