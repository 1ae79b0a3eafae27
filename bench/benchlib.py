"""Shared helpers of the benchmark scripts in bench/ (not a benchmark itself).

* common command-line options (model, dtype, threads, repeats, warm-up, --quick, --out);
* loading the model and the ORB-H prompts;
* building the ELS intervention from a folder of ``aligntax els train`` (settings from the flags, else
  ``DIR/sweep/best.json``, else defaults), or a *synthetic* energy bank trained on the fly with random
  labels (its steering is meaningless, but its cost is that of a real bank of the same architecture);
* the interleaved measurement loop: repetition ``r`` runs every alternative once, in forward order on
  even and reverse order on odd repetitions (A,B,B,A,A,B,...), so slow drift of a shared machine
  falls on every alternative alike; ratios are taken within a repetition and then the median is
  reported (the ratio of the medians is kept in the JSON too);
* Markdown tables and the JSON file of raw timings.

The scripts run as ``python bench/NAME.py`` (this folder is then first on ``sys.path``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = "embedded:qwen2.5-coder-0.5b-instruct"
SMALL_MODEL = "embedded:smollm2-135m-instruct"


# ---------------------------------------------------------------------------------------------- servers
def free_port() -> int:
    """A TCP port on the loopback interface that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(
    proc: subprocess.Popen, port: int, timeout: float, where: str = "", poll: float = 0.5
) -> subprocess.Popen:
    """Wait until the server ``proc`` answers ``/health`` on ``port`` with 200; raises RuntimeError (naming
    ``where``, e.g. its log) when it exits first or does not come up within ``timeout`` seconds (the
    caller stops it then)."""
    import httpx

    see = f"; see {where}" if where else ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}){see}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(poll)
    raise RuntimeError(f"the server did not come up in {timeout:.0f} s{see}")


# ---------------------------------------------------------------------------------------------- CLI
def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def optional_float(text: str) -> float | None:
    return None if text.strip().lower() in ("none", "null", "") else float(text)


def add_common_args(p: argparse.ArgumentParser, *, repeats: int, out_name: str) -> None:
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"model spec (default {DEFAULT_MODEL}; {SMALL_MODEL} for a quick check)",
    )
    p.add_argument("--dtype", default="bf16", help="bf16 (default), fp16 or fp32")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)"
    )
    p.add_argument("--repeats", type=int, default=repeats, help=f"measured repetitions (default {repeats})")
    p.add_argument(
        "--warmup", type=int, default=1, help="untimed warm-up runs of every alternative (default 1)"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny settings for a smoke run (few prompts and tokens, 1 repetition); explicit flags still win",
    )
    p.add_argument(
        "--out",
        default=f"runs/bench/{out_name}.json",
        help=f"JSON file of raw timings (a folder: FOLDER/{out_name}.json); the Markdown "
        "table is written next to it (.md)",
    )


def add_prompt_args(p: argparse.ArgumentParser, *, dataset: str, prompts: int, batch_size: int = 32) -> None:
    """``--dataset``, ``--prompts`` (per measurement) and ``--batch-size``."""
    p.add_argument("--dataset", default=dataset, help=f"prompt set (default {dataset})")
    p.add_argument(
        "--prompts", type=int, default=prompts, help=f"prompts per measurement (default {prompts})"
    )
    p.add_argument("--batch-size", type=int, default=batch_size, help=f"default {batch_size}")


def generation_parser(
    doc: str, name: str, *, dataset: str, note: str, repeats: int = 3
) -> argparse.ArgumentParser:
    """The parser of a greedy-generation benchmark: the common options, ``--dataset`` / ``--prompts`` /
    ``--batch-size`` (64 prompts of ``dataset`` by default) and ``--max-new-tokens`` (48, ``note``)."""
    p = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(p, repeats=repeats, out_name=name)
    add_prompt_args(p, dataset=dataset, prompts=64)
    p.add_argument("--max-new-tokens", type=int, default=48, help=f"default 48, {note}")
    return p


GENERATION_QUICK = dict(prompts=8, batch_size=4, max_new_tokens=4, repeats=1)


