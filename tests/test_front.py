"""Harm-orthogonal descent and the learned per-row strength of ELS, on tiny random models."""

from __future__ import annotations

import pytest
import torch

from aligntax.activations import capture
from aligntax.activations.decisions import row_info, unsteered_rows
from aligntax.energy.front import STRENGTH_FEATURES, HarmBasis, RowStrength, compute_harm_basis, pair_states
from aligntax.errors import AligntaxError, CompatibilityError
from aligntax.interventions import EnergySteering, NoIntervention
from tiny import PROMPTS, run_steered, save_tiny_bank, tiny_lm

H = 32
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("qwen2", hidden=H, layers=3)


def _basis(lm, k=4, seed=0) -> HarmBasis:
    torch.manual_seed(seed)
    harmful = {layer: torch.randn(20, H) + 2.0 for layer in range(3)}
    benign = {layer: torch.randn(30, H) for layer in range(3)}
    return compute_harm_basis(harmful, benign, None, k_max=k, fingerprint=lm.fingerprint)


@pytest.fixture(scope="module")
def folder(lm, tmp_path_factory):
    """A tiny ELS folder: an energy bank, a harm gate at block 1 and a harm basis."""
    from aligntax.energy.gate import HarmGate

    d = save_tiny_bank(lm, tmp_path_factory.mktemp("front") / "els")
    torch.manual_seed(3)
    states = capture(lm, PROMPTS, [1], progress=False)[1]
    mu, sc = states.mean(0), states.std(0)
    w = torch.randn(H)
    s = ((states - mu) / sc) @ w
    cut = float(s.sort().values[1:3].mean())
    HarmGate(1, w, torch.tensor([-cut]), mu, sc, threshold=0.5, fingerprint=lm.fingerprint).save(d)
    _basis(lm).save(d)
    return d


def els(lm, folder, **kw):
    kw.setdefault("eta", 0.5)
    kw.setdefault("layers", [1, 2])
    kw.setdefault("steps", 3)
    kw.setdefault("gate", "none")
    # every row and token unless a test asks otherwise (an untuned folder's defaults would hold rows back)
    kw.setdefault("row_threshold", "none")
    kw.setdefault("horizon", "none")
    return EnergySteering.from_dir(folder, lm, **kw)


# ---- harm basis -------------------------------------------------------------------------------------------
def test_harm_basis_is_orthonormal_and_starts_with_the_mean_difference(lm):
    torch.manual_seed(1)
    xh, xb = torch.randn(40, H) + 1.0, torch.randn(50, H)
    ph, pb = torch.randn(12, H), torch.randn(12, H)
    basis = compute_harm_basis({5: xh}, {5: xb}, {5: (ph, pb)}, k_max=4)
    q = basis.get(5, 4)
    torch.testing.assert_close(q @ q.T, torch.eye(4), atol=1e-5, rtol=0)
    diff = xh.mean(0) - xb.mean(0)
    torch.testing.assert_close(q[0], diff / diff.norm(), atol=1e-5, rtol=0)
    # the others span the pairs' differences with the first direction projected out
    d = ph - pb
    d = d - (d @ q[0])[:, None] * q[0]
    top = torch.linalg.svd(d, full_matrices=False).Vh[0]
    assert float((q[1:] @ top).norm()) > 0.999
    with pytest.raises(AligntaxError, match="harm_orth"):
        basis.get(5, 5)
    with pytest.raises(AligntaxError, match="layer 3"):
        basis.get(3, 1)


def test_pair_states_match_pairs_by_category():
    from aligntax.data.base import PromptItem

    items = [
        PromptItem("a", "x", "benign", "c", "p1"),
        PromptItem("b", "y", "harmful", "c", "p2"),
        PromptItem("c", "z", "harmful", "c", "p1"),
        PromptItem("d", "w", "benign", "c", None),
    ]
    states = torch.arange(4.0)[:, None].repeat(1, 3)
    h, b = pair_states(items, states)
    assert h[:, 0].tolist() == [2.0] and b[:, 0].tolist() == [0.0]


