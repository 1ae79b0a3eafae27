"""Known-answer capability check: the built-in set, the answer matching, the loader's errors, and the run
folder on a tiny random model (resume, changed settings, rescoring, the paired comparison, the CLI)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from aligntax.errors import AligntaxError, DataError
from aligntax.interventions import SystemPrompt
from aligntax.metrics.knowns import (
    KINDS,
    KnownItem,
    is_correct,
    load_known_answers,
    normalize,
    score_responses,
)
from aligntax.metrics.rates import wilson_interval
from aligntax.runs.knowns import KnownsConfig, run_knowns
from tiny import tiny_lm

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- the built-in set ------------------------------------------------------------------------------------
def test_builtin_set_is_well_formed():
    items = load_known_answers("builtin")
    assert len(items) >= 300
    assert len({it.id for it in items}) == len(items)
    assert len({it.prompt for it in items}) == len(items)
    assert all(it.answers and all(a.strip() for a in it.answers) for it in items)
    counts = Counter((it.kind, it.split) for it in items)
    assert {k for k, _ in counts} == set(KINDS)
    for kind in KINDS:  # half val, half test, within every kind
        assert counts[(kind, "val")] == counts[(kind, "test")] >= 50
    # no prompt already contains its answer (the check would pass by repeating the question)
    assert [it.id for it in items if it.check(it.prompt)] == []
    assert [(it.id, it.kind) for it in load_known_answers(limit=3)] == [
        ("known:001", "arithmetic"),
        ("known:002", "fact"),
        ("known:003", "instruction"),
    ]  # interleaved kinds


def test_split_and_limit():
    val, test = load_known_answers(split="val"), load_known_answers(split="test")
    assert {it.split for it in val} == {"val"} and {it.split for it in test} == {"test"}
    assert len(val) + len(test) == len(load_known_answers(split="all")) == len(load_known_answers(split=None))
    assert not {it.id for it in val} & {it.id for it in test}
    assert load_known_answers(split="val", limit=5) == val[:5]
    with pytest.raises(AligntaxError, match="Unknown split 'train'"):
        load_known_answers(split="train")


# ---- matching -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "response, answers, ok",
    [
        ("100 minus 42 is 58.", ["58", "fifty-eight"], True),
        ("78", ["58"], False),
        ("The answer is 158.", ["58"], False),
        ("It is 5.8 metres.", ["58"], False),
        ("58.5", ["58"], False),
        ("5,8", ["58"], False),
        ("**58**", ["58"], True),
        ("`58`", ["58"], True),
        ("The result is fifty-eight.", ["58", "fifty-eight"], True),
        ("The result is fifty-eight.", ["58"], False),  # a number word counts only when listed
        ("The capital of Japan is Tokyo.", ["Tokyo"], True),
        ("The capital of Japan is Tokoku.", ["Tokyo"], False),
        ("TOKYO", ["Tokyo"], True),
        ("Tokyoite", ["Tokyo"], False),
        ("There are 1,000 grams in a kilogram.", ["1000"], True),
        ("There are 1000 grams in a kilogram.", ["1,000"], True),
        ("There are 10,000 grams.", ["1000"], False),
        ("Plants take in CO₂.", ["CO2"], True),
        ("The capital of Argentina is Buenos\n  Aires.", ["Buenos Aires"], True),
        ("", ["58"], False),
    ],
)
def test_is_correct(response, answers, ok):
    assert is_correct(response, answers) is ok


def test_case_sensitive_and_options():
    assert is_correct("In capital letters: APPLE", ["APPLE"], case_sensitive=True)
    assert not is_correct("apple", ["APPLE"], case_sensitive=True)
    assert is_correct("apple", ["APPLE"])
    opts = ["pear", "apple", "mango"]
    assert is_correct("The word that comes first is apple.", ["apple"], options=opts)
    assert is_correct("Apple comes before mango and pear.", ["apple"], options=opts)
    assert not is_correct("Pear comes first, then apple.", ["apple"], options=opts)
    assert not is_correct("Which of pear, apple, mango?", ["apple"], options=opts)  # restating the question
    assert not is_correct("None of them.", ["apple"], options=opts)
    assert normalize("  **Tokyo**\n is `big` ") == "tokyo is big"


def test_score_responses():
    items = [
        KnownItem("a", "What is 100 minus 42?", ("58",), "arithmetic", "test"),
        KnownItem("b", "Capitals?", ("APPLE",), "instruction", "val", case_sensitive=True),
    ]
    assert score_responses(items, ["It is 58.", "apple"]) == [True, False]
    with pytest.raises(ValueError):
        score_responses(items, ["58"])


# ---- loading user files -----------------------------------------------------------------------------------
def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def _jsonl(*records):
    return "".join(json.dumps(r) + "\n" for r in records)


R = {"id": "x1", "prompt": "What is 2 + 3?", "answers": ["5", "five"], "kind": "arithmetic", "split": "test"}


def test_load_user_files(tmp_path):
    p = _write(
        tmp_path,
        "k.jsonl",
        _jsonl(
            R,
            {
                **R,
                "id": "x2",
                "answers": 7,
                "split": "val",
                "kind": "mine",
                "options": ["a", "b"],
                "case_sensitive": True,
            },
        ),
    )
    a, b = load_known_answers(p, split="all")
    assert a == KnownItem("x1", "What is 2 + 3?", ("5", "five"), "arithmetic", "test")
    assert b.answers == ("7",) and b.kind == "mine" and b.options == ("a", "b") and b.case_sensitive
    assert load_known_answers(p, split="val") == [b]
    j = _write(tmp_path, "k.json", json.dumps([R]))
    assert load_known_answers(j) == [a]


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("empty.jsonl", "\n\n", "empty"),
        (
            "nofields.jsonl",
            _jsonl({"prompt": "q", "answers": ["a"]}),
            "missing field(s) 'id', 'kind', 'split'",
        ),
        ("dup.jsonl", _jsonl(R, R), "duplicate id 'x1'"),
        ("split.jsonl", _jsonl({**R, "split": "train"}), "'split' must be one of val, test; got 'train'"),
        ("noanswers.jsonl", _jsonl({**R, "answers": []}), "'answers' must be a non-empty list"),
        ("blankanswer.jsonl", _jsonl({**R, "answers": ["5", " "]}), "'answers' holds an empty"),
        ("noprompt.jsonl", _jsonl({**R, "prompt": ""}), "'prompt' must be a non-empty string"),
        ("case.jsonl", _jsonl({**R, "case_sensitive": "yes"}), "'case_sensitive' must be true or false"),
        ("torn.jsonl", _jsonl(R) + '{"id": "q", \n', "line 2: malformed JSON"),
    ],
)
def test_loader_errors_name_the_problem(tmp_path, name, text, message):
    p = _write(tmp_path, name, text)
    with pytest.raises(DataError) as e:
        load_known_answers(p, split="all")
    assert message in str(e.value) and str(p) in str(e.value)


def test_missing_file_and_empty_split(tmp_path):
    with pytest.raises(DataError, match="file not found"):
        load_known_answers(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="no items in the split 'val'"):
        load_known_answers(_write(tmp_path, "k.jsonl", _jsonl(R)), split="val")


# ---- the run folder on a tiny random model ---------------------------------------------------------------
@pytest.fixture(scope="module")
def lm():
    return tiny_lm("qwen2", hidden=32, layers=3)


def _data(tmp_path, n=6):
    items = load_known_answers(split="all", limit=n)
    return _write(tmp_path, "k.jsonl", "".join(json.dumps(it.to_dict()) + "\n" for it in items))


def _rows(out):
    return [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]


def _cfg(out, data, **kw):
    return KnownsConfig(
        out=str(out),
        model="tiny",
        data=str(data),
        split="all",
        max_new_tokens=6,
        batch_size=4,
        dtype="fp32",
        progress=False,
        **kw,
    )


def test_run_writes_samples_results_and_report(tmp_path, lm):
    data = _data(tmp_path)
    res = run_knowns(_cfg(tmp_path / "run", data), lm=lm)
    rows = _rows(tmp_path / "run")
    assert [r["id"] for r in sorted(rows, key=lambda r: r["id"])] == [f"known:00{i}" for i in range(1, 7)]
    assert {"id", "prompt", "kind", "split", "answers", "response", "correct", "n_tokens"} <= set(rows[0])
    assert all(r["correct"] == is_correct(r["response"], r["answers"]) for r in rows)
    k = sum(r["correct"] for r in rows)
    assert res["n"] == 6 and res["correct"] == k and res["ci95"] == list(wilson_interval(k, 6))
    assert list(res["by_kind"]) == list(KINDS) and all(r["n"] == 2 for r in res["by_kind"].values())
    assert res["intervention"] is None and "paired" not in res
    cut = [r for r in rows if not r["correct"] and r["finish_reason"] == "length"]
    assert res["cut_off"]["all"] == len(cut) and set(res["cut_off"]) == {"all", *KINDS}
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert (
        saved["n"] == 6 and json.loads((tmp_path / "run" / "config.json").read_text())["max_new_tokens"] == 6
    )
    assert "| **all** | 6 |" in (tmp_path / "run" / "report.md").read_text()


def test_resume_does_not_redo_or_duplicate(tmp_path, lm):
    data = _data(tmp_path)
    out = tmp_path / "run"
    first = run_knowns(_cfg(out, data, limit=4), lm=lm)
    lines = (out / "samples.jsonl").read_text().splitlines()
    assert len(lines) == 4 and first["timing"]["new_samples"] == 4
    again = run_knowns(_cfg(out, data, limit=4), lm=lm)
    assert (out / "samples.jsonl").read_text().splitlines() == lines and again["timing"]["new_samples"] == 0
    assert again["accuracy"] == first["accuracy"] and again["n"] == first["n"]
    # a crash mid-write: a torn last line is dropped and that item generated again, nothing duplicated
    (out / "samples.jsonl").write_text("\n".join(lines[:2]) + "\n" + lines[2][:15])
    more = run_knowns(_cfg(out, data), lm=lm)
    rows = _rows(out)
    assert len(rows) == 6 and len({r["id"] for r in rows}) == 6 and more["timing"]["new_samples"] == 4
    assert [r for r in rows if r["id"] == json.loads(lines[0])["id"]] == [json.loads(lines[0])]


def test_changed_settings_are_refused(tmp_path, lm):
    data = _data(tmp_path)
    run_knowns(_cfg(tmp_path / "run", data, limit=2), lm=lm)
    with pytest.raises(AligntaxError, match=r"different settings \(max_new_tokens: 6 -> 8\)"):
        run_knowns(replace(_cfg(tmp_path / "run", data, limit=2), max_new_tokens=8), lm=lm)
    with pytest.raises(AligntaxError, match="system: None -> 'Be brief.'"):
        run_knowns(_cfg(tmp_path / "run", data, limit=2, system="Be brief."), lm=lm)


def test_fixed_answers_rescore_and_compare_to(tmp_path, lm):
    """Correcting an accepted answer rescores a finished run without generating; ``compare_to`` pairs two
    runs by id, both scored with the current answers."""
    data = _data(tmp_path)
    base = run_knowns(_cfg(tmp_path / "base", data), lm=lm)
    rows = _rows(tmp_path / "base")
    target = next(r for r in rows if normalize(r["response"]).strip() and not r["correct"])
    records = [json.loads(x) for x in data.read_text().splitlines()]
    for rec in records:  # accept exactly what the model said for one item
        if rec["id"] == target["id"]:
            rec["answers"] = [*rec["answers"], target["response"]]
    data.write_text(_jsonl(*records))
    fixed = run_knowns(_cfg(tmp_path / "base", data), lm=lm)
    assert fixed["timing"]["new_samples"] == 0 and fixed["correct"] == base["correct"] + 1
    assert next(r for r in _rows(tmp_path / "base") if r["id"] == target["id"])["correct"] is True
    # a changed prompt is generated again and replaces the item's old row
    records[0]["prompt"] += " Please."
    data.write_text(_jsonl(*records))
    changed = run_knowns(_cfg(tmp_path / "base", data), lm=lm)
    rows = _rows(tmp_path / "base")
    assert changed["timing"]["new_samples"] == 1 and len(rows) == 6
    assert [r["prompt"] for r in rows if r["id"] == records[0]["id"]] == [records[0]["prompt"]]
    fixed = changed

    other = run_knowns(
        _cfg(tmp_path / "sys", data, compare_to=str(tmp_path / "base")),
        lm=lm,
        intervention=SystemPrompt("Answer in French.", name="system-prompt"),
    )
    assert other["intervention"]["name"] == "system-prompt"
    before = {r["id"]: r["correct"] for r in _rows(tmp_path / "base")}
    after = {r["id"]: r["correct"] for r in _rows(tmp_path / "sys")}
    p = other["paired"]
    assert p["against"] == str(tmp_path / "base") and p["n_pairs"] == 6 and p["unmatched"] == 0
    assert p["gained"] == sum(after[i] and not before[i] for i in before)
    assert p["lost"] == sum(before[i] and not after[i] for i in before)
    assert p["before"] == pytest.approx(fixed["accuracy"]) and p["after"] == pytest.approx(other["accuracy"])
    assert set(p["by_kind"]) == set(KINDS) and sum(c["n"] for c in p["by_kind"].values()) == 6
    assert 0.0 <= p["p_value"] <= 1.0 and "Paired against" in (tmp_path / "sys" / "report.md").read_text()
    with pytest.raises(AligntaxError, match="no samples.jsonl"):
        run_knowns(_cfg(tmp_path / "sys", data, compare_to=str(tmp_path / "nothing")), lm=lm)


def test_cli_knowns(tmp_path, monkeypatch):
    from aligntax.cli import app

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model_dir = tmp_path / "model"
    m = tiny_lm("qwen2", hidden=32, layers=3)
    m.model.save_pretrained(model_dir)
    m.tokenizer.save_pretrained(model_dir)
    data = _data(tmp_path, n=4)
    runner = CliRunner()
    args = [
        "knowns",
        "--model",
        str(model_dir),
        "--data",
        str(data),
        "--split",
        "all",
        "--dtype",
        "fp32",
        "--max-new-tokens",
        "4",
        "--batch-size",
        "3",
        "--no-progress",
    ]
    res = runner.invoke(app, [*args, "--out", str(tmp_path / "a")])
    assert res.exit_code == 0, res.output
    assert "arithmetic" in res.output and "accuracy" in res.output
    res = runner.invoke(
        app,
        [
            *args,
            "--out",
            str(tmp_path / "b"),
            "--intervention",
            "system-prompt",
            "--compare-to",
            str(tmp_path / "a"),
        ],
    )
    assert res.exit_code == 0, res.output
    assert (
        "gained" in res.output
        and json.loads((tmp_path / "b" / "results.json").read_text())["paired"]["n_pairs"] == 4
    )
    bad = runner.invoke(app, [*args, "--out", str(tmp_path / "c"), "--split", "train"])
    assert bad.exit_code == 2 and "Unknown split 'train'" in bad.output


# ---- the real model --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_embedded_model_answers_most_val_items(tmp_path):
    res = run_knowns(
        KnownsConfig(
            out=str(tmp_path / "run"),
            model="embedded:qwen2.5-coder-0.5b-instruct",
            split="val",
            limit=40,
            progress=False,
        )
    )
    assert res["n"] == 40
    assert res["accuracy"] >= 0.5, res["by_kind"]


def test_gsm8k_items_score_the_final_number(data_dir):
    """GSM8K as known answers: the final number counts (after "Answer:" when given), not a number met on
    the way; --limit takes the same stratified sample every time; the val split is train's tail."""
    from aligntax.metrics.knowns import GSM8K_VAL_FROM, final_number, load_known_answers

    test = load_known_answers("gsm8k-test")
    assert len(test) == 1319 and test[0].answers == ("18",) and test[0].scoring == "final-number"
    assert test[0].check("16 - 3 - 4 = 9 eggs, 9 * 2 = 18.\nAnswer: $18")
    assert not test[0].check("She sells 18 eggs... Answer: 9")
    assert not test[0].check("16 - 3 - 4 = 9")
    assert final_number("It costs 1,200 dollars in all.") == 1200.0
    assert final_number("no number here") is None
    sample = load_known_answers("gsm8k-test", limit=50)
    assert [it.id for it in sample] == [it.id for it in load_known_answers("gsm8k-test", limit=50)]
    kinds = {k: sum(it.kind == k for it in test) / len(test) for k in {it.kind for it in test}}
    for k, share in kinds.items():
        assert abs(sum(it.kind == k for it in sample) - 50 * share) <= 1
    val = load_known_answers("gsm8k-val")
    assert len(val) == 7473 - GSM8K_VAL_FROM and all(int(it.id.split(":")[1]) >= GSM8K_VAL_FROM for it in val)
