"""Scene-bootstrap intervals of nVAT, the coupling matrix R (per entry, and row strengths) and the Mantel
statistic, on synthetic scene-shift tables (no model)."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from aligntax.vat import metrics as M
from aligntax.vat import schwartz as S
from aligntax.vat import stats as ST
from aligntax.vat.report import write_report
from aligntax.vat.runner import VATConfig, compute_results

REPS = 300


def _circle_table(n: int, seed: int = 0, noise: float = 0.5) -> pd.DataFrame:
    """Scene shifts d_{s,j} = a_s cos(theta_j) + b_s sin(theta_j) + noise: R falls with circular distance."""
    rng = np.random.default_rng(seed)
    theta = np.array([S.circle_angles("ten")[v] for v in S.VALUES])
    ab = rng.standard_normal((n, 2))
    X = ab[:, :1] * np.cos(theta) + ab[:, 1:] * np.sin(theta) + noise * rng.standard_normal((n, 10))
    return pd.DataFrame(X, columns=list(S.VALUES))


def _exchangeable_table(n: int, rho: float, seed: int = 0) -> pd.DataFrame:
    """Ten normal columns with every pairwise Pearson correlation equal to rho (one common factor)."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((n, 1))
    X = math.sqrt(rho) * z + math.sqrt(1 - rho) * rng.standard_normal((n, 10))
    return pd.DataFrame(X, columns=list(S.VALUES))


def _width(ci) -> float:
    return ci[1] - ci[0]


def _contains(ci, x, tol=1e-9) -> bool:
    return ci is not None and ci[0] - tol <= x <= ci[1] + tol


def test_fast_coupling_matches_coupling_matrix():
    t = _circle_table(25, seed=3)
    t.iloc[:, 4] = 1.0  # a constant column: NaN off-diagonal and diagonal
    for method in ("spearman", "pearson"):
        fast = ST._fast_coupling(t.to_numpy(), method, 4)
        slow = M.coupling_matrix(t, method, 4)
        assert np.allclose(fast, slow, equal_nan=True, atol=1e-12)
    assert ST._fast_coupling(t.to_numpy()[:3], "spearman", 4) is not None
    assert np.isnan(ST._fast_coupling(t.to_numpy()[:3], "spearman", 4)).all()
    assert ST._fast_coupling(t.to_numpy(), "kendall", 4) is None


def test_mantel_statistic_is_the_mantel_tests_statistic():
    R = M.coupling_matrix(_circle_table(30))
    assert M.mantel_statistic(R) == pytest.approx(M.mantel_test(R, n_perm=9)["statistic"])


def test_intervals_contain_point_estimates():
    t = _circle_table(60)
    R = M.coupling_matrix(t)
    b = ST.coupling_bootstrap(t, reps=REPS, seed=0)
    assert b["nvat"]["n_valid"] == REPS and b["mantel"]["n_valid"] == REPS
    assert _contains(b["nvat"]["ci95"], M.nvat(R))
    assert _contains(b["mantel"]["ci95"], M.mantel_statistic(R))
    lo, hi = b["coupling"]["lower"], b["coupling"]["upper"]
    off = ~np.eye(10, dtype=bool)
    assert ((lo[off] <= R[off] + 1e-9) & (R[off] <= hi[off] + 1e-9)).mean() >= 0.95
    assert np.allclose(np.diag(lo), 1.0) and np.allclose(np.diag(hi), 1.0)
    strength = M.hubs(R)["strength"]
    for v in S.VALUES:
        assert _contains(b["strength"][v]["ci95"], strength[v])


def test_intervals_shrink_with_more_scenes():
    small = ST.coupling_bootstrap(_circle_table(30, seed=1), reps=REPS, seed=0)
    large = ST.coupling_bootstrap(_circle_table(300, seed=1), reps=REPS, seed=0)
    assert _width(large["nvat"]["ci95"]) < 0.6 * _width(small["nvat"]["ci95"])
    assert _width(large["mantel"]["ci95"]) < 0.6 * _width(small["mantel"]["ci95"])
    ws = np.nanmean(small["coupling"]["upper"] - small["coupling"]["lower"])
    wl = np.nanmean(large["coupling"]["upper"] - large["coupling"]["lower"])
    assert wl < 0.6 * ws
    assert _width(large["strength"]["Power"]["ci95"]) < 0.6 * _width(small["strength"]["Power"]["ci95"])


def test_intervals_deterministic_for_a_seed():
    t = _circle_table(40)
    a = ST.coupling_bootstrap(t, reps=100, seed=7)
    b = ST.coupling_bootstrap(t, reps=100, seed=7)
    c = ST.coupling_bootstrap(t, reps=100, seed=8)
    assert a["nvat"] == b["nvat"] and a["mantel"] == b["mantel"] and a["strength"] == b["strength"]
    assert np.array_equal(a["coupling"]["lower"], b["coupling"]["lower"], equal_nan=True)
    assert np.array_equal(a["coupling"]["upper"], b["coupling"]["upper"], equal_nan=True)
    assert a["nvat"]["ci95"] != c["nvat"]["ci95"]


