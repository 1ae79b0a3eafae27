"""Value Alignment Tax metrics: pure functions over per-item judgments (numpy / pandas only).

Notation (per item i, Likert scores L_pre, L_post, polarity p_i in {+1, -1}, scale midpoint m):
    expression  e_i = p_i * (L_i - m)
    shift       d_i = e_i(post) - e_i(pre) = p_i * (L_post - L_pre)
    gain        G_T = mean d_i over items of the target value T
    drift       D_j = mean d_i over items of value j
    GND_j       = D_j / |G_T|  (undefined, reported as None with a reason, when |G_T| < eps)
    VAT         signed = sum_{j != T} D_j / |G_T|, absolute = sum_{j != T} |D_j| / |G_T|
    coupling R  Spearman correlation, across scenes (context groups), of the per-scene mean shifts of
                values j and k (10 x 10, circle order). Its diagonal is 1 by construction (a value's
                correlation with itself); entries with too few scenes or a constant column are NaN.
    nVAT        ||R||_F / sqrt(|V|) over the OFF-DIAGONAL entries only (diagonal excluded; NaN -> 0);
                ``include_diagonal=True`` gives the other reading of the paper.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from aligntax.vat.schwartz import VALUES, distance_matrix, resolve_value

DEFAULT_EPS = 1e-3


# ----------------------------------------------------------------- basic quantities
def expression(scores, polarity, midpoint: float) -> np.ndarray:
    return np.asarray(polarity, dtype=float) * (np.asarray(scores, dtype=float) - midpoint)


def shifts(pre, post, polarity, midpoint: float = 0.0) -> np.ndarray:
    """d_i = e_post - e_pre (the midpoint cancels)."""
    return expression(post, polarity, midpoint) - expression(pre, polarity, midpoint)


def _mean(x: np.ndarray) -> float:
    x = x[~np.isnan(x)]
    return float(x.mean()) if x.size else math.nan


def gain(d, values, target: str) -> float:
    """G_T: mean shift over the target's items (NaN when it has none)."""
    d, values = np.asarray(d, dtype=float), np.asarray(values)
    return _mean(d[values == resolve_value(target)])


def drifts(d, values, order: Sequence[str] = VALUES) -> dict[str, float]:
    """D_j for every value j in ``order`` (NaN for a value without items)."""
    d, values = np.asarray(d, dtype=float), np.asarray(values)
    return {v: _mean(d[values == v]) for v in order}


def gnd(drift: dict[str, float], g: float, target: str, eps: float = DEFAULT_EPS) -> dict[str, dict]:
    """GND_j = D_j / |G_T| for j != T, each as {"value": float | None, "reason": str | None}."""
    target = resolve_value(target)
    out = {}
    for v, dj in drift.items():
        if v == target:
            continue
        if g is None or math.isnan(g):
            out[v] = {"value": None, "reason": "gain undefined (no target items)"}
        elif abs(g) < eps:
            out[v] = {"value": None, "reason": f"|gain| = {abs(g):.2g} < eps = {eps:g}"}
        elif dj is None or math.isnan(dj):
            out[v] = {"value": None, "reason": "no items of this value"}
        else:
            out[v] = {"value": float(dj / abs(g)), "reason": None}
    return out


def vat(drift: dict[str, float], g: float, target: str, eps: float = DEFAULT_EPS) -> dict:
    """{"signed": sum_j D_j/|G_T|, "absolute": sum_j |D_j|/|G_T|, "reason": None or why undefined},
    summed over the off-target values that have items."""
    target = resolve_value(target)
    off = [dj for v, dj in drift.items() if v != target and dj is not None and not math.isnan(dj)]
    base = {
        "off_target_sum": float(np.sum(off)) if off else None,
        "off_target_abs_sum": float(np.sum(np.abs(off))) if off else None,
    }
    if g is None or math.isnan(g):
        return {"signed": None, "absolute": None, "reason": "gain undefined (no target items)", **base}
    if abs(g) < eps:
        return {"signed": None, "absolute": None, "reason": f"|gain| = {abs(g):.2g} < eps = {eps:g}", **base}
    return {
        "signed": float(np.sum(off) / abs(g)),
        "absolute": float(np.sum(np.abs(off)) / abs(g)),
        "reason": None,
        **base,
    }


