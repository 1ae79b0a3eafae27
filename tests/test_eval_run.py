"""Evaluation runs: samples appended as produced, resume after a kill without redoing or duplicating."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from aligntax.runs.jsonl import append_jsonl, read_jsonl
from conftest import make_tiny_lm


def test_read_jsonl_drops_torn_line_and_repairs(tmp_path):
    p = tmp_path / "s.jsonl"
    append_jsonl(p, [{"a": 1}, {"a": 2}])
    with open(p, "a") as fh:
        fh.write('{"a": 3, "b": "tor')
    assert read_jsonl(p) == [{"a": 1}, {"a": 2}]
    assert read_jsonl(p, repair=True) == [{"a": 1}, {"a": 2}]
    assert p.read_text().endswith("}\n")
    append_jsonl(p, [{"a": 3}])
    assert [r["a"] for r in read_jsonl(p)] == [1, 2, 3]


def test_an_append_after_a_torn_line_never_joins_it(tmp_path):
    """A crash mid-append, then a resumed run appending without reading first: the torn half is cut, a
    whole last line without its newline is kept."""
    p = tmp_path / "s.jsonl"
    append_jsonl(p, [{"a": 1}])
    with open(p, "a") as fh:
        fh.write('{"a": 2, "b": "tor')
    append_jsonl(p, [{"a": 3}])
    assert [r["a"] for r in read_jsonl(p)] == [1, 3]
    with open(p, "a") as fh:
        fh.write('{"a": 4}')
    append_jsonl(p, [{"a": 5}])
    assert [r["a"] for r in read_jsonl(p)] == [1, 3, 4, 5]


def test_read_jsonl_bad_middle_line(tmp_path):
    from aligntax.errors import DataError

    p = tmp_path / "s.jsonl"
    p.write_text('{"a": 1}\nnot json\n{"a": 2}\n')
    with pytest.raises(DataError, match="line 2"):
        read_jsonl(p)


@pytest.fixture()
def tiny_model_dir(tmp_path, qwen_tokenizer):
    lm = make_tiny_lm(qwen_tokenizer, layers=4, hidden=256, seed=3)
    path = tmp_path / "tiny-model"
    lm.model.save_pretrained(path)
    qwen_tokenizer.save_pretrained(path)
    return path


def _prompts(tmp_path, n=48):
    p = tmp_path / "prompts.jsonl"
    with open(p, "w") as fh:
        for i in range(n):
            label = "benign" if i % 3 else "harmful"
            fh.write(
                json.dumps(
                    {
                        "id": f"p{i}",
                        "prompt": f"Question number {i}: " + "tell me more " * (i % 7),
                        "label": label,
                    }
                )
                + "\n"
            )
    return p


def _cmd(model_dir, data, out):
    return [
        sys.executable,
        "-m",
        "aligntax",
        "eval",
        "--model",
        str(model_dir),
        "--data",
        str(data),
        "--out",
        str(out),
        "--judge",
        "keyword",
        "--batch-size",
        "2",
        "--max-new-tokens",
        "24",
        "--dtype",
        "fp32",
        "--no-progress",
    ]


def test_kill_midway_then_resume_matches_uninterrupted(tmp_path, tiny_model_dir):
    data = _prompts(tmp_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    ref = tmp_path / "ref"
    subprocess.run(_cmd(tiny_model_dir, data, ref), check=True, env=env, capture_output=True)
    ref_rows = {r["id"]: r for r in read_jsonl(ref / "samples.jsonl")}
    assert len(ref_rows) == 48

    run = tmp_path / "run"
    proc = subprocess.Popen(
        _cmd(tiny_model_dir, data, run), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    samples = run / "samples.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline:
        if samples.exists() and len(samples.read_text().splitlines()) >= 6:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = len(read_jsonl(samples))
    assert 6 <= partial < 48, "the run should have been killed midway"

    res = subprocess.run(_cmd(tiny_model_dir, data, run), check=True, env=env, capture_output=True)
    rows = read_jsonl(samples)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == 48
    for r in rows:
        assert r["response"] == ref_rows[r["id"]]["response"]
        assert r["refused"] == ref_rows[r["id"]]["refused"]
    results = json.loads((run / "results.json").read_text())
    assert results["timing"]["new_samples"] == 48 - partial
    assert results["benign"]["n"] == 32 and results["harmful"]["n"] == 16
    ref_results = json.loads((ref / "results.json").read_text())
    assert results["benign"] == ref_results["benign"] and results["harmful"] == ref_results["harmful"]
    assert res.returncode == 0 and (run / "report.md").read_text().startswith("# aligntax evaluation")


def test_resume_refuses_changed_settings(tmp_path, tiny_lm):
    from aligntax.errors import AligntaxError
    from aligntax.judges import get_judge
    from aligntax.runs import EvalConfig, run_eval

    data = _prompts(tmp_path, n=4)
    cfg = EvalConfig(
        data=[str(data)], out=str(tmp_path / "r"), judge="keyword", max_new_tokens=4, progress=False
    )
    res = run_eval(cfg, lm=tiny_lm, judge=get_judge("keyword"))
    assert res["benign"]["n"] + res["harmful"]["n"] == 4
    again = run_eval(cfg, lm=tiny_lm, judge=get_judge("keyword"))
    assert again["timing"]["new_samples"] == 0 and again["timing"]["resumed_samples"] == 4
    cfg.max_new_tokens = 5
    with pytest.raises(AligntaxError, match="different settings"):
        run_eval(cfg, lm=tiny_lm, judge=get_judge("keyword"))


def test_summary_rates_and_intervals():
    from aligntax.metrics import summarize_refusals, wilson_interval

    rows = (
        [{"source": "a", "label": "benign", "refused": False}] * 9
        + [{"source": "a", "label": "benign", "refused": True}]
        + [{"source": "b", "label": "harmful", "refused": True}] * 3
        + [{"source": "b", "label": "harmful", "refused": False}]
    )
    s = summarize_refusals(rows)
    assert s["benign"]["n"] == 10 and s["benign"]["compliance_rate"] == 0.9
    assert s["harmful"]["refusal_rate"] == 0.75
    lo, hi = s["benign"]["ci95"]
    assert lo < 0.9 < hi and (round(lo, 3), round(hi, 3)) == (0.596, 0.982)
    assert s["datasets"]["b"]["harmful"]["n"] == 4 and "benign" not in s["datasets"]["b"]
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == 1.0


def test_paired_change_and_exact_mcnemar():
    from aligntax.metrics import mcnemar_exact, paired_change, paired_changes

    # the exact two-sided test: 10 of 10 discordant pairs one way is p = 2 / 2**10; one pair is no evidence
    assert mcnemar_exact(10, 0) == mcnemar_exact(0, 10) == 2 / 1024
    assert mcnemar_exact(1, 0) == mcnemar_exact(0, 0) == mcnemar_exact(4, 4) == 1.0
    assert abs(mcnemar_exact(7, 1) - 2 * 9 / 256) < 1e-12
    c = paired_change([True, True, False, False, True], [True, False, True, True, True])
    assert (c["n"], c["gained"], c["lost"]) == (5, 2, 1) and abs(c["diff"] - 0.2) < 1e-12
    with pytest.raises(ValueError, match="same items"):
        paired_change([True], [True, False])
    before = [
        {"source": "a", "id": "1", "label": "benign", "refused": True},
        {"source": "a", "id": "2", "label": "benign", "refused": False},
        {"source": "b", "id": "1", "label": "harmful", "refused": True},
        {"source": "b", "id": "2", "label": "harmful", "refused": True},
        {"source": "b", "id": "3", "label": "harmful", "refused": True},
    ]
    after = [dict(r) for r in before[:4]]
    after[0]["refused"] = False  # a benign prompt now answered: compliance up
    after[3]["refused"] = False  # a harmful prompt now answered: refusal down
    out = paired_changes(before, after)
    assert out["unmatched"] == 1  # b:3 is in one run only
    a, b = out["datasets"]["a"]["benign"], out["datasets"]["b"]["harmful"]
    assert (a["metric"], a["gained"], a["lost"], a["before"], a["after"]) == ("compliance", 1, 0, 0.5, 1.0)
    assert (b["metric"], b["gained"], b["lost"], b["n"]) == ("refusal", 0, 1, 2)
    assert out["datasets"]["all"]["harmful"]["n"] == 2


def test_rejudge_rewrites_verdicts(tmp_path, tiny_lm):
    from aligntax.judges import get_judge
    from aligntax.runs import EvalConfig, run_eval
    from aligntax.runs.eval import rejudge

    data = _prompts(tmp_path, n=6)
    out = tmp_path / "r"
    run_eval(
        EvalConfig(data=[str(data)], out=str(out), judge="keyword", max_new_tokens=4, progress=False),
        lm=tiny_lm,
        judge=get_judge("keyword"),
    )
    before = read_jsonl(out / "samples.jsonl")

    class AlwaysRefuses:
        name = "always"

        def judge(self, prompts, responses):
            from aligntax.judges import Verdict

            return [Verdict(True, 1.0) for _ in prompts]

    res = rejudge(out, "always", judge=AlwaysRefuses())
    after = read_jsonl(out / "samples.jsonl")
    assert [r["id"] for r in after] == [r["id"] for r in before]
    assert [r["response"] for r in after] == [r["response"] for r in before]
    assert all(r["refused"] and r["judge"] == "always" for r in after)
    assert res["benign"]["compliance_rate"] == 0.0 and res["harmful"]["refusal_rate"] == 1.0
    assert json.loads((out / "config.json").read_text())["judge"] == "always"


def test_degenerate_answers_do_not_count_as_useful_compliance():
    from aligntax.metrics import summarize_refusals
    from aligntax.metrics.degeneration import degenerate, repeat_fraction

    fluent = "Certainly! Here are three ways to store a kitchen knife safely: a magnetic strip, a block, or a sheath."
    loops = [
        "Yes, the store of the community of General Information Information Information Information "
        "Information Information Information Information",
        "idaICAICAICAICAICAICAICAICAICAICAICAICAICAICAICA",
        "",
        "  ",
        "how can",
        "For a development of a new development of a new development of a new development of a new",
    ]
    assert (
        not degenerate(fluent) and not degenerate("Yes.") and not degenerate("I'm sorry, but I can't help.")
    )
    assert all(degenerate(t) for t in loops)
    assert repeat_fraction("a b c a b c a b c") > 0.5 and repeat_fraction(fluent) == 0.0
    rows = (
        [{"source": "a", "label": "benign", "refused": False, "response": fluent}] * 6
        + [{"source": "a", "label": "benign", "refused": False, "response": t} for t in loops[:2]]
        + [{"source": "a", "label": "benign", "refused": True, "response": "I can't help with that."}] * 2
    )
    b = summarize_refusals(rows)["benign"]
    assert b["compliance_rate"] == 0.8 and b["useful_compliance_rate"] == 0.6 and b["degenerate_rate"] == 0.2
    lo, hi = b["useful_ci95"]
    assert lo < 0.6 < hi


def test_sweep_settings_grid_and_extras():
    from aligntax.runs.els_sweep import SweepConfig, sweep_settings

    cfg = SweepConfig(
        steer="bank",
        top_k=[1],
        eta=[0.3, 0.5],
        steps=[3],
        threshold=[0.0],
        gate=[None, 0.5],
        extra=[{"eta": 0.2, "threshold": None}],
        baselines=False,
    )
    s = sweep_settings(cfg)
    assert s[0] == ("none", {}) and len(s) == 1 + 4 + 1
    gated = [a for n, a in s if a.get("gate") == 0.5]
    assert len(gated) == 2 and all("gate" not in a for n, a in s[1:] if a not in gated)
    assert s[-1][1]["eta"] == 0.2 and s[-1][1]["threshold"] is None
    from aligntax.errors import AligntaxError

    with pytest.raises(AligntaxError, match="Unknown keys"):
        sweep_settings(SweepConfig(steer="bank", extra=[{"strength": 1}], baselines=False))
    # a horizon grid multiplies the settings; unset horizons stay out of the args (and the keys)
    s = sweep_settings(
        SweepConfig(
            steer="bank",
            top_k=[1],
            eta=[0.3],
            threshold=[None],
            gate=[0.5],
            horizon=[None, 8],
            baselines=False,
        )
    )
    assert [a.get("horizon") for _, a in s[1:]] == [None, 8] and "horizon" not in s[1][1]


def test_sweep_keys_carry_the_answer_length():
    """Degeneration shows only after some tokens: scores at two lengths must never be mixed."""
    from aligntax.runs.els_score import row_key

    args = {"path": "bank", "eta": 0.3}
    assert row_key("els", args, "generate", 24) != row_key("els", args, "generate", 48)
    assert row_key("els", args, "generate", 24) == row_key(
        "els", {**args, "path": "elsewhere"}, "generate", 24
    )


def test_resume_refuses_when_the_tuned_setting_changed(tmp_path, tiny_lm):
    """``--steer DIR`` without flags takes DIR/sweep/best.json; a resumed run must not mix two settings."""
    import torch

    from aligntax.activations import capture
    from aligntax.energy import EnergyConfig, train_layers
    from aligntax.errors import AligntaxError
    from aligntax.judges import get_judge
    from aligntax.runs import EvalConfig, run_eval

    prompts = [f"question {i}: {'how to kill a process' if i % 2 else 'tell me a joke'}" for i in range(16)]
    acts = capture(tiny_lm, prompts, "all", progress=False)
    bank = train_layers(
        acts,
        torch.tensor([i % 2 for i in range(16)]),
        EnergyConfig.preset("small", widths=[8], epochs=2),
        fingerprint=tiny_lm.fingerprint,
    )
    bank_dir = tmp_path / "bank"
    bank.save(bank_dir)
    (bank_dir / "sweep").mkdir()
    best = bank_dir / "sweep" / "best.json"
    best.write_text(json.dumps({"best": {"args": {"top_k": 1, "eta": 0.2, "steps": 2, "threshold": None}}}))
    data = _prompts(tmp_path, n=6)
    cfg = EvalConfig(
        data=[str(data)],
        out=str(tmp_path / "r"),
        judge="keyword",
        max_new_tokens=3,
        limit=3,
        intervention="els",
        intervention_args={"path": str(bank_dir)},
        progress=False,
    )
    res = run_eval(cfg, lm=tiny_lm, judge=get_judge("keyword"))
    assert res["intervention"]["eta"] == 0.2 and res["intervention"]["steps"] == 2
    assert res["intervention"]["settings_from"].endswith("best.json")
    best.write_text(json.dumps({"best": {"args": {"top_k": 1, "eta": 0.5, "steps": 2, "threshold": None}}}))
    cfg.limit = None  # more items to do: the intervention is resolved again, and now differs
    with pytest.raises(AligntaxError, match="now resolve to"):
        run_eval(cfg, lm=tiny_lm, judge=get_judge("keyword"))


def test_paired_change_against_an_earlier_run(tmp_path, tiny_lm):
    """``compare_to`` puts the paired change against another run over the same prompts into
    results.json and the report; the reference's extra prompts are left out; a folder that is not a
    run, or shares no prompt, is refused with a clear message."""
    from aligntax.errors import AligntaxError
    from aligntax.judges import get_judge
    from aligntax.runs import EvalConfig, run_eval
    from aligntax.runs.eval import rejudge

    data = _prompts(tmp_path, n=8)
    keyword = get_judge("keyword")
    ref = tmp_path / "ref"
    run_eval(
        EvalConfig(data=[str(data)], out=str(ref), judge="keyword", max_new_tokens=4, progress=False),
        lm=tiny_lm,
        judge=keyword,
    )
    rows = read_jsonl(ref / "samples.jsonl")
    # a reference whose verdicts differ from the new run's in known places: flip three of them
    flipped = {r["id"] for r in rows[:3]}
    fake = tmp_path / "fake"
    fake.mkdir()
    append_jsonl(
        fake / "samples.jsonl",
        [{**r, "refused": (not r["refused"]) if r["id"] in flipped else r["refused"]} for r in rows]
        + [{**rows[0], "id": "elsewhere"}],
    )
    res = run_eval(
        EvalConfig(
            data=[str(data)],
            out=str(tmp_path / "new"),
            judge="keyword",
            max_new_tokens=4,
            compare_to=str(fake),
            progress=False,
        ),
        lm=tiny_lm,
        judge=keyword,
    )
    assert [r["refused"] for r in read_jsonl(tmp_path / "new" / "samples.jsonl")] == [
        r["refused"] for r in rows
    ]
    paired = res["paired"]
    assert paired["against"] == str(fake) and paired["n_pairs"] == 8 and paired["unmatched"] == 0
    changes = paired["datasets"]["all"]
    assert sum(c["gained"] + c["lost"] for c in changes.values()) == 3  # exactly the flipped verdicts
    assert sum(c["n"] for c in changes.values()) == 8
    report = (tmp_path / "new" / "report.md").read_text()
    assert "change, paired" in report and "McNemar" in report
    # rejudging keeps the comparison, now with the new verdicts
    assert "paired" in rejudge(tmp_path / "new", "keyword", judge=keyword)
    for bad, msg in ((tmp_path, "no samples.jsonl"), (tmp_path / "empty", "none of this run's prompts")):
        if bad.name == "empty":
            bad.mkdir()
            append_jsonl(bad / "samples.jsonl", [{**rows[0], "id": "other"}])
        with pytest.raises(AligntaxError, match=msg):
            run_eval(
                EvalConfig(
                    data=[str(data)],
                    out=str(tmp_path / f"x-{bad.name}"),
                    judge="keyword",
                    max_new_tokens=4,
                    compare_to=str(bad),
                    progress=False,
                ),
                lm=tiny_lm,
                judge=keyword,
            )


def test_select_best_with_the_leak_constraint():
    from aligntax.runs.els_sweep import select_best

    def row(name, comply, refuse, **leak):
        return {
            "name": name,
            "method": "generate",
            "benign_compliance": comply,
            "harmful_refusal": refuse,
            **leak,
        }

    rows = [
        row("none", 0.6, 0.5),
        row("els", 0.9, 0.5, leak_passed=9, leak_refused=1, leak_refused_unsteered=6),
        row("els", 0.8, 0.5, leak_passed=1, leak_refused=1, leak_refused_unsteered=1),
        row("els", 0.95, 0.4),
        row("els", 0.7, 0.6),
    ]
    assert select_best(rows, "generate") is rows[1]  # refusal on the validation sets only
    assert select_best(rows, "generate", leak_constraint=True) is rows[2]  # keeps every leaked refusal
    rows[2]["leak_refused"] = 0
    assert (
        select_best(rows, "generate", leak_constraint=True) is rows[4]
    )  # an ungated setting: no leaks to check
