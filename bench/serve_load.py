"""Open-loop overload test of the OpenAI-compatible server: find the sustainable arrival rate, then run
twice that rate and check that the server sheds the excess while the admitted requests stay fast.

The server runs in a child process (this script with ``--serve-child``: the model, ``create_app`` and
uvicorn on a free loopback port), so the load generator never shares its interpreter lock. The model
is a tiny random one (``--model tiny``, tests/serve_tiny.py: no download) or any model spec
(``--model embedded:NAME``).

Steps:

1. unloaded latency: ``--unloaded-n`` requests one at a time (closed loop); its p95 is the reference
   (with ``--max-latency-x F`` the server's completion-latency target is set to F x that p95 after
   step 2, so the sustainable rate is probed without it; with ``--remeasure`` the reference is measured
   again just before step 3 and that one is used for the overload and the target);
2. sustainable rate: open-loop Poisson arrivals (exponential gaps, seeded, sent without waiting for
   earlier answers) for ``--probe-duration`` s at rates from about half the one-at-a-time throughput,
   multiplied by ``--step`` while they pass (divided while they fail), then ``--refine`` bisections; a rate passes when nothing is rejected or
   fails and the p95 is within ``--near`` x the unloaded p95. The sustainable rate is the highest
   passing one;
3. overload: ``--overload`` x that rate (default 2) for ``--duration`` s (default 60);
4. optionally ``--extra-rates``, fixed rates (e.g. far past capacity), ``--probe-duration`` s each;
5. the unloaded latency again (the reference drifts on a shared machine);
6. afterwards: ``/health``, one plain request, and whether the server process is still running.

Reported per phase: sent, admitted (200), rejected (429/503), timed out (504), other failures,
admitted/s, p50/p95 of the admitted requests and p95 against the unloaded p95.

    python bench/serve_load.py --model tiny --max-queue-wait-ms 60
    python bench/serve_load.py --model embedded:qwen2.5-coder-0.5b-instruct --max-tokens 8 --duration 60
    python bench/serve_load.py --model embedded:qwen2.5-coder-0.5b-instruct --max-tokens 8 --max-latency-x 1.6
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import benchlib as bl  # noqa: E402

NAME = "serve_load"
MODEL_NAME = "load"
PROMPTS = [
    "Hello there, how are you today?",
    "How do I kill a Python process?",
    "Explain energy landscape steering in one sentence.",
    "Write a haiku about the sea.",
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", default="tiny", help="'tiny' (random test model) or a model spec (default tiny)"
    )
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=1, help="server's torch threads (default 1)")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of every request (default 16)")
    p.add_argument("--max-queue", type=int, default=256, help="server --max-queue (default 256)")
    p.add_argument(
        "--max-queue-wait-ms",
        type=float,
        default=20.0,
        help="server --max-queue-wait-ms, the admission target (default 20; 0: none)",
    )
    p.add_argument(
        "--max-latency-ms",
        type=float,
        default=0.0,
        help="server --max-latency-ms, the completion-latency target (default 0: none)",
    )
    p.add_argument(
        "--max-latency-x",
        type=float,
        default=0.0,
        help="set the server's latency target to this x the measured unloaded p95 before the "
        "overload (after the probes; overrides --max-latency-ms; default 0: no)",
    )
    p.add_argument("--max-batch-size", type=int, default=16, help="server max_batch_size (default 16)")
    p.add_argument(
        "--max-batch-wait-ms",
        type=float,
        default=20.0,
        help="server --max-batch-wait-ms, the longest a batch gathers requests (default 20)",
    )
    p.add_argument(
        "--request-timeout", type=float, default=30.0, help="server request timeout s (default 30)"
    )
    p.add_argument("--unloaded-n", type=int, default=40, help="one-at-a-time requests for the reference")
    p.add_argument("--probe-duration", type=float, default=10.0, help="seconds per probed rate (default 10)")
    p.add_argument("--step", type=float, default=1.5, help="rate factor between probes (default 2)")
    p.add_argument("--refine", type=int, default=1, help="bisection steps after the ladder (default 1)")
    p.add_argument(
        "--near",
        type=float,
        default=2.0,
        help="a sustainable rate keeps p95 within this x the unloaded p95 (default 2)",
    )
    p.add_argument("--overload", type=float, default=2.0, help="overload factor (default 2)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of overload (default 60)")
    p.add_argument(
        "--extra-rates",
        type=lambda t: [float(x) for x in t.split(",") if x.strip()],
        default=[],
        help="fixed rates (requests/s) to run after the overload, --probe-duration s each (e.g. "
        "far past capacity)",
    )
    p.add_argument(
        "--remeasure",
        action="store_true",
        help="measure the unloaded latency again just before the overload and use it as the "
        "overload's reference (and for --max-latency-x)",
    )
    p.add_argument(
        "--sustainable-rate",
        type=float,
        default=0.0,
        help="skip the probes and take this rate (requests/s) as the sustainable one (e.g. from an "
        "earlier run, to compare admission settings at the same load)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder or .json path for the results (default: print only)")
    p.add_argument("--serve-child", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- the server process ---------------------------------------------------------------------------------


def serve_child(args) -> None:
    bl.set_threads(args.threads)
    from aligntax.serve.app import create_app, serve
    from aligntax.serve.settings import ServerSettings

    if args.model == "tiny":
        sys.path.insert(0, str(HERE.parent / "tests"))
        from serve_tiny import tiny_lm

        lm = tiny_lm()
    else:
        lm, _ = bl.load_lm(args.model, args.dtype, args.device)
    settings = ServerSettings(
        port=args.serve_child,
        model_name=MODEL_NAME,
        max_batch_size=args.max_batch_size,
        max_queue=args.max_queue,
        max_batch_wait_ms=args.max_batch_wait_ms,
        max_queue_wait_ms=args.max_queue_wait_ms or None,
        request_timeout=args.request_timeout,
        max_tokens_limit=max(args.max_tokens, 4),
        max_latency_ms=args.max_latency_ms or None,
    )
    app = create_app(lm, None, settings)

    @app.post("/_bench/max-latency")
    async def set_max_latency(body: dict):  # the load generator sets the target from the unloaded p95
        ms = float(body["ms"])
        handler = app.state.handler
        handler.settings = app.state.settings = handler.settings.replace(max_latency_ms=ms)
        app.state.engine.max_latency = ms / 1000.0
        return {"max_latency_ms": ms}

    serve(app, log_level="warning")


def start_server(argv: list[str], port: int, timeout: float = 600) -> subprocess.Popen:

    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), *argv, "--serve-child", str(port)],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        return bl.wait_healthy(proc, port, timeout, poll=0.2)
    except RuntimeError:
        proc.kill()
        raise


# -- the load -------------------------------------------------------------------------------------------


def _body(rng: random.Random, max_tokens: int) -> dict:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


async def _one(client, url: str, body: dict, results: list) -> None:
    import httpx

    t0 = time.perf_counter()
    try:
        r = await client.post(url, json=body)
        status = r.status_code
    except httpx.HTTPError as exc:
        status = type(exc).__name__
    results.append((status, time.perf_counter() - t0))


def _summary(results: list, wall: float, unloaded_p95: float | None, **extra) -> dict:
    lat = [s for st, s in results if st == 200]
    count = lambda pred: sum(1 for st, _ in results if pred(st))  # noqa: E731
    p95 = bl.percentile(lat, 95)
    return {
        **extra,
        "sent": len(results),
        "admitted": len(lat),
        "rejected": count(lambda st: st in (429, 503)),
        "rejected_429": count(lambda st: st == 429),
        "rejected_503": count(lambda st: st == 503),
        "timed_out": count(lambda st: st == 504),
        "failed": count(lambda st: st not in (200, 429, 503, 504)),
        "admitted_per_s": len(lat) / wall if wall else float("nan"),
        "p50_s": bl.percentile(lat, 50),
        "p95_s": p95,
        "max_s": max(lat, default=float("nan")),
        "p95_vs_unloaded": p95 / unloaded_p95 if unloaded_p95 else None,
        "wall_s": wall,
        "statuses": sorted({str(st) for st, _ in results}),
    }


async def closed_loop(url: str, n: int, max_tokens: int, rng: random.Random) -> dict:
    import httpx

    results: list = []
    async with httpx.AsyncClient(timeout=120) as client:
        t0 = time.perf_counter()
        for _ in range(n):
            await _one(client, url, _body(rng, max_tokens), results)
        wall = time.perf_counter() - t0
    return _summary(results, wall, None, phase="unloaded", rate=None)


async def open_loop(
    url: str,
    rate: float,
    duration: float,
    max_tokens: int,
    rng: random.Random,
    unloaded_p95: float | None,
    phase: str,
) -> dict:
    import httpx

    results: list = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        tasks, t0, at, late = [], time.perf_counter(), 0.0, []
        while True:
            at += rng.expovariate(rate)
            if at > duration:
                break
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                late.append(-delay)
            tasks.append(asyncio.create_task(_one(client, url, _body(rng, max_tokens), results)))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    # the client keeps up when sends leave (almost) on time: reported so a saturated client is visible
    return _summary(
        results,
        wall,
        unloaded_p95,
        phase=phase,
        rate=rate,
        send_lag_p95_s=bl.percentile(late, 95) if late else 0.0,
    )


def passes(row: dict, unloaded_p95: float, near: float) -> bool:
    return (
        row["rejected"] == 0
        and row["failed"] == 0
        and row["timed_out"] == 0
        and row["p95_s"] <= near * unloaded_p95
    )


def after_check(base: str, proc: subprocess.Popen) -> dict:
    import httpx

    h = httpx.get(base + "/health", timeout=30)
    r = httpx.post(
        base + "/v1/chat/completions",
        timeout=60,
        json={
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "temperature": 0,
        },
    )
    m = httpx.get(base + "/metrics", timeout=30).json()
    alive = proc.poll() is None
    return {
        "health": h.json().get("status"),
        "request_status": r.status_code,
        "process_alive": alive,
        "healthy": h.status_code == 200 and r.status_code == 200 and alive,
        "batch_size_mean": m.get("batch_size_mean"),
        "batch_size_max": m.get("batch_size_max"),
        "requests_by_status": m.get("requests_by_status"),
    }


def _line(row: dict) -> str:
    rate = "-" if row["rate"] is None else f"{row['rate']:.1f}/s"
    return (
        f"{row['phase']:>10} {rate:>9}: sent {row['sent']}, admitted {row['admitted']}, rejected "
        f"{row['rejected']} (429 {row['rejected_429']}, 503 {row['rejected_503']}), timed out "
        f"{row['timed_out']}, failed {row['failed']}, p50 {bl.fmt(row['p50_s'])} s, p95 "
        f"{bl.fmt(row['p95_s'])} s"
        + (f", send lag p95 {bl.fmt(row['send_lag_p95_s'])} s" if "send_lag_p95_s" in row else "")
    )


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.serve_child is not None:
        serve_child(args)
        return {}
    argv = list(sys.argv[1:] if argv is None else argv)
    port = bl.free_port()
    print(f"starting the server ({args.model}) on port {port}", flush=True)
    proc = start_server(argv, port)
    base = f"http://127.0.0.1:{port}"
    url = base + "/v1/chat/completions"
    rng = random.Random(args.seed)
    rows = []
    try:
        asyncio.run(closed_loop(url, 5, args.max_tokens, rng))  # warm-up, not reported
        unloaded = asyncio.run(closed_loop(url, args.unloaded_n, args.max_tokens, rng))
        ref = unloaded["p95_s"]
        rows.append(unloaded)
        print(_line(unloaded), flush=True)

        def probe(rate: float) -> dict:
            row = asyncio.run(open_loop(url, rate, args.probe_duration, args.max_tokens, rng, ref, "probe"))
            row["passes"] = passes(row, ref, args.near)
            rows.append(row)
            print(_line(row) + ("  ok" if row["passes"] else "  not sustainable"), flush=True)
            return row

        rate = max(0.5, 0.5 * unloaded["admitted_per_s"])
        good, bad = (args.sustainable_rate or None), None
        for _ in range(0 if good else 20):  # up while the rate passes; down from a first rate that fails
            if probe(rate)["passes"]:
                good = rate
                if bad is not None:
                    break
                rate *= args.step
            else:
                bad = rate
                if good is not None:
                    break
                rate /= args.step
        if good is None:
            raise RuntimeError("no probed rate was sustainable")
        for _ in range(args.refine if bad is not None and not args.sustainable_rate else 0):
            mid = (good * bad) ** 0.5
            if probe(mid)["passes"]:
                good = mid
            else:
                bad = mid
        sustainable = good
        over_ref = ref
        if args.remeasure:  # the reference again, just before the overload
            before = asyncio.run(closed_loop(url, args.unloaded_n, args.max_tokens, rng))
            before["phase"] = "unloaded (before overload)"
            over_ref = before["p95_s"]
            rows.append(before)
            print(_line(before), flush=True)
        if args.max_latency_x:  # the sustainable rate is probed without it
            args.max_latency_ms = args.max_latency_x * over_ref * 1000.0
            import httpx

            httpx.post(
                base + "/_bench/max-latency", json={"ms": args.max_latency_ms}, timeout=30
            ).raise_for_status()
            print(
                f"latency target {args.max_latency_ms:.0f} ms ({args.max_latency_x:g} x unloaded p95)",
                flush=True,
            )
        over = asyncio.run(
            open_loop(
                url, args.overload * sustainable, args.duration, args.max_tokens, rng, over_ref, "overload"
            )
        )
        rows.append(over)
        print(_line(over), flush=True)
        for rate in args.extra_rates:
            row = asyncio.run(open_loop(url, rate, args.probe_duration, args.max_tokens, rng, ref, "fixed"))
            rows.append(row)
            print(_line(row), flush=True)
        # the reference again: on a shared machine the unloaded latency drifts while the test runs
        again = asyncio.run(closed_loop(url, args.unloaded_n, args.max_tokens, rng))
        again["phase"] = "unloaded (after)"
        rows.append(again)
        print(_line(again), flush=True)
        after = after_check(base, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    cmd = "python bench/serve_load.py " + " ".join(argv)
    table = bl.md_table(
        [
            "phase",
            "rate/s",
            "sent",
            "admitted",
            "rejected 429/503",
            "timed out",
            "failed",
            "admitted/s",
            "p50 s",
            "p95 s",
            "p95 / unloaded p95",
        ],
        [
            [
                r["phase"],
                r["rate"],
                r["sent"],
                r["admitted"],
                f"{r['rejected_429']}/{r['rejected_503']}",
                r["timed_out"],
                r["failed"],
                r["admitted_per_s"],
                r["p50_s"],
                r["p95_s"],
                r["p95_vs_unloaded"],
            ]
            for r in rows
        ],
    )
    md = "\n".join(
        [
            f"# serve_load: {args.model}, max_tokens {args.max_tokens}, batch {args.max_batch_size}, max_queue "
            f"{args.max_queue}, max_queue_wait_ms {args.max_queue_wait_ms:g}, max_batch_wait_ms "
            f"{args.max_batch_wait_ms:g}, max_latency_ms {args.max_latency_ms:.0f}, server threads {args.threads}",
            "",
            f"`{cmd}`",
            "",
            table,
            "",
            f"sustainable rate {sustainable:.1f}/s (no rejection, p95 <= {args.near:g} x unloaded p95 "
            f"{bl.fmt(ref)} s); overload {args.overload:g} x = {args.overload * sustainable:.1f}/s for "
            f"{args.duration:g} s: admitted p95 {bl.fmt(over['p95_s'])} s = {bl.fmt(over['p95_vs_unloaded'])} x "
            f"unloaded{' (measured just before it)' if args.remeasure else ''}; client send lag p95 {bl.fmt(over['send_lag_p95_s'])} s; against the unloaded p95 measured "
            f"after it ({bl.fmt(again['p95_s'])} s): {bl.fmt(over['p95_s'] / again['p95_s'])} x",
            f"after the overload: healthy {after['healthy']} ({json.dumps(after)})",
        ]
    )
    result = {
        "args": vars(args),
        "command": cmd,
        "unloaded_p95_s": ref,
        "unloaded_after_p95_s": again["p95_s"],
        "sustainable_rate": sustainable,
        "phases": rows,
        "after": after,
    }
    if args.out:
        bl.write_outputs(args.out, NAME, result, md)
    else:
        print(md)
    return result


if __name__ == "__main__":
    main()
