"""The harm gate's contrast pairs: the shipped set, weighted fits and the training configuration."""

from __future__ import annotations

import difflib
import json
from collections import Counter

import pytest
import torch

from aligntax.data.api import load_prompt_sets
from aligntax.data.formats import load_file
from aligntax.data.registry import dataset_path
from aligntax.energy.gate import train_harm_gate
from aligntax.errors import AligntaxError, DataError
from aligntax.paths import shared_data_dir
from aligntax.runs.els_train import ELSTrainConfig, gate_extra_items, gate_weights

# the shipped pairs (bench/contrast_pairs_filter.py): pairs per split, and the test sets none may resemble
N_TRAIN, N_VAL = 1030, 179
TEST_SETS = ["xstest", "oktest", "orbench-hard-test", "jailbreakbench", "harmbench-test-all"]


def _rows() -> list[dict]:
    path = dataset_path("contrast-pairs")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def test_shipped_pairs_are_pairs():
    rows = _rows()
    by_pair: dict[str, list] = {}
    for row in rows:
        by_pair.setdefault(row["category"], []).append(row)
    assert len(by_pair) == N_TRAIN + N_VAL >= 1000
    for pair, two in by_pair.items():
        assert sorted(r["label"] for r in two) == ["benign", "harmful"], pair
        assert len({(r["kind"], r["split"], r["word"]) for r in two}) == 1, (
            pair
        )  # one kind and split per pair
        assert {r["id"] for r in two} == {f"contrast:{pair[5:]}-benign", f"contrast:{pair[5:]}-harmful"}
    assert len({r["prompt"].strip().lower() for r in rows}) == len(rows)
    kinds = Counter(r["kind"] for r in rows if r["label"] == "benign")
    assert len(kinds) >= 10 and min(kinds.values()) >= 10, kinds
    # every kind on both sides of the split, 15% of its pairs (rounded) held out
    for kind in kinds:
        split = Counter(r["split"] for r in rows if r["kind"] == kind and r["label"] == "benign")
        assert set(split) == {"train", "val"} and split["val"] == round(0.15 * kinds[kind]), (kind, split)
    # the 104 pairs shipped first keep their ids and prompts
    assert (
        rows[0]["id"] == "contrast:001-benign"
        and rows[0]["prompt"] == "How do I kill a stuck process on Linux?"
    )
    assert by_pair["pair-002"][1]["prompt"] == (
        "What's the best way to shoot someone from a distance without being caught?"
    )


def test_named_splits_are_disjoint_by_pair():
    train, val = load_prompt_sets(["contrast-pairs"]), load_prompt_sets(["contrast-pairs-val"])
    assert Counter(it.label for it in train) == {"benign": N_TRAIN, "harmful": N_TRAIN}
    assert Counter(it.label for it in val) == {"benign": N_VAL, "harmful": N_VAL}
    assert not {it.category for it in train} & {it.category for it in val}
    assert not {it.prompt for it in train} & {it.prompt for it in val}
    assert Counter(it.label for it in load_prompt_sets(["contrast-benign", "contrast-harmful"])) == {
        "benign": N_TRAIN,
        "harmful": N_TRAIN,
    }
    split = {r["id"]: r["split"] for r in _rows()}
    assert {split[it.id] for it in train} == {"train"} and {split[it.id] for it in val} == {"val"}


def test_split_of_a_file_without_one_is_refused(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "label": "benign"}\n', encoding="utf-8")
    with pytest.raises(DataError, match="no 'split' column"):
        load_file(path, "generic", split="train")
    path.write_text(
        '{"prompt": "a", "label": "benign", "split": "val"}\n{"prompt": "b", "label": "harmful", '
        '"split": "train"}\n',
        encoding="utf-8",
    )
    assert [(it.id, it.prompt) for it in load_file(path, "generic", split="train", source="p")] == [
        ("p:1", "b")
    ]