def test_saved_files_round_trip_and_are_refused_for_another_model(lm, tmp_path):
    basis = _basis(lm)
    basis.save(tmp_path / "b")
    back = HarmBasis.load(tmp_path / "b", expect_fingerprint=lm.fingerprint, expect_hidden_size=H)
    assert sorted(back.directions) == [0, 1, 2] and back.k_max == 4
    for layer in range(3):
        assert torch.equal(back.directions[layer], basis.directions[layer])
    assert not list((tmp_path / "b").glob("*.pt")) and not list((tmp_path / "b").glob("*.pkl"))
    other = tiny_lm("qwen2", hidden=H, layers=3, seed=5)
    with pytest.raises(CompatibilityError):
        HarmBasis.load(tmp_path / "b", expect_fingerprint=other.fingerprint)
    rs = _strength(lm, layer=1)
    rs.save(tmp_path / "s")
    again = RowStrength.load(tmp_path / "s", expect_fingerprint=lm.fingerprint, expect_hidden_size=H)
    for name in ("weight", "mean", "scale", "refusal_dir", "harm_dir"):
        assert torch.equal(getattr(again, name), getattr(rs, name)), name
    assert (again.layer, again.bias, again.floor) == (rs.layer, rs.bias, rs.floor)
    with pytest.raises(CompatibilityError):
        RowStrength.load(tmp_path / "s", expect_fingerprint=other.fingerprint)
    assert all(p.suffix in (".json", ".safetensors") for p in (tmp_path / "s").iterdir())


def test_the_folder_basis_is_refused_for_another_model(lm, folder, tmp_path):
    import shutil

    d = tmp_path / "els"
    shutil.copytree(folder, d)
    other = tiny_lm("qwen2", hidden=H, layers=3, seed=5)
    HarmBasis(_basis(lm).directions, fingerprint=other.fingerprint).save(d)  # a basis of another model
    with pytest.raises(CompatibilityError):
        els(lm, d, harm_orth=2)
    (d / "harm_basis.json").unlink()
    with pytest.raises(AligntaxError, match="els harm-basis"):
        els(lm, d, harm_orth=2)


# ---- harm-orthogonal descent ------------------------------------------------------------------------------
def test_harm_orth_zero_is_identical_to_plain_els(lm, folder):
    plain = els(lm, folder)
    off = els(lm, folder, harm_orth=0)
    drop = {"settings_from"}  # says which options were given
    assert off.harm_dirs == {} and "harm_orth" not in plain.config()
    assert {k: v for k, v in off.config().items() if k not in drop} == {
        k: v for k, v in plain.config().items() if k not in drop
    }
    tok0, log0, _, _ = run_steered(lm, PROMPTS, plain)
    tok1, log1, _, _ = run_steered(lm, PROMPTS, off)
    assert torch.equal(tok0, tok1) and torch.equal(log0, log1)
    on = els(lm, folder, harm_orth=2)
    assert on.harm_orth == 2 and on.config()["harm_orth"] == 2
    _, log2, _, _ = run_steered(lm, PROMPTS, on)
    assert not torch.equal(log0, log2)


@pytest.mark.parametrize("k", [1, 3])
def test_harm_orth_step_has_no_component_on_the_harm_directions(lm, folder, k):
    iv = els(lm, folder, harm_orth=k)
    q = HarmBasis.load(folder).get(1, k)
    torch.testing.assert_close(iv.harm_dirs[1], q)
    kernel = iv.kernel(3)
    torch.manual_seed(0)
    x = torch.randn(16, H) * 3
    site = kernel.sites[0]
    moved = kernel.edit(site, x, torch.ones(16)) - x
    assert float(moved.norm()) > 1e-3
    assert float((moved @ q.T).abs().max()) < 1e-4 * float(moved.norm(dim=-1).max())
    plain = els(lm, folder).kernel(3).edit(site, x, torch.ones(16)) - x
    assert float((plain @ q.T).abs().max()) > 1e-2  # without the projection it does move along them
    # in the model: the state entering the first steered block moves only off the harm directions
    from test_steering import forward_with

    s0, _, _, _ = forward_with(lm, PROMPTS, NoIntervention(), layers=[1])
    s1, _, mask, _ = forward_with(lm, PROMPTS, iv, layers=[1])
    delta = (s1[1] - s0[1])[:, -1]  # the last prompt token (left padding)
    assert float(delta.norm()) > 1e-3
    assert float((delta @ q.T).abs().max()) < 1e-4 * float(delta.norm(dim=-1).max())


