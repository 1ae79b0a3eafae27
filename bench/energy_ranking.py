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
import time
from pathlib import Path

import benchlib

from aligntax.energy import train_layers
from aligntax.runs.els_train import training_states


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
        train_cfg, acts, y = training_states(folder)
        for folds in args.folds:
            t0 = time.perf_counter()
            bank = train_layers(acts, y, train_cfg.energy_config(folds=folds), progress=True)
            secs = time.perf_counter() - t0
            top = [
                {
                    "layer": layer,
                    "acc": round(bank.metrics(layer)["acc"], 4),
                    "auroc": round(bank.metrics(layer)["auroc"], 4),
                }
                for layer in bank.top(args.top)
            ]
            rows.append(
                {
                    "folder": str(folder),
                    "folds": folds,
                    "seconds": round(secs, 1),
                    "top": top,
                    "n_states": len(y),
                    "n_bad": int(y.sum()),
                }
            )
    table = benchlib.md_table(
        ["folder", "folds", "seconds", "ranked layers (val acc)"],
        [
            [
                r["folder"],
                r["folds"],
                r["seconds"],
                ", ".join(f"{t['layer']} ({t['acc']:.3f})" for t in r["top"]),
            ]
            for r in rows
        ],
        align="lrrl",
    )
    env = benchlib.environment()
    benchlib.write_outputs(
        args.out,
        "energy_ranking",
        {"rows": rows, "argv": vars(args), "threads": threads, "environment": env},
        "\n".join([*benchlib.header("Energy layer ranking: one split against folds", env), table]),
    )


if __name__ == "__main__":
    main()