# ----------------------------------------------------------------- correlation helpers
def _rank(x: np.ndarray) -> np.ndarray:
    return pd.Series(x).rank(method="average").to_numpy(dtype=float)


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    x, y = x - x.mean(), y - y.mean()
    den = math.sqrt(float((x * x).sum() * (y * y).sum()))
    return float((x * y).sum() / den) if den > 1e-15 else math.nan


def spearman(x, y) -> float:
    """Spearman rank correlation (average ranks for ties) over pairs where both are finite."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.sum() < 3:
        return math.nan
    return _pearson(_rank(x[ok]), _rank(y[ok]))


def kendall(x, y) -> float:
    """Kendall's tau-b over pairs where both are finite."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    n = len(x)
    if n < 3:
        return math.nan
    iu = np.triu_indices(n, 1)
    dx = np.sign(x[:, None] - x[None, :])[iu]
    dy = np.sign(y[:, None] - y[None, :])[iu]
    s = float((dx * dy).sum())
    n0 = len(dx)
    den = math.sqrt((n0 - float((dx == 0).sum())) * (n0 - float((dy == 0).sum())))
    return s / den if den > 0 else math.nan


def _corr(x, y, method: str) -> float:
    if method == "spearman":
        return spearman(x, y)
    if method == "kendall":
        return kendall(x, y)
    if method == "pearson":
        x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
        ok = np.isfinite(x) & np.isfinite(y)
        return _pearson(x[ok], y[ok]) if ok.sum() >= 3 else math.nan
    raise ValueError(f"Unknown correlation method '{method}'")


# ----------------------------------------------------------------- coupling
def scene_shift_table(d, values, groups, order: Sequence[str] = VALUES) -> pd.DataFrame:
    """Per-scene mean shift of each value: a (scenes x values) table in ``order`` (NaN where a scene
    has no item of a value)."""
    df = pd.DataFrame({"d": np.asarray(d, dtype=float), "value": list(values), "group": list(groups)})
    table = df.pivot_table(index="group", columns="value", values="d", aggfunc="mean")
    return table.reindex(columns=list(order))


def coupling_matrix(table: pd.DataFrame, method: str = "spearman", min_groups: int = 4) -> np.ndarray:
    """R[j, k] = correlation across scenes of the columns j and k of a scene-shift table. The diagonal
    is 1 for every value with a non-constant column (NaN otherwise); pairs with fewer than
    ``min_groups`` shared scenes or a constant column are NaN."""
    cols = list(table.columns)
    X = table.to_numpy(dtype=float)
    k = len(cols)
    R = np.full((k, k), np.nan)
    for a in range(k):
        xa = X[:, a]
        fa = np.isfinite(xa)
        if fa.sum() >= min_groups and np.nanstd(xa) > 1e-12:
            R[a, a] = 1.0
        for b in range(a + 1, k):
            xb = X[:, b]
            ok = fa & np.isfinite(xb)
            if ok.sum() < min_groups:
                continue
            r = _corr(xa[ok], xb[ok], method)
            R[a, b] = R[b, a] = r
    return R


def offdiag(R: np.ndarray) -> np.ndarray:
    R = np.asarray(R, dtype=float)
    return R[~np.eye(R.shape[0], dtype=bool)]


def nvat(R: np.ndarray, include_diagonal: bool = False) -> float:
    """||R||_F / sqrt(|V|); NaN entries count as 0; diagonal excluded unless ``include_diagonal``."""
    R = np.nan_to_num(np.asarray(R, dtype=float), nan=0.0)
    if not include_diagonal:
        R = R - np.diag(np.diag(R))
    return float(np.sqrt((R**2).sum()) / math.sqrt(R.shape[0]))


