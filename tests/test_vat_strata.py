"""Desirability strata (congruent / incongruent / neutral items), whole-scene sampling, hub stability,
paired comparison of runs, ``vat sweep`` and the matrix on ValueActionLens-style items. Tiny random model
or synthetic rows; no downloads."""

from __future__ import annotations

import csv
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from aligntax.errors import AligntaxError, DataError
from aligntax.vat import metrics as M
from aligntax.vat.items import ValueItem, load_builtin, load_item_file, load_items, sample_items, split_items
from aligntax.vat.judge import JudgeConfig
from aligntax.vat.schwartz import VALUES


@pytest.fixture(scope="module")
def builtin():
    return load_builtin()


@pytest.fixture(scope="module")
def tiny():
    from vat_tiny import tiny_lm

    return tiny_lm(seed=0)


@pytest.fixture()
def cache_env(tmp_path, monkeypatch):
    monkeypatch.setenv("ALIGNTAX_CACHE", str(tmp_path / "cache"))
    return tmp_path


def _cfg(**kw):
    from aligntax.vat.runner import VATConfig

    base = {
        "judge": JudgeConfig(batch_size=40),
        "bootstrap_reps": 200,
        "n_perm": 19,
        "nvat_null_reps": 0,
        "hub_reps": 0,
        "progress": False,
    }
    return VATConfig(**{**base, **kw})


# ================================================================= the built-in strata
def test_builtin_strata_balanced(builtin):
    assert len(builtin) == 520
    assert all(it.desirability in ("congruent", "incongruent", "neutral") for it in builtin)
    assert all((it.desirability == "neutral") == (it.polarity == 0) for it in builtin)
    c = Counter((it.value, it.desirability, it.polarity) for it in builtin)
    for v in VALUES:  # balanced over the ten values
        assert c[(v, "congruent", 1)] == c[(v, "congruent", -1)] == 20
        assert c[(v, "incongruent", 1)] == c[(v, "incongruent", -1)] == 4, v
        assert c[(v, "neutral", 0)] == 4, v
    inc = [it for it in builtin if it.desirability == "incongruent"]
    ctx = Counter((it.scene, it.value, it.context) for it in inc)  # incongruent items are minimal pairs
    assert set(ctx.values()) == {2}
    assert len({it.scene for it in inc}) == 20 and len({it.scene for it in builtin if it.polarity == 0}) == 20
    texts = [it.action for it in builtin]
    assert len(texts) == len(set(texts))


def test_file_polarity_zero_and_desirability(tmp_path):
    rows = [
        {"id": "a", "context": "At work.", "action": "I file the form.", "value": "Power", "polarity": 0},
        {
            "id": "b",
            "context": "At work.",
            "action": "I bully my team.",
            "value": "Power",
            "polarity": 1,
            "desirability": "incongruent",
        },
    ]
    f = tmp_path / "x.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    a, b = load_item_file(f)
    assert (a.polarity, a.desirability, a.stratum) == (0, "neutral", "neutral")
    assert (b.desirability, b.stratum) == ("incongruent", "incongruent")
    for bad, msg in (
        ({"polarity": 1, "desirability": "neutral"}, "does not fit"),
        ({"polarity": 0, "desirability": "congruent"}, "does not fit"),
        ({"polarity": 1, "desirability": "nice"}, "bad desirability"),
    ):
        f.write_text(json.dumps({**rows[0], **bad}))
        with pytest.raises(DataError, match=msg):
            load_item_file(f)


def test_sample_strata_proportional(builtin):
    sub = sample_items(builtin, per_value=13, seed=0)  # 40 : 8 : 4 of 52 per value -> 10 : 2 : 1
    c = Counter((it.value, it.stratum, it.polarity) for it in sub)
    for v in VALUES:
        assert (c[(v, "congruent", 1)], c[(v, "congruent", -1)]) == (5, 5)
        assert (c[(v, "incongruent", 1)], c[(v, "incongruent", -1)]) == (1, 1)
        assert c[(v, "neutral", 0)] == 1
    only = sample_items(builtin, strata=["incongruent", "neutral"])
    assert {it.stratum for it in only} == {"incongruent", "neutral"} and len(only) == 120
    with pytest.raises(DataError, match="Unknown strata"):
        sample_items(builtin, strata=["nice"])


