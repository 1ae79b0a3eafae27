"""How stable is the ranking of energy layers? One 80/20 split against k disjoint folds.

For each folder written by ``aligntax els train`` (its ``activations/`` and ``labels/``), the energy
bank is trained again with the folder's settings, once per fold count, on the states in the order
training used them. Two folders holding the same prompts (e.g. two demo runs whose states differ only
by bf16 rounding) show whether a ranking survives that noise. Wall seconds of each fold count are
measured side by side in one run.

    python bench/energy_ranking.py --threads 2 runs/demo/els runs/demo-g6/els --folds 1,5
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import benchlib
import torch

from aligntax.activations.cache import ActivationCache
from aligntax.energy import EnergyConfig, state_labels, train_layers
from aligntax.runs.eval import load_prompt_sets
from aligntax.runs.jsonl import read_jsonl


def _states(folder: Path, train_cfg: dict) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """States and good/bad labels in the order training used them (benign sets, then harmful sets)."""
    items = [*load_prompt_sets(train_cfg["benign"], train_cfg["limit_benign"]),
             *load_prompt_sets(train_cfg["harmful"], train_cfg["limit_harmful"])]
    judged = {(r["source"], r["id"]): r for r in read_jsonl(folder / "labels" / "samples.jsonl")}
    cache = ActivationCache.load(folder / "activations")
    row = {pid: i for i, pid in enumerate(cache.prompt_ids)}
    idx = torch.tensor([row[f"{it.source}/{it.id}"] for it in items])
    y = state_labels([it.label for it in items], [bool(judged[(it.source, it.id)]["refused"]) for it in items])
    return {layer: cache[layer][idx] for layer in cache.layers}, y


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folders", nargs="+", help="folders of aligntax els train")
    p.add_argument("--folds", type=benchlib.int_list, default=[1, 5], help="fold counts (default 1,5)")
    p.add_argument("--top", type=int, default=5, help="ranks shown (default 5)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="runs/bench/energy_ranking.json", help="JSON file or folder")
    args = p.parse_args()
    threads = benchlib.set_threads(args.threads)
    rows = []
    for folder in map(Path, args.folders):
        train_cfg = json.loads((folder / "train_config.json").read_text())
        acts, y = _states(folder, train_cfg)
        for folds in args.folds:
            cfg = EnergyConfig.preset(train_cfg.get("preset", "small"), objective=train_cfg.get("objective", "logistic"),
                                      epochs=train_cfg.get("epochs", 60), lr=train_cfg.get("lr", 1e-3),
                                      seed=train_cfg.get("seed", 0), folds=folds)
            t0 = time.perf_counter()
            bank = train_layers(acts, y, cfg, progress=True)
            secs = time.perf_counter() - t0
            top = [{"layer": layer, "acc": round(bank.metrics(layer)["acc"], 4),
                    "auroc": round(bank.metrics(layer)["auroc"], 4)} for layer in bank.top(args.top)]
            rows.append({"folder": str(folder), "folds": folds, "seconds": round(secs, 1), "top": top,
                         "n_states": len(y), "n_bad": int(y.sum())})
    table = benchlib.md_table(["folder", "folds", "seconds", "ranked layers (val acc)"],
                              [[r["folder"], r["folds"], r["seconds"],
                                ", ".join(f"{t['layer']} ({t['acc']:.3f})" for t in r["top"])] for r in rows],
                              align="lrrl")
    env = benchlib.environment()
    benchlib.write_outputs(args.out, "energy_ranking", {"rows": rows, "argv": vars(args), "threads": threads,
                                                         "environment": env},
                           "\n".join([*benchlib.header("Energy layer ranking: one split against folds", env), table]))


if __name__ == "__main__":
    main()
