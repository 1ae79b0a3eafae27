"""Energy models: training, gradients, ranking, save/load and compatibility checks."""

from __future__ import annotations

import json

import pytest
import torch

from aligntax.energy import (
    EnergyBank,
    EnergyConfig,
    EnergyModel,
    EnergyTrainer,
    auroc,
    best_threshold,
    plot_energy_histograms,
    state_labels,
    train_layers,
)
from aligntax.errors import AligntaxError, CompatibilityError, DataError

pytestmark = pytest.mark.usefixtures("one_thread")

D = 16
FP = {
    "spec": "tiny-a",
    "model_type": "qwen2",
    "num_layers": 3,
    "hidden_size": D,
    "vocab_size": 300,
    "embedding_digest": "abcdef0123456789",
}


def clusters(n=200, d=D, sep=1.5, seed=0):
    """Two Gaussian clusters whose means are ``sep`` apart (overlap about 23% at 1.5 sigma per axis)."""
    g = torch.Generator().manual_seed(seed)
    direction = torch.randn(d, generator=g)
    direction = direction / direction.norm()
    offset = 3.0 * torch.randn(d, generator=g)  # not centred: normalisation matters
    good = torch.randn(n, d, generator=g) + offset - 0.5 * sep * direction
    bad = torch.randn(n, d, generator=g) + offset + 0.5 * sep * direction
    return good * 5, bad * 5  # residual streams are not unit scale


def fast_config(**kw):
    return EnergyConfig.preset("small", **{"widths": [32, 16], "epochs": 25, "patience": 8, **kw})


@pytest.mark.parametrize("objective", ["infonce", "logistic"])
def test_training_separates_clusters(objective):
    good, bad = clusters(sep=4.0)
    res = EnergyTrainer(fast_config(objective=objective)).train(good, bad)
    assert res.val_acc > 0.9, res.metrics
    assert res.val_auroc > 0.95
    assert res.metrics["mean_energy_good"] < 0 < res.metrics["mean_energy_bad"]
    assert res.data["n_val_good"] == 40 and res.data["n_val_bad"] == 40
    assert res.train_metrics["acc"] > 0.9
    assert not res.model.training
    # The validation accuracy reported is the sign accuracy of the returned model.
    e_good = res.model.energy(good)
    assert ((e_good < 0).float().mean()) > 0.85


def test_paper_architecture_trains():
    good, bad = clusters(n=120, sep=4.0)
    cfg = EnergyConfig(widths=[64, 32], epochs=8, lr=1e-3, patience=None)  # LayerNorm + dropout blocks
    res = EnergyTrainer(cfg).train(good, bad)
    assert len(res.history) == 8 and res.val_acc > 0.85
    assert len(res.model.norms) == 2 and res.model.dropout_p == 0.15


def test_config_presets_and_validation():
    paper = EnergyConfig()
    assert paper.widths == [2048, 1024, 1024, 512] and paper.layernorm and paper.dropout == 0.15
    assert paper.objective == "infonce" and paper.temperature == 0.1 and paper.batch_size == 64
    assert paper.val_fraction == 0.2
    small = EnergyConfig.preset("small")
    assert small.widths == [512, 256] and not small.layernorm and small.dropout == 0.0
    m = EnergyModel.from_config(D, small)
    assert [lin.out_features for lin in m.linears] == [512, 256] and m.out.in_features == 256
    assert EnergyConfig.from_dict(paper.to_dict()) == paper
    with pytest.raises(AligntaxError, match="objective"):
        EnergyConfig(objective="hinge")
    with pytest.raises(AligntaxError, match="preset"):
        EnergyConfig.preset("huge")