def _val_like(n_countries=4, n_topics=5):
    """ValueActionLens-shaped items: country/topic groups, every value in both polarities, 2 per cell."""
    items = []
    for c in range(n_countries):
        for t in range(n_topics):
            for v in VALUES:
                for k in range(4):
                    items.append(
                        ValueItem(
                            id=f"c{c}t{t}-{v}-{k}",
                            context=f"country {c} topic {t}",
                            action=f"act {k}",
                            value=v,
                            polarity=1 if k % 2 else -1,
                            country=f"C{c}",
                            topic=f"T{t}",
                        )
                    )
    return items


def test_sample_by_whole_scenes():
    items = _val_like()
    items = [it for it in items if not (it.group == "C0 / T0" and it.value == "Power")]  # C0/T0 lacks Power
    sub = sample_items(items, per_value=12, by="scene", per_scene_value=2, seed=1)
    groups = {it.group for it in sub}
    assert len(groups) == 6 and "C0 / T0" not in groups
    for g in groups:  # every chosen scene holds every value, one item of each polarity
        c = Counter((it.value, it.polarity) for it in sub if it.group == g)
        assert set(c) == {(v, p) for v in VALUES for p in (1, -1)} and set(c.values()) == {1}
    by_item = sample_items(items, per_value=12, seed=1)
    assert len({it.group for it in by_item}) > 6  # item sampling scatters over more scenes


# ================================================================= strata in the results
def _rows(nice: float, value_shift: dict[str, float] | None = None, n_scenes=10, neutral_lift=0.0):
    """Per scene and value: a congruent pair, an incongruent pair and a neutral item. ``nice``: the judge
    rates approved actions higher by this (congruent shift +nice, incongruent -nice); ``value_shift``:
    a real change of the value (both strata alike)."""
    value_shift = value_shift or {}
    rows = []
    for s in range(n_scenes):
        for v in VALUES:
            for des, sign in (("congruent", 1), ("incongruent", -1)):
                for pol in (1, -1):
                    d = sign * nice + value_shift.get(v, 0.0)
                    rows.append(
                        {
                            "id": f"{s}-{v}-{des}-{pol}",
                            "value": v,
                            "polarity": pol,
                            "desirability": des,
                            "group": f"s{s}",
                            "pre": 3.0,
                            "post": 3.0 + pol * d,
                        }
                    )
            rows.append(
                {
                    "id": f"{s}-{v}-neu",
                    "value": v,
                    "polarity": 0,
                    "desirability": "neutral",
                    "group": f"s{s}",
                    "pre": 3.0,
                    "post": 3.0 + neutral_lift,
                }
            )
    return rows


def test_strata_separate_niceness_from_value_change():
    from aligntax.vat.runner import compute_results

    nice = compute_results(_rows(0.5, neutral_lift=0.3), "Power", {"min": 1, "max": 5}, _cfg())
    st = nice["strata"]
    assert st["congruent"]["gain"]["value"] == pytest.approx(0.5)
    assert st["incongruent"]["gain"]["value"] == pytest.approx(-0.5)
    assert st["congruent_minus_incongruent"]["value"] == pytest.approx(1.0)
    assert st["neutral"]["lift"]["value"] == pytest.approx(0.3) and nice["n_neutral"] == 100
    assert nice["gain"]["value"] == pytest.approx(0.0)  # pooled over strata the lift cancels
    real = compute_results(_rows(0.0, {"Power": 0.4}), "Power", {"min": 1, "max": 5}, _cfg())
    st = real["strata"]
    assert st["congruent"]["gain"]["value"] == pytest.approx(0.4) == st["incongruent"]["gain"]["value"]
    assert st["congruent"]["specificity"]["ci95"][0] > 0 and st["incongruent"]["specificity"]["ci95"][0] > 0
    assert st["congruent_minus_incongruent"]["value"] == pytest.approx(0.0)
    assert st["neutral"]["lift"]["value"] == pytest.approx(0.0)


