"""Reports of VAT runs: a Markdown summary with a circumplex radar of drifts and a coupling heatmap,
and ``compare(dirs)``: gain versus tax across interventions (scatter PNG + Markdown table)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from aligntax.errors import AligntaxError
from aligntax.runfolder import save_figure, write_text_atomic
from aligntax.vat.schwartz import CODES, VALUES, circle_angles


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def _f(x, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return f"{x:+.{digits}f}" if isinstance(x, float) else str(x)


def _ci(ci) -> str:
    return "" if not ci else f" [{ci[0]:+.3f}, {ci[1]:+.3f}]"


def _boot_text(b: dict) -> str:
    if not b:
        return "No intervals (bootstrap off)."
    if b.get("method", "").startswith("scene bootstrap"):
        return (
            f"Intervals: {b.get('reps')} scene-bootstrap resamples ({b.get('n_groups')} of "
            f"{b.get('n_groups')} scenes with replacement), percentiles."
        )
    kind = "with" if b.get("replace") else "without"
    txt = (
        f"Intervals: {b.get('reps')} resamples of {b.get('subsample_size')} of {b.get('n_groups')} scenes "
        f"({kind} replacement)"
    )
    if b.get("rescaled"):
        return txt + f", deviations rescaled to the full sample (x{b.get('scale', 0):.2f})."
    return txt + ", raw percentiles (subsample spread, not a confidence interval)."


def _null_p(p) -> str:
    return "" if p is None else f" (p {p:.3f})"


def _intervention_label(results: dict) -> str:
    iv = (results.get("config") or {}).get("intervention") or {}
    return str(iv.get("name") or "?")


# ----------------------------------------------------------------- plots
def plot_radar(results: dict, path: str | Path) -> Path:
    """Drift of every value on the Schwartz circle (the target shows its gain), target marked."""
    plt = _plt()
    target = results["target"]
    ang = circle_angles("wedge")
    vals = {
        v: (results["gain"]["value"] if v == target else (results["drift"].get(v) or {}).get("value"))
        for v in VALUES
    }
    r = np.array([np.nan if vals[v] is None else vals[v] for v in VALUES], dtype=float)
    th = np.array([ang[v] for v in VALUES])
    finite = r[np.isfinite(r)]
    span = max(0.05, float(np.max(np.abs(finite))) if finite.size else 0.05)
    lo, hi = -1.15 * span, 1.15 * span
    fig = plt.figure(figsize=(6.2, 6.2))
    ax = fig.add_subplot(111, projection="polar")
    ax.set_theta_zero_location("N")
    ax.set_theta_direction(-1)
    ax.set_ylim(lo, hi)
    circle = np.linspace(0, 2 * np.pi, 200)
    ax.plot(circle, np.zeros_like(circle), ls="--", lw=1, color="grey")
    closed = np.append(np.nan_to_num(r, nan=0.0), np.nan_to_num(r[:1], nan=0.0))
    ax.plot(np.append(th, th[:1]), closed, color="tab:blue", lw=2)
    ax.fill(np.append(th, th[:1]), closed, color="tab:blue", alpha=0.12)
    ax.scatter(th, np.nan_to_num(r, nan=0.0), color="tab:blue", zorder=3, s=20)
    ti = VALUES.index(target)
    ax.scatter(
        [th[ti]],
        [np.nan_to_num(r[ti], nan=0.0)],
        marker="*",
        s=260,
        color="tab:red",
        zorder=4,
        label=f"target {target} (gain)",
    )
    ax.set_xticks(th)
    ax.set_xticklabels([f"{v}\n{_f(vals[v], 2)}" for v in VALUES], fontsize=8)
    for lab, v in zip(ax.get_xticklabels(), VALUES, strict=True):
        if v == target:
            lab.set_color("tab:red")
            lab.set_fontweight("bold")
    ax.set_title(
        f"Shift of value expression ({_intervention_label(results)} -> {target})\n"
        "radius: mean shift d; dashed: no change",
        fontsize=10,
    )
    ax.legend(loc="lower right", bbox_to_anchor=(1.15, -0.1), fontsize=8)
    fig.tight_layout()
    path = Path(path)
    save_figure(fig, path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_coupling(results: dict, path: str | Path) -> Path:
    plt = _plt()
    order = results.get("values", list(VALUES))
    R = np.array([[np.nan if x is None else x for x in row] for row in results["coupling"]], dtype=float)
    fig, ax = plt.subplots(figsize=(6.4, 5.6))
    cmap = plt.get_cmap("RdBu_r").with_extremes(bad="#dddddd")
    im = ax.imshow(np.ma.masked_invalid(R), cmap=cmap, vmin=-1, vmax=1)
    codes = [CODES.get(v, v[:2]) for v in order]
    ax.set_xticks(range(len(order)), codes)
    ax.set_yticks(range(len(order)), [f"{v} ({c})" for v, c in zip(order, codes, strict=True)])
    for i in range(len(order)):
        for j in range(len(order)):
            if np.isfinite(R[i, j]):
                ax.text(
                    j,
                    i,
                    f"{R[i, j]:.2f}",
                    ha="center",
                    va="center",
                    fontsize=6.5,
                    color="white" if abs(R[i, j]) > 0.6 else "black",
                )
    ti = order.index(results["target"])
    ax.add_patch(plt.Rectangle((-0.5, ti - 0.5), len(order), 1, fill=False, ec="tab:red", lw=1.5))
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    ax.set_title(
        f"Coupling R ({results.get('coupling_method', 'spearman')} across "
        f"{results.get('n_groups', '?')} scenes); nVAT = {_f(results.get('nvat'))}",
        fontsize=9,
    )
    fig.tight_layout()
    path = Path(path)
    save_figure(fig, path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


# ----------------------------------------------------------------- Markdown
def value_table(results: dict) -> str:
    target = results["target"]
    tests = (results.get("tests") or {}).get("per_value", {})
    expr = results.get("expression", {})
    lines = [
        "| value | n | e pre | e post | shift D [95% CI] | GND | p | q (BH) |",
        "|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for v in results.get("values", VALUES):
        if v == target:
            block, gnd = results["gain"], None
            name = f"**{v} (target)**"
        else:
            block, gnd = results["drift"].get(v, {}), results["gnd"].get(v, {})
            name = v
        t = tests.get(v, {})
        e = expr.get(v, {})
        gtxt = "" if gnd is None else (_f(gnd.get("value")) if gnd.get("value") is not None else "undef.")
        lines.append(
            f"| {name} | {results['counts'].get(v, 0)} | {_f(e.get('pre'))} | {_f(e.get('post'))} | "
            f"{_f(block.get('value'))}{_ci(block.get('ci95'))} | {gtxt} | "
            f"{_f(t.get('p_value'))[1:] if t.get('p_value') is not None else 'n/a'} | "
            f"{_f(t.get('q_value'))[1:] if t.get('q_value') is not None else 'n/a'}"
            f"{' *' if t.get('significant') else ''} |"
        )
    return "\n".join(lines)


def _p(p) -> str:
    return "n/a" if p is None else f"{p:.4f}"


def _specificity_lines(results: dict) -> list[str]:
    lines = []
    sp = results.get("specificity")
    if sp:
        lines.append(
            f"- specificity S_T = G_T - mean off-target drift = {_f(sp.get('value'))}{_ci(sp.get('ci95'))} "
            f"(mean off-target drift {_f(sp.get('mean_off_target_drift'))}; scene-level p "
            f"{_p(sp.get('p_value_scene'))}): {sp.get('interpretation')}"
        )
    avo = results.get("adjacent_vs_opposite")
    if avo and avo.get("value") is not None:
        lines.append(
            f"- neighbours minus opposites of the target ({', '.join(avo['neighbours'])} vs "
            f"{', '.join(avo['opposites'])}): {_f(avo['value'])}{_ci(avo.get('ci95'))}, scene-level p "
            f"{_p(avo.get('p_value_scene'))} (circumplex predicts > 0)"
        )
    c = results.get("control")
    if c and c.get("n_paired"):
        csp = c.get("specificity") or {}
        lines.append(
            f"- lift-adjusted against the control run ({c['n_paired']} paired items): gain "
            f"{_f(c['gain']['value'])}{_ci(c['gain'].get('ci95'))}, S_T {_f(csp.get('value'))}"
            f"{_ci(csp.get('ci95'))}; drifts: "
            + ", ".join(f"{CODES[v]} {_f(x['value'])}" for v, x in c["drift"].items())
        )
    elif c:
        lines.append(f"- control run: {c.get('reason')}")
    return lines


def _hub_stability_text(hs: dict | None) -> str:
    if not hs or not hs.get("top1_share"):
        return ""
    top = hs["full_top_strength"][0]
    return (
        f"; the top hub {top} stays on top in {hs['full_top1_kept']:.0%} of {hs['reps']} "
        f"{hs['fraction']:.0%} scene subsamples"
    )


def strata_lines(results: dict) -> list[str]:
    """The per-stratum table of a run: gain, mean off-target drift, S_T and every value's shift within
    the congruent and incongruent items, and the raw lift of the neutral items."""
    st = results.get("strata")
    if not st:
        return []
    t = results["target"]
    lines = [
        "## Desirability strata",
        "",
        "Congruent: supporting the value is also the socially approved action; incongruent: supporting it "
        "is the disapproved one. A change of the values moves both strata alike; a judge that only rates "
        "approved actions higher lifts congruent shifts and lowers incongruent ones. Neutral: raw score "
        "change (post - pre) of actions that bear on no value.",
        "",
        "| stratum | n | gain G_T [95% CI] | mean off-target drift | S_T [95% CI] | "
        + " | ".join(CODES[v] for v in VALUES)
        + " |",
        "|---|---:|---|---:|---|" + "---:|" * len(VALUES),
    ]
    for k in ("congruent", "incongruent", "unlabelled"):
        r = st.get(k)
        if not r:
            continue
        cells = []
        for v in VALUES:
            x = r["gain"]["value"] if v == t else (r["drift"].get(v) or {}).get("value")
            cells.append("n/a" if x is None else (f"**{x:+.3f}**" if v == t else f"{x:+.3f}"))
        lines.append(
            f"| {k} | {r['n_items']} | {_f(r['gain']['value'])}{_ci(r['gain'].get('ci95'))} | "
            f"{_f(r.get('mean_off_target_drift'))} | {_f(r['specificity']['value'])}"
            f"{_ci(r['specificity'].get('ci95'))} | " + " | ".join(cells) + " |"
        )
    lines.append("")
    if st.get("neutral"):
        nl = st["neutral"]["lift"]
        lines.append(
            f"- neutral items ({st['neutral']['n_items']}): raw lift {_f(nl['value'])}{_ci(nl.get('ci95'))}"
            f", scene-level p = {_f(nl.get('p_value_scene'))}"
        )
    if st.get("congruent_minus_incongruent"):
        lines.append(
            f"- congruent minus incongruent (mean shift over all values): "
            f"{_f(st['congruent_minus_incongruent']['value'])}"
        )
    return [*lines, ""]


def _valid(results: dict, key: str) -> str:
    """' (n of reps valid resamples)' for a coupling-bootstrap statistic, '' without one."""
    cb = results.get("coupling_bootstrap") or {}
    blk = cb.get(key) or {}
    if blk.get("ci95") is None:
        return ""
    return f" ({blk.get('n_valid')} of {cb.get('reps')} resamples valid)"


def _coupling_interval_lines(results: dict) -> list[str]:
    """The scene-bootstrap intervals of the coupling matrix: which off-diagonal entries' intervals
    exclude 0, and the top hub's row-strength interval."""
    cb = results.get("coupling_bootstrap") or {}
    ci = results.get("coupling_ci95") or {}
    lo, hi = ci.get("lower"), ci.get("upper")
    if not lo or not hi:
        return []
    vals = results.get("values") or [str(i) for i in range(len(lo))]
    pairs, n_def = [], 0
    for a in range(len(lo)):
        for b in range(a + 1, len(lo)):
            if lo[a][b] is None or hi[a][b] is None:
                continue
            n_def += 1
            if lo[a][b] > 0 or hi[a][b] < 0:
                r = (results.get("coupling") or [[None] * len(lo)] * len(lo))[a][b]
                pairs.append(f"{vals[a]}-{vals[b]} {_f(r)} [{lo[a][b]:+.3f}, {hi[a][b]:+.3f}]")
    line = (
        f"- coupling R, scene-bootstrap {cb.get('level', 0.95):.0%} intervals per entry "
        f"({cb.get('reps')} resamples): {len(pairs)} of {n_def} off-diagonal pairs exclude 0"
        + (": " + "; ".join(pairs) if pairs else "")
    )
    top = ((results.get("hubs") or {}).get("top_strength") or [None])[0]
    sblk = (cb.get("strength") or {}).get(top) or {}
    if top is not None and sblk.get("ci95"):
        s = ((results.get("hubs") or {}).get("strength") or {}).get(top)
        line += f"; top hub {top} row strength {_f(s)}{_ci(sblk['ci95'])}"
    return [line]


