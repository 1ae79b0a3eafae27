"""The main job end to end on a tiny random model: every stage, the report, and resuming."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.long  # the complete profile, every stage and front mechanism: minutes even on a tiny model
def test_full_demo_runs_end_to_end_and_resumes(tmp_path, tiny_lm, data_dir, parity_judge):
    from aligntax.runs.demo import demo_config, run_demo

    # the parity judge (a function of the answer's text) refuses about half of the random model's answers,
    # benign ones included, so that the learned per-row strength has over-refused prompts to learn from
    cfg = demo_config(
        True,
        out=str(tmp_path / "demo"),
        test_sets=["orbench-hard-test", "jailbreakbench"],
        limit=6,
        judge="parity",
        max_new_tokens=6,
        limit_benign_train=24,
        limit_harmful_train=16,
        limit_gate_harmful=16,
        limit_gate_benign=16,
        sweep_max_new_tokens=6,
        limit_leak=40,
        sweep_limit=60,
        limit_reasoning=4,
        reasoning_max_new_tokens=6,
        progress=False,
        mechanisms=["harm-orth", "row-strength", "els-lora"],
    )
    assert cfg.full and cfg.sweep_halving is None and len(cfg.test_baselines) == 3
    summary = run_demo(cfg, lm=tiny_lm)
    out = tmp_path / "demo"
    for path in (
        "baseline/results.json",
        "els/energy.json",
        "els/gate.json",
        "els/vectors/vectors.json",
        "els/sweep/sweep.jsonl",
        "els/sweep/pareto.png",
        "report.md",
        "test_pareto.png",
        "knowns-baseline/results.json",
        "test-baselines/cast/results.json",
    ):
        assert (out / path).is_file(), path
    gate = json.loads((out / "els/gate.json").read_text())["info"]
    # harmful train prompts plus 16 of each extra gate set (OR-Bench toxic, StrongREJECT, MaliciousInstruct,
    # Do-Not-Answer); benign: the 24 + 24 train prompts (OR-Bench-Hard, PHTest), the harmless ones and up to
    # 16 more of each benign train set that are not already among its first 24
    assert gate["harmful"][1:] == ["orbench-toxic", "strongreject", "maliciousinstruct", "do-not-answer"]
    assert gate["n_harmful"] == 16 + 4 * 16 and gate["benign"][-2:] == [
        "orbench-hard-train",
        "phtest-harmless-train",
    ]
    # the energy models' states were recorded during label generation: no second pass, one shard
    shards = json.loads((out / "els/activations/cache.json").read_text())["shards"]
    assert len(shards) == 1 and shards[0]["n_prompts"] == 24 + 24 + 16
    # read back from the folder alone, the states and labels retrain the same bank
    from aligntax.energy import EnergyBank, train_layers
    from aligntax.runs.els_train import training_states

    train_cfg, acts, y = training_states(out / "els")
    bank = EnergyBank.load(out / "els")
    assert train_cfg.energy_config() == bank.config and len(y) == bank.metadata["n_states"] == 24 + 24 + 16
    again = train_layers(acts, y, train_cfg.energy_config())
    assert again.layers == bank.layers and again.metrics(bank.layers[0]) == bank.metrics(bank.layers[0])
    from aligntax.runs.els_train import sampled
    from aligntax.runs.eval import load_prompt_sets

    extra = 0
    for spec in ("orbench-hard-train", "phtest-harmless-train"):
        first24 = {it.id for it in load_prompt_sets([spec], 24)}
        extra += len({it.id for it in sampled(load_prompt_sets([spec]), 16, 0)} - first24)
    assert gate["n"] - gate["n_harmful"] == 48 + 300 + extra  # 300 harmless; duplicates dropped
    # calibrated for 99% out-of-fold recall on the harmful prompts, never above 0.5
    threshold = json.loads((out / "els/gate.json").read_text())["threshold"]
    assert (
        gate["recall_target"] == 0.99
        and threshold <= 0.5
        and gate["cv_at_threshold"]["harmful_caught"] >= 0.99
    )
    rows = [json.loads(line) for line in (out / "els/sweep/sweep.jsonl").read_text().splitlines()]
    # the front mechanisms of the complete evaluation, each in the sweep: harm-orthogonal descent and the
    # learned per-row strength on the best layer, the distilled adapter at two scales
    front = [r for r in rows if {"harm_orth", "row_strength"} & set(r["args"])]
    assert sorted(
        json.dumps({k: r["args"].get(k) for k in ("harm_orth", "row_strength", "row_threshold")})
        for r in front
    ) == sorted(
        [
            json.dumps({"harm_orth": 2, "row_strength": None, "row_threshold": -2.0}),
            json.dumps({"harm_orth": None, "row_strength": True, "row_threshold": None}),
        ]
    )
    assert (out / "els/row_strength.json").is_file() and (out / "els-lora/els_lora.json").is_file()
    lora = [r for r in rows if r["name"] == "els-lora"]
    assert sorted(r["args"]["scale"] for r in lora) == [0.5, 1.0]
    assert all(
        r["args"]["path"] == str(out / "els-lora") and r["leak_passed"] == r["leak_prompts"] for r in lora
    )
    # ELS on top of the adapter: the core setting on the best layer, the adapter everywhere or gated
    compose = [r for r in rows if r["name"] == "els-compose"]
    assert sorted(str(r["args"]["lora_gate"]) for r in compose) == ["0.1", "None"]
    assert all(r["args"]["adapter"] == str(out / "els-lora") for r in compose)
    rows = [r for r in rows if r not in front and r not in lora and r not in compose]
    gated = [r for r in rows if r["name"] == "els" and r["args"].get("gate") is True]  # the saved threshold
    ranked = json.loads((out / "els/energy.json").read_text())["layers"]
    runner_ups = [r for r in gated if "layers" in r["args"]]
    assert {r["args"]["layers"][0] for r in runner_ups} == set(ranked[1:3])  # the 2nd and 3rd best layers
    # the grid within the energy models' prompt-length domain, and the core setting without it
    domain = [r for r in gated if r["args"].get("max_prompt_tokens") is not None]
    assert len(domain) == 2 * (1 + len(ranked[1:3])) and len(gated) == len(domain) + 1
    assert len({r["args"]["max_prompt_tokens"] for r in domain}) == 1
    assert len(gated) == 2 * (1 + len(ranked[1:3])) + 1 and any(
        r["name"] == "els" and "gate" not in r["args"] for r in rows
    )
    assert all(r["args"]["threshold"] is None and r["args"]["horizon"] == 16 for r in gated)
    assert {r["args"]["row_threshold"] for r in gated} == {0.0, -2.0}  # the row energy decision
    assert all("degenerate" in r for r in rows)
    # benign validation is scored per set (OR-Bench-Hard val and PHTest val) and averaged; every setting is
    # also scored on the known-answer val questions
    benign_sets = {"orbench-hard-val", "phtest-harmless-val", "contrast-benign-val"}
    assert all(set(r["benign_by_set"]) == benign_sets for r in rows)
    assert all(abs(r["benign_compliance"] - sum(r["benign_by_set"].values()) / 3) < 1e-9 for r in rows)
    assert all(0 <= r["known_accuracy"] <= 1 and r["known_n"] == 60 for r in rows)
    # the jailbreak validation prompts (WildGuardTest adversarial, val half) are scored apart
    assert all(0 <= r["jailbreak_refusal"] <= 1 for r in rows)
    # the sweep keeps the unsteered answers, and gated settings take the rows the gate holds back from them
    assert (out / "els/sweep/unsteered-6tok.jsonl").is_file()
    assert all(0 <= r["reused_unsteered"] <= 3 * 60 + 39 + 41 + 60 + 60 + r["known_n"] for r in gated)
    # the leak check: 40 OR-Bench toxic prompts sampled after the 16 the gate was trained on are left out;
    # each gated setting's gate passes the same rows (one gate, one threshold)
    assert all(r["leak_sets"] == ["orbench-toxic"] and r["leak_prompts"] == 40 for r in gated)
    assert not any("leak_passed" in r for r in rows if r not in gated)
    passed = {r["leak_passed"] for r in gated}
    assert len(passed) == 1
    assert all(
        0 <= r["leak_refused"] <= r["leak_passed"] and 0 <= r["leak_refused_unsteered"] <= r["leak_passed"]
        for r in gated
    )
    store = (
        out / "els/sweep/unsteered-leak-6tok.jsonl"
    )  # unsteered answers, once, for the passed prompts only
    # (the adapter passes every leak prompt: it decides nothing per row)
    assert len(store.read_text().splitlines() if store.is_file() else []) == max(
        passed.pop(), *(r["leak_passed"] for r in lora)
    )
    # the leak check added to an earlier sweep (here: other leak prompts) scores only the leaks again
    from dataclasses import replace

    from aligntax.runs.demo import demo_sweep_config
    from aligntax.runs.els_sweep import run_sweep
    from aligntax.runs.els_train import prompt_domain, prompt_surprisal_domain

    before = {r["key"]: r for r in rows}
    demo_sweep = demo_sweep_config(
        cfg, out / "els", prompt_domain(out / "els", tiny_lm), prompt_surprisal_domain(out / "els", tiny_lm)
    )
    res = run_sweep(
        replace(
            demo_sweep,
            extra=[e for e in demo_sweep.extra if not {"harm_orth", "row_strength"} & set(e)],
            lora=[],
            compose=[],
            limit_leak=30,
        ),
        lm=tiny_lm,
    )
    again = [json.loads(line) for line in (out / "els/sweep/sweep.jsonl").read_text().splitlines()]
    done = len(rows) + len(front) + len(lora) + len(compose)
    assert (
        len(again) == done + len(gated) and res["n_settings"] == 2 + len(gated) and res["leak_prompts"] == 30
    )
    for r in again[done:]:
        old = before[r["key"]]
        assert r["leak_prompts"] == 30
        assert {k: r[k] for k in ("benign_compliance", "harmful_refusal")} == {
            k: old[k] for k in ("benign_compliance", "harmful_refusal")
        }
    report = (out / "report.md").read_text()
    assert "| orbench-hard-test | benign | compliance |" in report
    assert "useful compliance" in report and "pareto.png" in report and "Wall time (minutes)" in report
    assert "test_pareto.png" in report and "| system-prompt |" in report and "| cast |" in report
    minutes = json.loads((out / "timing.json").read_text())
    assert minutes["total"] >= minutes["baseline evaluation"] >= 0 and "validation sweep" in minutes
    if summary["best"] is not None:  # a steered run of the selected setting, with the same test sets
        from aligntax.interventions.selection import read_selection
        from aligntax.runs.els_score import sweep_iv_args

        steered = json.loads((out / "steered/config.json").read_text())
        name = summary["best"]["name"]
        assert steered["intervention"] == name
        args = sweep_iv_args(name, {"path": str(out / "els"), **summary["best"]["args"]})
        assert steered["intervention_args"] == args
        # the folder's selection (what --steer DIR applies) is exactly the steered run's setting
        chosen, chosen_args, record = read_selection(out)
        assert (chosen, chosen_args) == (name, args) and record["chosen_on"]["split"] == "validation"
        assert "jailbreak_refusal" in record["validation"]
        assert steered["reuse_unsteered"] == str(out / "baseline")
        timing = summary["steered"]["timing"]
        assert timing["new_samples"] + timing["reused_unsteered_samples"] == 12
        assert "Everyday questions with known answers" in report  # steered and unsteered, paired
        assert summary["knowns"]["steered"]["paired"]["n_pairs"] == 6
        # the paired change of every compliance / refusal row: up, down and the exact McNemar p-value
        rows = [
            line
            for line in report.splitlines()
            if line.startswith("| orbench-hard-test | benign | compliance")
        ]
        assert len(rows) == 1 and " up, " in rows[0] and "; p " in rows[0]
        # a different selection later: the old steered run is kept aside, not mixed with the new one
        cfg_path = out / "steered/config.json"
        old = json.loads(cfg_path.read_text())
        old["intervention_args"]["eta"] = 123.0
        cfg_path.write_text(json.dumps(old))
        run_demo(cfg, lm=tiny_lm)
        assert (out / "steered.prev1/config.json").is_file()
        assert json.loads(cfg_path.read_text())["intervention_args"] == steered["intervention_args"]


def test_quick_demo_halves_the_sweep_and_scores_the_strongest_baseline(tmp_path, tiny_lm, data_dir):
    """The default profile: every sweep setting on a stratified third of the validation prompts, the two
    best (and the unsteered model) on all of them, the answers of the first round reused; CAST alone
    on the test sets; the same files as the complete evaluation; a second run resumes without work."""
    from aligntax.runs.demo import DemoConfig, run_demo
    from aligntax.runs.els_score import row_key

    cfg = DemoConfig(
        out=str(tmp_path / "demo"),
        test_sets=["orbench-hard-test", "jailbreakbench"],
        limit=6,
        judge="keyword",
        max_new_tokens=6,
        limit_benign_train=24,
        limit_harmful_train=16,
        limit_gate_harmful=16,
        limit_gate_benign=16,
        sweep_max_new_tokens=6,
        limit_leak=40,
        sweep_limit=30,
        limit_reasoning=4,
        reasoning_max_new_tokens=6,
        progress=False,
    )
    assert not cfg.full and cfg.sweep_halving == 3 and cfg.test_baselines == []
    summary = run_demo(cfg, lm=tiny_lm)
    out = tmp_path / "demo"
    for path in (
        "baseline/results.json",
        "els/sweep/pareto.png",
        "report.md",
        "test_pareto.png",
        "reasoning-baseline/results.json",
    ):
        assert (out / path).is_file(), path
    assert not (out / "test-baselines").exists()
    rows = [json.loads(line) for line in (out / "els/sweep/sweep.jsonl").read_text().splitlines()]
    first = [r for r in rows if json.loads(r["key"])["data"].get("part") == "1/3"]
    second = [r for r in rows if "part" not in json.loads(r["key"])["data"]]
    ranked = json.loads((out / "els/energy.json").read_text())["layers"]
    # unsteered, the best layers x 2 row cut-offs, the paper-style one, and harm-orthogonal descent on the
    # best layer (the quick profile's front mechanism)
    n_settings = 1 + 2 * len(ranked[:3]) + 1 + 1 + 1  # + the core setting without the length domain
    assert len(first) == n_settings and len(second) == 1 + 2
    assert [r["args"]["harm_orth"] for r in first if "harm_orth" in r["args"]] == [2]
    # a third of each validation set (rounded up), known answers too
    full_none = next(r for r in second if r["name"] == "none")
    part_none = next(r for r in first if r["name"] == "none")
    assert part_none["known_n"] == -(-full_none["known_n"] // 3)
    assert all("leak_passed" not in r for r in first)  # the leak check runs for the finalists only
    finalists = [r for r in second if r["name"] == "els"]
    best = json.loads((out / "els/sweep/best.json").read_text())
    assert best["halving"]["part"] == "1/3" and best["halving"]["finalists"] == [r["args"] for r in finalists]
    if summary["best"] is not None:
        assert summary["best"]["args"] in best["halving"]["finalists"]
    # the finalists are the best of the first round: eligible first, then by benign score
    base = part_none
    from aligntax.runs.els_sweep import eligible

    ranked = sorted(
        (r for r in first if r["name"] == "els"),
        key=lambda r: (not eligible(r, base), -r["benign_compliance"], -r["harmful_refusal"]),
    )
    assert [r["args"] for r in ranked[:2]] == [r["args"] for r in finalists]
    # the second round generated only the prompts the first did not: each finalist's stored answers
    # are unique per prompt
    stored = [json.loads(line) for line in (out / "els/sweep/steered-6tok.jsonl").read_text().splitlines()]
    for r in finalists:
        setting = row_key("els", r["args"], "generate", 6, None)
        prompts = [s["prompt"] for s in stored if s["setting"] == setting]
        assert len(prompts) == len(set(prompts)) <= r["steered_rows"]
        assert (len(prompts) > 0) == (r["steered_rows"] > 0)
    again = run_demo(cfg, lm=tiny_lm)
    assert [json.loads(line) for line in (out / "els/sweep/sweep.jsonl").read_text().splitlines()] == rows
    assert again["best"] == summary["best"]


def test_demo_clock_scales_by_calibration_then_by_measured_stages():
    from aligntax.runs.demo import STAGE_MINUTES, _Clock

    typical = STAGE_MINUTES["quick"]
    stages = list(typical)
    clock = _Clock(stages, show=False, typical=typical)
    clock.speed = 2.0  # the calibration forward took twice the reference machine's time
    assert clock.left(1) == pytest.approx(2.0 * sum(typical[s] for s in stages[1:]))
    # once stages worth over half a minute are done, their measured minutes set the scale
    clock.laps = {stages[0]: typical[stages[0]] * 3, stages[1]: typical[stages[1]] * 3}
    assert clock.left(2) == pytest.approx(3.0 * sum(typical[s] for s in stages[2:]))
    clock.begin(2, "a stage")
    assert len(clock.estimates) == 1 and clock.estimates[0] > 0


def test_calibration_forward_runs_on_a_tiny_model(tiny_lm):
    from aligntax.runs.demo import calibrate

    seconds = calibrate(tiny_lm, rows=2, tokens=4, repeats=1)
    assert 0 < seconds < 30


def test_test_subsets_sample_each_attack_alike(data_dir):
    """The quick profile's jailbreak test set: 40 prompts of each JailbreakBench attack, the same draw
    every run, the other test sets whole."""
    from collections import Counter

    from aligntax.runs.demo import DemoConfig
    from aligntax.runs.eval import EvalConfig, eval_items

    cfg = DemoConfig()
    ev = EvalConfig(data=["xstest-safe", "jbb-attacks"], subsets=dict(cfg.test_subsets))
    items = eval_items(ev)
    counts = Counter(it.source for it in items)
    assert counts == {
        "xstest": 250,
        **{f"jbb-{a}": 40 for a in ("pair", "jbc", "random-search", "gcg", "dsn")},
    }
    assert [(it.source, it.id) for it in eval_items(ev)] == [(it.source, it.id) for it in items]
    assert len(eval_items(EvalConfig(data=["jbb-attacks"]))) == 482