def test_neutral_rows_do_not_change_headline():
    from aligntax.vat.runner import compute_results

    rows = _rows(0.2, {"Security": 0.3}, neutral_lift=1.0)
    a = compute_results(rows, "Security", {"min": 1, "max": 5}, _cfg())
    b = compute_results([r for r in rows if r["polarity"] != 0], "Security", {"min": 1, "max": 5}, _cfg())
    assert a["gain"] == b["gain"] and a["drift"] == b["drift"] and a["n_items"] == b["n_items"]
    old = [{k: v for k, v in r.items() if k != "desirability"} for r in rows if r["polarity"] != 0]
    assert compute_results(old, "Security", {"min": 1, "max": 5}, _cfg())["strata"] is None


def test_report_has_strata_table(tmp_path):
    from aligntax.vat.report import write_report
    from aligntax.vat.runner import compute_results

    res = compute_results(_rows(0.5, neutral_lift=0.3), "Power", {"min": 1, "max": 5}, _cfg())
    text = write_report(res, tmp_path).read_text()
    assert "## Desirability strata" in text and "| incongruent | 200 | -0.500" in text
    assert "neutral items (100): raw lift +0.300" in text


def test_fewshot_and_oracle_ignore_incongruent_and_neutral(builtin, tiny, cache_env):
    from aligntax.vat.methods import OracleBias, build_fewshot

    ev, tr = split_items(builtin, 0.2, seed=0)
    for t in VALUES:
        fs = build_fewshot(tr, t, 8, seed=0)
        kinds = {next(it for it in tr if it.id == i).desirability for i in fs.example_ids}
        assert kinds == {"congruent"}
    neu = next(it for it in builtin if it.polarity == 0)
    orc = OracleBias(target=neu.value, scope="all", gain=0.5)
    assert orc.adjust_probs(neu, [0.2] * 5, np.arange(1, 6, dtype=float)) is None


# ================================================================= hub stability
def test_hub_stability_finds_a_planted_hub():
    rng = np.random.default_rng(0)
    n = 30
    hub = rng.standard_normal(n)
    X = {v: 0.8 * hub + 0.6 * rng.standard_normal(n) for v in VALUES}
    X["Power"] = hub  # Power co-moves with every other value
    table = pd.DataFrame(X)[list(VALUES)]
    hs = M.hub_stability(table, reps=60, seed=1)
    assert hs["full_top_strength"][0] == "Power"
    assert hs["top1_share"]["Power"] >= 0.9 and hs["full_top1_kept"] >= 0.9
    assert sum(hs["top1_share"].values()) == pytest.approx(1.0)
    noise = pd.DataFrame(rng.standard_normal((30, 10)), columns=list(VALUES))
    assert max(M.hub_stability(noise, reps=60, seed=1)["top1_share"].values()) < 0.9
    assert "reason" in M.hub_stability(noise.iloc[:4], reps=10)