def write_report(results: dict, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    plot_radar(results, out / "radar.png")
    plot_coupling(results, out / "coupling.png")
    cfg = results.get("config", {})
    fp = results.get("model_fingerprint", {})
    v = results["vat"]
    ct = results.get("circumplex_test", {})
    hubs = results.get("hubs", {})
    rob = results.get("robustness", {})
    judge = cfg.get("judge", {})
    nn = results.get("nvat_null") or {}
    lines = [
        f"# Value Alignment Tax: {_intervention_label(results)} -> {results['target']}",
        "",
        f"- model: `{fp.get('spec')}` ({fp.get('model_type')}, {fp.get('num_layers')} layers)",
        f"- intervention: `{json.dumps(cfg.get('intervention', {}))[:300]}`",
        f"- items: {results['n_items']} in {results.get('n_groups')} scenes"
        f"{(', dropped ' + str(results['n_dropped'])) if results.get('n_dropped') else ''}; "
        f"judgment: {judge.get('method')} over Likert {results['scale']['min']}-{results['scale']['max']}, "
        f"templates {judge.get('templates')}, orders {judge.get('orders')}",
        "",
        "## Headline",
        "",
        f"- on-target gain G_T = {_f(results['gain']['value'])}{_ci(results['gain'].get('ci95'))}",
        f"- VAT signed = {_f(v.get('signed'))}{_ci(v.get('ci95_signed'))}, "
        f"absolute = {_f(v.get('absolute'))}{_ci(v.get('ci95_absolute'))}"
        + (f" ({v['reason']})" if v.get("reason") else ""),
        *_specificity_lines(results),
        f"- nVAT = {_f(results.get('nvat'))}{_ci(results.get('nvat_ci95'))}{_valid(results, 'nvat')} "
        f"(diagonal {results.get('nvat_diagonal')})"
        + (
            "; the point lies below its bootstrap interval (nVAT is inflated by resampling noise when coupling "
            "is weak: read it against the null)"
            if results.get("nvat_ci95")
            and results.get("nvat") is not None
            and results["nvat"] < results["nvat_ci95"][0]
            else ""
        )
        + (
            f"; no-coupling null: mean {_f(nn.get('null_mean'))}, 95th pct {_f(nn.get('null_q95'))}, "
            f"p = {nn.get('p_value'):.3f}"
            if nn.get("p_value") is not None
            else ""
        ),
        f"- circumplex (Mantel) test: statistic = {_f(ct.get('statistic'))}{_ci(ct.get('ci95'))}"
        f"{_valid(results, 'mantel')}, p = "
        f"{_f(ct.get('p_value'))[1:] if ct.get('p_value') is not None else 'n/a'} "
        f"({ct.get('method')} of R vs {ct.get('distance')}, alternative {ct.get('alternative')}, "
        f"{ct.get('n_perm')} permutations)",
        f"- hubs: by row strength {hubs.get('top_strength')}, by eigenvector centrality "
        f"{hubs.get('top_eigenvector')}" + _hub_stability_text(results.get("hub_stability")),
        *_coupling_interval_lines(results),
        f"- robustness: Spearman-Kendall agreement {_f(rob.get('spearman_kendall_agreement'))}, "
        f"nVAT Kendall {_f(rob.get('nvat_kendall'))}",
        "",
        "## Per value",
        "",
        "e = polarity x (score - midpoint), mean over the value's items; D = mean shift e_post - e_pre; "
        "GND = D / |G_T|. " + _boot_text(results.get("bootstrap") or {}) + " "
        "q: Benjamini-Hochberg over the 10 values (* = significant).",
        "",
        value_table(results),
        "",
        *strata_lines(results),
        "![radar](radar.png)",
        "",
        "![coupling](coupling.png)",
        "",
    ]
    path = out / "report.md"
    write_text_atomic(path, "\n".join(lines))
    return path


# ----------------------------------------------------------------- comparison
@dataclass
class Comparison:
    table: pd.DataFrame
    png: Path
    markdown: Path
    refusal_png: Path | None = None


def _shift_of(r: dict, v: str) -> float | None:
    """Mean shift of value ``v`` in a results dict: the gain for the target, else its drift."""
    if v == r["target"]:
        return r["gain"]["value"]
    return (r.get("drift") or {}).get(v, {}).get("value")


def _eval_rates(results: dict) -> dict[str, tuple[str, float, list | None, int]]:
    """dataset -> (kind, rate, ci95, n) of an ``aligntax eval`` results.json: the compliance rate on
    benign prompts, the refusal rate on harmful ones."""
    out = {}
    for name, parts in (results.get("datasets") or {}).items():
        for label, key in (("benign", "compliance_rate"), ("harmful", "refusal_rate")):
            if label in parts:
                out[f"{name} ({label})"] = (
                    key.replace("_rate", ""),
                    parts[label][key],
                    parts[label].get("ci95"),
                    parts[label].get("n"),
                )
    return out


def refusal_side(eval_dirs: Sequence[str | Path], baseline: str | Path, out: Path) -> tuple[list[str], Path]:
    """Markdown lines and a bar chart comparing ``aligntax eval`` runs with an unsteered baseline run:
    benign compliance (over-refusal side) and harmful refusal (safety side) per dataset, with 95% CIs
    and the change in percentage points. Only datasets present in every run are shown."""

    def load(d):
        f = Path(d) / "results.json"
        if not f.is_file():
            raise AligntaxError(f"{d} has no results.json (not a finished evaluation run)")
        r = json.loads(f.read_text())
        return {
            "run": Path(d).name,
            "system": (r.get("config") or {}).get("system"),
            "intervention": (r.get("config") or {}).get("intervention"),
            "rates": _eval_rates(r),
        }

    base = load(baseline)
    runs = [load(d) for d in eval_dirs]
    keys = [k for k in base["rates"] if all(k in r["rates"] for r in runs)]
    if not keys:
        raise AligntaxError("The evaluation runs share no dataset with the baseline")
    md = [
        "## Refusal side",
        "",
        "Benign rows: compliance rate (higher = less over-refusal). Harmful rows: refusal rate (higher = "
        "safer). Change in percentage points against the baseline run "
        f"`{base['run']}`; 95% intervals as reported by `aligntax eval`.",
        "",
        "| run | " + " | ".join(keys) + " |",
        "|---|" + "---|" * len(keys),
    ]

    def cell(rate, ci, ref=None):
        txt = f"{rate:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")
        return txt + (f" ({100 * (rate - ref):+.1f} pp)" if ref is not None else "")

    md.append(
        f"| {base['run']} (baseline) | "
        + " | ".join(cell(base["rates"][k][1], base["rates"][k][2]) for k in keys)
        + " |"
    )
    for r in runs:
        md.append(
            f"| {r['run']} | "
            + " | ".join(cell(r["rates"][k][1], r["rates"][k][2], base["rates"][k][1]) for k in keys)
            + " |"
        )
    md.append("")
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(keys) * (len(runs) + 1) / 2), 4.2))
    width = 0.8 / (len(runs) + 1)
    for j, r in enumerate([base, *runs]):
        xs = np.arange(len(keys)) + (j - len(runs) / 2) * width
        vals = [r["rates"][k][1] for k in keys]
        errs = np.array(
            [
                [v - (r["rates"][k][2] or [v, v])[0], (r["rates"][k][2] or [v, v])[1] - v]
                for k, v in zip(keys, vals, strict=True)
            ]
        ).T
        ax.bar(
            xs,
            vals,
            width,
            yerr=errs,
            capsize=2,
            label=r["run"] + (" (baseline)" if r is base else ""),
            color="grey" if r is base else plt.get_cmap("tab10")(j % 10),
        )
    ax.set_xticks(np.arange(len(keys)))
    ax.set_xticklabels([k.replace(" (", "\n(") for k in keys], fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("compliance (benign) / refusal (harmful)")
    ax.set_title("Refusal side of the interventions")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    png = out / "refusal_side.png"
    save_figure(fig, png, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return md + ["![refusal side](refusal_side.png)", ""], png


def compare(
    dirs: Sequence[str | Path],
    out_dir: str | Path | None = None,
    eval_dirs: Sequence[str | Path] = (),
    eval_baseline: str | Path | None = None,
) -> Comparison:
    """Gain versus tax across runs: a scatter of on-target gain vs absolute VAT (PNG), a Markdown table
    of headline numbers and one of every value's shift, written to ``out_dir`` (default: the parent of
    the first run folder). With ``eval_dirs`` and ``eval_baseline`` (``aligntax eval`` run folders), a
    refusal-side section (``refusal_side``) is added: the same report then holds the value tax and
    the over-refusal/safety tax of the interventions."""
    rows = []
    for d in dirs:
        f = Path(d) / "results.json"
        if not f.is_file():
            raise AligntaxError(f"{d} has no results.json (not a finished VAT run)")
        r = json.loads(f.read_text())
        rows.append(
            {
                "run": Path(d).name,
                "intervention": _intervention_label(r),
                "target": r["target"],
                "gain": r["gain"]["value"],
                "gain_ci95": r["gain"].get("ci95"),
                "specificity": (r.get("specificity") or {}).get("value"),
                "specificity_ci95": (r.get("specificity") or {}).get("ci95"),
                "vat_signed": r["vat"].get("signed"),
                "vat_absolute": r["vat"].get("absolute"),
                "vat_absolute_ci95": r["vat"].get("ci95_absolute"),
                "off_target_abs_sum": r["vat"].get("off_target_abs_sum"),
                "nvat": r.get("nvat"),
                "nvat_null_p": (r.get("nvat_null") or {}).get("p_value"),
                "circumplex_stat": (r.get("circumplex_test") or {}).get("statistic"),
                "circumplex_p": (r.get("circumplex_test") or {}).get("p_value"),
                "n_items": r.get("n_items"),
            }
        )
    if not rows:
        raise AligntaxError("compare needs at least one run folder")
    df = pd.DataFrame(rows)
    out = Path(out_dir) if out_dir else Path(dirs[0]).resolve().parent
    out.mkdir(parents=True, exist_ok=True)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.8))
    targets = sorted(df["target"].unique())
    colours = {t: plt.get_cmap("tab10")(i % 10) for i, t in enumerate(targets)}
    for _, row in df.iterrows():
        y = row["vat_absolute"]
        if y is None or (isinstance(y, float) and not math.isfinite(y)):
            continue
        ax.scatter(row["gain"], y, color=colours[row["target"]], s=50)
        ax.annotate(
            f"{row['intervention']}:{CODES.get(row['target'], row['target'])}",
            (row["gain"], y),
            fontsize=8,
            xytext=(4, 3),
            textcoords="offset points",
        )
    for t in targets:
        ax.scatter([], [], color=colours[t], label=t)
    ax.axvline(0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("on-target gain G_T (Likert points, polarity-signed)")
    ax.set_ylabel("absolute VAT = sum_j |D_j| / |G_T|")
    ax.set_title("Gain versus value alignment tax")
    ax.legend(fontsize=8)
    fig.tight_layout()
    png = out / "gain_vs_tax.png"
    save_figure(fig, png, dpi=120, bbox_inches="tight")
    plt.close(fig)
    md = [
        "| run | intervention | target | gain [95% CI] | S_T [95% CI] | VAT signed | VAT absolute [95% CI] | "
        "nVAT (null p) | circumplex stat (p) | n |",
        "|---|---|---|---|---|---:|---|---|---|---:|",
    ]
    for r in rows:
        md.append(
            f"| {r['run']} | {r['intervention']} | {r['target']} | {_f(r['gain'])}{_ci(r['gain_ci95'])} | "
            f"{_f(r['specificity'])}{_ci(r['specificity_ci95'])} | "
            f"{_f(r['vat_signed'])} | {_f(r['vat_absolute'])}{_ci(r['vat_absolute_ci95'])} | "
            f"{_f(r['nvat'])}"
            f"{_null_p(r['nvat_null_p'])} | "
            f"{_f(r['circumplex_stat'])} "
            f"({'n/a' if r['circumplex_p'] is None else format(r['circumplex_p'], '.3f')}) | "
            f"{r['n_items']} |"
        )
    md += [
        "",
        "## Shift of every value",
        "",
        "Mean polarity-signed shift per value (the target's is its gain, in bold); Likert points.",
        "",
        "| run | target | " + " | ".join(CODES[v] for v in VALUES) + " |",
        "|---|---|" + "---:|" * len(VALUES),
    ]
    for d in dirs:
        r = json.loads((Path(d) / "results.json").read_text())
        cells = []
        for v in VALUES:
            x = _shift_of(r, v)
            txt = "n/a" if x is None else f"{x:+.3f}"
            cells.append(f"**{txt}**" if v == r["target"] else txt)
        md.append(f"| {Path(d).name} | {CODES[r['target']]} | " + " | ".join(cells) + " |")
    md += ["", "![gain vs tax](gain_vs_tax.png)", ""]
    refusal_png = None
    if eval_dirs:
        if eval_baseline is None:
            raise AligntaxError("A refusal-side comparison needs the unsteered baseline evaluation run")
        lines, refusal_png = refusal_side(eval_dirs, eval_baseline, out)
        md += lines
    mdp = out / "compare.md"
    write_text_atomic(mdp, "# VAT comparison\n\n" + "\n".join(md))
    return Comparison(table=df, png=png, markdown=mdp, refusal_png=refusal_png)
