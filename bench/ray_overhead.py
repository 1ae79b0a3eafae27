"""What one Ray replica costs against the plain run: ``aligntax eval`` on ORB-H test, the same command
with and without ``--ray local --workers 1``, side by side.

Each arm is the whole command in a fresh process (model load, generation, judging, writing the run
folder; the Ray arm also starts a local cluster and its replica), into a new run folder each time, with
``OMP_NUM_THREADS`` threads in the plain process and in the replica (``--worker-cpus``). The arms are
interleaved (A,B,B,A,...) and the ratio is taken per repetition; the load average before and after each
run is kept, since the machine may be shared. Both arms must write the same responses (checked).

    python bench/ray_overhead.py --limit 32 --max-new-tokens 48 --repeats 3 --out runs/bench
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import (
    DEFAULT_MODEL,
    ROOT,
    environment,
    fmt,
    header,
    interleaved,
    md_table,
    paired_ratio,
    summarize,
    write_outputs,
)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--data", default="orbench-hard-test")
    p.add_argument("--limit", type=int, default=32, help="first N prompts of the dataset")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--judge", default="keyword")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the plain run and of the replica")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--out", default="runs/bench/ray_overhead.json")
    args = p.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="ray-overhead-"))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1", "RAY_ADDRESS": ""}
    base = [
        sys.executable,
        "-m",
        "aligntax",
        "eval",
        "--model",
        args.model,
        "--dtype",
        args.dtype,
        "--data",
        args.data,
        "--limit",
        str(args.limit),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--batch-size",
        str(args.batch_size),
        "--judge",
        args.judge,
        "--no-progress",
    ]
    count = {"n": 0}

    def arm(extra: list[str], name: str):
        def run() -> dict:
            count["n"] += 1
            out = work / f"{name}-{count['n']}"
            load0 = os.getloadavg()[0]
            t = time.perf_counter()
            subprocess.run(
                [*base, "--out", str(out), *extra],
                env=env,
                cwd=ROOT,
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            seconds = time.perf_counter() - t
            res = json.loads((out / "results.json").read_text())
            responses = {
                (r["source"], r["id"]): r["response"]
                for r in map(json.loads, (out / "samples.jsonl").read_text().splitlines())
            }
            shutil.rmtree(out)
            return {
                "seconds": seconds,
                "tokens": res["timing"]["generated_tokens"],
                "generation_seconds": res["timing"]["generation_seconds"],
                "load_before": load0,
                "load_after": os.getloadavg()[0],
                "responses": responses,
            }

        return run

    arms = {
        "plain": arm([], "plain"),
        "ray, 1 replica": arm(
            ["--ray", "local", "--workers", "1", "--worker-cpus", str(args.threads)], "ray"
        ),
    }
    env_info = environment()
    runs = interleaved(arms, args.repeats, args.warmup)
    same = all(r["responses"] == runs["plain"][0]["responses"] for rs in runs.values() for r in rs)
    for rs in runs.values():
        for r in rs:
            r.pop("responses")
    ratio = paired_ratio(runs["plain"], runs["ray, 1 replica"])
    gen_ratio = paired_ratio(runs["plain"], runs["ray, 1 replica"], "generation_seconds")
    result = {
        "env": env_info,
        "args": vars(args),
        "runs": runs,
        "summary": {k: summarize(v) for k, v in runs.items()},
        "ratio_wall": ratio,
        "ratio_generation": gen_ratio,
        "same_responses": same,
    }
    rows = [
        [
            name,
            fmt(s["median_s"], 1),
            fmt(s["min_s"], 1),
            fmt(s["max_s"], 1),
            fmt(summarize(runs[name])["median_tok_s"], 1),
        ]
        for name, s in result["summary"].items()
    ]
    lines = header(
        "One Ray replica against the plain run (aligntax eval)",
        env_info,
        [
            f"{args.data}, first {args.limit} prompts, {args.max_new_tokens} new tokens, batch {args.batch_size}, "
            f"judge {args.judge}, {args.threads} torch thread(s) per process; whole commands, fresh processes",
            "load average (1 min) before each run: "
            + ", ".join(f"{r['load_before']:.1f}" for rs in runs.values() for r in rs),
        ],
    )
    lines += [
        "",
        md_table(["arm", "median s", "min s", "max s", "tok/s"], rows),
        "",
        f"- wall time ray/plain: median of per-repetition ratios {ratio['median_paired']:.3f} "
        f"(per repetition: {', '.join(f'{x:.3f}' for x in ratio['per_repeat'])})",
        f"- generation time ray/plain: {gen_ratio['median_paired']:.3f}",
        f"- same responses in every run: {same}",
    ]
    write_outputs(args.out, "ray_overhead", result, "\n".join(lines))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
