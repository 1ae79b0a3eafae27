"""Scene-level statistics of a VAT run: specificity, a scene bootstrap, scene-level tests, ratio
intervals that respect the sign of the statistic, the adjacent-versus-opposite test, and the analysis
of a 10 x 10 target-by-value shift matrix.

Items of one scene share a context (and, in the built-in set, a minimal pair), so they are not
independent. Everything here therefore resamples or permutes **scenes** (``item.group``), never items.

Notation: d_i is the polarity-signed shift of item i, D_j the mean shift of value j's items, G_T the
target's. Specificity

    S_T = G_T - mean_{j != T} D_j

is 0 when the intervention lifts every value alike (a global shift) and G_T when it moves only the
target. ``scene_bootstrap`` draws scenes with replacement (the full number, a cluster bootstrap) and
reports percentile intervals: the interval of a non-negative statistic (absolute VAT) never goes below
0, and the interval of a ratio is withheld when the gain's own interval covers 0.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np

from aligntax.vat.schwartz import VALUES, distance_matrix, neighbours, opposites, resolve_value

COVER_TOL = 1e-12


def _nanmean(a: np.ndarray, axis: int) -> np.ndarray:
    """np.nanmean without the warning for an all-NaN slice (which gives NaN)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(a, axis=axis)


def covers_zero(ci: Sequence[float] | None) -> bool | None:
    if not ci:
        return None
    return bool(ci[0] - COVER_TOL <= 0.0 <= ci[1] + COVER_TOL)


def scene_sums(d, values, groups, order: Sequence[str] = VALUES):
    """Per-scene sums and counts of the shifts of each value: (scene names, S [G, V], N [G, V])."""
    d, values, groups = np.asarray(d, dtype=float), np.asarray(values), np.asarray(groups)
    ok = np.isfinite(d)
    d, values, groups = d[ok], values[ok], groups[ok]
    scenes, gi = np.unique(groups, return_inverse=True)
    vi = np.array([list(order).index(v) for v in values], dtype=int)
    S = np.zeros((len(scenes), len(order)))
    N = np.zeros((len(scenes), len(order)))
    np.add.at(S, (gi, vi), d)
    np.add.at(N, (gi, vi), 1.0)
    return scenes, S, N