# ================================================================= paired comparison
def _run_dir(path: Path, rows, target="Benevolence", judge=None, model="m-a"):
    from aligntax.vat.runner import compute_results

    path.mkdir(parents=True)
    res = compute_results(rows, target, {"min": 1, "max": 5}, _cfg())
    res["config"] = {"judge": judge or JudgeConfig().to_dict()}
    res["model_fingerprint"] = {"spec": model}
    (path / "results.json").write_text(json.dumps(res))
    (path / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _shift_rows(delta: dict[str, float], n_scenes=12, seed=0, noise=0.05):
    rng = np.random.default_rng(seed)
    rows = []
    for s in range(n_scenes):
        for v in VALUES:
            for pol in (1, -1):
                d = delta.get(v, 0.0) + noise * rng.standard_normal()
                rows.append(
                    {
                        "id": f"{s}-{v}-{pol}",
                        "value": v,
                        "polarity": pol,
                        "group": f"s{s}",
                        "pre": 3.0,
                        "post": 3.0 + pol * d,
                    }
                )
    return rows


def test_paired_compare_finds_the_difference(tmp_path):
    from aligntax.vat.sweep import paired_compare

    a = _run_dir(tmp_path / "a", _shift_rows({v: 0.2 for v in VALUES}, seed=1))
    b = _run_dir(tmp_path / "b", _shift_rows({**{v: 0.2 for v in VALUES}, "Benevolence": 0.6}, seed=2))
    out = paired_compare([a, b], tmp_path / "cmp", reps=500)
    pv = out["comparisons"][0]["per_value"]
    assert pv["Benevolence"]["value"] == pytest.approx(0.4, abs=0.05)
    assert pv["Benevolence"]["ci95"][0] > 0.3 and pv["Benevolence"]["significant"]
    for v in VALUES:
        if v != "Benevolence":
            assert pv[v]["covers_zero"] and not pv[v]["significant"], v
    chk = out["comparisons"][0]["checks"]
    assert chk["shared_items"] == 240 and chk["same_model"] and chk["note"] is None
    assert "paired.md" in {p.name for p in (tmp_path / "cmp").iterdir()}


def test_paired_compare_checks(tmp_path):
    from aligntax.vat.sweep import paired_compare

    rows = _shift_rows({})
    a = _run_dir(tmp_path / "a", rows)
    other_judge = {**JudgeConfig().to_dict(), "templates": ["rate"]}
    b = _run_dir(tmp_path / "b", rows, judge=other_judge)
    with pytest.raises(AligntaxError, match="different judges"):
        paired_compare([a, b], tmp_path / "o")
    flipped = [{**r, "polarity": -r["polarity"]} if r["id"].startswith("0-") else r for r in rows]
    c = _run_dir(tmp_path / "c", flipped)
    with pytest.raises(AligntaxError, match="different value or polarity"):
        paired_compare([a, c], tmp_path / "o")
    d = _run_dir(tmp_path / "d", [{**r, "id": "x" + r["id"]} for r in rows])
    with pytest.raises(AligntaxError, match="share no item"):
        paired_compare([a, d], tmp_path / "o")
    e = _run_dir(tmp_path / "e", rows[:100], model="m-b")
    chk = paired_compare([a, e], tmp_path / "o")["comparisons"][0]["checks"]
    assert not chk["same_model"] and "different models" in chk["note"]
    assert chk["shared_items"] == 100 and chk["only_in_reference"] == 140
    with pytest.raises(AligntaxError, match="at least two"):
        paired_compare([a], tmp_path / "o")


def test_compare_cli_writes_paired(tmp_path):
    from typer.testing import CliRunner

    from aligntax.cli.vat import app

    a = _run_dir(tmp_path / "a", _shift_rows({}, seed=1))
    b = _run_dir(tmp_path / "b", _shift_rows({"Power": 0.5}, seed=2))
    r = CliRunner().invoke(
        app, ["compare", str(a), str(b), "--out", str(tmp_path / "c"), "--bootstrap", "200"]
    )
    assert r.exit_code == 0, r.output
    assert "Paired differences against `a`" in r.output and (tmp_path / "c" / "paired.json").is_file()


# ================================================================= sweep
def test_sweep_runs_resumes_and_records_failures(tiny, cache_env, tmp_path):
    from aligntax.vat.sweep import SweepSpec, cell_dir, run_sweep

    calls = []

    def loader(spec, dtype=None):
        calls.append(spec)
        return tiny

    spec = SweepSpec.from_dict(
        {
            "models": ["tiny-a"],
            "interventions": ["oracle", "uniform"],
            "targets": ["Power", "Benevolence"],
            "limit_per_value": 4,
            "bootstrap": 50,
            "permutations": 9,
            "strata": ["congruent"],
        }
    )
    out = tmp_path / "sweep"
    rows = run_sweep(spec, out, load_model=loader, progress=False)
    assert [r["status"] for r in rows] == ["done"] * 4 and calls == ["tiny-a"]
    by = {(r["intervention"], r["target"]): r for r in rows}
    assert by[("oracle", "Power")]["gain"] == pytest.approx(0.5, abs=1e-3)
    assert by[("oracle", "Power")]["mean_off_target_drift"] == pytest.approx(0.0, abs=1e-9)
    assert by[("uniform", "Power")]["specificity"] == pytest.approx(0.0, abs=1e-3)
    assert (cell_dir(out, "tiny-a", "oracle", "Power") / "results.json").is_file()
    assert (out / "summary.md").read_text().count("| tiny-a |") == 4
    with open(out / "summary.csv") as fh:
        assert len(list(csv.DictReader(fh))) == 4
    again = run_sweep(spec, out, load_model=loader, progress=False)
    assert [r["status"] for r in again] == ["done"] * 4 and calls == ["tiny-a"]  # no reload
    (cell_dir(out, "tiny-a", "oracle", "Power") / "results.json").unlink()
    spec2 = SweepSpec.from_dict(
        {
            **{k: getattr(spec, k) for k in spec.__dataclass_fields__},
            "interventions": ["oracle", "fewshot-99"],
            "targets": ["Power"],
        }
    )
    rows = run_sweep(spec2, out, load_model=loader, progress=False)
    assert rows[0]["status"] == "done" and rows[1]["status"].startswith("failed")
    with pytest.raises(AligntaxError, match=r"different settings \(limit_per_value: "):
        run_sweep(SweepSpec.from_dict({**spec2.__dict__, "limit_per_value": 6}), out, load_model=loader)


def test_sweep_yaml(tmp_path):
    from aligntax.vat.sweep import SweepSpec

    f = tmp_path / "s.yaml"
    f.write_text("models: [a, b]\ninterventions: fewshot-8, persona\ntargets: [PO, be]\nlimit_per_value: 4\n")
    s = SweepSpec.from_yaml(f)
    assert s.models == ["a", "b"] and s.interventions == ["fewshot-8", "persona"]
    assert s.targets == ["Power", "Benevolence"] and s.limit_per_value == 4
    f.write_text("models: [a]\ninterventions: [x]\nbogus: 1\n")
    with pytest.raises(DataError, match="unknown keys"):
        SweepSpec.from_yaml(f)
    assert SweepSpec.from_dict({"models": ["a"], "interventions": ["x"]}).targets == list(VALUES)


# ================================================================= matrix on ValueActionLens-style items
def _val_csv(path: Path) -> Path:
    """A small file in the ValueActionLens layout (country, topic, SVS item, polarity, generation_prompt)."""
    from aligntax.vat.schwartz import SVS_TO_BASIC

    svs_by_value = {}
    for svs, basic in SVS_TO_BASIC.items():
        svs_by_value.setdefault(basic, svs)
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=["country", "topic", "value", "polarity", "generation_prompt"])
        w.writeheader()
        for c in ("Kenya", "Peru", "Japan", "Chile"):
            for t in ("work", "family", "school"):
                for v in VALUES:
                    for pol in ("positive", "negative"):
                        act = f"I help my family at work {'' if pol == 'positive' else 'not '}today"
                        w.writerow(
                            {
                                "country": c,
                                "topic": t,
                                "value": svs_by_value[v],
                                "polarity": pol,
                                "generation_prompt": json.dumps({"Human Action": act}),
                            }
                        )
    return path