def test_gate_held_rows_are_not_moved_with_harm_orth(lm, folder):
    """Rows the harm gate holds back stay exactly unsteered with the projection on; the others move."""
    iv = els(lm, folder, gate=True, harm_orth=2)
    held = torch.tensor(unsteered_rows(iv, lm, PROMPTS))
    assert int(held.sum()) == 2
    _, log0, _, _ = run_steered(lm, PROMPTS, NoIntervention())
    _, log_g, _, _ = run_steered(lm, PROMPTS, iv)
    for i in range(4):
        if held[i]:
            torch.testing.assert_close(log_g[i], log0[i], rtol=0, atol=1e-5)
        else:
            assert not torch.allclose(log_g[i], log0[i], atol=1e-3)


def test_strength_scales_the_step_linearly(lm, folder):
    for k in (None, 2):
        kernel = els(lm, folder, steps=1, harm_orth=k).kernel(3)
        torch.manual_seed(1)
        x = torch.randn(8, H)
        site = kernel.sites[0]
        full = kernel.edit(site, x, torch.ones(8)) - x
        for s in (0.0, 0.25, 0.5):
            part = kernel.edit(site, x, torch.full((8,), s)) - x
            torch.testing.assert_close(part, s * full, atol=1e-5, rtol=1e-4)
        mixed = kernel.edit(site, x, torch.tensor([0.0, 1.0, 0.3, 1.0, 0.0, 0.7, 1.0, 0.1])) - x
        assert torch.equal(mixed[0], torch.zeros(H)) and torch.equal(mixed[4], torch.zeros(H))


# ---- the learned row strength ----------------------------------------------------------------------------
def _strength(lm, layer=1, weight=None, bias=0.0, floor=0.1):
    torch.manual_seed(7)
    w = torch.tensor([-2.0, 0.5, 0.3, -0.4]) if weight is None else weight
    return RowStrength(
        layer,
        w,
        bias,
        torch.zeros(len(STRENGTH_FEATURES)),
        torch.ones(len(STRENGTH_FEATURES)),
        torch.randn(H),
        torch.randn(H),
        floor,
        fingerprint=lm.fingerprint,
    )


def _split_strength(lm, folder):
    """A row strength model at block 1 that holds back (strength 0) two of the four PROMPTS."""
    iv = els(lm, folder, gate=True)
    rs = _strength(lm)
    states = capture(lm, PROMPTS, [1], progress=False)
    f = iv.kernel(3).row_features(states, (rs.refusal_dir, rs.harm_dir))
    rs.weight = rs.weight * 2.0 / float((f @ rs.weight).max() - (f @ rs.weight).min())  # strengths below 1
    z = f @ rs.weight
    cut = float(z.sort().values[1:3].mean())
    rs.bias = -cut
    rs.floor = 0.5  # sigmoid(z - cut) < 0.5 for the two lowest
    return rs