def _stats_from_means(means: np.ndarray, ti: int) -> dict[str, np.ndarray]:
    """Statistics from value means [..., V] (NaN where a value has no item)."""
    g = means[..., ti]
    off = np.delete(means, ti, axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        off_mean = _nanmean(off, axis=-1) if off.size else np.full(g.shape, np.nan)
        absg = np.abs(g)
        return {
            "gain": g,
            "off_mean": off_mean,
            "specificity": g - off_mean,
            "off_sum": np.nansum(off, axis=-1),
            "off_abs_sum": np.nansum(np.abs(off), axis=-1),
            "vat_signed": np.nansum(off, axis=-1) / absg,
            "vat_absolute": np.nansum(np.abs(off), axis=-1) / absg,
        }


def _means(S: np.ndarray, N: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(N > 0, S / np.where(N > 0, N, 1.0), np.nan)


def _pct(x: np.ndarray, level: float) -> list[float] | None:
    x = np.asarray(x, dtype=float)
    x = x[np.isfinite(x)]
    if not x.size:
        return None
    lo, hi = (1 - level) / 2 * 100, (1 + level) / 2 * 100
    return [float(np.percentile(x, lo)), float(np.percentile(x, hi))]


def scene_bootstrap(
    d,
    values,
    groups,
    target: str,
    reps: int = 2000,
    seed: int = 0,
    level: float = 0.95,
    order: Sequence[str] = VALUES,
) -> dict:
    """Cluster bootstrap over scenes: each replicate draws n of the n scenes with replacement and
    recomputes every statistic from their items. Percentile intervals for the gain, each drift, the
    mean off-target drift, S_T, the raw off-target sums, GND_j and both VAT ratios. A replicate whose
    target has no item is dropped."""
    t = resolve_value(target)
    ti = list(order).index(t)
    scenes, S, N = scene_sums(d, values, groups, order)
    n = len(scenes)
    out = {
        "method": "scene bootstrap (n of n scenes with replacement), percentile intervals",
        "reps": int(reps),
        "n_groups": int(n),
        "level": level,
    }
    if n < 2 or reps <= 0:
        return {**out, "intervals": None}
    rng = np.random.default_rng(seed)
    W = rng.multinomial(n, np.full(n, 1.0 / n), size=reps).astype(float)  # [reps, G] scene weights
    means = _means(W @ S, W @ N)
    st = _stats_from_means(means, ti)
    keep = np.isfinite(st["gain"])
    iv = {k: _pct(v[keep], level) for k, v in st.items()}
    iv["drift"] = {v: _pct(means[keep, j], level) for j, v in enumerate(order) if j != ti}
    with np.errstate(invalid="ignore", divide="ignore"):
        absg = np.abs(means[keep, ti])
        iv["gnd"] = {v: _pct(means[keep, j] / absg, level) for j, v in enumerate(order) if j != ti}
    out["reps_used"] = int(keep.sum())
    return {**out, "intervals": iv}


def shift_intervals(
    d,
    values,
    groups,
    reps: int = 2000,
    seed: int = 0,
    level: float = 0.95,
    order: Sequence[str] = VALUES,
) -> dict[str, list[float] | None]:
    """Per value, the percentile interval of its mean shift D_j from the cluster bootstrap over scenes of
    :func:`scene_bootstrap` (the same draws for the same ``seed`` and ``reps``, so a value's interval is
    the one :func:`scene_bootstrap` gives its drift), with no value singled out as a target: every
    value gets one. None where there are fewer than 2 scenes or the value has no item."""
    scenes, S, N = scene_sums(d, values, groups, order)
    n = len(scenes)
    if n < 2 or reps <= 0:
        return {v: None for v in order}
    rng = np.random.default_rng(seed)
    W = rng.multinomial(n, np.full(n, 1.0 / n), size=reps).astype(float)
    means = _means(W @ S, W @ N)
    return {v: _pct(means[:, j], level) for j, v in enumerate(order)}


def _sign_flip(x: np.ndarray, n_perm: int, seed: int) -> float | None:
    from aligntax.vat.metrics import sign_flip_p

    x = np.asarray(x, dtype=float)
    x = x[np.isfinite(x)]
    if not x.size:
        return None
    p = sign_flip_p(x, n_perm=n_perm, seed=seed)
    return None if math.isnan(p) else float(p)


def scene_means(d, values, groups, order: Sequence[str] = VALUES) -> np.ndarray:
    """Per-scene mean shift of each value [G, V] (NaN where a scene lacks a value)."""
    _, S, N = scene_sums(d, values, groups, order)
    return _means(S, N)


def scene_level_tests(
    d, values, groups, order: Sequence[str] = VALUES, alpha: float = 0.05, n_perm: int = 9999, seed: int = 0
) -> dict[str, dict]:
    """Per value: a sign-flip test of mean shift = 0 whose unit is the scene (the per-scene mean shift
    of that value), Benjamini-Hochberg over the values tested."""
    from aligntax.vat.metrics import benjamini_hochberg

    X = scene_means(d, values, groups, order)
    ps = [_sign_flip(X[:, j], n_perm, seed) for j in range(len(order))]
    qs, rej = benjamini_hochberg(ps, alpha)
    return {
        v: {
            "p_value": p,
            "q_value": q,
            "significant": r,
            "n_scenes": int(np.isfinite(X[:, j]).sum()),
            "n": int((np.asarray(values) == v).sum()),
        }
        for j, (v, p, q, r) in enumerate(zip(order, ps, qs, rej, strict=True))
    }


def specificity(
    d,
    values,
    groups,
    target: str,
    reps: int = 2000,
    seed: int = 0,
    level: float = 0.95,
    n_perm: int = 9999,
    boot: dict | None = None,
    order: Sequence[str] = VALUES,
) -> dict:
    """S_T = G_T - mean off-target drift, its scene-bootstrap interval, and a scene-level sign-flip
    test of S_T = 0 (per scene: the target's mean shift minus the mean of the other values' mean shifts).
    ``interpretation`` says whether the change is targeted or a global shift."""
    t = resolve_value(target)
    ti = list(order).index(t)
    d, values = np.asarray(d, dtype=float), np.asarray(values)
    means = np.array([np.nanmean(d[values == v]) if (values == v).any() else np.nan for v in order])
    st = _stats_from_means(means, ti)
    boot = boot or scene_bootstrap(d, values, groups, t, reps, seed, level, order)
    ci = (boot.get("intervals") or {}).get("specificity")
    X = scene_means(d, values, groups, order)
    with np.errstate(invalid="ignore"):
        per_scene = X[:, ti] - _nanmean(np.delete(X, ti, axis=1), axis=1)
    p = _sign_flip(per_scene, n_perm, seed)
    value = float(st["specificity"])
    cov = covers_zero(ci)
    if ci is None:
        text = "no interval (too few scenes)"
    elif cov:
        text = (
            f"S_T's {level:.0%} interval covers 0: the target moved no more than the mean of the other "
            "values; the change is not distinguishable from a global shift of every value"
        )
    elif ci[0] > 0:
        text = (
            f"S_T's {level:.0%} interval is above 0: the target moved more than the other values (targeted)"
        )
    else:
        text = f"S_T's {level:.0%} interval is below 0: the other values moved more than the target"
    n_sc = int(np.isfinite(per_scene).sum())
    if ci is not None and n_sc < 10:
        text += f" (only {n_sc} scenes: a bootstrap over so few is rough)"
    return {
        "value": value,
        "ci95": ci,
        "covers_zero": cov,
        "gain": float(st["gain"]),
        "mean_off_target_drift": float(st["off_mean"]),
        "p_value_scene": p,
        "n_scenes": int(np.isfinite(per_scene).sum()),
        "interpretation": text,
    }


def adjacent_vs_opposite(
    d,
    values,
    groups,
    target: str,
    reps: int = 2000,
    seed: int = 0,
    level: float = 0.95,
    n_perm: int = 9999,
    order: Sequence[str] = VALUES,
) -> dict:
    """The circumplex prediction for a targeted change: the target's neighbours on the circle move with
    it more than its opposites do. Statistic: mean drift of T's neighbours minus mean drift of T's
    opposites (each a mean of value means), with a scene-bootstrap percentile interval and a
    scene-level sign-flip test (per scene: neighbours' mean shift minus opposites' mean shift)."""
    t = resolve_value(target)
    adj = [list(order).index(v) for v in neighbours(t) if v != t]
    opp = [list(order).index(v) for v in opposites(t)]
    out = {"target": t, "neighbours": [order[j] for j in adj], "opposites": [order[j] for j in opp]}
    if not adj or not opp:
        return {**out, "value": None, "reason": "the target has no neighbours or no opposites"}
    scenes, S, N = scene_sums(d, values, groups, order)
    full = _means(S.sum(0, keepdims=True), N.sum(0, keepdims=True))[0]
    with np.errstate(invalid="ignore"):
        value = float(_nanmean(full[adj], 0) - _nanmean(full[opp], 0))
        X = _means(S, N)
        per_scene = _nanmean(X[:, adj], axis=1) - _nanmean(X[:, opp], axis=1)
    ci = None
    if len(scenes) >= 2 and reps > 0:
        rng = np.random.default_rng(seed)
        W = rng.multinomial(len(scenes), np.full(len(scenes), 1.0 / len(scenes)), size=reps).astype(float)
        with np.errstate(invalid="ignore", divide="ignore"):
            M = _means(W @ S, W @ N)
            ci = _pct(_nanmean(M[:, adj], axis=1) - _nanmean(M[:, opp], axis=1), level)
    return {
        **out,
        "value": value,
        "ci95": ci,
        "covers_zero": covers_zero(ci),
        "p_value_scene": _sign_flip(per_scene, n_perm, seed),
        "n_scenes": int(np.isfinite(per_scene).sum()),
        "prediction": "positive: neighbours move with the target more than opposites do",
    }


def withheld_reason(gain_ci: Sequence[float] | None, level: float = 0.95) -> str | None:
    """Why GND and VAT are withheld: the gain's interval covers 0 (the denominator may be 0)."""
    if gain_ci and covers_zero(gain_ci):
        return (
            f"withheld: the gain's {level:.0%} interval [{gain_ci[0]:+.4f}, {gain_ci[1]:+.4f}] covers 0, "
            "so the ratio's denominator is not distinguishable from 0"
        )
    return None


# ----------------------------------------------------------------- lift adjustment against a control run
def control_adjusted(
    rows: Sequence[dict],
    control_rows: Sequence[dict],
    target: str,
    midpoint: float = 0.0,
    reps: int = 2000,
    seed: int = 0,
    level: float = 0.95,
    order: Sequence[str] = VALUES,
) -> dict:
    """Lift-adjusted shifts: for each item judged in both runs, d_i(run) - d_i(control), where the
    control run applied a comparison intervention (e.g. examples of no particular value) to the same
    items. The adjusted drifts remove the general lift the control also produces; intervals from the
    scene bootstrap of the paired differences."""
    t = resolve_value(target)
    ctrl = {r["id"]: r for r in control_rows if r.get("pre") is not None and r.get("post") is not None}
    ids, vals, grp, dd = [], [], [], []
    for r in rows:
        c = ctrl.get(r["id"])
        if c is None or r.get("pre") is None or r.get("post") is None or int(r["polarity"]) == 0:
            continue
        p = float(r["polarity"])
        d_run = p * (float(r["post"]) - float(r["pre"]))
        d_ctl = float(c["polarity"]) * (float(c["post"]) - float(c["pre"]))
        if not (math.isfinite(d_run) and math.isfinite(d_ctl)):
            continue
        ids.append(r["id"])
        vals.append(resolve_value(r["value"]))
        grp.append(str(r.get("group") or r["id"]))
        dd.append(d_run - d_ctl)
    if not ids:
        return {"n_paired": 0, "reason": "no item is shared with the control run"}
    d, values = np.array(dd), np.array(vals)
    boot = scene_bootstrap(d, values, grp, t, reps, seed, level, order)
    iv = boot.get("intervals") or {}
    means = {v: float(np.mean(d[values == v])) if (values == v).any() else None for v in order}
    spec = specificity(d, values, grp, t, reps, seed, level, boot=boot, order=order)
    return {
        "n_paired": len(ids),
        "definition": "d_i(run) - d_i(control), items judged in both runs",
        "gain": {"value": means[t], "ci95": iv.get("gain")},
        "drift": {v: {"value": means[v], "ci95": (iv.get("drift") or {}).get(v)} for v in order if v != t},
        "specificity": spec,
    }


# ----------------------------------------------------------------- desirability strata
def stratum_summary(
    d,
    values,
    groups,
    target: str,
    reps: int = 500,
    seed: int = 0,
    level: float = 0.95,
    order: Sequence[str] = VALUES,
) -> dict:
    """Gain, drifts, mean off-target drift and S_T of one desirability stratum's items, with
    scene-bootstrap intervals (the stratum's own scenes). Values without items in the stratum are None."""
    t = resolve_value(target)
    d, values = np.asarray(d, dtype=float), np.asarray(values)
    n = {v: int((values == v).sum()) for v in order}
    mean = {v: (float(d[values == v].mean()) if n[v] else None) for v in order}
    iv = {}
    if reps > 0 and n[t]:
        iv = scene_bootstrap(d, values, groups, t, reps, seed, level, order).get("intervals") or {}
    off = [mean[v] for v in order if v != t and mean[v] is not None]
    off_mean = float(np.mean(off)) if off else None
    spec = None if mean[t] is None or off_mean is None else mean[t] - off_mean
    present = [mean[v] for v in order if mean[v] is not None]
    return {
        "n_items": int(len(d)),
        "n_scenes": int(len(set(np.asarray(groups).tolist()))),
        "gain": {"value": mean[t], "ci95": iv.get("gain"), "n": n[t]},
        "drift": {
            v: {"value": mean[v], "ci95": (iv.get("drift") or {}).get(v), "n": n[v]} for v in order if v != t
        },
        "mean_off_target_drift": off_mean,
        "specificity": {
            "value": spec,
            "ci95": iv.get("specificity"),
            "covers_zero": covers_zero(iv.get("specificity")),
        },
        "all_values_mean": float(np.mean(present)) if present else None,
    }


def neutral_lift(
    raw, values, groups, reps: int = 500, seed: int = 0, level: float = 0.95, order: Sequence[str] = VALUES
) -> dict:
    """Neutral items have no polarity, so their shift is the raw score change post - pre: the general
    rise (or fall) in acceptability the intervention gives actions that bear on no value. Per value and
    pooled (mean of the value means), with a scene-bootstrap interval of the pooled mean and a
    scene-level sign-flip test."""
    raw, values = np.asarray(raw, dtype=float), np.asarray(values)
    scenes, S, N = scene_sums(raw, values, groups, order)
    per_value = {v: (float(raw[values == v].mean()) if (values == v).any() else None) for v in order}
    present = [x for x in per_value.values() if x is not None]
    pooled = float(np.mean(present)) if present else None
    ci = None
    if len(scenes) >= 2 and reps > 0:
        rng = np.random.default_rng(seed)
        W = rng.multinomial(len(scenes), np.full(len(scenes), 1.0 / len(scenes)), size=reps).astype(float)
        ci = _pct(_nanmean(_means(W @ S, W @ N), axis=1), level)
    per_scene = _nanmean(_means(S, N), axis=1)
    return {
        "n_items": int(len(raw)),
        "n_scenes": int(len(scenes)),
        "definition": "raw score change post - pre (Likert points) of actions that neither support nor "
        "violate their value",
        "lift": {
            "value": pooled,
            "ci95": ci,
            "covers_zero": covers_zero(ci),
            "p_value_scene": _sign_flip(per_scene, 9999, seed),
        },
        "per_value": per_value,
    }


# ----------------------------------------------------------------- the ten-target matrix
def double_centre(M: np.ndarray) -> np.ndarray:
    """M - row means - column means + grand mean."""
    M = np.asarray(M, dtype=float)
    return M - M.mean(axis=1, keepdims=True) - M.mean(axis=0, keepdims=True) + M.mean()


def diagonal_permutation_test(M: np.ndarray, n_perm: int = 9999, seed: int = 0) -> dict:
    """Is the double-centred shift matrix largest on its diagonal (each target moves its own value more
    than the row and column effects predict)? Statistic: mean diagonal of the double-centred matrix.
    Null: the target labels of the rows are permuted (double centring commutes with that), so the
    statistic becomes mean_i C[pi(i), i]. One-sided, p = (1 + #{null >= observed}) / (1 + n_perm)."""
    C = double_centre(M)
    k = C.shape[0]
    obs = float(np.trace(C) / k)
    rng = np.random.default_rng(seed)
    cols = np.arange(k)
    null = np.array([C[rng.permutation(k), cols].mean() for _ in range(n_perm)])
    return {
        "statistic": obs,
        "p_value": float((1 + (null >= obs - 1e-12).sum()) / (1 + n_perm)),
        "n_perm": n_perm,
        "null_mean": float(null.mean()),
        "null": "target labels of the rows permuted",
        "alternative": "greater",
    }


def matrix_mantel(
    M: np.ndarray, D: np.ndarray | None = None, n_perm: int = 9999, seed: int = 0, alternative: str = "less"
) -> dict:
    """Mantel test of the double-centred shift matrix against distance on the Schwartz circle: Spearman
    correlation of the off-diagonal entries C[T, j] with D[T, j]; the null permutes the value labels
    (rows and columns together). The circumplex predicts a negative statistic (a target's neighbours
    gain more than its opposites), hence ``alternative="less"``."""
    from aligntax.vat.metrics import spearman

    C = double_centre(M)
    D = distance_matrix() if D is None else np.asarray(D, dtype=float)
    k = C.shape[0]
    off = ~np.eye(k, dtype=bool)

    def stat(Cm):
        x = Cm[off]
        if np.std(x) < 1e-12:
            return math.nan
        return spearman(x, D[off])

    obs = stat(C)
    out = {
        "statistic": None if math.isnan(obs) else float(obs),
        "p_value": None,
        "n_perm": n_perm,
        "alternative": alternative,
        "distance": "circular (wedge convention)",
        "entries": "off-diagonal entries of the double-centred matrix",
    }
    if math.isnan(obs):
        return {**out, "reason": "the off-diagonal entries are constant"}
    rng = np.random.default_rng(seed)
    null = []
    for _ in range(n_perm):
        p = rng.permutation(k)
        null.append(stat(C[np.ix_(p, p)]))
    null = np.array(null)
    null = null[np.isfinite(null)]
    if alternative == "less":
        ext = (null <= obs + 1e-12).sum()
    elif alternative == "greater":
        ext = (null >= obs - 1e-12).sum()
    else:
        ext = (np.abs(null) >= abs(obs) - 1e-12).sum()
    return {**out, "p_value": float((1 + ext) / (1 + len(null)))}


def shift_matrix(results_by_target: dict[str, dict], order: Sequence[str] = VALUES) -> np.ndarray:
    """The 10 x 10 matrix M[T, j] = shift of value j in the run aimed at T (gain on the diagonal), from
    results dicts keyed by target. Rows missing a target are NaN."""
    M = np.full((len(order), len(order)), np.nan)
    for t, r in results_by_target.items():
        i = list(order).index(resolve_value(t))
        for j, v in enumerate(order):
            x = r["gain"]["value"] if v == r["target"] else (r.get("drift") or {}).get(v, {}).get("value")
            M[i, j] = np.nan if x is None else float(x)
    return M


def analyse_matrix(M: np.ndarray, n_perm: int = 9999, seed: int = 0, order: Sequence[str] = VALUES) -> dict:
    """Double-centred matrix, the diagonal permutation test and the Mantel test (all ten rows needed)."""
    M = np.asarray(M, dtype=float)
    if not np.isfinite(M).all():
        raise ValueError("the shift matrix needs all ten targets and every value (no missing entries)")
    C = double_centre(M)
    diag = np.diag(M)
    rank_of_own = [int((M[i] > M[i, i] + 1e-15).sum()) + 1 for i in range(len(order))]
    return {
        "values": list(order),
        "matrix": M.tolist(),
        "double_centred": C.tolist(),
        "row_mean": M.mean(axis=1).tolist(),
        "grand_mean": float(M.mean()),
        "own_shift": diag.tolist(),
        "own_rank_in_row": dict(zip(order, rank_of_own, strict=True)),
        "diagonal_test": diagonal_permutation_test(M, n_perm, seed),
        "mantel": matrix_mantel(M, n_perm=n_perm, seed=seed),
    }


# ----------------------------------------------------------------- coupling, nVAT and Mantel intervals
def _fast_coupling(X: np.ndarray, method: str, min_groups: int) -> np.ndarray | None:
    """``coupling_matrix`` of a scene-shift array without missing cells, all pairs at once (Spearman or
    Pearson); None when the array has a missing cell or the method is another (use the slow path)."""
    import pandas as pd

    if method not in ("spearman", "pearson") or not np.isfinite(X).all():
        return None
    n, k = X.shape
    R = np.full((k, k), np.nan)
    if n < max(min_groups, 3):
        return R
    Z = pd.DataFrame(X).rank(method="average").to_numpy(dtype=float) if method == "spearman" else X.copy()
    Z = Z - Z.mean(axis=0)
    ss = (Z * Z).sum(axis=0)
    den = np.sqrt(np.outer(ss, ss))
    with np.errstate(invalid="ignore", divide="ignore"):
        C = np.where(den > 1e-15, (Z.T @ Z) / np.where(den > 1e-15, den, 1.0), np.nan)
    off = ~np.eye(k, dtype=bool)
    R[off] = C[off]
    R[np.diag_indices(k)] = np.where(X.std(axis=0) > 1e-12, 1.0, np.nan)
    return R


def coupling_bootstrap(
    table,
    reps: int = 2000,
    seed: int = 0,
    level: float = 0.95,
    method: str = "spearman",
    min_groups: int = 4,
    include_diagonal: bool = False,
    D: np.ndarray | None = None,
    order: Sequence[str] = VALUES,
) -> dict:
    """Scene bootstrap of the coupling statistics. Each replicate draws n of the n scenes (rows of the
    scene-shift table) with replacement, recomputes the coupling matrix R from them and from it nVAT, the
    row strengths s_j = sum_{k != j} |R_jk| (the hub statistic) and the Mantel statistic against D
    (default: circular distance, wedge convention). Percentile intervals; a replicate in which a
    statistic is undefined (an R entry NaN, no finite off-diagonal entry for nVAT and the strengths, too
    few finite entries or a constant side for the Mantel statistic) is skipped for that statistic, and
    the number of valid replicates is reported with each interval."""
    import pandas as pd

    from aligntax.vat.metrics import coupling_matrix, mantel_statistic, nvat

    D = distance_matrix() if D is None else np.asarray(D, dtype=float)
    cols = list(table.columns)
    X = table.to_numpy(dtype=float)
    n, k = X.shape
    out = {
        "method": "scene bootstrap (n of n scenes with replacement), percentile intervals",
        "reps": int(reps),
        "n_groups": int(n),
        "level": level,
        "seed": int(seed),
        "coupling_method": method,
        "min_groups": int(min_groups),
    }
    if n < 2 or reps <= 0:
        return {**out, "nvat": None, "mantel": None, "coupling": None, "strength": None}
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(reps, n))
    off = ~np.eye(k, dtype=bool)
    Rs = np.empty((reps, k, k))
    nv = np.full(reps, np.nan)
    mt = np.full(reps, np.nan)
    st = np.full((reps, k), np.nan)
    for b in range(reps):
        Xb = X[idx[b]]
        Rb = _fast_coupling(Xb, method, min_groups)
        if Rb is None:
            Rb = coupling_matrix(pd.DataFrame(Xb, columns=cols), method, min_groups)
        Rs[b] = Rb
        if np.isfinite(Rb[off]).any():
            nv[b] = nvat(Rb, include_diagonal)
            A = np.abs(np.nan_to_num(Rb, nan=0.0))
            np.fill_diagonal(A, 0.0)
            st[b] = A.sum(axis=1)
        mt[b] = mantel_statistic(Rb, D, method)

    def block(x: np.ndarray) -> dict:
        return {"ci95": _pct(x, level), "n_valid": int(np.isfinite(x).sum())}

    lower = np.full((k, k), np.nan)
    upper = np.full((k, k), np.nan)
    valid = np.isfinite(Rs).sum(axis=0)
    for a in range(k):
        for c in range(k):
            ci = _pct(Rs[:, a, c], level)
            if ci is not None:
                lower[a, c], upper[a, c] = ci
    labels = list(order) if len(order) == k else [str(c) for c in cols]
    return {
        **out,
        "nvat": block(nv),
        "mantel": block(mt),
        "coupling": {"lower": lower, "upper": upper, "n_valid": valid.astype(int)},
        "strength": {v: block(st[:, j]) for j, v in enumerate(labels)},
    }