def parse_with_quick(p: argparse.ArgumentParser, argv, quick: dict) -> argparse.Namespace:
    """Parse; with --quick, ``quick`` replaces the defaults (flags given explicitly still win)."""
    args = p.parse_args(argv)
    if args.quick:
        p.set_defaults(**quick)
        args = p.parse_args(argv)
    return args


def add_steer_args(p: argparse.ArgumentParser, *, required_note: str = "") -> None:
    p.add_argument(
        "--steer",
        default=None,
        help="folder written by `aligntax els train`, or 'synthetic' for an energy bank trained "
        "on the fly with random labels (timing only)" + required_note,
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=None,
        help="steered layers (best first); default: DIR/sweep/best.json, else 2",
    )
    p.add_argument("--eta", type=float, default=None, help="step size; default: best.json, else 0.3")
    p.add_argument("--steps", type=int, default=None, help="descent steps; default: best.json, else 3")
    p.add_argument(
        "--threshold",
        type=optional_float,
        default=argparse.SUPPRESS,
        help="energy gate ('none' for no gate); default: best.json, else none",
    )
    p.add_argument(
        "--gate",
        type=optional_float,
        default=argparse.SUPPRESS,
        help="harm-gate threshold ('none' for no gate); default: best.json, else none",
    )
    p.add_argument(
        "--synthetic-preset",
        default="small",
        choices=("small", "paper"),
        help="architecture of the synthetic energy models (default small, as `els train`)",
    )
    p.add_argument(
        "--synthetic-layers",
        type=int_list,
        default=None,
        help="layers of the synthetic bank (default: max(top_k, 3) layers spread over the middle)",
    )
    p.add_argument(
        "--synthetic-prompts",
        type=int,
        default=64,
        help="prompts captured for the synthetic bank (default 64)",
    )


def out_paths(out: str, name: str) -> tuple[Path, Path]:
    path = Path(out)
    if path.suffix != ".json":
        path = path / f"{name}.json"
    return path, path.with_suffix(".md")


def set_threads(n: int | None) -> int:
    import torch

    if n is not None:
        torch.set_num_threads(n)
    return torch.get_num_threads()


# -------------------------------------------------------------------------------------- environment
def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return (
            out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else None
        )
    except (OSError, subprocess.SubprocessError):
        return None


def environment(lm=None) -> dict:
    import torch
    import transformers

    env = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "argv": sys.argv,
    }
    try:
        env["load_average"] = os.getloadavg()
    except OSError:
        pass
    if lm is not None:
        env["model"] = {
            "spec": lm.spec,
            "dtype": str(lm.dtype).replace("torch.", ""),
            "device": str(lm.device),
            "num_layers": lm.num_layers,
            "hidden_size": lm.hidden_size,
        }
    return env


# ---------------------------------------------------------------------------------- model and data
def start(args) -> tuple:
    """Set ``--threads``, say what is being loaded, and load ``--model``: ``(lm, load seconds)``."""
    threads = set_threads(args.threads)
    print(f"loading {args.model} ({args.dtype}), {threads} torch threads", flush=True)
    return load_lm(args.model, args.dtype, args.device)


def load_lm(spec: str, dtype: str, device: str | None):
    from transformers.utils import logging as hf_logging

    from aligntax.models import load_model

    hf_logging.disable_progress_bar()
    t = time.perf_counter()
    lm = load_model(spec, dtype=dtype, device=device)
    return lm, time.perf_counter() - t


def load_items(dataset: str, n: int | None):
    """The first ``n`` items of a dataset (cycled if it has fewer than ``n``)."""
    from aligntax.data import load_prompts

    items = load_prompts(dataset)
    if n is None or n <= len(items):
        return items[:n] if n is not None else items
    return [items[i % len(items)] for i in range(n)]


def load_prompt_texts(dataset: str, n: int | None) -> list[str]:
    return [it.prompt for it in load_items(dataset, n)]


