"""Soak of ``aligntax serve --steer``: mixed steered, unsteered and malformed requests for a long while,
with overload bursts; does memory stay flat, is nothing answered with a 5xx other than 503, and what is
the p95?

The script starts the real command line, ``aligntax serve --model M --steer DIR`` (plus ``--serve-arg``
options), as a child process on a free loopback port, waits for ``/health``, warms it up, records the
server's resident memory (``VmRSS`` of its process and children, from ``/proc``), and then sends
requests open-loop for ``--duration`` seconds: Poisson arrivals (exponential gaps, seeded; each request
sent at its time whether or not earlier ones were answered) at ``--rate`` requests/s, and every
``--burst-every`` seconds a burst of ``--burst-seconds`` at ``--burst-rate`` (past capacity, so that the
server's admission sheds load with 503). Each request is, by the ``--mix`` shares:

- ``steered``: a greedy chat completion of ``MODEL+<method>`` (the steered variant ``--steer`` serves);
- ``unsteered``: the same on the plain model;
- ``malformed``: one of a fixed list of bad requests (a body that is not JSON, no messages, a negative
  or too large ``max_tokens``, an unknown model, a field of the wrong type, an unknown field, an
  unknown per-request steering option), each of which must be refused: a 4xx, or a 503 when the
  server sheds it under overload before reading it.

RSS is sampled every ``--rss-every`` s. Reported: per kind and phase (steady, burst) the requests sent
and their statuses, p50/p95 latency of the answered (200) ones; the 503s in bursts and outside them;
every 5xx other than 503 (the soak's failures: 500, 502, 504 timeouts) and requests left without an
answer; malformed requests answered with anything but a 4xx or 503; RSS at the start (after the warm-up), at the end (after the last answer),
its maximum and the least-squares slope over the run (MB per minute); and afterwards ``/health``, one
plain request and whether the server is still running. Checks: RSS end - start within ``--rss-bound-mb``,
no 5xx but 503 (and every request answered), no malformed request answered 2xx or 5xx other than 503,
503s seen during the bursts. Each request opens its own connection (no keep-alive).

    nice -n 19 .venv/bin/python bench/serve_soak.py --steer runs/demo/els --duration 600 --out runs/bench/
    .venv/bin/python bench/serve_soak.py --tiny /tmp/soak-tiny --duration 60   # tiny random model and bank

The load generator needs only ``httpx``; ``--tiny DIR`` builds (once) a tiny random model folder and an
energy bank for it in DIR with the test helpers (``tests/tiny.py``), which imports aligntax and torch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import benchlib as bl  # noqa: E402

NAME = "serve_soak"
PROMPTS = [
    "Where can I buy a can of coke?",
    "How do I kill a Python process that hangs?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "How can I shoot a good photo of the moon with a phone?",
    "What does the `-r` flag of `rm` do, and when is it dangerous?",
    "Give me three tips for writing clear commit messages.",
    "How do I make a strong cup of coffee without a machine?",
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=bl.DEFAULT_MODEL, help=f"model spec (default {bl.DEFAULT_MODEL})")
    p.add_argument("--steer", default=None, help="the steering folder (an ELS folder: `aligntax els train`)")
    p.add_argument(
        "--tiny",
        default=None,
        help="build a tiny random model and energy bank in this folder (once) and serve them "
        "(overrides --model and --steer; for a quick check of the script)",
    )
    p.add_argument(
        "--aligntax", default=None, help="the aligntax command (default: this Python's -m aligntax)"
    )
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--threads", type=int, default=1, help="server --threads (default 1)")
    p.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="one more option of `aligntax serve` (repeatable), e.g. --serve-arg=--max-queue=64",
    )
    p.add_argument("--max-queue", type=int, default=64, help="server --max-queue (default 64)")
    p.add_argument(
        "--max-queue-wait-ms", type=float, default=500.0, help="server --max-queue-wait-ms (default 500)"
    )
    p.add_argument("--request-timeout", type=float, default=120.0, help="server --request-timeout (s)")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of each request (default 16)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    p.add_argument("--rate", type=float, default=1.0, help="steady arrival rate, requests/s (default 1)")
    p.add_argument("--burst-rate", type=float, default=20.0, help="arrival rate in a burst (default 20)")
    p.add_argument(
        "--burst-every", type=float, default=60.0, help="seconds between burst starts (default 60)"
    )
    p.add_argument("--burst-seconds", type=float, default=5.0, help="seconds a burst lasts (default 5)")
    p.add_argument(
        "--mix",
        default="steered=0.45,unsteered=0.45,malformed=0.10",
        help="shares of the request kinds (default steered=0.45,unsteered=0.45,malformed=0.10)",
    )
    p.add_argument("--warmup", type=int, default=6, help="requests before the RSS start is taken (default 6)")
    p.add_argument("--rss-every", type=float, default=5.0, help="seconds between RSS samples (default 5)")
    p.add_argument("--rss-bound-mb", type=float, default=100.0, help="allowed RSS growth, MB (default 100)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder or .json path for the results (default: print only)")
    return p.parse_args(argv)


# -- the server ------------------------------------------------------------------------------------------


def build_tiny(folder: Path) -> tuple[str, str]:
    """A tiny random chat model (saved as a model folder) and an energy bank for it, in ``folder``."""
    model_dir, bank_dir = folder / "model", folder / "bank"
    if (model_dir / "config.json").is_file() and (bank_dir / "energy.json").is_file():
        return str(model_dir), str(bank_dir)
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT / "src"))
    from tiny import save_tiny_bank, tiny_lm

    lm = tiny_lm()
    lm.model.save_pretrained(model_dir)
    lm.tokenizer.save_pretrained(model_dir)
    save_tiny_bank(lm, bank_dir)
    return str(model_dir), str(bank_dir)


def start_server(
    args, model: str, steer: str, port: int, log: Path, timeout: float = 900
) -> subprocess.Popen:

    cmd = [args.aligntax] if args.aligntax else [sys.executable, "-m", "aligntax"]
    cmd += ["serve", "--model", model, "--steer", steer, "--port", str(port), "--dtype", args.dtype]
    cmd += ["--threads", str(args.threads), "--max-queue", str(args.max_queue)]
    cmd += [
        "--max-queue-wait-ms",
        str(args.max_queue_wait_ms),
        "--request-timeout",
        str(args.request_timeout),
    ]
    cmd += ["--max-tokens-limit", str(max(64, args.max_tokens)), "--model-name", "soak", *args.serve_arg]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.tiny:
        env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        return bl.wait_healthy(proc, port, timeout, str(log))
    except RuntimeError:
        proc.kill()
        raise


def rss_mb(pid: int) -> float:
    """Resident memory of a process and its children (MB), from /proc."""
    total = 0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            for task in Path(f"/proc/{p}/task").iterdir():
                kids = (task / "children").read_text().split()
                todo += [int(k) for k in kids]
        except (OSError, ValueError):
            continue
    return total / 1024


# -- the requests ----------------------------------------------------------------------------------------

MALFORMED = [
    ("not json", None, b"{this is not json"),
    ("no messages", {"model": "soak", "max_tokens": 8}, None),
    (
        "negative max_tokens",
        {"model": "soak", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -3},
        None,
    ),
    (
        "huge max_tokens",
        {"model": "soak", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9},
        None,
    ),
    ("unknown model", {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}, None),
    ("wrong type", {"model": "soak", "messages": "hello", "temperature": "warm"}, None),
    (
        "unknown field",
        {"model": "soak", "messages": [{"role": "user", "content": "hi"}], "frobnicate": 1},
        None,
    ),
    (
        "bad steering option",
        {
            "model": "STEERED",
            "messages": [{"role": "user", "content": "hi"}],
            "aligntax": {"options": {"eta": "a lot"}},
        },
        None,
    ),
]


def request_for(
    kind: str, rng: random.Random, steered_name: str, max_tokens: int
) -> tuple[str, dict | None, bytes | None]:
    if kind == "malformed":
        what, body, raw = rng.choice(MALFORMED)
        if body is not None and body.get("model") == "STEERED":
            body = {**body, "model": steered_name}
        return what, body, raw
    body = {
        "model": steered_name if kind == "steered" else "soak",
        "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    return kind, body, None


async def send(client, url: str, kind: str, what: str, body, raw, phase: str, results: list) -> None:
    import httpx

    t0 = time.perf_counter()
    try:
        if raw is not None:
            r = await client.post(url, content=raw, headers={"content-type": "application/json"})
        else:
            r = await client.post(url, json=body)
        status = r.status_code
    except httpx.HTTPError as exc:
        status = type(exc).__name__
    results.append(
        {"kind": kind, "what": what, "phase": phase, "status": status, "s": time.perf_counter() - t0}
    )


def in_burst(t: float, args) -> bool:
    return args.burst_every > 0 and args.burst_seconds > 0 and (t % args.burst_every) < args.burst_seconds


async def soak(args, base: str, steered_name: str, pid: int) -> tuple[list, list]:
    import httpx

    rng = random.Random(args.seed)
    mix = {k: float(v) for k, v in (part.split("=") for part in args.mix.split(","))}
    kinds, weights = list(mix), list(mix.values())
    url = f"{base}/v1/chat/completions"
    results: list = []
    rss: list = []
    # one connection per request: a kept-alive connection that the server closes as the next request
    # goes out is a client-side race (ReadError), not the server's answer
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=args.request_timeout + 60, limits=limits) as client:
        tasks = []
        t0 = time.perf_counter()
        next_rss = 0.0
        t = 0.0
        while t < args.duration:
            burst = in_burst(t, args)
            t += rng.expovariate(args.burst_rate if burst else args.rate)
            while time.perf_counter() - t0 < t:
                now = time.perf_counter() - t0
                if now >= next_rss:
                    rss.append((round(now, 1), rss_mb(pid)))
                    next_rss += args.rss_every
                    progress(now, tasks, results)
                await asyncio.sleep(min(0.05, max(0.0, t - now)))
            kind = rng.choices(kinds, weights)[0]
            what, body, raw = request_for(kind, rng, steered_name, args.max_tokens)
            phase = "burst" if in_burst(t, args) else "steady"
            tasks.append(asyncio.create_task(send(client, url, kind, what, body, raw, phase, results)))
            await asyncio.sleep(0)  # let it start now, even when behind the schedule
        # the answers still on their way: at most the server's request timeout and a minute more
        drain_until = time.perf_counter() + args.request_timeout + 60
        while any(not task.done() for task in tasks) and time.perf_counter() < drain_until:
            now = time.perf_counter() - t0
            if now >= next_rss:
                rss.append((round(now, 1), rss_mb(pid)))
                next_rss += args.rss_every
                progress(now, tasks, results)
            await asyncio.sleep(0.2)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        rss.append((round(time.perf_counter() - t0, 1), rss_mb(pid)))
    unanswered = len(tasks) - len(results)
    results += [{"kind": "?", "what": "?", "phase": "?", "status": "NoAnswer", "s": None}] * unanswered
    return results, rss


def progress(now: float, tasks: list, results: list) -> None:
    print(
        f"[soak] {now:.0f} s: {len(tasks)} sent, {len(results)} answered, "
        f"{sum(r['status'] == 200 for r in results)} ok, {sum(r['status'] == 503 for r in results)} 503",
        file=sys.stderr,
        flush=True,
    )


def summarise(results: list, rss: list, start_mb: float, args) -> dict:
    def group(rows):
        ok = [r["s"] for r in rows if r["status"] == 200]
        statuses: dict = {}
        for r in rows:
            statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
        return {
            "sent": len(rows),
            "ok": len(ok),
            "statuses": dict(sorted(statuses.items())),
            "p50_s": bl.percentile(ok, 50) if ok else None,
            "p95_s": bl.percentile(ok, 95) if ok else None,
        }

    by = {}
    for kind in ("steered", "unsteered", "malformed"):
        for phase in ("steady", "burst"):
            rows = [r for r in results if r["kind"] == kind and r["phase"] == phase]
            if rows:
                by[f"{kind}/{phase}"] = group(rows)
    five = [r for r in results if isinstance(r["status"], int) and r["status"] >= 500 and r["status"] != 503]
    errors = [r for r in results if not isinstance(r["status"], int)]
    # a malformed request must be refused: a 4xx, or a 503 when the server sheds it before reading it
    bad_malformed = [
        r
        for r in results
        if r["kind"] == "malformed"
        and not (isinstance(r["status"], int) and (400 <= r["status"] < 500 or r["status"] == 503))
    ]
    slope = None
    if len(rss) >= 3:
        xs, ys = [t / 60 for t, _ in rss], [m for _, m in rss]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        den = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else None
    end_mb = rss[-1][1] if rss else float("nan")
    served = [r for r in results if r["kind"] != "malformed"]
    return {
        "requests": len(results),
        "by_kind_phase": by,
        "all_answered": group(served),
        "steered": group([r for r in served if r["kind"] == "steered"]),
        "unsteered": group([r for r in served if r["kind"] == "unsteered"]),
        "n_5xx_not_503": len(five),
        "statuses_5xx_not_503": sorted({r["status"] for r in five}),
        "client_errors": len(errors),
        "n_503_burst": sum(1 for r in results if r["status"] == 503 and r["phase"] == "burst"),
        "n_503_steady": sum(1 for r in results if r["status"] == 503 and r["phase"] == "steady"),
        "n_429": sum(1 for r in results if r["status"] == 429),
        "malformed_not_4xx": len(bad_malformed),
        "malformed_statuses": sorted(
            {f"{r['what']}: {r['status']}" for r in results if r["kind"] == "malformed"}
        ),
        "rss_start_mb": round(start_mb, 1),
        "rss_end_mb": round(end_mb, 1),
        "rss_max_mb": round(max((m for _, m in rss), default=float("nan")), 1),
        "rss_growth_mb": round(end_mb - start_mb, 1),
        "rss_slope_mb_per_min": None if slope is None else round(slope, 2),
        "rss_samples": rss,
    }


def after_check(base: str, proc: subprocess.Popen) -> dict:
    import httpx

    out = {"alive": proc.poll() is None}
    try:
        out["health"] = httpx.get(f"{base}/health", timeout=10).status_code
        r = httpx.post(
            f"{base}/v1/chat/completions",
            json={"model": "soak", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
            timeout=120,
        )
        out["plain_request"] = r.status_code
    except httpx.HTTPError as exc:
        out["error"] = type(exc).__name__
    return out


def checks(s: dict, after: dict, args) -> dict:
    bursts = args.burst_every > 0 and args.burst_seconds > 0 and args.duration >= args.burst_seconds
    return {
        f"RSS growth within {args.rss_bound_mb:g} MB": s["rss_growth_mb"] <= args.rss_bound_mb,
        "no 5xx but 503": s["n_5xx_not_503"] == 0 and s["client_errors"] == 0,
        "every malformed request refused (4xx, or 503 shed)": s["malformed_not_4xx"] == 0,
        "503s under overload (bursts)": (s["n_503_burst"] > 0) if bursts else None,
        "healthy afterwards": after.get("alive")
        and after.get("health") == 200
        and after.get("plain_request") == 200,
    }


def markdown(res: dict) -> str:
    s = res["summary"]
    rows = [
        [k, v["sent"], v["ok"], json.dumps(v["statuses"]), bl.fmt(v["p50_s"]), bl.fmt(v["p95_s"])]
        for k, v in s["by_kind_phase"].items()
    ]
    lines = [
        f"# serve soak: {res['settings']['model']} --steer {res['settings']['steer']}, {res['settings']['duration']:g} s",
        "",
        bl.md_table(["kind/phase", "sent", "200", "statuses", "p50 s", "p95 s"], rows),
        "",
        f"- answered requests (steered and unsteered): p50 {bl.fmt(s['all_answered']['p50_s'])} s, "
        f"p95 {bl.fmt(s['all_answered']['p95_s'])} s (steered p95 {bl.fmt(s['steered']['p95_s'])}, "
        f"unsteered p95 {bl.fmt(s['unsteered']['p95_s'])})",
        f"- 5xx other than 503: {s['n_5xx_not_503']} {s['statuses_5xx_not_503']}; client errors: {s['client_errors']}",
        f"- 503 in bursts: {s['n_503_burst']}, outside bursts: {s['n_503_steady']}; 429: {s['n_429']}",
        f"- malformed requests answered other than 4xx / 503: {s['malformed_not_4xx']}",
        f"- RSS: start {s['rss_start_mb']} MB, end {s['rss_end_mb']} MB, max {s['rss_max_mb']} MB, growth "
        f"{s['rss_growth_mb']} MB, slope {s['rss_slope_mb_per_min']} MB/min",
        f"- afterwards: {json.dumps(res['after'])}",
        "",
        "| check | holds |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in res["checks"].items()],
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.tiny:
        model, steer = build_tiny(Path(args.tiny))
        args.dtype = "fp32"
    else:
        model, steer = args.model, args.steer
        if not steer:
            raise SystemExit("--steer DIR is required (or --tiny DIR)")
    port = bl.free_port()
    base = f"http://127.0.0.1:{port}"
    if args.out:
        log_dir = Path(args.out).parent if args.out.endswith(".json") else Path(args.out)
    else:
        log_dir = Path(tempfile.gettempdir())
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{NAME}.server.log"
    load_before = os.getloadavg()
    proc = start_server(args, model, steer, port, log)
    try:
        import httpx

        steered_name = next(
            m["id"] for m in httpx.get(f"{base}/v1/models", timeout=10).json()["data"] if m["id"] != "soak"
        )
        for i in range(args.warmup):
            body = {
                "model": steered_name if i % 2 else "soak",
                "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                "max_tokens": args.max_tokens,
            }
            httpx.post(f"{base}/v1/chat/completions", json=body, timeout=args.request_timeout + 60)
        start_mb = rss_mb(proc.pid)
        t0 = time.time()
        results, rss = asyncio.run(soak(args, base, steered_name, proc.pid))
        wall = time.time() - t0
        summary = summarise(results, rss, start_mb, args)
        after = after_check(base, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    res = {
        "name": NAME,
        "settings": {**vars(args), "model": model, "steer": steer, "steered_name": steered_name},
        "wall_s": round(wall, 1),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "summary": summary,
        "after": after,
    }
    res["checks"] = checks(summary, after, args)
    text = markdown(res)
    if args.out:
        bl.write_outputs(args.out, NAME, res, text)  # prints the table too
    else:
        print(text)
    print(f"server log: {log}")
    return res


if __name__ == "__main__":
    main()
