"""Known-answer validation of the VAT pipeline (oracle and uniform lift), specificity and scene-level
statistics, audits of checkpoints (--post-model) and external PEFT adapters (--adapter, read only),
and the ten-target matrix. Tiny random model; no downloads."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from aligntax.errors import AligntaxError, CompatibilityError
from aligntax.vat import stats as ST
from aligntax.vat.items import load_builtin, sample_items, split_items
from aligntax.vat.judge import JudgeConfig
from aligntax.vat.schwartz import VALUES, distance_matrix


@pytest.fixture(scope="module")
def tiny():
    from vat_tiny import tiny_lm

    return tiny_lm(seed=0)


@pytest.fixture(scope="module")
def split():
    ev, tr = split_items(load_builtin(), 0.2)
    return ev, tr


@pytest.fixture()
def cache_env(tmp_path, monkeypatch):
    monkeypatch.setenv("ALIGNTAX_CACHE", str(tmp_path / "cache"))
    return tmp_path


def _cfg(**kw):
    from aligntax.vat.runner import VATConfig

    base = {
        "judge": JudgeConfig(batch_size=40),
        "bootstrap_reps": 300,
        "n_perm": 49,
        "nvat_null_reps": 0,
        "progress": False,
    }
    return VATConfig(**{**base, **kw})


def _rows(shift_fn, n_scenes=16, per=2, seed=0):
    """Synthetic item rows: ``per`` items per value and polarity in each scene, shift from shift_fn."""
    rng = np.random.default_rng(seed)
    rows = []
    for s in range(n_scenes):
        for v in VALUES:
            for k in range(per):
                pol = 1 if k % 2 == 0 else -1
                d = float(shift_fn(v, s, rng))
                rows.append(
                    {
                        "id": f"{s}-{v}-{k}",
                        "value": v,
                        "polarity": pol,
                        "group": f"scene{s}",
                        "pre": 3.0,
                        "post": 3.0 + pol * d,
                    }
                )
    return rows


# ================================================================= 1. known answers
def test_oracle_moves_only_the_target(tiny, split, cache_env):
    from aligntax.vat.methods import OracleBias, build_intervention
    from aligntax.vat.runner import run_vat

    ev, tr = split
    items = sample_items(ev, scenes=4, seed=0)
    iv = build_intervention("oracle", tiny, "Benevolence", tr, oracle_gain=0.4)
    assert isinstance(iv, OracleBias) and iv.scope == "target"
    res = run_vat(tiny, items, "Benevolence", iv, cache_env / "oracle", _cfg())
    for v, blk in res["drift"].items():
        assert abs(blk["value"]) <= 1e-6, v
    assert (
        res["gain"]["value"] == pytest.approx(0.4, rel=0.01, abs=1e-9)
        and abs(res["gain"]["value"] - 0.4) < 1e-9
    )
    rows = [json.loads(x) for x in (cache_env / "oracle" / "items.jsonl").read_text().splitlines()]
    assert all(r["pre"] == r["post"] for r in rows if r["value"] != "Benevolence")  # bit for bit
    sp = res["specificity"]
    assert sp["value"] == pytest.approx(0.4, rel=0.01) and sp["ci95"][0] > 0 and sp["covers_zero"] is False
    assert res["vat"]["absolute"] == pytest.approx(0.0, abs=1e-5)
    # a fixed logit bias: still no off-target movement, and a positive gain
    fixed = run_vat(
        tiny,
        items,
        "Power",
        OracleBias(target="Power", gain=None, bias=2.0),
        cache_env / "oracle-bias",
        _cfg(),
    )
    assert fixed["gain"]["value"] > 0.05 and max(abs(b["value"]) for b in fixed["drift"].values()) <= 1e-6


def test_uniform_lift_has_no_specificity(tiny, split, cache_env):
    from aligntax.vat.methods import build_intervention
    from aligntax.vat.runner import run_vat

    ev, tr = split
    items = sample_items(ev, scenes=4, seed=0)
    iv = build_intervention("uniform", tiny, "Security", tr, oracle_gain=0.3)
    res = run_vat(tiny, items, "Security", iv, cache_env / "uniform", _cfg())
    assert all(b["value"] == pytest.approx(0.3, rel=0.01) for b in res["drift"].values())
    sp = res["specificity"]
    assert sp["covers_zero"] is True and sp["ci95"][0] <= 0 <= sp["ci95"][1]
    assert "global shift" in sp["interpretation"]
    assert "global shift" in (cache_env / "uniform" / "report.md").read_text()


def test_uniform_lift_with_noise_covers_zero_and_target_lift_does_not():
    from aligntax.vat.runner import compute_results

    lift = compute_results(
        _rows(lambda v, s, rng: 0.3 + rng.normal(0, 0.2)), "Security", {"min": 1, "max": 5}, _cfg()
    )
    sp = lift["specificity"]
    assert sp["covers_zero"] and sp["ci95"][0] < 0 < sp["ci95"][1] and "global shift" in sp["interpretation"]
    assert lift["vat"]["absolute"] > 5  # the classic VAT is large either way
    targeted = compute_results(
        _rows(lambda v, s, rng: (0.5 if v == "Security" else 0.0) + rng.normal(0, 0.2)),
        "Security",
        {"min": 1, "max": 5},
        _cfg(),
    )
    assert targeted["specificity"]["ci95"][0] > 0 and "targeted" in targeted["specificity"]["interpretation"]


def test_oracle_needs_logits_method(tiny, split):
    from aligntax.vat.judge import LikertJudge
    from aligntax.vat.methods import OracleBias

    judge = LikertJudge(tiny, JudgeConfig(method="generate", cache=False))
    with pytest.raises(AligntaxError, match="logits"):
        judge.judge(split[0][:2], OracleBias(target="Power"))
    with pytest.raises(AligntaxError, match="exactly one"):
        OracleBias(target="Power", gain=0.2, bias=1.0)


# ================================================================= 2-3. statistics
def test_scene_bootstrap_resamples_scenes():
    # every item of a scene shares the scene's shift: 16 independent units, not 320
    def fn(v, s, rng):
        return scene_effect[s]

    scene_effect = np.random.default_rng(1).normal(0.2, 0.3, 16)
    rows = _rows(fn, per=2)
    d = np.array([r["polarity"] * (r["post"] - r["pre"]) for r in rows])
    b = ST.scene_bootstrap(d, [r["value"] for r in rows], [r["group"] for r in rows], "Power", reps=4000)
    lo, hi = b["intervals"]["gain"]
    se_scene = scene_effect.std(ddof=1) / np.sqrt(16)
    assert (hi - lo) == pytest.approx(2 * 1.96 * se_scene, rel=0.25)
    assert b["n_groups"] == 16


def test_scene_level_tests_use_scenes():
    from aligntax.vat.metrics import sign_flip_p
    from aligntax.vat.runner import compute_results

    rows = _rows(lambda v, s, rng: rng.normal(0.1, 0.3), n_scenes=10, per=4)
    res = compute_results(rows, "Power", {"min": 1, "max": 5}, _cfg())
    pv = res["tests"]["per_value"]
    assert res["tests"]["unit"] == "scene" and pv["Power"]["n_scenes"] == 10
    d = np.array([r["polarity"] * (r["post"] - r["pre"]) for r in rows if r["value"] == "Power"])
    scene_means = d.reshape(10, 4).mean(axis=1)
    assert pv["Power"]["p_value"] == pytest.approx(sign_flip_p(scene_means))


def test_ratios_withheld_when_gain_interval_covers_zero():
    from aligntax.vat.runner import compute_results

    rows = _rows(lambda v, s, rng: (0.0 if v == "Power" else 0.2) + rng.normal(0, 0.3))
    res = compute_results(rows, "Power", {"min": 1, "max": 5}, _cfg())
    assert res["gain"]["ci95"][0] < 0 < res["gain"]["ci95"][1]
    assert res["vat"]["signed"] is None and res["vat"]["absolute"] is None
    assert "covers 0" in res["vat"]["reason"] and res["vat"]["ci95_absolute"] is None
    assert all(g["value"] is None and "covers 0" in g["reason"] for g in res["gnd"].values())


@pytest.mark.parametrize("seed", range(5))
def test_absolute_vat_interval_never_below_zero(seed):
    from aligntax.vat.runner import compute_results

    # a small but clearly positive gain and drifts scattered around 0
    rows = _rows(lambda v, s, rng: (0.15 if v == "Power" else 0.0) + rng.normal(0, 0.12), seed=seed)
    res = compute_results(rows, "Power", {"min": 1, "max": 5}, _cfg())
    if res["vat"]["absolute"] is not None:
        lo, hi = res["vat"]["ci95_absolute"]
        assert 0 <= lo <= res["vat"]["absolute"] <= hi
        for v, g in res["gnd"].items():
            assert g["ci95"][0] <= g["value"] <= g["ci95"][1], v


def test_adjacent_vs_opposite():
    from aligntax.vat.schwartz import neighbours, opposites

    t = "Benevolence"
    nb, op = set(neighbours(t)), set(opposites(t))

    def fn(v, s, rng):
        return (0.3 if v in nb else -0.3 if v in op else 0.0) + rng.normal(0, 0.1)

    rows = _rows(fn)
    d = np.array([r["polarity"] * (r["post"] - r["pre"]) for r in rows])
    r = ST.adjacent_vs_opposite(d, [x["value"] for x in rows], [x["group"] for x in rows], t, reps=500)
    assert r["value"] == pytest.approx(0.6, abs=0.05) and r["ci95"][0] > 0 and r["p_value_scene"] < 0.01
    assert set(r["opposites"]) == {"Achievement", "Power"}
    null = ST.adjacent_vs_opposite(
        d * 0 + np.random.default_rng(0).normal(0, 0.1, len(d)),
        [x["value"] for x in rows],
        [x["group"] for x in rows],
        t,
        reps=500,
    )
    assert null["covers_zero"]


def test_control_adjusts_the_lift():
    from aligntax.vat.runner import compute_results

    control = _rows(lambda v, s, rng: 0.3 + rng.normal(0, 0.1))
    run = copy.deepcopy(control)
    for r in run:
        if r["value"] == "Tradition":  # the run adds 0.2 on the target only
            r["post"] += r["polarity"] * 0.2
    res = compute_results(run, "Tradition", {"min": 1, "max": 5}, _cfg(), control_rows=control)
    c = res["control"]
    assert c["n_paired"] == len(run)
    assert c["gain"]["value"] == pytest.approx(0.2) and all(
        abs(x["value"]) < 1e-9 for x in c["drift"].values()
    )
    assert c["specificity"]["ci95"][0] > 0
    assert res["specificity"]["value"] == pytest.approx(0.2, abs=0.02)


# ================================================================= 4. audits
def _other_tokenizer_lm():
    from tiny import make_tiny_lm
    from vat_tiny import tiny_tokenizer

    return make_tiny_lm(
        tiny_tokenizer(extra_text="zebra quokka axolotl"),
        "qwen2",
        4,
        64,
        0,
        dtype=None,
        spec="tiny-other-tokenizer",
        source="tiny",
        prepare=True,
        max_position_embeddings=2048,
        bos_token_id=None,
    )


def test_post_model_against_itself_is_zero(tiny, split, cache_env):
    from aligntax.vat.runner import run_vat
    from vat_tiny import tiny_lm

    items = sample_items(split[0], scenes=2, seed=0)
    same = tiny_lm(seed=0)  # a second instance of model A
    cfg = _cfg(judge=JudgeConfig(batch_size=40, cache=False))
    res = run_vat(tiny, items, "Power", None, cache_env / "self", cfg, post_lm=same)
    rows = [json.loads(x) for x in (cache_env / "self" / "items.jsonl").read_text().splitlines()]
    assert all(r["pre"] == r["post"] for r in rows)
    assert res["gain"]["value"] == 0 and all(b["value"] == 0 for b in res["drift"].values())
    assert res["post_model_fingerprint"] == same.fingerprint
    other = run_vat(tiny, items, "Power", None, cache_env / "other", cfg, post_lm=tiny_lm(seed=3))
    assert any(abs(b["value"]) > 1e-4 for b in other["drift"].values())
    with pytest.raises(CompatibilityError, match="tokenizers"):
        run_vat(tiny, items, "Power", None, cache_env / "bad", cfg, post_lm=_other_tokenizer_lm())
    with pytest.raises(
        AligntaxError, match=r"different settings \(post_model: "
    ):  # resuming with another post model
        run_vat(tiny, items, "Power", None, cache_env / "self", cfg, post_lm=tiny_lm(seed=3))


def _peft_adapter(lm, folder: Path, seed=0, **lora_kw) -> Path:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    kw = {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "v_proj"],
        "lora_dropout": 0.0,
        "task_type": "CAUSAL_LM",
        **lora_kw,
    }
    pm = get_peft_model(copy.deepcopy(lm.model), LoraConfig(**kw))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n or "lora_embedding_B" in n:
                p.normal_(0, 0.5)
    pm.save_pretrained(str(folder))
    return folder


def _digest(folder: Path) -> dict:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def test_external_adapter_is_read_only_and_exact(tiny, split, cache_env):
    from peft import PeftModel

    from aligntax.generation import prompt_logits
    from aligntax.vat.judge import LikertScale, Variant, judgment_prompt
    from aligntax.vat.methods import LoRAAdapter, build_intervention
    from aligntax.vat.runner import run_vat

    ev, tr = split
    folder = _peft_adapter(tiny, cache_env / "user-adapter")
    before = _digest(folder)
    ad = build_intervention("adapter", tiny, "Power", tr, adapter=folder)
    assert isinstance(ad, LoRAAdapter) and ad.name == "adapter" and len(ad.weights) == 8
    prompts = [judgment_prompt(it, Variant("acceptable"), LikertScale()) for it in ev[:3]]
    peft_model = PeftModel.from_pretrained(copy.deepcopy(tiny.model), str(folder)).eval()

    class Shim:
        model, tokenizer, device = peft_model, tiny.tokenizer, tiny.device

    hooked = prompt_logits(tiny, prompts, intervention=ad)
    assert torch.allclose(prompt_logits(Shim, prompts), hooked, atol=1e-4)
    assert not torch.allclose(prompt_logits(tiny, prompts), hooked)
    run_vat(tiny, sample_items(ev, scenes=1, seed=0), "Power", ad, cache_env / "run-adapter", _cfg())
    assert _digest(folder) == before  # byte-identical, no file added
    # training into it, or writing a run into it, is refused
    with pytest.raises(AligntaxError, match="did not create"):
        build_intervention("lora", tiny, "Power", tr, adapter_dir=folder)
    with pytest.raises(AligntaxError, match="did not create"):
        run_vat(tiny, ev[:2], "Power", ad, folder, _cfg())
    assert _digest(folder) == before
    with pytest.raises(AligntaxError, match="--adapter"):
        build_intervention("lora", tiny, "Power", tr, adapter=folder)


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "lora_embedding"),
        ({"bias": "lora_only"}, "bias"),
        ({"use_dora": True}, "DoRA"),
    ],
)
def test_unsupported_adapter_parts_are_refused(tiny, tmp_path, kw, message):
    from aligntax.vat.methods import LoRAAdapter

    folder = _peft_adapter(tiny, tmp_path / "ad", **kw)
    with pytest.raises(AligntaxError, match=message):
        LoRAAdapter.load(folder, tiny)


def test_adapter_for_another_model_is_refused(tiny, tmp_path):
    from aligntax.vat.methods import LoRAAdapter
    from vat_tiny import tiny_lm

    wider = tiny_lm(seed=0, hidden=32)
    folder = _peft_adapter(wider, tmp_path / "ad")
    with pytest.raises(CompatibilityError, match="another model"):
        LoRAAdapter.load(folder, tiny)


# ================================================================= 5. matrix
def test_matrix_tests_on_synthetic_matrices():
    rng = np.random.default_rng(0)
    D = distance_matrix()
    # circumplex: a target's neighbours gain, its opposites lose, plus a global lift per row
    circ = 0.5 - 0.2 * D + rng.normal(0, 0.02, (10, 10)) + rng.normal(0, 0.3, (10, 1))
    r = ST.analyse_matrix(circ, n_perm=1999)
    assert r["diagonal_test"]["p_value"] < 0.01
    assert r["mantel"]["statistic"] < -0.5 and r["mantel"]["p_value"] < 0.01
    C = np.array(r["double_centred"])
    assert np.allclose(C.mean(axis=0), 0) and np.allclose(C.mean(axis=1), 0)
    # a uniform lift (row and column effects, no target effect): nothing to find
    lift = rng.normal(0, 0.3, (10, 1)) + rng.normal(0, 0.3, (1, 10)) + rng.normal(0, 0.05, (10, 10))
    u = ST.analyse_matrix(lift, n_perm=1999)
    assert u["diagonal_test"]["p_value"] > 0.05 and u["mantel"]["p_value"] > 0.05


def test_matrix_of_oracle_runs(tiny, split, cache_env):
    from typer.testing import CliRunner

    from aligntax.cli.vat import app
    from aligntax.vat.matrix import run_matrix
    from aligntax.vat.methods import build_intervention

    ev, tr = split
    items = sample_items(ev, scenes=2, seed=0)
    out = cache_env / "matrix"
    res = run_matrix(
        tiny,
        items,
        lambda t: build_intervention("oracle", tiny, t, tr, oracle_gain=0.25),
        out,
        _cfg(bootstrap_reps=100),
        n_perm=2999,
    )
    M = np.array(res["matrix"])
    assert np.allclose(np.diag(M), 0.25, rtol=0.01) and np.abs(M[~np.eye(10, dtype=bool)]).max() <= 1e-6
    assert res["diagonal_test"]["p_value"] < 0.005
    # no off-diagonal structure to relate to the circle (entries equal up to the gains' rounding)
    assert res["mantel"]["statistic"] is None or res["mantel"]["p_value"] > 0.01
    assert all(k == 1 for k in res["own_rank_in_row"].values())
    assert (out / "matrix.md").is_file() and len(list(out.glob("*/results.json"))) == 10
    # the same matrix from the finished runs, through the CLI
    r = CliRunner().invoke(
        app,
        [
            "matrix",
            "--out",
            str(cache_env / "m2"),
            "--matrix-permutations",
            "999",
            *sum((["--from", str(p.parent)] for p in sorted(out.glob("*/results.json"))), []),
        ],
    )
    assert r.exit_code == 0, r.output
    again = json.loads((cache_env / "m2" / "matrix.json").read_text())
    assert np.allclose(again["matrix"], M)
    r = CliRunner().invoke(app, ["matrix", "--out", str(cache_env / "m3"), "--from", str(out / "po")])
    assert r.exit_code == 2 and "missing" in r.output


def test_cli_oracle_adapter_and_control(tiny, split, cache_env, monkeypatch):
    from typer.testing import CliRunner

    import aligntax.models
    from aligntax.cli.vat import app

    monkeypatch.setattr(aligntax.models, "load_model", lambda spec, dtype="bf16": tiny)
    runner = CliRunner()
    common = [
        "--target",
        "Power",
        "--scenes",
        "2",
        "--bootstrap",
        "50",
        "--permutations",
        "9",
        "--null-reps",
        "0",
        "--batch-size",
        "40",
    ]
    r = runner.invoke(
        app,
        [
            "run",
            *common,
            "--intervention",
            "uniform",
            "--oracle-gain",
            "0.2",
            "--out",
            str(cache_env / "ctl"),
        ],
    )
    assert r.exit_code == 0, r.output
    r = runner.invoke(
        app,
        [
            "run",
            *common,
            "--intervention",
            "oracle",
            "--oracle-gain",
            "0.2",
            "--out",
            str(cache_env / "orc"),
            "--control",
            str(cache_env / "ctl"),
        ],
    )
    assert r.exit_code == 0, r.output
    res = json.loads((cache_env / "orc" / "results.json").read_text())
    assert res["control"]["gain"]["value"] == pytest.approx(0.0, abs=1e-6)
    assert res["control"]["drift"]["Security"]["value"] == pytest.approx(-0.2, rel=0.01)
    folder = _peft_adapter(tiny, cache_env / "ad")
    before = _digest(folder)
    r = runner.invoke(app, ["run", *common, "--adapter", str(folder), "--out", str(cache_env / "ad-run")])
    assert r.exit_code == 0, r.output
    assert (
        json.loads((cache_env / "ad-run" / "results.json").read_text())["config"]["intervention"]["name"]
        == "adapter"
    )
    assert _digest(folder) == before
    r = runner.invoke(
        app,
        [
            "run",
            *common,
            "--intervention",
            "lora",
            "--adapter-dir",
            str(folder),
            "--out",
            str(cache_env / "x"),
        ],
    )
    assert r.exit_code == 2 and "did not create" in r.output
    r = runner.invoke(
        app,
        [
            "rescore",
            str(cache_env / "orc"),
            "--bootstrap",
            "50",
            "--permutations",
            "9",
            "--null-reps",
            "0",
            "--control",
            str(cache_env / "ctl"),
        ],
    )
    assert r.exit_code == 0 and "S_T" in r.output