# ------------------------------------------------------------------------------------------- ELS
def els_settings(args, steer: str | None) -> tuple[dict, str]:
    """ELS settings: explicit flags win, then DIR/sweep/best.json, then the library defaults
    (:func:`aligntax.interventions.els.resolve_settings`)."""
    from aligntax.interventions.els import resolve_settings, tuned_settings

    given = {"top_k": args.top_k, "eta": args.eta, "steps": args.steps}
    for key in ("threshold", "gate"):  # set on the command line: None there means "off"
        if hasattr(args, key):
            given[key] = "none" if getattr(args, key) is None else getattr(args, key)
    folder = steer if steer and steer != "synthetic" else None
    if folder is None or tuned_settings(folder) is None:
        # untuned: the setting these benchmarks have always timed (two layers, every row and token), not
        # the library's safe defaults for steering an untuned folder
        for key, value in BENCH_UNTUNED.items():
            if given.get(key) is None:
                given[key] = value
    return resolve_settings(folder, **given)


BENCH_UNTUNED = {"top_k": 2, "eta": 0.3, "gate": "none", "horizon": "none", "row_threshold": "none"}


def synthetic_layers(lm, top_k: int, layers: Sequence[int] | None) -> list[int]:
    if layers:
        return [int(x) for x in layers]
    n = lm.num_layers
    k = min(n, max(top_k, 3))
    lo, hi = n // 4, max(n // 4, (3 * n) // 4)
    picks = sorted({round(lo + (hi - lo) * i / max(k - 1, 1)) for i in range(k)})
    return [min(n - 1, p) for p in picks]


def synthetic_bank(lm, n_prompts: int, layers: Sequence[int], preset: str = "small", seed: int = 0):
    """An energy bank for ``lm`` from last-token states of ``n_prompts`` ORB-H train prompts and RANDOM
    labels: useless for steering, but the cost of steering with it is that of a real bank of the same
    architecture (the closed-form gradient does not depend on the weights' values)."""
    import torch

    from aligntax.activations.capture import capture
    from aligntax.energy import EnergyConfig, train_layers

    n_prompts = max(8, n_prompts)
    prompts = load_prompt_texts("orbench-hard-train", n_prompts)
    acts = capture(lm, prompts, list(layers), "last", batch_size=32, progress=False)
    gen = torch.Generator().manual_seed(seed)
    y = torch.tensor([i % 2 for i in range(len(prompts))])[torch.randperm(len(prompts), generator=gen)]
    cfg = EnergyConfig.preset(preset, objective="logistic", epochs=3, seed=seed, patience=None)
    return train_layers(
        acts,
        y,
        cfg,
        fingerprint=lm.fingerprint,
        metadata={"synthetic": True, "labels": "random", "n_prompts": len(prompts)},
    )


def build_els(lm, args, grad_methods: Sequence[str] = ("closed",)) -> tuple[dict, dict]:
    """ELS interventions by grad method, plus a description of where they came from."""
    from aligntax.interventions.els import EnergySteering

    settings, origin = els_settings(args, args.steer)
    kw = dict(
        top_k=settings["top_k"], eta=settings["eta"], steps=settings["steps"], threshold=settings["threshold"]
    )
    t = time.perf_counter()
    if args.steer == "synthetic":
        layers = synthetic_layers(lm, settings["top_k"], args.synthetic_layers)
        bank = synthetic_bank(lm, args.synthetic_prompts, layers, args.synthetic_preset)
        ivs = {
            gm: EnergySteering.from_bank(bank, grad_method=gm, source="synthetic", **kw)
            for gm in grad_methods
        }
        source = (
            f"SYNTHETIC energy bank built on the fly: last-token states of {bank.metadata['n_prompts']} "
            f"ORB-H train prompts at layers {layers}, '{args.synthetic_preset}' energy models trained "
            "3 epochs on RANDOM labels (timing only depends on the architecture; the steering "
            "itself is meaningless)"
        )
    else:
        # from a folder, None would mean "take the tuned value": say "none" to keep the gates off
        kw.update(
            {
                k: "none" if settings[k] is None else settings[k]
                for k in ("threshold", "gate", "horizon", "row_threshold")
            }
        )
        kw["layers"] = settings["layers"]  # a sweep may select a layer list instead of a top_k
        ivs = {gm: EnergySteering.from_dir(args.steer, lm, grad_method=gm, **kw) for gm in grad_methods}
        source = f"energy bank {args.steer}"
    first = next(iter(ivs.values()))
    arch = {layer: first.models[layer].arch() for layer in sorted(first.models)}
    info = {
        "source": source,
        "settings": settings,
        "settings_from": origin,
        "layers": sorted(first.models),
        "arch": {str(k): v for k, v in arch.items()},
        "build_seconds": round(time.perf_counter() - t, 2),
    }
    return ivs, info