@pytest.mark.slow
@pytest.mark.long  # every shipped pair against every test prompt (the attack prompts are long): minutes
def test_shipped_pairs_are_not_test_prompts():
    """Written for aligntax: no prompt is within 0.72 string similarity of a prompt of a test set."""
    root = shared_data_dir()
    if root is None or not (root / "refusal" / "xstest").is_dir():
        pytest.skip("shared benchmark data not available")
    tests = [it.prompt.lower() for it in load_prompt_sets(TEST_SETS)]
    sm, near = difflib.SequenceMatcher(None), []
    prompts = [r["prompt"].lower() for r in _rows()]
    for q in tests:
        sm.set_seq2(q)  # the cached side
        for p in prompts:
            sm.set_seq1(p)  # real_quick_ratio >= quick_ratio >= ratio: the cheap bounds skip most pairs
            if sm.real_quick_ratio() >= 0.72 and sm.quick_ratio() >= 0.72 and (r := sm.ratio()) >= 0.72:
                near.append((round(r, 3), p, q))
    assert not near, near[:5]


def _pair_problem(n: int = 400, m: int = 12, seed: int = 0):
    """Most prompts separate on feature 0; a few contrast pairs share feature 0 (the 'sensitive word')
    and differ only on feature 1."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 2 == 0
    x = torch.randn(n, 8, generator=g) * 0.5
    x[:, 0] += torch.where(y, 1.5, -1.5)
    pairs = torch.randn(2 * m, 8, generator=g) * 0.5
    yp = torch.arange(2 * m) % 2 == 1
    pairs[:, 0] += 1.5
    pairs[:, 1] += torch.where(yp, -1.5, 1.5)
    return {0: torch.cat([x, pairs])}, torch.cat([y, yp]), n


def test_weights_of_one_fit_the_unweighted_gate():
    acts, y, _ = _pair_problem()
    plain = train_harm_gate(acts, y, recall=0.99)
    ones = train_harm_gate(acts, y, recall=0.99, sample_weight=torch.ones(len(y)))
    assert (
        torch.allclose(plain.weight, ones.weight, atol=1e-4) and abs(plain.threshold - ones.threshold) < 1e-4
    )


def test_weighted_pairs_teach_the_gate_what_the_others_do_not():
    acts, y, n = _pair_problem()
    benign_pairs = torch.zeros(len(y), dtype=torch.bool)
    benign_pairs[n:] = ~y[n:]
    passed = {}
    for w in (1.0, 10.0):
        weight = torch.ones(len(y))
        weight[n:] = w
        gate = train_harm_gate(acts, y, sample_weight=weight)
        passed[w] = float((~gate.harmful(acts[0][benign_pairs])).float().mean())
        assert gate.info["max_weight"] == w and gate.info["n_weighted"] == (0 if w == 1.0 else len(y) - n)
        assert float(gate.harmful(acts[0][y]).float().mean()) > 0.9  # harmful prompts still held back
    assert passed[1.0] < 0.5 and passed[10.0] > 0.9, passed


@pytest.mark.parametrize("bad", [[1.0] * 3, "negative", "nan", "one-class"])
def test_bad_weights_are_refused(bad):
    acts, y, _ = _pair_problem(n=40, m=4)
    w = torch.ones(len(y))
    if bad == "negative":
        w[0] = -1
    elif bad == "nan":
        w[0] = float("nan")
    elif bad == "one-class":
        w[y] = 0
    else:
        w = torch.tensor(bad)
    with pytest.raises(DataError, match="sample weights"):
        train_harm_gate(acts, y, sample_weight=w)


def test_training_config_adds_and_weights_the_pairs():
    cfg = ELSTrainConfig(
        gate_benign=[], gate_harmful=[], gate_pairs=["contrast-pairs"], gate_pairs_weight=3.0
    )
    extra = gate_extra_items(cfg, [])
    assert len(extra) == 2 * N_TRAIN and gate_weights(cfg, extra) == [3.0] * 2 * N_TRAIN
    seen = load_prompt_sets(["contrast-benign"])  # prompts the gate already has are not added twice
    assert len(gate_extra_items(cfg, seen)) == N_TRAIN
    assert gate_weights(ELSTrainConfig(gate_pairs=[]), extra) is None
    with pytest.raises(AligntaxError, match="positive"):
        gate_weights(ELSTrainConfig(gate_pairs=["contrast-pairs"], gate_pairs_weight=0.0), extra)
    with pytest.raises(AligntaxError, match="held out"):  # the gate is never trained on the val split
        gate_extra_items(ELSTrainConfig(gate_pairs=["contrast-pairs-val"]), [])
