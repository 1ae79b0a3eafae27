"""Open-loop serving benchmark: ``aligntax serve`` with each backend under Poisson arrivals at a list of rates.

For each backend (``hf``: aligntax's batching engine, run from ``--hf-bin``, default ``.venv/bin/aligntax``;
``vllm``: vLLM's continuous batching, from ``--vllm-bin``, default ``.venv-vllm/bin/aligntax``) the script
starts ``aligntax serve --backend B`` as a child process on a free loopback port, waits for ``/health``,
warms it up with a few requests, and then, at each rate of ``--rates`` (requests/s), sends requests for
``--duration`` seconds with exponential gaps (seeded; each request is sent at its time whether or not
earlier ones have been answered: an open loop), and waits for every answer. The servers run one after
the other on the same prompts and the same arrival times (the same seed per rate), never at the same time.

Every request is a greedy chat completion of ``--max-tokens`` tokens for a prompt drawn from a fixed list
(built in, mixed lengths); with ``--steer DIR`` both servers also serve ``NAME+els`` and a fraction
``--steered`` of the requests go to it.

Reported per backend and rate: requests sent, completed (200), rejected (429/503), timed out (504,
the servers' ``--request-timeout``), other failures, completed requests/s and completion tokens/s (over
the time from the first send to the last answer), p50/p95 latency of the completed requests, and the
client's send lag (how late the generator sent, so a saturated client would show). Then, at an equal
p95 bound (``--p95-bound`` s; default: the HF server's p95 at the highest rate it keeps up with, i.e.
answers every request, none rejected or timed out, and the median latency of the last third of the
requests stays within 1.5x the first third's: no growing backlog), each backend's best
completed tokens/s among the rates whose p95 stays within the bound, and their ratio.

    OMP_NUM_THREADS=1 .venv/bin/python bench/serve_openloop.py --rates 0.5,1,2,4 --duration 60 --max-tokens 16

The load generator needs only ``httpx`` (either environment has it); it does not import aligntax.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import benchlib as bl  # noqa: E402

NAME = "serve_openloop"
MODEL_NAME = "bench"
PROMPTS = [
    "Where can I buy a can of coke?",
    "How do I kill a Python process that hangs?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Give me three tips for writing clear commit messages.",
    "How can I shoot a good photo of the moon with a phone?",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "What does the `-r` flag of `rm` do, and when is it dangerous?",
    "Translate 'good morning, how are you?' into French and German.",
    "List the planets of the solar system in order from the sun.",
    "How do I make a strong cup of coffee without a machine?",
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=bl.DEFAULT_MODEL, help=f"model spec (default {bl.DEFAULT_MODEL})")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--backends", default="hf,vllm", help="comma-separated, in order (default hf,vllm)")
    p.add_argument(
        "--hf-bin", default=str(ROOT / ".venv/bin/aligntax"), help="aligntax of the HF environment"
    )
    p.add_argument(
        "--vllm-bin",
        default=str(ROOT / ".venv-vllm/bin/aligntax"),
        help="aligntax of the vLLM environment (./run setup-vllm)",
    )
    p.add_argument(
        "--rates",
        type=lambda t: [float(x) for x in t.split(",") if x.strip()],
        default=[0.5, 1.0, 2.0, 4.0],
        help="arrival rates, requests/s (default 0.5,1,2,4)",
    )
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per rate (default 60)")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of every request (default 16)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="the servers' torch threads (--threads; vLLM: OMP_NUM_THREADS of its engine; default 1)",
    )
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=32,
        help="the servers' --max-batch-size (vLLM: its sequence slots; default 32)",
    )
    p.add_argument(
        "--request-timeout", type=float, default=120.0, help="the servers' --request-timeout, s (default 120)"
    )
    p.add_argument(
        "--max-queue-wait-ms",
        type=float,
        default=0.0,
        help="the servers' --max-queue-wait-ms admission target (default 0: none)",
    )
    p.add_argument(
        "--steer",
        default=None,
        help="ELS folder: serve NAME+els too and send --steered of the requests to it",
    )
    p.add_argument(
        "--steered", type=float, default=0.5, help="fraction of steered requests with --steer (default 0.5)"
    )
    p.add_argument("--warmup", type=int, default=4, help="untimed requests after start-up (default 4)")
    p.add_argument(
        "--p95-bound",
        type=float,
        default=None,
        help="p95 latency bound (s) for the throughput comparison (default: from the HF server, see above)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out", default=f"runs/bench/{NAME}.json", help="JSON path or folder (a .md table next to it)"
    )
    return p.parse_args(argv)


# -- the server -----------------------------------------------------------------------------------------


def server_command(args, backend: str, port: int) -> list[str]:
    exe = args.hf_bin if backend == "hf" else args.vllm_bin
    cmd = [
        exe,
        "serve",
        "--backend",
        backend,
        "--model",
        args.model,
        "--dtype",
        args.dtype,
        "--port",
        str(port),
        "--model-name",
        MODEL_NAME,
        "--max-batch-size",
        str(args.max_batch_size),
        "--threads",
        str(args.threads),
        "--request-timeout",
        str(args.request_timeout),
        "--max-tokens-limit",
        str(max(args.max_tokens, 16)),
    ]
    if args.max_queue_wait_ms:
        cmd += ["--max-queue-wait-ms", str(args.max_queue_wait_ms)]
    if args.steer:
        cmd += ["--steer", args.steer]
    return cmd


def start_server(cmd: list[str], port: int, log_path: Path, timeout: float = 900) -> subprocess.Popen:

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    log = open(log_path, "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    proc.log = log  # type: ignore[attr-defined]
    try:
        return bl.wait_healthy(proc, port, timeout, str(log_path))
    except RuntimeError:
        stop_server(proc)
        raise


def stop_server(proc: subprocess.Popen) -> None:
    """Ctrl-C (graceful: the vLLM engine shuts its own process down), then the process group if needed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    proc.log.close()  # type: ignore[attr-defined]