# ------------------------------------------------------------------------------------ measurement
def interleaved(
    arms: dict[str, Callable[[], dict]],
    repeats: int,
    warmup: int = 1,
    warmups: dict[str, Callable[[], dict]] | None = None,
    log: bool = True,
) -> dict[str, list[dict]]:
    """Run every arm ``warmup`` times untimed, then ``repeats`` times interleaved (order reversed on odd
    repetitions). Each arm returns a dict with at least ``seconds``; the lists of those dicts come back."""
    names = list(arms)
    warmups = warmups or {}
    for w in range(warmup):
        for name in names:
            t = time.perf_counter()
            (warmups.get(name) or arms[name])()
            if log:
                print(f"  warm-up {w + 1}/{warmup} {name}: {time.perf_counter() - t:.2f} s", flush=True)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(repeats):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            res = arms[name]()
            res["repeat"] = r
            runs[name].append(res)
            if log:
                extra = f", {res['tokens'] / res['seconds']:.1f} tok/s" if res.get("tokens") else ""
                print(f"  rep {r + 1}/{repeats} {name}: {res['seconds']:.3f} s{extra}", flush=True)
    return runs


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def median(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.median(xs) if xs else float("nan")


def percentile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100])."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(runs: list[dict]) -> dict:
    secs = [r["seconds"] for r in runs]
    out = {
        "median_s": median(secs),
        "min_s": min(secs) if secs else float("nan"),
        "max_s": max(secs) if secs else float("nan"),
        "n": len(secs),
    }
    if runs and all("tokens" in r for r in runs):
        out["tokens"] = (
            runs[0]["tokens"] if len({r["tokens"] for r in runs}) == 1 else [r["tokens"] for r in runs]
        )
        out["median_tok_s"] = median([r["tokens"] / r["seconds"] for r in runs])
    return out


def paired_ratio(a: list[dict], b: list[dict], key: str = "seconds") -> dict:
    """b/a: the median of the per-repetition ratios, and the ratio of the medians."""
    per = [rb[key] / ra[key] for ra, rb in zip(a, b, strict=True) if ra[key]]
    ma, mb = median([r[key] for r in a]), median([r[key] for r in b])
    return {"median_paired": median(per), "of_medians": mb / ma if ma else float("nan"), "per_repeat": per}


# ---------------------------------------------------------------------------------------- output
def fmt(x, nd: int = 3) -> str:
    if isinstance(x, str):
        return x
    if x is None:
        return "-"
    if isinstance(x, float):
        if math.isnan(x):
            return "-"
        return f"{x:.{nd}f}"
    return str(x)


def md_table(headers: Sequence[str], rows: Sequence[Sequence[object]], align: str | None = None) -> str:
    align = align or ("l" + "r" * (len(headers) - 1))
    sep = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_outputs(out: str, name: str, result: dict, markdown: str) -> tuple[Path, Path]:
    json_path, md_path = out_paths(out, name)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2, default=_jsonable))
    md_path.write_text(markdown + "\n")
    print(markdown)
    print(f"\nraw timings: {json_path}\ntable: {md_path}")
    return json_path, md_path


def _jsonable(obj):
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    return str(obj)


def header(title: str, env: dict, notes: Sequence[str] = ()) -> list[str]:
    model = env.get("model") or {}
    lines = [
        f"## {title}",
        "",
        f"- {env['date']}, commit {env.get('commit')}, torch {env['torch']}, transformers "
        f"{env['transformers']}, {env['cpu_count']} CPUs, torch threads {env['torch_threads']}"
        + (f", GPU {env['cuda']}" if env.get("cuda") else ""),
        f"- model {model.get('spec')} ({model.get('dtype')}, {model.get('device')})",
    ]
    if "load_average" in env:
        lines.append("- load average at start: " + ", ".join(f"{x:.2f}" for x in env["load_average"]))
    lines += [f"- {n}" for n in notes]
    return lines + [""]
