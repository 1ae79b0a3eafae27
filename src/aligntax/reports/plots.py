"""Plots for people to look at: the compliance-versus-safety trade-off."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

_COLORS = {
    "none": "black",
    "els": "tab:red",
    "system-prompt": "tab:blue",
    "helpful-prompt": "tab:cyan",
    "refusal-ablation": "tab:green",
    "false-refusal-ablation": "tab:olive",
    "cast": "tab:purple",
    "refusal-add": "tab:brown",
}
# points of other names (a mechanism per point): colour and marker both cycle, so that no two of up to
# 40 names look alike
_OTHER_COLORS = ("tab:orange", "tab:pink", "tab:gray", "gold", "teal", "navy", "magenta", "sienna")
_MARKERS = ("o", "s", "^", "D", "v")


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points not dominated in (x, y), both to be maximised, sorted by x."""
    front = [p for p in points if not any(q[0] >= p[0] and q[1] >= p[1] and q != p for q in points)]
    return sorted(set(front))


def pareto_plot(
    rows: list[dict],
    path: str | Path,
    title: str = "compliance vs safety",
    x: str = "harmful_refusal",
    y: str = "benign_compliance",
) -> Path:
    """Scatter of benign compliance (y) against harmful refusal (x), one colour a method, with the
    Pareto front of all points drawn as a step line."""
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    names = sorted({r["name"] for r in rows}, key=lambda n: (n != "none", n != "els", n))
    for name in names:
        pts = [(r[x], r[y]) for r in rows if r["name"] == name]
        ax.scatter(
            [p[0] for p in pts],
            [p[1] for p in pts],
            label=name,
            s=60 if name == "none" else 28,
            color=_COLORS.get(name) or _OTHER_COLORS[names.index(name) % len(_OTHER_COLORS)],
            marker="*" if name == "none" else _MARKERS[names.index(name) % len(_MARKERS)],
            alpha=0.8,
        )
    front = pareto_front([(r[x], r[y]) for r in rows])
    if front:
        ax.step(
            [p[0] for p in front],
            [p[1] for p in front],
            where="post",
            color="grey",
            lw=1,
            ls="--",
            label="Pareto front",
        )
    ax.set_xlabel("harmful refusal rate (higher = safer)")
    ax.set_ylabel("benign compliance rate (higher = fewer false refusals)")
    ax.set_xlim(-0.02, 1.02)
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    from aligntax.runfolder import save_figure

    save_figure(fig, path, dpi=120)
    plt.close(fig)
    return Path(path)
