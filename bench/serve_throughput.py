"""Throughput of the OpenAI-compatible server versus offline batched generation, in one process.

The server (``aligntax.serve.create_app``, uvicorn in a background thread on a free loopback port, as
tests/test_serve.py does) serves the model; N prompts (64 ORB-H test prompts by default, greedy,
``max_tokens`` 32) are sent with the official ``openai`` async client at each concurrency (1, 8, 32:
a closed loop, at most C requests in flight). The same prompts are also generated offline with
``aligntax.generation.generate`` at batch 32 in the same process. All alternatives are interleaved
(order reversed every repetition) after an untimed warm-up.

Reported: completion tokens/s of every alternative (tokens counted the same way on both sides: the
generated tokens of every request, its eos token included), the server/offline throughput ratio
(median of per-repetition ratios; target >= 0.8 at concurrency 32), request latency p50/p95 per
concurrency (over all measured repetitions) and the server's mean batch size.

With ``--steer DIR`` (or ``--steer synthetic``) the steered model ``NAME+els`` is measured as well, at
the concurrencies of ``--steer-concurrency`` (default: the largest), against offline ELS generation.

Note: the server pins sampling options to neutral values (OpenAI semantics) while offline ``generate``
keeps the model's generation_config (e.g. a repetition penalty), so the texts, and the token counts,
may differ a little; throughput is per counted token.

    python bench/serve_throughput.py --threads 2
    python bench/serve_throughput.py --threads 2 --steer runs/els
    python bench/serve_throughput.py --quick --model embedded:smollm2-135m-instruct   # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib as bl  # noqa: E402

NAME = "serve_throughput"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    bl.add_common_args(p, repeats=3, out_name=NAME)
    bl.add_steer_args(p, required_note=" (default: no steered model)")
    p.add_argument("--dataset", default="orbench-hard-test", help="prompt set (default orbench-hard-test)")
    p.add_argument("--prompts", type=int, default=64, help="requests per measurement (default 64)")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens of every request (default 32)")
    p.add_argument("--concurrency", type=bl.int_list, default=[1, 8, 32], help="default 1,8,32")
    p.add_argument(
        "--steer-concurrency",
        type=bl.int_list,
        default=None,
        help="concurrencies for the steered model (default: the largest of --concurrency)",
    )
    p.add_argument("--offline-batch-size", type=int, default=32, help="default 32")
    p.add_argument("--max-batch-size", type=int, default=32, help="server max_batch_size (default 32)")
    p.add_argument("--batch-wait-ms", type=float, default=10.0, help="server batch_wait_ms (default 10)")
    p.add_argument(
        "--max-batch-wait-ms", type=float, default=100.0, help="server max_batch_wait_ms (default 100)"
    )
    p.add_argument("--warmup-prompts", type=int, default=8, help="requests per warm-up run (default 8)")
    args = bl.parse_with_quick(
        p,
        argv,
        dict(prompts=8, max_tokens=4, concurrency=[1, 4], repeats=1, warmup_prompts=2, synthetic_prompts=16),
    )
    if args.steer_concurrency is None:
        args.steer_concurrency = [max(args.concurrency)]
    return args


async def _clients(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    import openai

    n = len(prompts)
    latency = [0.0] * n
    completion = [0] * n
    finish = [""] * n
    async with openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="bench", max_retries=0, timeout=3600
    ) as client:
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with sem:
                t = time.perf_counter()
                r = await client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": prompts[i]}],
                    temperature=0,
                    max_tokens=max_tokens,
                )
                latency[i] = time.perf_counter() - t
                completion[i] = r.usage.completion_tokens
                finish[i] = r.choices[0].finish_reason

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        seconds = time.perf_counter() - t0
    tokens = sum(completion)
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tok_s": tokens / seconds,
        "latency_s": latency,
        "finish_length": sum(f == "length" for f in finish),
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    from aligntax.generation import GenerationConfig, generate
    from aligntax.serve import ServerSettings, create_app, default_model_name
    from aligntax.serve.background import BackgroundServer

    lm, load_s = bl.start(args)
    iv, els_info = None, None
    if args.steer:
        ivs, els_info = bl.build_els(lm, args, ("closed",))
        iv = ivs["closed"]
        print(
            f"ELS: {els_info['source']}; layers {els_info['layers']}; settings {els_info['settings']} "
            f"({els_info['settings_from']})",
            flush=True,
        )
    prompts = bl.load_prompt_texts(args.dataset, args.prompts)
    warm_prompts = prompts[: max(1, min(args.warmup_prompts, len(prompts)))]
    name = default_model_name(lm)
    settings = ServerSettings(
        model_name=name,
        max_batch_size=args.max_batch_size,
        batch_wait_ms=args.batch_wait_ms,
        max_batch_wait_ms=args.max_batch_wait_ms,
        max_tokens_limit=max(args.max_tokens, 1),
        default_max_tokens=args.max_tokens,
    )
    app = create_app(lm, iv, settings)
    steered_name = app.state.handler.steered_name
    metrics = app.state.metrics
    srv = BackgroundServer(app).start()
    print(
        f"server at {srv.url}/v1 serving {name}" + (f" and {steered_name}" if steered_name else ""),
        flush=True,
    )

    def offline(ps: list[str], intervention) -> dict:
        cfg = GenerationConfig(max_new_tokens=args.max_tokens, batch_size=args.offline_batch_size)
        t = time.perf_counter()
        gens = generate(lm, ps, cfg, intervention, progress=False)
        seconds = time.perf_counter() - t
        # count the eos token of rows that stopped on it, as the server's usage.completion_tokens does
        tokens = sum(g.n_tokens + (g.finish_reason == "stop") for g in gens)
        return {
            "seconds": seconds,
            "tokens": tokens,
            "tok_s": tokens / seconds,
            "finish_length": sum(g.finish_reason == "length" for g in gens),
        }

    def served(ps: list[str], model: str, c: int) -> dict:
        b0, r0 = metrics.batches, metrics.batch_rows
        res = asyncio.run(_clients(srv.url, model, ps, c, args.max_tokens))
        res["batches"] = metrics.batches - b0
        res["mean_batch"] = (metrics.batch_rows - r0) / max(1, res["batches"])
        return res

    arms, warm = {}, {}
    arms["offline"] = lambda: offline(prompts, None)
    warm["offline"] = lambda: offline(warm_prompts, None)
    for c in args.concurrency:
        arms[f"server c={c}"] = lambda c=c: served(prompts, name, c)
        warm[f"server c={c}"] = lambda c=c: served(warm_prompts, name, c)
    if iv is not None:
        arms["offline+els"] = lambda: offline(prompts, iv)
        warm["offline+els"] = lambda: offline(warm_prompts, iv)
        for c in args.steer_concurrency:
            arms[f"server+els c={c}"] = lambda c=c: served(prompts, steered_name, c)
            warm[f"server+els c={c}"] = lambda c=c: served(warm_prompts, steered_name, c)
    print(
        f"{len(prompts)} prompts x max {args.max_tokens} tokens; alternatives: {', '.join(arms)}", flush=True
    )
    try:
        runs = bl.interleaved(arms, args.repeats, args.warmup, warm)
        server_snapshot = metrics.snapshot()
    finally:
        srv.stop()

    summary = {k: bl.summarize(r) for k, r in runs.items()}
    rows = []
    for k, r in runs.items():
        s = summary[k]
        base = "offline+els" if "+els" in k else "offline"
        ratio = bl.paired_ratio(runs[base], r, key="tok_s") if k.startswith("server") else None
        s["ratio_vs_" + base] = ratio
        lat = [x for run in r for x in run.get("latency_s", [])]
        if lat:
            s["latency_p50_s"], s["latency_p95_s"] = bl.percentile(lat, 50), bl.percentile(lat, 95)
            s["mean_batch"] = bl.median([run["mean_batch"] for run in r])
        target = ""
        if ratio is not None and k.endswith(f"c={max(args.concurrency)}"):
            target = "yes" if ratio["median_paired"] >= 0.8 else "no"
        rows.append(
            [
                k,
                s["median_s"],
                bl.median([run["tokens"] for run in r]),
                bl.fmt(bl.median([run["tok_s"] for run in r]), 1),
                ratio["median_paired"] if ratio else "1 (reference)",
                s.get("latency_p50_s"),
                s.get("latency_p95_s"),
                bl.fmt(s.get("mean_batch"), 1) if "mean_batch" in s else "-",
                target or "-",
            ]
        )
    headers = [
        "alternative",
        "median s",
        "completion tokens",
        "tok/s",
        "throughput / offline",
        "latency p50 s",
        "latency p95 s",
        "mean server batch",
        f">= 0.8 at c={max(args.concurrency)}",
    ]
    env = bl.environment(lm)
    notes = [
        f"{len(prompts)} prompts from `{args.dataset}`, greedy, max_tokens {args.max_tokens}; offline "
        f"`generate` at batch {args.offline_batch_size}; server max_batch_size {args.max_batch_size}, "
        f"batch_wait_ms {args.batch_wait_ms}, max_batch_wait_ms {args.max_batch_wait_ms}; openai async client, closed loop of C requests in flight",
        "tokens: every request's generated tokens including its eos; ratio: median of per-repetition "
        "throughput ratios (steered rows against offline+els)",
        f"{args.repeats} interleaved repetitions after {args.warmup} warm-up of {len(warm_prompts)} prompts",
    ]
    if els_info:
        notes.append(
            f"steered model {steered_name}: {els_info['source']}; layers {els_info['layers']}, "
            f"settings {els_info['settings']} (from {els_info['settings_from']})"
        )
    md = "\n".join(
        bl.header("Server throughput vs offline generation", env, notes) + [bl.md_table(headers, rows)]
    )
    result = {
        "benchmark": NAME,
        "env": env,
        "args": vars(args),
        "model_load_seconds": load_s,
        "els": els_info,
        "model_name": name,
        "steered_name": steered_name,
        "n_prompts": len(prompts),
        "runs": runs,
        "summary": summary,
        "server_metrics": server_snapshot,
    }
    bl.write_outputs(args.out, NAME, result, md)
    return result


if __name__ == "__main__":
    main()