def test_row_strength_holds_back_and_scales_rows(lm, folder, tmp_path):
    import shutil

    d = tmp_path / "els"
    shutil.copytree(folder, d)
    rs = _split_strength(lm, folder)
    rs.save(d)
    iv = els(lm, d, row_strength=True, harm_orth=2)
    assert iv.gate is not None and iv.row_strength is not None
    assert iv.config()["row_strength"] == {"layer": 1, "floor": 0.5}
    kernel = iv.kernel(3)
    states = capture(lm, PROMPTS, kernel.decision_layers, progress=False)
    s = kernel.decide(states)
    held = s == 0
    assert int(held.sum()) == 2 and bool(((s[~held] >= 0.5) & (s[~held] < 1)).all())
    assert unsteered_rows(iv, lm, PROMPTS) == held.tolist()
    info = row_info(iv, lm, PROMPTS)
    assert [r["steered"] for r in info] == (~held).tolist()
    torch.testing.assert_close(torch.tensor([r["strength"] for r in info]), s, atol=1e-4, rtol=0)
    assert all("strength_p" in r and "harm_p" in r for r in info)
    # held rows are exactly the unsteered model's; the others are moved, by their strength
    _, log0, _, _ = run_steered(lm, PROMPTS, NoIntervention())
    for use_cache in (True, False):
        _, log_s, ctx, _ = run_steered(lm, PROMPTS, iv, use_cache=use_cache)
        for i in range(4):
            if held[i]:
                torch.testing.assert_close(log_s[i], log0[i], rtol=0, atol=1e-5 if use_cache else 1e-4)
            else:
                assert not torch.allclose(log_s[i], log0[i], atol=1e-3)
        assert ctx.stats["els_strength"] == {"rows": 4, "held": 2}
    # the same as plain ELS given that per-row strength directly
    _, log_direct, _, _ = run_steered(lm, PROMPTS, els(lm, d, harm_orth=2), strength=s.tolist())
    torch.testing.assert_close(log_s, log_direct, rtol=0, atol=1e-4)


def test_row_strength_replaces_the_cut_offs_and_checks_its_layer(lm, folder, tmp_path):
    import shutil

    d = tmp_path / "els"
    shutil.copytree(folder, d)
    with pytest.raises(AligntaxError, match="els row-strength"):
        els(lm, d, row_strength=True)
    _strength(lm, layer=2).save(d)
    with pytest.raises(AligntaxError, match="layer 2"):
        els(lm, d, row_strength=True)  # steering starts at block 1
    _strength(lm, layer=1).save(d)
    iv = els(lm, d, row_strength=True, row_threshold=0.0, gate=0.3)
    assert iv.row_threshold is None and iv.gate_ramp is None
    assert list(iv.kernel(3).decision_parts(capture(lm, PROMPTS, [1], progress=False))) == ["els_strength"]
    assert els(lm, d, row_strength="none").row_strength is None


def test_fit_row_strength_learns_the_worth_of_steering(lm):
    from aligntax.energy.front import fit_row_strength

    torch.manual_seed(0)
    n = 200
    worth = torch.arange(n) % 2 == 0
    f = torch.randn(n, 4)
    f[:, 0] += torch.where(worth, -2.0, 2.0)  # harmful rows: a high gate logit
    rs = fit_row_strength(
        f,
        worth,
        1,
        torch.randn(H),
        torch.randn(H),
        weight=torch.ones(n),
        floor=0.2,
        fingerprint=lm.fingerprint,
    )
    s = rs.strength(f)
    assert ((s >= 0) & (s <= 1)).all() and float(s[worth].mean()) > 0.8 and float(s[~worth].mean()) < 0.2
    assert rs.weight[0] < 0 and rs.info["n"] == n and rs.info["held_at_floor"]["not_worth"] > 0.5
    with pytest.raises(Exception, match="worth"):
        fit_row_strength(f, torch.ones(n, dtype=torch.bool), 1, torch.randn(H), torch.randn(H))