def test_intervals_cover_known_values():
    rho, n = 0.5, 400
    t = _exchangeable_table(n, rho, seed=0)
    # Pearson coupling: every entry's true value is rho, and nVAT = sqrt(90 rho^2 / 10) = 3 rho
    b = ST.coupling_bootstrap(t, reps=REPS, seed=0, method="pearson")
    assert _contains(b["nvat"]["ci95"], 3 * rho)
    off = ~np.eye(10, dtype=bool)
    cover = (b["coupling"]["lower"][off] <= rho) & (rho <= b["coupling"]["upper"][off])
    assert cover.mean() >= 0.85  # 95% intervals, 90 (45 distinct) entries
    # Spearman of a normal pair with correlation rho: (6 / pi) asin(rho / 2)
    rs = 6 / math.pi * math.asin(rho / 2)
    b = ST.coupling_bootstrap(t, reps=REPS, seed=0, method="spearman")
    cover = (b["coupling"]["lower"][off] <= rs) & (rs <= b["coupling"]["upper"][off])
    assert cover.mean() >= 0.85
    assert _contains(b["nvat"]["ci95"], 3 * rs)
    # no coupling with the circle: the Mantel statistic's true value is 0 (exchangeable R)
    assert _contains(b["mantel"]["ci95"], 0.0)


def test_undefined_resamples_are_skipped_and_counted():
    t = _circle_table(40, seed=2)
    t.iloc[5:, 3] = np.nan  # value 3 seen in 5 scenes only: often < min_groups in a resample
    b = ST.coupling_bootstrap(t, reps=200, seed=0, min_groups=4)
    nv = b["coupling"]["n_valid"]
    assert 0 < nv[3, 0] < 200 and nv[0, 1] == 200
    assert b["nvat"]["n_valid"] == 200 and b["coupling"]["lower"][3, 0] <= b["coupling"]["upper"][3, 0]
    # a table whose R is never defined: no interval and 0 valid resamples
    none = ST.coupling_bootstrap(t.iloc[:3], reps=50, seed=0)
    assert none["nvat"] == {"ci95": None, "n_valid": 0} and none["mantel"]["n_valid"] == 0
    assert ST.coupling_bootstrap(t, reps=0)["nvat"] is None


def _rows(n_scenes: int, seed: int = 0) -> list[dict]:
    t = _circle_table(n_scenes, seed=seed, noise=0.3)
    rows = []
    for s in range(n_scenes):
        for v in S.VALUES:
            d = float(t.loc[s, v])
            for p in (1, -1):
                rows.append(
                    {
                        "id": f"{s}-{v}-{p}",
                        "value": v,
                        "polarity": p,
                        "group": f"s{s}",
                        "pre": 3.0,
                        "post": 3.0 + p * d,
                    }
                )
    return rows


def test_results_and_report_carry_the_intervals(tmp_path):
    cfg = VATConfig(
        bootstrap_reps=200, n_perm=99, nvat_null_reps=20, hub_reps=10, report=False, progress=False
    )
    res = compute_results(_rows(30), "Power", {"min": 1, "max": 5}, cfg)
    json.dumps(res)
    assert _contains(res["nvat_ci95"], res["nvat"]) and res["nvat_ci95_n_valid"] == 200
    ct = res["circumplex_test"]
    assert _contains(ct["ci95"], ct["statistic"]) and ct["ci95_n_valid"] == 200
    lo = np.array(res["coupling_ci95"]["lower"], dtype=float)
    hi = np.array(res["coupling_ci95"]["upper"], dtype=float)
    R = np.array(res["coupling"], dtype=float)
    assert lo.shape == (10, 10) and (lo <= R + 1e-9).mean() > 0.9 and (R <= hi + 1e-9).mean() > 0.9
    assert res["coupling_bootstrap"]["reps"] == 200 and set(res["coupling_bootstrap"]["strength"]) == set(
        S.VALUES
    )
    # the new intervals add keys only: the point values are those of the bootstrap-free run
    plain = compute_results(
        _rows(30),
        "Power",
        {"min": 1, "max": 5},
        VATConfig(bootstrap_reps=0, n_perm=99, nvat_null_reps=20, hub_reps=10),
    )
    assert (
        plain["nvat_ci95"] is None
        and plain["coupling_bootstrap"] is None
        and "ci95" not in plain["circumplex_test"]
    )
    assert plain["nvat"] == res["nvat"] and plain["coupling"] == res["coupling"]
    assert plain["circumplex_test"]["statistic"] == ct["statistic"] and plain["hubs"] == res["hubs"]
    res["config"] = cfg.to_dict()
    md = write_report(res, tmp_path).read_text()
    assert f"nVAT = {res['nvat']:+.3f} [{res['nvat_ci95'][0]:+.3f}, {res['nvat_ci95'][1]:+.3f}]" in md
    assert f"[{ct['ci95'][0]:+.3f}, {ct['ci95'][1]:+.3f}] (200 of 200 resamples valid)" in md
    assert "coupling R, scene-bootstrap 95% intervals per entry (200 resamples)" in md
