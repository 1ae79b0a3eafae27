"""The harm gate's contrast pairs: the shipped set, weighted fits and the training configuration."""

from __future__ import annotations

import difflib
from collections import Counter

import pytest
import torch

from aligntax.data.api import load_prompt_sets
from aligntax.data.formats import load_file
from aligntax.energy.gate import train_harm_gate
from aligntax.errors import AligntaxError, DataError
from aligntax.paths import shared_data_dir
from aligntax.runs.els import ELSTrainConfig, gate_extra_items, gate_weights


def test_shipped_pairs_are_pairs():
    items = load_prompt_sets(["contrast-pairs"])
    by_pair: dict[str, list] = {}
    for it in items:
        by_pair.setdefault(it.category, []).append(it)
    assert len(by_pair) == 104
    assert all(sorted(it.label for it in v) == ["benign", "harmful"] for v in by_pair.values())
    assert len({it.prompt for it in items}) == len(items)
    assert Counter(it.label for it in load_prompt_sets(["contrast-benign", "contrast-harmful"])) == \
        {"benign": 104, "harmful": 104}


def test_shipped_pairs_are_not_xstest():
    """Written for aligntax: no prompt is within 0.72 string similarity of an XSTest prompt (a test set)."""
    root = shared_data_dir()
    if root is None or not (root / "refusal" / "xstest").is_dir():
        pytest.skip("shared benchmark data not available")
    xs = [it.prompt.lower() for it in load_prompt_sets(["xstest"])]
    worst = max((difflib.SequenceMatcher(None, it.prompt.lower(), q).ratio(), it.prompt, q)
                for it in load_prompt_sets(["contrast-pairs"]) for q in xs)
    assert worst[0] < 0.72, worst


def test_split_of_a_file_without_one_is_refused(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "label": "benign"}\n', encoding="utf-8")
    with pytest.raises(DataError, match="no 'split' column"):
        load_file(path, "generic", split="train")
    path.write_text('{"prompt": "a", "label": "benign", "split": "val"}\n{"prompt": "b", "label": "harmful", '
                    '"split": "train"}\n', encoding="utf-8")
    assert [(it.id, it.prompt) for it in load_file(path, "generic", split="train", source="p")] == [("p:1", "b")]


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
    assert torch.allclose(plain.weight, ones.weight, atol=1e-4) and abs(plain.threshold - ones.threshold) < 1e-4


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
    cfg = ELSTrainConfig(gate_benign=[], gate_harmful=[], gate_pairs=["contrast-pairs"], gate_pairs_weight=3.0)
    extra = gate_extra_items(cfg, [])
    assert len(extra) == 208 and gate_weights(cfg, extra) == [3.0] * 208
    seen = load_prompt_sets(["contrast-benign"])  # prompts the gate already has are not added twice
    assert len(gate_extra_items(cfg, seen)) == 104
    assert gate_weights(ELSTrainConfig(gate_pairs=[]), extra) is None
    with pytest.raises(AligntaxError, match="positive"):
        gate_weights(ELSTrainConfig(gate_pairs=["contrast-pairs"], gate_pairs_weight=0.0), extra)