def nvat_null(
    table: pd.DataFrame,
    reps: int = 200,
    seed: int = 0,
    method: str = "spearman",
    min_groups: int = 4,
    include_diagonal: bool = False,
) -> dict:
    """The nVAT expected with no coupling at all: each value's column of the scene-shift table is
    permuted independently across scenes (NaN cells stay in place) and nVAT recomputed. With few
    scenes, sampling noise alone gives a large nVAT (about sqrt(9 / (n_scenes - 1)) for 10 values), so
    compare the observed nVAT with this null: returns the observed value, the null mean and 95th
    percentile, and p = (1 + #{null >= observed}) / (1 + reps)."""
    obs = nvat(coupling_matrix(table, method, min_groups), include_diagonal)
    rng = np.random.default_rng(seed)
    X = table.to_numpy(dtype=float)
    null = np.empty(reps)
    for i in range(reps):
        Y = X.copy()
        for j in range(Y.shape[1]):
            ok = np.where(np.isfinite(Y[:, j]))[0]
            Y[ok, j] = Y[rng.permutation(ok), j]
        null[i] = nvat(
            coupling_matrix(pd.DataFrame(Y, columns=table.columns), method, min_groups), include_diagonal
        )
    return {
        "observed": obs,
        "null_mean": float(null.mean()) if reps else None,
        "null_q95": float(np.percentile(null, 95)) if reps else None,
        "p_value": float((1 + (null >= obs - 1e-12).sum()) / (1 + reps)) if reps else None,
        "reps": reps,
        "null": "columns permuted independently across scenes",
    }


def hubs(R: np.ndarray, order: Sequence[str] = VALUES, top: int = 3) -> dict:
    """Hub values of the coupling matrix: row strength s_j = sum_{k != j} |R_jk| and eigenvector
    centrality (leading eigenvector of the off-diagonal |R|, scaled to max 1)."""
    A = np.abs(np.nan_to_num(np.asarray(R, dtype=float), nan=0.0))
    np.fill_diagonal(A, 0.0)
    strength = A.sum(axis=1)
    if A.any():
        w, vecs = np.linalg.eigh(A)
        vec = np.abs(vecs[:, int(np.argmax(w))])
        cent = vec / vec.max() if vec.max() > 0 else vec
    else:
        cent = np.zeros(len(order))
    by_s = [order[i] for i in np.argsort(-strength, kind="stable")[:top]]
    by_c = [order[i] for i in np.argsort(-cent, kind="stable")[:top]]
    return {
        "strength": {v: float(s) for v, s in zip(order, strength, strict=True)},
        "eigenvector": {v: float(c) for v, c in zip(order, cent, strict=True)},
        "top_strength": by_s,
        "top_eigenvector": by_c,
    }


def hub_stability(
    table: pd.DataFrame,
    reps: int = 100,
    fraction: float = 0.8,
    seed: int = 0,
    method: str = "spearman",
    min_groups: int = 4,
    top: int = 3,
    order: Sequence[str] = VALUES,
) -> dict:
    """How stable the hubs are under resampling of scenes: ``reps`` subsamples of ``fraction`` of the
    scenes (without replacement), the coupling matrix and the row strengths recomputed on each. Returns,
    per value, the share of subsamples in which it is the top hub and in which it is among the ``top``
    hubs, and the share in which the full sample's top hub stays on top."""
    X = table.to_numpy(dtype=float)
    n = X.shape[0]
    m = int(round(fraction * n))
    full = hubs(coupling_matrix(table, method, min_groups), order, top)
    out = {
        "reps": reps,
        "fraction": fraction,
        "n_groups": n,
        "subsample_size": m,
        "top": top,
        "full_top_strength": full["top_strength"],
    }
    if m < min_groups or reps <= 0:
        return {**out, "reason": f"too few scenes ({n}) for subsamples of {min_groups} or more"}
    rng = np.random.default_rng(seed)
    first = np.zeros(len(order))
    in_top = np.zeros(len(order))
    for _ in range(reps):
        rows = np.sort(rng.choice(n, size=m, replace=False))
        h = hubs(coupling_matrix(table.iloc[rows], method, min_groups), order, top)
        first[order.index(h["top_strength"][0])] += 1
        for v in h["top_strength"]:
            in_top[order.index(v)] += 1
    return {
        **out,
        "top1_share": {v: float(first[i] / reps) for i, v in enumerate(order)},
        "top_share": {v: float(in_top[i] / reps) for i, v in enumerate(order)},
        "full_top1_kept": float(first[order.index(full["top_strength"][0])] / reps),
    }