def test_matrix_on_value_action_lens_layout(tiny, cache_env, tmp_path):
    from aligntax.vat.matrix import run_matrix
    from aligntax.vat.methods import OracleBias

    items = load_items(_val_csv(tmp_path / "val.csv"))
    assert {it.source for it in items} == {"value-action-lens"} and len({it.group for it in items}) == 12
    sub = sample_items(items, per_value=8, by="scene", per_scene_value=2, seed=0)
    assert len({it.group for it in sub}) == 4
    res = run_matrix(tiny, sub, lambda t: OracleBias(target=t, gain=0.5), tmp_path / "m", _cfg(), n_perm=999)
    M_ = np.array(res["matrix"])
    assert np.allclose(np.diag(M_), 0.5, atol=1e-3)
    assert np.allclose(M_[~np.eye(10, dtype=bool)], 0.0, atol=1e-9)
    assert res["diagonal_test"]["p_value"] < 0.01
    assert json.loads((tmp_path / "m" / "matrix.json").read_text())["strata"] == {}


def test_strata_matrices_from_runs(tmp_path):
    from aligntax.vat.matrix import write_matrix
    from aligntax.vat.runner import compute_results

    runs = {}
    for t in VALUES:  # congruent items: target +0.4, everything +0.2 (lift); incongruent: lift reversed
        rows = []
        for s in range(6):
            for v in VALUES:
                for des, sign in (("congruent", 1), ("incongruent", -1)):
                    for pol in (1, -1):
                        d = sign * 0.2 + (0.4 if v == t else 0.0) + 0.01 * ((s + len(v)) % 3)
                        rows.append(
                            {
                                "id": f"{s}-{v}-{des}-{pol}",
                                "value": v,
                                "polarity": pol,
                                "desirability": des,
                                "group": f"s{s}",
                                "pre": 3.0,
                                "post": 3.0 + pol * d,
                            }
                        )
        runs[t] = compute_results(rows, t, {"min": 1, "max": 5}, _cfg(bootstrap_reps=20))
    res = write_matrix(runs, tmp_path, n_perm=999)
    inc, con = res["strata"]["incongruent"], res["strata"]["congruent"]
    assert con["grand_mean"] == pytest.approx(0.2 + 0.04, abs=0.02)
    assert inc["grand_mean"] == pytest.approx(-0.2 + 0.04, abs=0.02)
    assert con["diagonal_test"]["p_value"] < 0.01 and inc["diagonal_test"]["p_value"] < 0.01
    assert "## Incongruent items only" in (tmp_path / "matrix.md").read_text()