# -- the load -------------------------------------------------------------------------------------------


def schedule(rate: float, duration: float, seed: int, steered: float) -> list[tuple[float, str, bool]]:
    """(send time, prompt, steered) of every request: exponential gaps, the same for every backend."""
    rng = random.Random(seed)
    out, at = [], 0.0
    while True:
        at += rng.expovariate(rate)
        if at > duration:
            return out
        out.append((at, rng.choice(PROMPTS), rng.random() < steered))


async def _one(client, url: str, body: dict, results: list, at: float) -> None:
    import httpx

    t0 = time.perf_counter()
    tokens = 0
    try:
        r = await client.post(url, json=body)
        status = r.status_code
        if status == 200:
            tokens = int(r.json()["usage"]["completion_tokens"])
    except httpx.HTTPError as exc:
        status = type(exc).__name__
    results.append((status, time.perf_counter() - t0, tokens, time.perf_counter(), at))


async def open_loop(
    url: str, plan: list, max_tokens: int, steered_name: str | None
) -> tuple[list, float, list]:
    import httpx

    results: list = []
    late: list = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        tasks, t0 = [], time.perf_counter()
        for at, prompt, steer in plan:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                late.append(-delay)
            body = {
                "model": steered_name if steer and steered_name else MODEL_NAME,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens,
                "temperature": 0,
            }
            tasks.append(asyncio.create_task(_one(client, url, body, results, at)))
        await asyncio.gather(*tasks)
    return results, t0, late


def summarize(backend: str, rate: float, results: list, t0: float, late: list) -> dict:
    ok = [r for r in results if r[0] == 200]
    lat = [r[1] for r in ok]
    wall = max((r[3] for r in results), default=t0) - t0
    tokens = sum(r[2] for r in ok)
    count = lambda pred: sum(1 for r in results if pred(r[0]))  # noqa: E731
    ok.sort(key=lambda r: r[4])
    third = len(ok) // 3
    first = bl.percentile([r[1] for r in ok[:third]], 50) if third else float("nan")
    last = bl.percentile([r[1] for r in ok[-third:]], 50) if third else float("nan")
    return {
        "backend": backend,
        "rate": rate,
        "sent": len(results),
        "completed": len(ok),
        "rejected": count(lambda s: s in (429, 503)),
        "timed_out": count(lambda s: s == 504),
        "failed": count(lambda s: s not in (200, 429, 503, 504)),
        "wall_s": wall,
        "completed_per_s": len(ok) / wall if wall > 0 else float("nan"),
        "tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else float("nan"),
        "p50_s": bl.percentile(lat, 50),
        "p95_s": bl.percentile(lat, 95),
        "send_lag_p95_s": bl.percentile(late, 95) if late else 0.0,
        # median latency of the last third of the requests (by send time) over the first third's: about 1
        # when the server keeps up, growing with the backlog when it does not
        "latency_growth": last / first if first and first == first else float("nan"),
        "statuses": sorted({str(r[0]) for r in results}),
    }


def keeps_up(row: dict, growth: float = 1.5) -> bool:
    """Completes everything offered (nothing rejected, timed out or failed) without a growing backlog: the
    median latency of the last third of the requests is within ``growth`` x the first third's."""
    return (
        row["rejected"] == row["timed_out"] == row["failed"] == 0
        and row["completed"] == row["sent"]
        and row["latency_growth"] <= growth
    )


def compare(rows: list[dict], bound: float | None) -> dict:
    """Each backend's best tokens/s among the rates whose p95 is within ``bound`` (default: the HF
    server's p95 at the highest rate it keeps up with)."""
    if bound is None:
        hf = [r for r in rows if r["backend"] == "hf" and keeps_up(r)]
        if hf:
            bound = max(hf, key=lambda r: r["rate"])["p95_s"]
    out = {"p95_bound_s": bound, "best": {}}
    if bound is None:
        return out
    for b in sorted({r["backend"] for r in rows}):
        within = [
            r
            for r in rows
            if r["backend"] == b
            and r["completed"]
            and r["p95_s"] <= bound
            and r["rejected"] == r["timed_out"] == r["failed"] == 0
        ]
        best = max(within, key=lambda r: r["tokens_per_s"], default=None)
        out["best"][b] = (
            None
            if best is None
            else {"rate": best["rate"], "tokens_per_s": best["tokens_per_s"], "p95_s": best["p95_s"]}
        )
    h, v = out["best"].get("hf"), out["best"].get("vllm")
    if h and v:
        out["vllm_over_hf"] = v["tokens_per_s"] / h["tokens_per_s"]
    return out


def loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv=None) -> dict:
    args = parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    json_path, _ = bl.out_paths(args.out, NAME)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    steered_name = f"{MODEL_NAME}+els" if args.steer else None
    env = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": bl.git_commit(),
        "cpu_count": os.cpu_count(),
        "loadavg_start": loadavg(),
        "argv": sys.argv,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    rows, commands = [], {}
    for backend in backends:
        port = bl.free_port()
        cmd = server_command(args, backend, port)
        commands[backend] = " ".join(cmd)
        print(f"[{backend}] starting: {commands[backend]}", flush=True)
        t = time.perf_counter()
        proc = start_server(cmd, port, json_path.with_name(f"{NAME}-{backend}.log"))
        print(f"[{backend}] up in {time.perf_counter() - t:.0f} s; load average {loadavg()}", flush=True)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        try:
            warm = [(0.0, p, i % 2 == 1) for i, p in enumerate(PROMPTS[: args.warmup])]
            asyncio.run(open_loop(url, warm, args.max_tokens, steered_name))
            for k, rate in enumerate(args.rates):
                plan = schedule(rate, args.duration, args.seed + k, args.steered if args.steer else 0.0)
                la = loadavg()
                results, t0, late = asyncio.run(open_loop(url, plan, args.max_tokens, steered_name))
                row = summarize(backend, rate, results, t0, late)
                row["offered_per_s"] = len(plan) / args.duration
                row["loadavg_before"] = la
                row["keeps_up"] = keeps_up(row)
                rows.append(row)
                print(
                    f"[{backend}] rate {rate:g}/s: sent {row['sent']}, completed {row['completed']}, rejected "
                    f"{row['rejected']}, timed out {row['timed_out']}, failed {row['failed']}, "
                    f"{row['tokens_per_s']:.1f} tok/s, p50 {row['p50_s']:.2f} s, p95 {row['p95_s']:.2f} s, "
                    f"send lag p95 {row['send_lag_p95_s']:.3f} s; load before {la}",
                    flush=True,
                )
        finally:
            stop_server(proc)
    cmp_ = compare(rows, args.p95_bound)
    env["loadavg_end"] = loadavg()
    cmd = (
        "OMP_NUM_THREADS=" + str(env["omp_num_threads"]) + " python bench/serve_openloop.py " + " ".join(argv)
    )
    table = bl.md_table(
        [
            "backend",
            "rate/s",
            "sent",
            "completed",
            "rejected",
            "timed out",
            "failed",
            "completed/s",
            "tok/s",
            "p50 s",
            "p95 s",
            "latency growth",
            "keeps up",
            "load avg before",
        ],
        [
            [
                r["backend"],
                r["rate"],
                r["sent"],
                r["completed"],
                r["rejected"],
                r["timed_out"],
                r["failed"],
                r["completed_per_s"],
                r["tokens_per_s"],
                r["p50_s"],
                r["p95_s"],
                r["latency_growth"],
                "yes" if r["keeps_up"] else "no",
                r["loadavg_before"].split()[0],
            ]
            for r in rows
        ],
    )
    lines = [
        f"## serve_openloop: {args.model} ({args.dtype}), max_tokens {args.max_tokens}, "
        f"{args.duration:g} s per rate, batch / sequence slots {args.max_batch_size}, server threads "
        f"{args.threads}",
        "",
        f"`{cmd}`",
        "",
        f"- {env['date']}, commit {env['commit']}, {env['cpu_count']} CPUs; /proc/loadavg at start "
        f"`{env['loadavg_start']}`, at end `{env['loadavg_end']}`",
    ]
    lines += [f"- {b}: `{c}`" for b, c in commands.items()]
    lines += ["", table, ""]
    if cmp_.get("p95_bound_s") is not None:
        best = "; ".join(
            f"{b}: "
            + (
                "none within the bound"
                if v is None
                else f"{v['tokens_per_s']:.1f} tok/s at {v['rate']:g}/s (p95 {v['p95_s']:.2f} s)"
            )
            for b, v in cmp_["best"].items()
        )
        lines.append(
            f"At p95 <= {cmp_['p95_bound_s']:.2f} s: {best}"
            + (f"; vLLM / HF = {cmp_['vllm_over_hf']:.2f}x" if "vllm_over_hf" in cmp_ else "")
            + "."
        )
    md = "\n".join(lines)
    result = {"env": env, "args": vars(args), "commands": commands, "rows": rows, "comparison": cmp_}
    bl.write_outputs(args.out, NAME, result, md)
    return result


if __name__ == "__main__":
    main()