# ---- options ---------------------------------------------------------------------------------------------
def test_options_on_the_command_line_and_the_sweep_grid():
    from aligntax.interventions.registry import cli_options, grid_values, intervention_args
    from aligntax.runs.els_sweep import SweepConfig, sweep_settings

    args = intervention_args("els", {"iv_steer": "d", "iv_harm_orth": "2", "iv_row_strength": "on"})
    assert args == {"path": "d", "harm_orth": 2, "row_strength": True}
    assert intervention_args("els", {"iv_row_strength": "off"}) == {"row_strength": "none"}
    with pytest.raises(AligntaxError, match="on' or 'off"):
        intervention_args("els", {"iv_row_strength": "maybe"})
    opts = {o.name: o for o in cli_options()}
    assert opts["harm_orth"].grid and opts["row_strength"].grid
    assert grid_values("0,2", opts["harm_orth"]) == [0, 2]
    assert grid_values("off,on", opts["row_strength"]) == [None, True]
    cfg = SweepConfig(
        steer="d",
        top_k=[1],
        eta=[0.35],
        threshold=[None],
        gate=[True],
        horizon=[16],
        row_threshold=[0.0, -2.0],
        harm_orth=[0, 2],
        row_strength=[None, True],
        baselines=False,
    )
    els_args = [a for n, a in sweep_settings(cfg) if n == "els"]
    # harm_orth 0 is the plain setting (its key unchanged); with the strength the row threshold is gone
    assert {
        "path": "d",
        "top_k": 1,
        "eta": 0.35,
        "steps": 3,
        "threshold": None,
        "gate": True,
        "horizon": 16,
        "row_threshold": 0.0,
    } in els_args
    assert sum(1 for a in els_args if a.get("row_strength")) == 2  # harm_orth 0 and 2, deduplicated
    assert all("row_threshold" not in a for a in els_args if a.get("row_strength"))
    assert len(els_args) == 6


def test_vllm_adapter_runs_the_same_kernel(lm, folder, tmp_path):
    """The vLLM backend's flat-batch adapter runs the ELS kernel with the learned strength and the harm
    projection: a held request is untouched, a steered one gets the kernel's own edit, off the harm
    directions."""
    import shutil

    from aligntax.backends.vllm.steering import BatchSteering, RequestSteer, StepBatch

    d = tmp_path / "els"
    shutil.copytree(folder, d)
    _split_strength(lm, folder).save(d)
    iv = EnergySteering.from_dir(d, None, eta=0.5, layers=[1, 2], steps=3, row_strength=True, harm_orth=2)
    kernel = iv.kernel(3)
    st = BatchSteering()
    st.register("els", kernel)
    states = capture(lm, PROMPTS, [1], progress=False)[1]  # the last prompt tokens' states: two held
    s = kernel.decide({1: states})
    held = (s == 0).tolist()
    assert sum(held) == 2
    # four requests, one prefill step of 3 tokens each: the last one is the state above
    hidden = torch.randn(12, H)
    hidden[2::3] = states
    batch = StepBatch(["a", "b", "c", "d"], [0, 3, 6, 9], [3, 6, 9, 12], [3] * 4, torch.tensor([0, 1, 2] * 4))
    st.begin_step(batch, [RequestSteer("els", 1.0)] * 4, {"a", "b", "c", "d"})
    new_h, _ = st.pre_block(1, hidden, None)
    q = HarmBasis.load(d).get(1, 2)
    for i in range(4):
        delta = new_h[3 * i + 2] - hidden[3 * i + 2]
        if held[i]:
            assert torch.equal(delta, torch.zeros(H))
        else:
            want = kernel.edit(kernel.sites[0], states[i : i + 1], s[i : i + 1])[0] - states[i]
            torch.testing.assert_close(delta, want, atol=1e-5, rtol=1e-4)
            assert float((delta @ q.T).abs().max()) < 1e-4 * float(delta.norm())
        assert torch.equal(
            new_h[3 * i : 3 * i + 2], hidden[3 * i : 3 * i + 2]
        )  # earlier prompt tokens untouched
    recs = st.take_records()
    assert [recs[r]["strength"] for r in "abcd"] == pytest.approx(s.tolist(), abs=1e-6)