def mantel_statistic(R: np.ndarray, D: np.ndarray | None = None, method: str = "spearman") -> float:
    """The Mantel statistic: correlation (``method``) between the upper-triangle entries of R and D, over
    the finite entries of R; NaN with fewer than 3 finite entries or a constant side."""
    R = np.asarray(R, dtype=float)
    D = distance_matrix() if D is None else np.asarray(D, dtype=float)
    iu = np.triu_indices(R.shape[0], 1)
    r, dd = R[iu], D[iu]
    ok = np.isfinite(r)
    if ok.sum() < 3 or np.std(r[ok]) < 1e-12 or np.std(dd[ok]) < 1e-12:
        return math.nan
    return _corr(r[ok], dd[ok], method)


def mantel_test(
    R: np.ndarray,
    D: np.ndarray | None = None,
    n_perm: int = 999,
    seed: int = 0,
    method: str = "spearman",
    alternative: str = "less",
) -> dict:
    """Permutation (Mantel) test of the association between the coupling matrix R and a distance matrix
    D (default: circular distance on the Schwartz circle, wedge convention).

    statistic: correlation (``method``) between the upper-triangle entries of R and D, over finite R.
    Under the circumplex hypothesis neighbours co-move and opposites diverge, so R falls with distance
    and the statistic is negative: the default ``alternative="less"`` tests for that; ``"greater"``
    and ``"two-sided"`` are available. The null permutes the value labels of R (rows and columns
    together). p = (1 + #{null as or more extreme}) / (1 + n_perm)."""
    R = np.asarray(R, dtype=float)
    D = distance_matrix() if D is None else np.asarray(D, dtype=float)
    k = R.shape[0]

    def stat(Rm: np.ndarray) -> float:
        return mantel_statistic(Rm, D, method)

    obs = stat(R)
    out = {
        "statistic": None if math.isnan(obs) else float(obs),
        "p_value": None,
        "n_perm": n_perm,
        "method": method,
        "alternative": alternative,
        "distance": "circular (wedge convention)",
    }
    if math.isnan(obs):
        out["reason"] = "too few finite coupling entries"
        return out
    rng = np.random.default_rng(seed)
    null = np.empty(n_perm)
    for i in range(n_perm):
        p = rng.permutation(k)
        null[i] = stat(R[np.ix_(p, p)])
    null = null[np.isfinite(null)]
    if alternative == "less":
        extreme = (null <= obs + 1e-12).sum()
    elif alternative == "greater":
        extreme = (null >= obs - 1e-12).sum()
    elif alternative == "two-sided":
        extreme = (np.abs(null) >= abs(obs) - 1e-12).sum()
    else:
        raise ValueError("alternative must be 'less', 'greater' or 'two-sided'")
    out["p_value"] = float((1 + extreme) / (1 + len(null)))
    return out


# ----------------------------------------------------------------- tests and multiplicity
def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction for the regularised incomplete beta function (Numerical Recipes)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        de = d * c
        h *= de
        if abs(de - 1.0) < 3e-14:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    lbeta = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log(1 - x)
    if x < (a + 1) / (a + b + 2):
        return math.exp(lbeta) * _betacf(a, b, x) / a
    return 1.0 - math.exp(lbeta) * _betacf(b, a, 1 - x) / b


def t_test_p(x) -> float:
    """Two-sided one-sample t-test p-value of mean(x) = 0."""
    x = np.asarray(x, dtype=float)
    x = x[np.isfinite(x)]
    n = len(x)
    if n < 2:
        return math.nan
    sd = x.std(ddof=1)
    if sd < 1e-15:
        return 0.0 if abs(x.mean()) > 1e-15 else 1.0
    t = x.mean() / (sd / math.sqrt(n))
    df = n - 1
    return float(_betainc(df / 2, 0.5, df / (df + t * t)))