@pytest.mark.parametrize("layernorm", [True, False])
def test_closed_form_gradient_matches_autograd(layernorm):
    torch.manual_seed(0)
    m = EnergyModel(D, [24, 12], layernorm=layernorm, dropout=0.15)
    with torch.no_grad():
        m.set_normalization(torch.randn(D), torch.rand(D) + 0.5)
        for ln in m.norms:
            ln.weight.normal_()
            ln.bias.normal_()
    m.train()  # the closed form is always eval-mode (no dropout)
    h = 4 * torch.randn(2, 3, 5, D)
    e, g = m.energy_and_grad(h)
    m.eval()
    assert e.shape == (2, 3, 5) and g.shape == h.shape
    torch.testing.assert_close(e, m.energy(h), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g, m.grad(h, method="autograd"), atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(m.grad(h), g)
    assert m.energy(h[0, 0, 0]).shape == ()


def test_nan_inputs_refused():
    m = EnergyModel(D, [8], layernorm=False, dropout=0.0)
    h = torch.randn(3, D)
    h[1, 2] = float("nan")
    with pytest.raises(AligntaxError, match="NaN"):
        m.energy(h)
    with pytest.raises(AligntaxError, match="NaN"):
        m.grad(h)
    with pytest.raises(AligntaxError, match="NaN"):
        EnergyTrainer(fast_config()).train(h, torch.randn(3, D))
    with pytest.raises(AligntaxError, match="hidden size 16"):
        m.energy(torch.randn(2, D + 1))


def test_state_labels():
    labels = ["benign", "benign", "harmful", "harmful"]
    refused = [False, True, True, False]
    # benign+complied good, benign+refused bad, harmful+refused good, harmful+complied bad
    assert state_labels(labels, refused).tolist() == [0, 1, 0, 1]
    assert state_labels([False, True], [True, True]).tolist() == [1, 0]
    with pytest.raises(DataError):
        state_labels(["weird"], [True])
    with pytest.raises(DataError):
        state_labels(["benign"], [True, False])


def test_auroc_and_threshold():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(50, generator=g).round(decimals=1)
    pos = torch.rand(50, generator=g) > 0.5
    brute = 0.0
    for i in torch.nonzero(pos).flatten():
        for j in torch.nonzero(~pos).flatten():
            brute += float(scores[i] > scores[j]) + 0.5 * float(scores[i] == scores[j])
    assert auroc(scores, pos) == pytest.approx(brute / (int(pos.sum()) * int((~pos).sum())))
    t = best_threshold(torch.tensor([-3.0, -2.0, -1.0]), torch.tensor([1.0, 2.0]))
    assert -1.0 < t < 1.0


def _layer_data(n=160):
    good, bad = clusters(n=n, sep=5.0, seed=1)
    noise_g, noise_b = clusters(n=n, sep=0.0, seed=2)
    acts = {0: torch.cat([noise_g, noise_b]), 2: torch.cat([good, bad])}
    labels = torch.cat([torch.zeros(n), torch.ones(n)]).long()
    return acts, labels


def test_train_layers_ranks_and_round_trip(tmp_path):
    acts, labels = _layer_data()
    bank = train_layers(acts, labels, fast_config(), fingerprint=FP, metadata={"dataset": "synthetic"})
    assert bank.layers == [2, 0]  # the separable layer first
    assert bank.metrics(2)["acc"] > 0.9 and bank.metrics(0)["acc"] < 0.8
    assert bank.median_norm(2) == pytest.approx(float(acts[2].norm(dim=-1).median()))
    assert bank.top(1) == [2] and bank.summary()[0]["layer"] == 2

    bank.save(tmp_path / "bank")
    files = sorted(p.name for p in (tmp_path / "bank").iterdir())
    assert files == ["energy.json", "energy.safetensors"]  # never a pickle
    meta = json.loads((tmp_path / "bank" / "energy.json").read_text())
    assert meta["fingerprint"] == FP and meta["layers"] == [2, 0]
    assert meta["config"]["widths"] == [32, 16] and meta["config"]["objective"] == "infonce"
    assert meta["normalization"] == "standard"
    assert meta["info"]["2"]["data"]["n_good"] == 160 and "acc" in meta["info"]["2"]["metrics"]
    assert meta["metadata"]["dataset"] == "synthetic"

    back = EnergyBank.load(tmp_path / "bank", expect_fingerprint=dict(FP, spec="other/path"))
    assert back.layers == [2, 0]
    for layer in (0, 2):
        assert not back[layer].training
        torch.testing.assert_close(back[layer].energy(acts[layer]), bank[layer].energy(acts[layer]))
        torch.testing.assert_close(back[layer].in_mean, bank[layer].in_mean)
    one = EnergyBank.load(tmp_path / "bank", layers=[2])
    assert list(one.models) == [2]


def test_folds_rank_by_mean_over_disjoint_validation_blocks():
    acts, labels = _layer_data(n=60)
    one = train_layers(acts, labels, fast_config())
    five = train_layers(acts, labels, fast_config(folds=5))
    assert five.layers == [2, 0]
    info = five.info[2]
    assert len(info["fold_metrics"]) == 5
    # fold 0 is the single split: the same kept model, the same validation metrics
    assert info["fold_metrics"][0] == one.metrics(2)
    torch.testing.assert_close(five[2].energy(acts[2]), one[2].energy(acts[2]))
    assert five.metrics(2)["acc"] == pytest.approx(sum(m["acc"] for m in info["fold_metrics"]) / 5)
    # the five validation blocks are disjoint and cover every state once
    assert five.metrics(2)["n_good"] == 60 and five.metrics(2)["n_bad"] == 60
    assert five.metadata["folds"] == 5 and "fold_metrics" not in one.info[2]


def test_fold_validation_blocks_are_disjoint():
    from aligntax.energy.train import _split

    held = [set(_split(23, 0.2, torch.Generator().manual_seed(0), f)[1].tolist()) for f in range(5)]
    assert all(not (a & b) for i, a in enumerate(held) for b in held[i + 1 :])
    for f in range(5):
        tr, va = _split(23, 0.2, torch.Generator().manual_seed(0), f)
        assert sorted([*tr.tolist(), *va.tolist()]) == list(range(23))


def test_folds_are_checked():
    with pytest.raises(AligntaxError, match="folds"):
        EnergyConfig(folds=6, val_fraction=0.2)
    with pytest.raises(AligntaxError, match="folds"):
        EnergyConfig(folds=0)
    good, bad = clusters(n=4)
    with pytest.raises(DataError, match="fewer folds"):
        EnergyTrainer(fast_config(folds=5)).train(good, bad[:2], fold=4)
    with pytest.raises(AligntaxError, match="fold must be"):
        EnergyTrainer(fast_config(folds=2)).train(good, bad, fold=2)


def test_bank_refuses_other_model(tmp_path):
    acts, labels = _layer_data(n=40)
    bank = train_layers({2: acts[2]}, labels, fast_config(epochs=2), fingerprint=FP)
    bank.save(tmp_path / "bank")
    other = dict(FP, embedding_digest="ffffeeeeddddcccc")
    with pytest.raises(CompatibilityError) as e:
        EnergyBank.load(tmp_path / "bank", expect_fingerprint=other)
    assert "abcdef0123456789" in str(e.value) and "ffffeeeeddddcccc" in str(e.value)
    bigger = dict(FP, hidden_size=64)
    with pytest.raises(CompatibilityError) as e:
        EnergyBank.load(tmp_path / "bank", expect_fingerprint=bigger)
    assert "16" in str(e.value) and "64" in str(e.value)
    with pytest.raises(CompatibilityError, match="hidden size 16.*hidden size 64"):
        EnergyBank.load(tmp_path / "bank", expect_hidden_size=64)
    with pytest.raises(DataError, match="No energy bank"):
        EnergyBank.load(tmp_path / "nothing")


def test_plot_histograms(tmp_path):
    acts, labels = _layer_data(n=40)
    bank = train_layers(acts, labels, fast_config(epochs=2))
    out = plot_energy_histograms(bank, acts, labels, tmp_path / "h.png", title="test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