def test_sample_by_auto_and_sweep_cli_errors(tmp_path):
    from typer.testing import CliRunner

    from aligntax.cli.vat import _sample_by, app

    assert _sample_by("auto", "value-action-lens") == "scene" and _sample_by("auto", "builtin") == "item"
    f = tmp_path / "s.yaml"
    f.write_text("models: [a]\ninterventions: [oracle]\nnonsense: 3\n")
    r = CliRunner().invoke(app, ["sweep", "--config", str(f), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "unknown keys" in r.output


def test_hub_stability_in_report(tmp_path):
    from aligntax.vat.report import write_report
    from aligntax.vat.runner import compute_results

    rows = _shift_rows({"Power": 0.3}, n_scenes=12, noise=0.3)
    res = compute_results(rows, "Power", {"min": 1, "max": 5}, _cfg(hub_reps=20))
    hs = res["hub_stability"]
    assert hs["reps"] == 20 and sum(hs["top1_share"].values()) == pytest.approx(1.0)
    assert "stays on top in" in write_report(res, tmp_path).read_text()


def test_ratios_withheld_when_target_in_one_scene():
    from aligntax.vat.runner import compute_results

    rows = [r for r in _shift_rows({"Power": 0.5}) if r["value"] != "Power" or r["group"] == "s0"]
    res = compute_results(rows, "Power", {"min": 1, "max": 5}, _cfg())
    assert res["gain"]["n_scenes"] == 1 and res["gain"]["ci95"][0] == pytest.approx(res["gain"]["ci95"][1])
    assert res["vat"]["absolute"] is None and "1 scene" in res["vat"]["reason"]
    ok = compute_results(_shift_rows({"Power": 0.5}), "Power", {"min": 1, "max": 5}, _cfg())
    assert ok["gain"]["n_scenes"] == 12 and ok["vat"]["absolute"] is not None