def test_training_computes_the_harm_basis_with_the_contrast_pairs(lm, tmp_path):
    """``els train``'s harm basis step: harmful training prompts against every benign one, the shipped
    contrast pairs captured beside them; saved as safetensors + JSON and loadable for the model."""
    from aligntax.data.base import PromptItem
    from aligntax.runs.els_train import ELSTrainConfig, harm_basis

    items = [PromptItem(f"b{i}", p, "benign", "t") for i, p in enumerate(PROMPTS)] + [
        PromptItem(f"h{i}", "harm " + p, "harmful", "t") for i, p in enumerate(PROMPTS)
    ]
    harmless = [PromptItem(f"n{i}", f"say {i}", "benign", "n") for i in range(3)]
    acts = capture(lm, [it.prompt for it in items], "all", progress=False)
    h_acts = capture(lm, [it.prompt for it in harmless], "all", progress=False)
    cfg = ELSTrainConfig(harm_k=3, batch_size=64, progress=False)
    basis = harm_basis(cfg, lm, tmp_path, items, acts, harmless, h_acts)
    assert sorted(basis.directions) == [0, 1, 2] and basis.k_max == 3
    assert basis.info["layers"]["1"]["n_pairs"] == 1030 and basis.info["pairs"] == ["contrast-pairs"]
    diff = acts[1][4:].mean(0) - torch.cat([acts[1][:4], h_acts[1]]).mean(0)
    torch.testing.assert_close(basis.directions[1][0], diff / diff.norm(), atol=1e-5, rtol=0)
    basis.save(tmp_path)
    assert HarmBasis.load(tmp_path, expect_fingerprint=lm.fingerprint).k_max == 3
    no_pairs = harm_basis(
        ELSTrainConfig(harm_k=2, harm_pairs=[], progress=False), lm, tmp_path, items, acts, harmless, h_acts
    )
    assert no_pairs.info["layers"]["1"]["n_pairs"] == 0


def test_train_then_fit_the_row_strength(lm, tmp_path, parity_judge):
    """End to end on a tiny model: ``els train`` writes the harm basis; ``els row-strength`` steers the
    over-refused benign and the harmful training prompts, fits, saves and records per prompt; the
    fitted model steers through ``--row-strength on``."""
    import json

    from aligntax.runs.els_train import ELSTrainConfig, train_els
    from aligntax.runs.strength import StrengthConfig, fit_strength

    def data(name, label, n):
        path = tmp_path / f"{name}.jsonl"
        path.write_text(
            "".join(
                json.dumps(
                    {"id": f"{name}{i}", "prompt": f"{name} request {i} {'x' * (i % 5)}", "label": label}
                )
                + "\n"
                for i in range(n)
            )
        )
        return str(path)

    cfg = ELSTrainConfig(
        out=str(tmp_path / "els"),
        benign=[data("b", "benign", 24)],
        harmful=[data("h", "harmful", 24)],
        harmless=[data("n", "benign", 8)],
        gate_harmful=[],
        gate_benign=[],
        judge="parity",
        max_new_tokens=4,
        batch_size=16,
        dtype="fp32",
        epochs=2,
        energy_folds=2,
        harm_k=3,
        progress=False,
    )
    train_els(cfg, lm=lm)
    folder = tmp_path / "els"
    assert HarmBasis.load(folder, expect_fingerprint=lm.fingerprint).k_max == 3
    from aligntax.energy.gate import HarmGate

    layer = max(HarmGate.load(folder).layer, 1)  # the gate decides at or before the steered block
    res = fit_strength(
        StrengthConfig(
            steer=str(folder),
            layers=[layer],
            eta=0.5,
            horizon=2,
            judge="parity",
            max_new_tokens=4,
            batch_size=16,
            dtype="fp32",
            progress=False,
        ),
        lm=lm,
    )
    assert res["layer"] == layer and res["outcome"]["harmful"] == 24
    rows = [json.loads(line) for line in (folder / "row_strength" / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == res["outcome"]["benign_over_refused"] + 24
    assert all(0.0 <= r["strength"] <= 1.0 and len(r["features"]) == len(STRENGTH_FEATURES) for r in rows)
    iv = EnergySteering.from_dir(folder, lm, layers=[layer], eta=0.5, row_strength=True, harm_orth=2)
    assert iv.row_strength.layer == layer and iv.harm_orth == 2
    info = row_info(iv, lm, PROMPTS)
    assert all(0.0 <= r["strength"] <= 1.0 for r in info)