def sign_flip_p(x, n_perm: int = 9999, seed: int = 0) -> float:
    """Two-sided sign-flip permutation p-value of mean(x) = 0 (exact enumeration for n <= 14)."""
    x = np.asarray(x, dtype=float)
    x = x[np.isfinite(x)]
    n = len(x)
    if n == 0:
        return math.nan
    obs = abs(x.mean())
    if n <= 14:
        signs = ((np.arange(2**n)[:, None] >> np.arange(n)) & 1) * 2 - 1
        null = np.abs((signs * x).mean(axis=1))
        return float((null >= obs - 1e-12).mean())
    rng = np.random.default_rng(seed)
    signs = rng.choice([-1.0, 1.0], size=(n_perm, n))
    null = np.abs((signs * x).mean(axis=1))
    return float((1 + (null >= obs - 1e-12).sum()) / (1 + n_perm))


def benjamini_hochberg(p_values: Sequence[float | None], alpha: float = 0.05) -> tuple[list, list]:
    """Benjamini-Hochberg adjusted p-values (q-values) and rejections at FDR ``alpha``. None/NaN
    p-values are left out (q None, not rejected)."""
    p = np.array([np.nan if v is None else float(v) for v in p_values], dtype=float)
    ok = np.where(np.isfinite(p))[0]
    q = np.full(len(p), np.nan)
    m = len(ok)
    if m:
        order = ok[np.argsort(p[ok], kind="stable")]
        ranked = p[order] * m / np.arange(1, m + 1)
        adj = np.minimum.accumulate(ranked[::-1])[::-1]
        q[order] = np.minimum(adj, 1.0)
    qs = [None if not np.isfinite(v) else float(v) for v in q]
    return qs, [bool(v is not None and v <= alpha) for v in qs]


def per_value_tests(
    d,
    values,
    order: Sequence[str] = VALUES,
    test: str = "signflip",
    alpha: float = 0.05,
    n_perm: int = 9999,
    seed: int = 0,
) -> dict[str, dict]:
    """For each value: p-value of mean shift = 0 (sign-flip permutation or t-test), BH q-value over
    the values tested, and whether it is significant at FDR ``alpha``."""
    d, values = np.asarray(d, dtype=float), np.asarray(values)
    ps = []
    for v in order:
        x = d[values == v]
        if test == "signflip":
            ps.append(sign_flip_p(x, n_perm=n_perm, seed=seed) if x.size else math.nan)
        elif test == "ttest":
            ps.append(t_test_p(x))
        else:
            raise ValueError("test must be 'signflip' or 'ttest'")
    qs, rej = benjamini_hochberg([None if math.isnan(p) else p for p in ps], alpha)
    return {
        v: {
            "p_value": None if math.isnan(p) else float(p),
            "q_value": q,
            "significant": r,
            "n": int((values == v).sum()),
        }
        for v, p, q, r in zip(order, ps, qs, rej, strict=True)
    }


