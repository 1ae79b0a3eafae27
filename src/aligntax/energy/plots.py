"""Energy histograms per layer (good vs bad) as a PNG."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from aligntax.energy.bank import EnergyBank


def plot_energy_histograms(
    bank: EnergyBank,
    acts_by_layer: dict[int, torch.Tensor],
    labels: Any,
    path: str | Path,
    layers: Sequence[int] | None = None,
    bins: int = 40,
    title: str | None = None,
) -> Path:
    """One panel per layer: histogram of E over good (label 0) and bad (label 1) states; saves ``path``."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    y = torch.as_tensor(labels).long().flatten()
    layers = (
        list(layers) if layers is not None else [layer for layer in bank.layers if layer in acts_by_layer]
    )
    n = max(len(layers), 1)
    cols = min(4, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.8 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    for ax, layer in zip(axes.flat, layers, strict=False):
        with torch.no_grad():
            e = bank[layer].eval().energy(acts_by_layer[layer]).cpu()
        good, bad = e[y == 0].numpy(), e[y == 1].numpy()
        lo, hi = float(e.min()), float(e.max())
        edges = torch.linspace(lo, hi if hi > lo else lo + 1, bins + 1).numpy()
        ax.hist(good, bins=edges, alpha=0.6, label=f"good ({len(good)})", color="tab:green")
        ax.hist(bad, bins=edges, alpha=0.6, label=f"bad ({len(bad)})", color="tab:red")
        ax.axvline(0.0, color="k", lw=0.8, ls="--")
        m = bank.metrics(layer)
        acc, au = m.get("acc"), m.get("auroc")
        sub = f"val acc {acc:.2f}, AUROC {au:.2f}" if acc is not None and au is not None else ""
        ax.set_title(f"layer {layer}  {sub}", fontsize=9)
        ax.set_xlabel("energy")
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    from aligntax.runfolder import save_figure

    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path
