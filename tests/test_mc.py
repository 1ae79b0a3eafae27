"""Multiple-choice accuracy: the built-in set, the loader's errors, and the scoring on tiny random models
(batching, steering through SteerContext, a case with a known answer, the CLI)."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch
from typer.testing import CliRunner

from aligntax.activations import capture
from aligntax.energy import EnergyConfig, EnergyModel, train_layers
from aligntax.errors import DataError
from aligntax.generation.chat import build_messages, render_chat
from aligntax.interventions import EnergySteering, SystemPrompt
from aligntax.metrics.mc import (
    ANSWER_PREFIX,
    LETTERS,
    MCItem,
    load_mc,
    mc_prompt,
    mc_text,
    option_token_ids,
)
from aligntax.metrics.rates import wilson_interval
from aligntax.runs.mc import mc_accuracy, score_items
from tiny import tiny_lm

pytestmark = pytest.mark.usefixtures("one_thread")

H = 32


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("qwen2", hidden=H, layers=3)


@pytest.fixture(scope="module")
def items():
    return load_mc("builtin", limit=12)


# ---- the built-in set ------------------------------------------------------------------------------------
def test_builtin_set_is_well_formed():
    items = load_mc("builtin")
    assert 100 <= len(items) <= 150
    assert len({it.id for it in items}) == len(items)
    assert len({it.question for it in items}) == len(items)
    assert all(len(it.choices) == 4 and len(set(it.choices)) == 4 for it in items)
    subjects = Counter(it.subject for it in items)
    assert set(subjects) == {"science", "geography", "arithmetic", "history", "reasoning", "language"}
    assert min(subjects.values()) >= 20
    answers = Counter(it.answer for it in items)  # balanced over A-D: a letter bias cannot look like skill
    assert set(answers) == {0, 1, 2, 3} and max(answers.values()) - min(answers.values()) <= 2
    assert all({it.answer for it in items if it.subject == s} == {0, 1, 2, 3} for s in subjects)
    assert {it.subject for it in load_mc("builtin", limit=6)} == set(subjects)  # interleaved subjects


# ---- loading user files -----------------------------------------------------------------------------------
def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def _jsonl(*records):
    return "".join(json.dumps(r) + "\n" for r in records)


Q = {"question": "2 + 2?", "choices": ["3", "4", "5", "22"], "answer": 1}


def test_load_user_jsonl_and_csv(tmp_path):
    p = _write(
        tmp_path,
        "q.jsonl",
        _jsonl(
            {**Q, "id": "a", "subject": "math"},
            {"question": "Sky colour?", "choices": ["blue", "green"], "answer": "A"},
        ),
    )
    a, b = load_mc(p)
    assert a == MCItem("a", "2 + 2?", ("3", "4", "5", "22"), 1, "math")
    assert b.id == "2" and b.answer == 0 and b.choices == ("blue", "green") and b.subject == ""
    csv_json = _write(tmp_path, "q.csv", 'id,question,choices,answer\nx,"2 + 2?","[""3"", ""4"", ""5""]",2\n')
    assert load_mc(csv_json)[0] == MCItem("x", "2 + 2?", ("3", "4", "5"), 2, "")
    csv_cols = _write(tmp_path, "cols.csv", "question,A,B,C,D,answer\nPick b,a,b,c,,B\n")
    assert load_mc(csv_cols)[0].choices == ("a", "b", "c") and load_mc(csv_cols)[0].answer == 1
    assert len(load_mc(_write(tmp_path, "three.jsonl", _jsonl(Q, Q, Q)), limit=2)) == 2


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("empty.jsonl", "\n\n", "empty"),
        ("noanswer.jsonl", _jsonl({"question": "q", "choices": ["a", "b"]}), "missing field(s) 'answer'"),
        ("nochoices.csv", "question,answer\nq,0\n", "missing field(s) 'choices'"),
        ("range.jsonl", _jsonl(Q, {**Q, "answer": 4}), "line 2: answer 4 is out of range for 4 choices"),
        ("negative.jsonl", _jsonl({**Q, "answer": -1}), "out of range"),
        ("letter.jsonl", _jsonl({**Q, "answer": "E"}), "out of range"),
        ("badanswer.jsonl", _jsonl({**Q, "answer": "four"}), "'answer' must be an option index"),
        ("boolanswer.jsonl", _jsonl({**Q, "answer": True}), "'answer' must be an option index"),
        ("one.jsonl", _jsonl({**Q, "choices": ["a"], "answer": 0}), "1 choices; a question needs 2 to 8"),
        ("notlist.jsonl", _jsonl({**Q, "choices": "a, b"}), "'choices' must be a list"),
        ("dup.jsonl", _jsonl({**Q, "choices": ["a", "a", "b"]}), "not distinct"),
        ("blank.jsonl", _jsonl({**Q, "choices": ["a", " ", "b"]}), "choice B is empty"),
        ("noq.jsonl", _jsonl({**Q, "question": ""}), "'question' must be a non-empty string"),
        ("ids.jsonl", _jsonl({**Q, "id": "x"}, {**Q, "id": "x"}), "duplicate id 'x'"),
        ("torn.jsonl", _jsonl(Q) + '{"question": "q", \n', "line 2: malformed JSON"),
    ],
)
def test_loader_errors_name_the_problem(tmp_path, name, text, message):
    p = _write(tmp_path, name, text)
    with pytest.raises(DataError) as e:
        load_mc(p)
    assert message in str(e.value) and str(p) in str(e.value)


def test_missing_file_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="file not found"):
        load_mc(tmp_path / "nope.jsonl")


# ---- scoring ------------------------------------------------------------------------------------------------
def test_option_tokens_and_prompt(lm, items):
    ids = option_token_ids(lm.tokenizer, 4)
    # the byte-level test tokenizer has one token per letter (" A" is two tokens, so it is not used)
    assert ids == [[lm.tokenizer.convert_tokens_to_ids(c)] for c in "ABCD"]
    text = mc_prompt(items[0])
    assert items[0].question in text and all(
        f"\n{LETTERS[i]}. {c}" in text for i, c in enumerate(items[0].choices)
    )
    full = mc_text(lm.tokenizer, items[0], system="Be brief.")
    assert full == render_chat(lm.tokenizer, build_messages(text, "Be brief.")) + ANSWER_PREFIX


def test_scores_match_an_unpadded_forward(lm, items):
    """Batched scoring (left padding, position ids from the mask) equals one forward per question."""
    batched = score_items(lm, items, batch_size=5)
    single = score_items(lm, items, batch_size=1)
    ids = [t[0] for t in option_token_ids(lm.tokenizer, 4)]
    for it, b, s in zip(items, batched, single, strict=True):
        assert b.pred == s.pred
        assert b.probs == pytest.approx(s.probs, abs=1e-5) and b.letter_mass == pytest.approx(
            s.letter_mass, abs=1e-6
        )
        text = mc_text(lm.tokenizer, it)
        enc = torch.tensor([lm.tokenizer(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(lm.model(input_ids=enc).logits[0, -1].float(), -1)
        want = torch.softmax(logp[ids], 0)
        assert b.probs == pytest.approx(want.tolist(), abs=1e-5)
        assert b.letter_mass == pytest.approx(float(logp[ids].exp().sum()), rel=1e-4)
        assert b.pred == int(want.argmax()) and sum(b.probs) == pytest.approx(1.0)


def energy_models(seed=1, layers=(1, 2)):
    torch.manual_seed(seed)
    return {layer: EnergyModel(H, [32, 16]) for layer in layers}


def test_zero_strength_steering_is_identity_and_steering_acts(lm, items):
    base = score_items(lm, items, batch_size=4)
    for zero in (
        EnergySteering(energy_models(), eta=0.0, steps=3, scale_by_norm=False),
        EnergySteering(energy_models(), eta=2.0, steps=0, scale_by_norm=False),
    ):
        same = score_items(lm, items, zero, batch_size=4)
        assert [s.probs for s in same] == [b.probs for b in base]
        assert [s.letter_mass for s in same] == [b.letter_mass for b in base]
    steered = score_items(
        lm, items, EnergySteering(energy_models(), eta=2.0, steps=3, scale_by_norm=False), batch_size=4
    )
    diffs = [
        max(abs(a - b) for a, b in zip(s.probs, b0.probs, strict=True))
        for s, b0 in zip(steered, base, strict=True)
    ]
    assert min(diffs) > 1e-4  # every question's scores move: the last prompt token is steered
    # batched equals unbatched under steering too (steered positions do not depend on the padding)
    iv = EnergySteering(energy_models(), eta=2.0, steps=3, scale_by_norm=False)
    one = score_items(lm, items, iv, batch_size=1)
    assert all(a.probs == pytest.approx(b.probs, abs=1e-5) for a, b in zip(one, steered, strict=True))
    # message-rewriting interventions apply as in generation
    sys_iv = SystemPrompt("Always answer A.", name="system-prompt")
    assert [s.probs for s in score_items(lm, items, sys_iv)] == [
        s.probs for s in score_items(lm, items, system="Always answer A.")
    ]


def test_known_answer_from_a_rigged_head(items):
    """A head whose only non-zero output is a bias on the letter C: every question is answered C with
    probabilities known in closed form."""
    rigged = tiny_lm("qwen2", hidden=H, layers=3)
    vocab = rigged.model.lm_head.out_features
    c = rigged.tokenizer.convert_tokens_to_ids("C")
    head = torch.nn.Linear(H, vocab, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        head.bias[c] = 3.0
    rigged.model.lm_head = head
    res = mc_accuracy(rigged, items, batch_size=5)
    e3 = math.exp(3.0)
    assert all(r["pred"] == 2 for r in res["rows"])
    for r in res["rows"]:
        assert r["probs"] == pytest.approx(
            [1 / (e3 + 3), 1 / (e3 + 3), e3 / (e3 + 3), 1 / (e3 + 3)], abs=1e-6
        )
        assert r["letter_mass"] == pytest.approx((e3 + 3) / (e3 + vocab - 1), abs=1e-6)
        assert r["correct"] == (r["answer"] == 2)
    k = sum(it.answer == 2 for it in items)
    assert 0 < k < len(items)
    assert res["n"] == len(items) and res["correct"] == k and res["accuracy"] == k / len(items)
    assert res["ci95"] == list(wilson_interval(k, len(items)))
    assert sum(s["n"] for s in res["by_subject"].values()) == len(items)
    assert res["letter_mass_mean"] == pytest.approx((e3 + 3) / (e3 + vocab - 1), abs=1e-6)


# ---- the command line -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-model")
    m = tiny_lm("qwen2", hidden=H, layers=3)
    m.model.save_pretrained(d)
    m.tokenizer.save_pretrained(d)
    return d


def test_cli_mc_unsteered_zero_and_steered(tmp_path, model_dir, monkeypatch):
    from aligntax.cli import app
    from aligntax.models import load_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = load_model(str(model_dir), dtype="fp32")
    acts = capture(
        loaded,
        [f"question {i}: {'how to kill a process' if i % 2 else 'tell me a joke'}" for i in range(16)],
        "all",
        progress=False,
    )
    bank = train_layers(
        acts,
        torch.tensor([i % 2 for i in range(16)]),
        EnergyConfig.preset("small", widths=[16], epochs=2),
        fingerprint=loaded.fingerprint,
    )
    bank.save(tmp_path / "bank")
    data = _write(
        tmp_path, "q.jsonl", "".join(json.dumps(it.to_dict()) + "\n" for it in load_mc("builtin", limit=8))
    )
    runner = CliRunner()

    def run(name, *flags):
        res = runner.invoke(
            app,
            [
                "mc",
                "--model",
                str(model_dir),
                "--data",
                str(data),
                "--out",
                str(tmp_path / name),
                "--dtype",
                "fp32",
                "--batch-size",
                "3",
                "--no-progress",
                *flags,
            ],
        )
        assert res.exit_code == 0, res.output
        results = json.loads((tmp_path / name / "results.json").read_text())
        rows = [json.loads(x) for x in (tmp_path / name / "samples.jsonl").read_text().splitlines()]
        assert results["n"] == len(rows) == 8 and results["correct"] == sum(r["correct"] for r in rows)
        return results, rows

    base, base_rows = run("base")
    assert base["intervention"] is None and base["config"]["data"] == str(data)
    help_text = runner.invoke(app, ["mc", "--help"]).output
    assert all(flag in help_text for flag in ("--steer", "--intervention", "--top-k", "--eta", "--data"))
    zero, zero_rows = run("zero", "--steer", str(tmp_path / "bank"), "--steps", "0", "--top-k", "1")
    assert zero["intervention"]["name"] == "els" and zero["intervention"]["steps"] == 0
    assert [r["probs"] for r in zero_rows] == [r["probs"] for r in base_rows]
    steered, steered_rows = run(
        "steered", "--steer", str(tmp_path / "bank"), "--eta", "3", "--top-k", "2", "--row-threshold", "none"
    )  # every row (the default row decision holds some)
    assert (
        steered["config"]["intervention_args"]["top_k"] == 2 and len(steered["intervention"]["layers"]) == 2
    )
    assert [r["probs"] for r in steered_rows] != [r["probs"] for r in base_rows]
    bad = runner.invoke(
        app,
        [
            "mc",
            "--model",
            str(model_dir),
            "--data",
            str(tmp_path / "missing.jsonl"),
            "--out",
            str(tmp_path / "x"),
        ],
    )
    assert bad.exit_code == 2 and "file not found" in bad.output