# ----------------------------------------------------------------- bootstrap
def bootstrap_intervals(
    d,
    values,
    groups,
    target: str,
    reps: int = 500,
    fraction: float = 0.8,
    replace: bool = False,
    seed: int = 0,
    order: Sequence[str] = VALUES,
    level: float = 0.95,
    eps: float = DEFAULT_EPS,
    rescale: bool = True,
) -> dict:
    """Intervals of the gain, each drift and the VAT scalars from resampled scenes. Each repetition
    draws m = ``fraction`` x n of the n scene groups (without replacement by default: an 80% subsample;
    ``replace=True``: a bootstrap sample of size m) and recomputes everything from their items.

    A subsample of 80% varies much less than the full-sample estimate does, so by default
    (``rescale=True``) the deviations theta_b - theta_hat are scaled to the full sample before taking
    percentiles: by sqrt(m / (n - m)) without replacement (the subsampling / finite-population factor,
    = 2 at 80%) and by sqrt(m / n) with replacement, giving an interval theta_hat + c * [q_lo, q_hi].
    ``rescale=False`` returns the raw percentiles of the subsample estimates (the spread across 80%
    subsamples, a stability check rather than a confidence interval)."""
    d, values, groups = np.asarray(d, dtype=float), np.asarray(values), np.asarray(groups)
    uniq = np.unique(groups)
    n = len(uniq)
    size = max(1, int(round(fraction * n)))
    if not replace and size >= n:
        size = n - 1
    out = {
        "reps": reps,
        "fraction": fraction,
        "replace": replace,
        "n_groups": int(n),
        "level": level,
        "subsample_size": size,
        "rescaled": rescale,
    }
    if n < 2 or size < 1 or reps <= 0:
        return {
            **out,
            "gain": None,
            "drift": {v: None for v in order},
            "vat_signed": None,
            "vat_absolute": None,
            "scale": None,
        }
    c = (math.sqrt(size / (n - size)) if not replace else math.sqrt(size / n)) if rescale else 1.0
    out["scale"] = c
    rng = np.random.default_rng(seed)
    idx_by_group = {g: np.where(groups == g)[0] for g in uniq}

    def stats(dd, vv):
        g = gain(dd, vv, target)
        dr = drifts(dd, vv, order)
        t = vat(dr, g, target, eps)
        return (
            g,
            dr,
            (np.nan if t["signed"] is None else t["signed"]),
            (np.nan if t["absolute"] is None else t["absolute"]),
        )

    g0, dr0, vs0, va0 = stats(d, values)
    G, Dj, VS, VA = [], {v: [] for v in order}, [], []
    for _ in range(reps):
        pick = rng.choice(uniq, size=size, replace=replace)
        idx = np.concatenate([idx_by_group[g] for g in pick])
        g, dr, vs, va = stats(d[idx], values[idx])
        G.append(g)
        for v in order:
            Dj[v].append(dr[v])
        VS.append(vs)
        VA.append(va)
    lo, hi = (1 - level) / 2 * 100, (1 + level) / 2 * 100

    def ci(xs, point) -> list[float] | None:
        xs = np.asarray(xs, dtype=float)
        xs = xs[np.isfinite(xs)]
        if not xs.size:
            return None
        if not rescale:
            return [float(np.percentile(xs, lo)), float(np.percentile(xs, hi))]
        if point is None or not math.isfinite(point):
            return None
        dev = xs - point
        return [float(point + c * np.percentile(dev, lo)), float(point + c * np.percentile(dev, hi))]

    return {
        **out,
        "gain": ci(G, g0),
        "drift": {v: ci(Dj[v], dr0[v]) for v in order},
        "vat_signed": ci(VS, vs0),
        "vat_absolute": ci(VA, va0),
    }


# ----------------------------------------------------------------- robustness
def coupling_robustness(table: pd.DataFrame, min_groups: int = 4) -> dict:
    """Spearman vs Kendall coupling: Pearson agreement of their off-diagonal entries, the share with the
    same sign, the max |difference| (tau is typically smaller in magnitude than rho) and the nVAT under
    each, plus the Kendall matrix itself."""
    Rs = coupling_matrix(table, "spearman", min_groups)
    Rk = coupling_matrix(table, "kendall", min_groups)
    a, b = offdiag(Rs), offdiag(Rk)
    ok = np.isfinite(a) & np.isfinite(b)
    return {
        "spearman_kendall_agreement": None if ok.sum() < 3 else _pearson(a[ok], b[ok]),
        "sign_agreement": None if not ok.any() else float((np.sign(a[ok]) == np.sign(b[ok])).mean()),
        "max_abs_diff": None if not ok.any() else float(np.max(np.abs(a[ok] - b[ok]))),
        "nvat_spearman": nvat(Rs),
        "nvat_kendall": nvat(Rk),
        "kendall_coupling": [[None if not np.isfinite(x) else float(x) for x in row] for row in Rk],
    }


def svs_weighted_drifts(d, values, svs_items, order: Sequence[str] = VALUES) -> dict[str, float] | None:
    """Drifts from the 56-D view: mean over SVS items of each item's mean shift (each SVS item weighs
    the same), instead of pooling all items. None when no SVS items are known."""
    svs = [s if s else None for s in svs_items]
    if not any(svs):
        return None
    df = pd.DataFrame({"d": np.asarray(d, dtype=float), "value": list(values), "svs": svs}).dropna()
    per_item = df.groupby(["value", "svs"])["d"].mean().reset_index()
    means = per_item.groupby("value")["d"].mean()
    return {v: float(means[v]) if v in means.index else math.nan for v in order}
