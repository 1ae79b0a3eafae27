"""``vat matrix``: the same intervention aimed at each of the ten values in turn.

Row T of the 10 x 10 shift matrix M holds the shift of every value j in the run aimed at T (the gain
on the diagonal). A global lift adds a constant to a row (row effect); a value that moves under every
intervention adds a constant to a column (column effect). Double centring removes both, so what is left
on the diagonal is the target-specific part. ``stats.analyse_matrix`` tests it: a permutation test of
the diagonal (target labels of the rows permuted) and a Mantel test of the off-diagonal entries against
distance on the Schwartz circle.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from aligntax.errors import AligntaxError
from aligntax.runfolder import run_lock, write_json_atomic, write_text_atomic
from aligntax.vat import stats as ST
from aligntax.vat.schwartz import CODES, VALUES, resolve_value


def matrix_from_runs(dirs: Sequence[str | Path]) -> dict[str, dict]:
    """Results of finished runs keyed by target; each target at most once."""
    out: dict[str, dict] = {}
    for d in dirs:
        f = Path(d) / "results.json"
        if not f.is_file():
            raise AligntaxError(f"{d} has no results.json (not a finished VAT run)")
        r = json.loads(f.read_text())
        if r["target"] in out:
            raise AligntaxError(f"Two runs aim at {r['target']}; the matrix needs one run per target")
        out[r["target"]] = r
    return out


def strata_matrices(results_by_target: dict[str, dict], n_perm: int = 9999, seed: int = 0) -> dict:
    """The shift matrix and its diagonal test within each desirability stratum that every run measured
    with every value (from ``results["strata"]``); strata lacking a cell are left out with the reason."""
    out = {}
    for k in ("congruent", "incongruent"):
        sub = {t: (r.get("strata") or {}).get(k) for t, r in results_by_target.items()}
        if not all(sub.values()):
            continue
        M = ST.shift_matrix({t: {**s, "target": t} for t, s in sub.items()})
        if not np.isfinite(M).all():
            out[k] = {"reason": "some value has no item of this stratum in some run"}
            continue
        out[k] = {
            "matrix": M.tolist(),
            "row_mean": M.mean(axis=1).tolist(),
            "grand_mean": float(M.mean()),
            "diagonal_test": ST.diagonal_permutation_test(M, n_perm, seed),
        }
    return out


def write_matrix(
    results_by_target: dict[str, dict], out_dir: str | Path, n_perm: int = 9999, seed: int = 0
) -> dict:
    """Analyse the ten runs and write ``matrix.json`` and ``matrix.md`` into ``out_dir``."""
    from aligntax.vat.runner import json_safe

    missing = [v for v in VALUES if v not in results_by_target]
    if missing:
        raise AligntaxError(f"The matrix needs a run for every target; missing: {', '.join(missing)}")
    M = ST.shift_matrix(results_by_target)
    try:
        res = ST.analyse_matrix(M, n_perm=n_perm, seed=seed)
    except ValueError as exc:
        raise AligntaxError(str(exc)) from None
    res["strata"] = strata_matrices(results_by_target, n_perm=n_perm, seed=seed)
    res["specificity"] = {t: (r.get("specificity") or {}).get("value") for t, r in results_by_target.items()}
    res["specificity_ci95"] = {
        t: (r.get("specificity") or {}).get("ci95") for t, r in results_by_target.items()
    }
    out = Path(out_dir)
    res = json_safe(res)
    with run_lock(out):
        write_json_atomic(out / "matrix.json", res)
        _write_matrix_md(res, out)
    return res


def _write_matrix_md(res: dict, out: Path) -> None:
    codes = [CODES[v] for v in VALUES]

    def table(rows, bold_diag=True):
        lines = ["| target \\ value | " + " | ".join(codes) + " |", "|---|" + "---:|" * len(codes)]
        for i, v in enumerate(VALUES):
            cells = [
                (f"**{x:+.3f}**" if (i == j and bold_diag) else f"{x:+.3f}") for j, x in enumerate(rows[i])
            ]
            lines.append(f"| {v} | " + " | ".join(cells) + " |")
        return lines

    dt, mt = res["diagonal_test"], res["mantel"]
    md = [
        "# VAT matrix: shift of every value (columns) under the intervention aimed at each target (rows)",
        "",
        "## Shift matrix M",
        "",
        *table(res["matrix"]),
        "",
        "## Double-centred (row and column effects removed)",
        "",
        *table(res["double_centred"]),
        "",
        f"- diagonal test: mean double-centred diagonal = {dt['statistic']:+.4f}, p = {dt['p_value']:.4f} "
        f"({dt['n_perm']} permutations of the row labels, one-sided)",
        f"- Mantel test against circular distance: statistic = "
        f"{'n/a' if mt['statistic'] is None else format(mt['statistic'], '+.3f')}, p = "
        f"{'n/a' if mt['p_value'] is None else format(mt['p_value'], '.4f')}"
        + (f" ({mt['reason']})" if mt.get("reason") else " (alternative: less)"),
        "- rank of the target's own shift in its row (1 = largest): "
        + ", ".join(f"{CODES[v]} {k}" for v, k in res["own_rank_in_row"].items()),
        "- specificity S_T per target: "
        + ", ".join(
            f"{CODES[v]} {'n/a' if res['specificity'].get(v) is None else format(res['specificity'][v], '+.3f')}"
            for v in VALUES
        ),
        "",
    ]
    for k, sm in (res.get("strata") or {}).items():
        if sm.get("diagonal_test"):
            d = sm["diagonal_test"]
            md += [
                f"## {k.capitalize()} items only",
                "",
                *table(sm["matrix"]),
                "",
                f"- grand mean {sm['grand_mean']:+.3f}; diagonal test: {d['statistic']:+.4f}, p = {d['p_value']:.4f}",
                "",
            ]
    write_text_atomic(out / "matrix.md", "\n".join(md))


def run_matrix(
    lm,
    items,
    make_intervention: Callable[[str], object],
    out_dir: str | Path,
    cfg=None,
    targets: Sequence[str] = VALUES,
    post_lm=None,
    n_perm: int = 9999,
) -> dict:
    """Run the intervention aimed at each target into ``out_dir/<code>/`` (each resumable), then write the
    matrix. ``make_intervention(target)`` builds the intervention for one target."""
    from aligntax.vat.runner import run_vat

    out = Path(out_dir)
    runs = {}
    with run_lock(out):  # the matrix folder's writer; each target's run folder has its own lock and header
        for t in targets:
            t = resolve_value(t)
            runs[t] = run_vat(
                lm, items, t, make_intervention(t), out / CODES[t].lower(), cfg, post_lm=post_lm
            )
    return write_matrix(runs, out, n_perm=n_perm, seed=(cfg.seed if cfg else 0))
