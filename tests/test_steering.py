"""Energy landscape steering and the vector baselines on tiny random models (fp32 unless noted)."""

from __future__ import annotations

import pytest
import torch

from aligntax.activations import capture, position_ids_from_mask
from aligntax.activations.decisions import row_info, unsteered_rows
from aligntax.energy import EnergyBank, EnergyModel
from aligntax.errors import AligntaxError, CompatibilityError
from aligntax.generation import GenerationConfig, generate
from aligntax.interventions import (
    INTERVENTIONS,
    ActivationAddition,
    ConditionalSteering,
    DirectionAblation,
    EnergySteering,
    NoIntervention,
    SteerContext,
    SteeringVectors,
    SystemPrompt,
    compute_vectors,
    false_refusal_direction,
    make_intervention,
    refusal_direction,
)
from aligntax.interventions.kernels import attach_kernel
from aligntax.models import decoder_layers
from tiny import (
    PROMPTS,
    end_token_for_varied_lengths,
    hook_counts,
    record_block_inputs,
    run_steered,
    save_tiny_bank,
    save_tiny_vectors,
    tiny_lm,
)

H = 32


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("qwen2", hidden=H, layers=3)


def energy_models(seed=1, layers=(1, 2)):
    torch.manual_seed(seed)
    out = {}
    for i, layer in enumerate(layers):
        out[layer] = EnergyModel(H, [32, 16], layernorm=i % 2 == 0, dropout=0.15)  # dropout must be ignored
    return out


def els(eta=1.0, steps=3, layers=(1, 2), **kw):
    kw.setdefault("scale_by_norm", False)
    return EnergySteering(energy_models(layers=layers), eta=eta, steps=steps, **kw)


def forward_with(lm, prompts, intervention, rows=None, layers=None):
    """One prefill forward (as generate does it) recording the states entering every block."""
    from aligntax.generation.chat import build_messages, encode_chats, render_chat

    texts = [render_chat(lm.tokenizer, build_messages(p)) for p in prompts]
    enc = encode_chats(lm.tokenizer, texts, lm.device)
    ctx = SteerContext(
        prompt_len=enc["input_ids"].shape[1], rows=None if rows is None else torch.tensor(rows)
    )
    with torch.no_grad(), intervention.attach(lm.model, ctx):
        store, remove = record_block_inputs(lm.model, layers)  # registered after: sees the steered input
        try:
            logits = lm.model(
                **enc, position_ids=position_ids_from_mask(enc["attention_mask"]), use_cache=False
            ).logits
        finally:
            remove()
    return {k: v[0] for k, v in store.items()}, logits, enc["attention_mask"], ctx


# ---- ELS core ------------------------------------------------------------------------------------------
def test_eta_zero_is_bit_identical(lm):
    tok0, log0, _, _ = run_steered(lm, PROMPTS, NoIntervention())
    tok1, log1, ctx, _ = run_steered(lm, PROMPTS, els(eta=0.0))
    assert torch.equal(tok0, tok1) and torch.equal(log0, log1)
    assert ctx.stats["els"][1]["positions"] > 0  # the hooks did run
    # and a real step changes the output
    _, log2, _, _ = run_steered(lm, PROMPTS, els(eta=2.0))
    assert not torch.allclose(log0, log2)


def test_batched_equals_unbatched(lm):
    st = els(eta=2.0)
    tok_b, log_b, _, _ = run_steered(lm, PROMPTS, st)
    for i, p in enumerate(PROMPTS):
        tok_1, log_1, _, _ = run_steered(lm, [p], st)
        assert torch.equal(tok_b[i], tok_1[0]), i
        torch.testing.assert_close(log_b[i], log_1[0], atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_kv_cache_equals_no_cache(arch):
    model_lm = tiny_lm(arch, hidden=H, layers=3)
    st = els(eta=2.0, threshold=-1e9)
    tok_c, log_c, ctx_c, _ = run_steered(model_lm, PROMPTS, st, use_cache=True)
    tok_n, log_n, ctx_n, _ = run_steered(model_lm, PROMPTS, st, use_cache=False)
    assert torch.equal(tok_c, tok_n)
    torch.testing.assert_close(log_c, log_n, atol=2e-4, rtol=2e-4)
    tok_0, _, _, _ = run_steered(model_lm, PROMPTS, NoIntervention())
    assert not torch.equal(tok_0, tok_c)  # steering did something
    # cached: 4 rows x (1 last prompt token + 4 decode steps that reach the model); each layer
    assert ctx_c.stats["els"][1]["positions"] == 4 * 5


def test_horizon_steers_only_the_first_generated_tokens(lm):
    """A horizon H steers the last prompt token and the first H generated tokens, with and without the
    KV cache alike; a horizon beyond the generation is the same as none."""
    st = els(eta=2.0, threshold=-1e9, horizon=2)
    tok_c, log_c, ctx_c, _ = run_steered(lm, PROMPTS, st, use_cache=True)
    tok_n, log_n, _, _ = run_steered(lm, PROMPTS, st, use_cache=False)
    assert torch.equal(tok_c, tok_n)
    torch.testing.assert_close(log_c, log_n, atol=2e-4, rtol=2e-4)
    assert ctx_c.stats["els"][1]["positions"] == 4 * (1 + 2)  # 4 rows x (last prompt token + 2 tokens)
    _, log_all, ctx_all, _ = run_steered(lm, PROMPTS, els(eta=2.0, threshold=-1e9))
    _, log_far, _, _ = run_steered(lm, PROMPTS, els(eta=2.0, threshold=-1e9, horizon=100))
    assert torch.equal(log_all, log_far) and ctx_all.stats["els"][1]["positions"] == 4 * 5
    # the first logits (from the steered last prompt token) agree; later ones differ once steering stops
    torch.testing.assert_close(log_c[:, :3], log_all[:, :3], atol=2e-4, rtol=2e-4)
    assert not torch.allclose(log_c[:, 3:], log_all[:, 3:], atol=1e-3)
    _, _, ctx0, _ = run_steered(lm, PROMPTS, els(eta=2.0, threshold=-1e9, horizon=0))
    assert ctx0.stats["els"][1]["positions"] == 4
    with pytest.raises(AligntaxError, match="horizon"):
        els(horizon=-1)


def test_steering_lands_on_claimed_positions(lm):
    base, _, mask, _ = forward_with(lm, PROMPTS, NoIntervention())
    steered, _, _, ctx = forward_with(
        lm, PROMPTS, EnergySteering(energy_models(layers=(1,)), eta=3.0, steps=1, scale_by_norm=False)
    )
    T = mask.shape[1]
    # entering layer 1: exactly the last prompt token of every row changed
    diff = (steered[1] - base[1]).norm(dim=-1)
    assert torch.all(diff[:, T - 1] > 0.1) and torch.all(diff[:, : T - 1] == 0)
    torch.testing.assert_close(
        diff[:, T - 1], torch.full((4,), 3.0), atol=1e-4, rtol=1e-4
    )  # one step of eta 3
    # layer 0 untouched, and no earlier prompt token changes at any later layer either
    assert torch.equal(steered[0], base[0])
    real = mask[:, : T - 1].bool()  # (padding positions may attend anywhere; they are never read)
    assert torch.all((steered[2] - base[2])[:, : T - 1][real] == 0)
    assert ctx.stats["els"][1]["positions"] == 4 and ctx.stats["els"][1]["steered"] == 4
    # 'all' steers every position, 'generated' nothing in the prefill
    st_all, _, _, _ = forward_with(
        lm,
        PROMPTS,
        EnergySteering(energy_models(layers=(1,)), eta=3.0, steps=1, positions="all", scale_by_norm=False),
    )
    assert torch.all((st_all[1] - base[1]).norm(dim=-1) > 0.1)
    st_gen, _, _, _ = forward_with(
        lm,
        PROMPTS,
        EnergySteering(
            energy_models(layers=(1,)), eta=3.0, steps=1, positions="generated", scale_by_norm=False
        ),
    )
    assert torch.equal(st_gen[1], base[1])


def test_each_step_moves_by_eta_and_norm_scaling():
    m = energy_models(layers=(1,))
    x = 5 * torch.randn(3, 4, H)
    scale = torch.ones(3, 1, 1)
    for steps in (1, 2, 5):
        st = EnergySteering(m, eta=0.7, steps=steps, scale_by_norm=False)
        prev = x
        # one step at a time: every step moves each position by exactly eta
        for _ in range(steps):
            nxt = EnergySteering(m, eta=0.7, steps=1, scale_by_norm=False).kernel(3).steer(1, prev, scale)
            torch.testing.assert_close(
                (nxt - prev).norm(dim=-1), torch.full((3, 4), 0.7), atol=1e-5, rtol=1e-5
            )
            prev = nxt
        torch.testing.assert_close(st.kernel(3).steer(1, x, scale), prev)
    scaled = EnergySteering(m, eta=0.5, steps=1, norms={1: 8.0})
    assert scaled.step_size(1) == 4.0
    moved = scaled.kernel(3).steer(1, x, torch.tensor([1.0, 0.0, 2.0]).view(3, 1, 1))
    torch.testing.assert_close((moved - x).norm(dim=-1), torch.tensor([[4.0] * 4, [0.0] * 4, [8.0] * 4]))
    # descending the energy lowers it
    e0 = m[1].energy(x)
    e1 = m[1].energy(EnergySteering(m, eta=0.05, steps=3, scale_by_norm=False).kernel(3).steer(1, x, scale))
    assert torch.all(e1 < e0)
    with pytest.raises(AligntaxError, match="scale_by_norm"):
        EnergySteering(m, eta=0.5)


def test_autograd_and_closed_form_steering_agree(lm):
    m = energy_models()
    x = 5 * torch.randn(2, 3, H)
    scale = torch.ones(2, 1, 1)
    for layer in (1, 2):
        a = EnergySteering(m, eta=0.4, steps=3, scale_by_norm=False).kernel(3).steer(layer, x, scale)
        b = (
            EnergySteering(m, eta=0.4, steps=3, scale_by_norm=False, grad_method="autograd")
            .kernel(3)
            .steer(layer, x, scale)
        )
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # generation runs under no_grad: the autograd path still works
        _, log_a, _, _ = run_steered(
            lm, PROMPTS[:2], EnergySteering(m, eta=1.0, scale_by_norm=False, grad_method="autograd")
        )
    _, log_c, _, _ = run_steered(lm, PROMPTS[:2], EnergySteering(m, eta=1.0, scale_by_norm=False))
    torch.testing.assert_close(log_a, log_c, atol=1e-3, rtol=1e-3)
    assert all(p.grad is None for p in lm.model.parameters())  # nothing flowed through the LLM


def test_per_row_steering_and_strength(lm):
    st = els(eta=2.0)
    tok0, log0, _, _ = run_steered(lm, PROMPTS, NoIntervention())
    tok_s, log_s, _, _ = run_steered(lm, PROMPTS, st)
    tok_r, log_r, ctx, _ = run_steered(lm, PROMPTS, st, rows=[True, False, True, False])
    for i in (1, 3):  # unsteered rows: identical to an unsteered run
        assert torch.equal(log_r[i], log0[i]) and torch.equal(tok_r[i], tok0[i])
    for i in (0, 2):  # steered rows: identical to steering every row
        assert torch.equal(log_r[i], log_s[i])
    assert ctx.stats["els"][1]["positions"] == 2 * 5
    _, log_z, _, _ = run_steered(lm, PROMPTS, st, strength=[0.0, 1.0, 0.0, 1.0])
    assert torch.equal(log_z[0], log0[0]) and torch.equal(log_z[1], log_s[1])
    # strength scales the step: entering layer 1 the last prompt token moves by strength * eta * steps
    base, _, mask, _ = forward_with(lm, PROMPTS, NoIntervention(), layers=[1])
    single = EnergySteering(energy_models(layers=(1,)), eta=1.5, steps=1, scale_by_norm=False)
    T = mask.shape[1]
    ctx2 = SteerContext(prompt_len=T, strength=torch.tensor([0.5, 1.0, 2.0, 0.0]))
    from aligntax.generation.chat import build_messages, encode_chats, render_chat

    enc = encode_chats(lm.tokenizer, [render_chat(lm.tokenizer, build_messages(p)) for p in PROMPTS], "cpu")
    with torch.no_grad(), single.attach(lm.model, ctx2):
        store, remove = record_block_inputs(lm.model, [1])
        lm.model(**enc, position_ids=position_ids_from_mask(enc["attention_mask"]), use_cache=False)
        remove()
    moved = (store[1][0] - base[1])[:, T - 1].norm(dim=-1)
    torch.testing.assert_close(moved, torch.tensor([0.75, 1.5, 3.0, 0.0]), atol=1e-4, rtol=1e-4)


def test_threshold_gating(lm):
    tok0, log0, _, _ = run_steered(lm, PROMPTS, NoIntervention())
    _, log_hi, ctx, _ = run_steered(lm, PROMPTS, els(eta=2.0, threshold=1e9))
    assert torch.equal(log_hi, log0) and ctx.stats["els"][1]["steered"] == 0
    _, log_lo, _, _ = run_steered(lm, PROMPTS, els(eta=2.0, threshold=-1e9))
    _, log_un, _, _ = run_steered(lm, PROMPTS, els(eta=2.0))
    assert torch.equal(log_lo, log_un)
    # gating is per position: a threshold between the energies steers only the positions above it
    m = energy_models(layers=(1,))
    x = 5 * torch.randn(6, 1, H)
    e = m[1].energy(x).detach()
    srt = e.flatten().sort().values
    thr = float(srt[2] + srt[3]) / 2  # between two energies: half the positions above
    out = (
        EnergySteering(m, eta=0.5, steps=1, scale_by_norm=False, threshold=thr)
        .kernel(3)
        .steer(1, x, torch.ones(6, 1, 1))
    )
    moved = (out - x).norm(dim=-1).squeeze(1) > 0
    assert torch.equal(moved, e.squeeze(1) > thr) and int(moved.sum()) == 3


def test_hooks_removed_on_exit_and_exception(lm):
    n0 = hook_counts(lm.model)
    st = els(eta=1.0)
    ctx = SteerContext(prompt_len=3)
    with st.attach(lm.model, ctx):
        assert hook_counts(lm.model) == n0 + 2
    assert hook_counts(lm.model) == n0
    with pytest.raises(RuntimeError, match="boom"), st.attach(lm.model, ctx):
        raise RuntimeError("boom")
    assert hook_counts(lm.model) == n0
    for iv in (
        DirectionAblation(torch.randn(H)),
        ActivationAddition({1: torch.randn(H)}),
        ConditionalSteering(torch.randn(H), 1, 0.0, torch.randn(H)),
    ):
        with pytest.raises(ValueError), iv.attach(lm.model, ctx):
            raise ValueError
        assert hook_counts(lm.model) == n0


def test_nan_states_raise(lm):
    st = els(eta=1.0)
    x = torch.randn(2, 3, H)
    x[0, 1, 0] = float("nan")
    blocks = decoder_layers(lm.model)
    ctx = SteerContext(prompt_len=3)

    def poison(module, args, kwargs):
        h = args[0].clone()
        h[:, -1] = float("nan")
        return (h, *args[1:]), kwargs

    handle = blocks[1].register_forward_pre_hook(poison, with_kwargs=True, prepend=True)
    try:
        with pytest.raises(AligntaxError, match="NaN"), torch.no_grad(), st.attach(lm.model, ctx):
            lm.model(input_ids=torch.tensor([[5, 6, 7]]), use_cache=False)
    finally:
        handle.remove()


def test_generate_integration_and_stats(lm):
    st = els(eta=0.3, steps=2)
    cfg = GenerationConfig(max_new_tokens=4, batch_size=2)
    gens = generate(
        lm,
        PROMPTS,
        cfg,
        st,
        progress=False,
        steer_rows=[True, False, True, True],
        strengths=[1.0, 1.0, 0.5, 2.0],
    )
    assert len(gens) == 4 and all(g.n_tokens <= 4 for g in gens)
    base = generate(lm, PROMPTS, cfg, progress=False)
    assert gens[1].response == base[1].response  # the unsteered row
    assert st.config()["layers"] == [1, 2] and st.config()["eta_by_layer"] == {1: 0.3, 2: 0.3}


# ---- energy bank integration -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bank_dir(lm, tmp_path_factory):
    return save_tiny_bank(lm, tmp_path_factory.mktemp("bank"), n=24, epochs=3)


def test_from_dir_and_fingerprint_refusal(lm, bank_dir):
    bank = EnergyBank.load(bank_dir)
    st = EnergySteering.from_dir(bank_dir, lm, eta=0.2, steps=2, top_k=2)
    assert sorted(st.models) == sorted(bank.layers[:2])
    best = bank.layers[0]
    assert st.step_size(best) == pytest.approx(0.2 * bank.median_norm(best))
    st1 = EnergySteering.from_dir(bank_dir, lm, layers=[0], eta=0.1)
    assert list(st1.models) == [0]
    _, _, ctx, _ = run_steered(lm, PROMPTS[:2], st)
    assert set(ctx.stats["els"]) == set(st.models)
    other = tiny_lm("qwen2", hidden=H, layers=3, seed=5)  # same shape, other weights
    with pytest.raises(CompatibilityError) as e:
        EnergySteering.from_dir(bank_dir, other)
    assert lm.fingerprint["embedding_digest"] in str(e.value)
    assert other.fingerprint["embedding_digest"] in str(e.value)
    wider = tiny_lm("qwen2", hidden=48, layers=3)
    with pytest.raises(CompatibilityError, match="hidden_size"):
        EnergySteering.from_dir(bank_dir, wider)
    with pytest.raises(AligntaxError, match="no model for layers"):
        EnergySteering.from_dir(bank_dir, lm, layers=[7])


# ---- vector baselines -----------------------------------------------------------------------------------
def test_direction_ablation_removes_direction(lm):
    r = torch.randn(H)
    u = r / r.norm()
    st, logits, _, _ = forward_with(lm, PROMPTS, DirectionAblation(r))
    for layer in range(3):  # every block input, every position
        assert (st[layer] @ u).abs().max() < 1e-4
    # the output of the last block is ablated too: the final hidden state has no component along u
    blocks = decoder_layers(lm.model)
    out = {}
    iv = DirectionAblation(r)
    with torch.no_grad(), iv.attach(lm.model, SteerContext(prompt_len=3)):
        # registered after the ablation's own hook, so it sees the block's final output
        handle = blocks[-1].register_forward_hook(
            lambda m, a, o: out.setdefault("h", o[0] if isinstance(o, tuple) else o)
        )
        try:
            lm.model(input_ids=torch.tensor([[5, 6, 7]]), use_cache=False)
        finally:
            handle.remove()
    assert (out["h"] @ u).abs().max() < 1e-4
    # nor does the stream between each attention and its MLP (the input of post_attention_layernorm: the
    # block input plus the attention output); without the attention-output sites it does
    for attn_sites in (True, False):
        kernel = DirectionAblation(r).kernel(3, H)
        if not attn_sites:
            kernel.sites = [s for s in kernel.sites if s.where != "attn"]
        mids = {}

        def keep(i, into):
            def hook(m, args):
                into[i] = args[0].detach()

            return hook

        handles = [
            blk.post_attention_layernorm.register_forward_pre_hook(keep(i, mids))
            for i, blk in enumerate(blocks)
        ]
        try:
            with torch.no_grad(), attach_kernel(lm.model, SteerContext(prompt_len=3), kernel, "test"):
                lm.model(input_ids=torch.tensor([[5, 6, 7]]), use_cache=False)
        finally:
            for h in handles:
                h.remove()
        worst = max(float((m @ u).abs().max()) for m in mids.values())
        assert (worst < 1e-4) == attn_sites, worst
    assert hook_counts(lm.model) == 0
    base, log0, _, _ = forward_with(lm, PROMPTS, NoIntervention())
    part, log_p, _, _ = forward_with(lm, PROMPTS, DirectionAblation(r), rows=[False, True, False, True])
    assert torch.equal(log_p[0], log0[0]) and not torch.allclose(log_p[1], log0[1])


def test_activation_addition_adds_exactly(lm):
    v = torch.randn(H)
    base, _, _, _ = forward_with(lm, PROMPTS, NoIntervention())
    st, _, mask, _ = forward_with(lm, PROMPTS, ActivationAddition({1: v}, coeff=2.0))
    torch.testing.assert_close(st[1] - base[1], (2.0 * v).expand_as(base[1]), atol=1e-5, rtol=1e-5)
    assert torch.equal(st[0], base[0])
    st2, _, _, _ = forward_with(
        lm, PROMPTS, ActivationAddition({1: v}, coeff=2.0, positions="last_and_generated")
    )
    T = mask.shape[1]
    assert torch.equal(st2[1][:, : T - 1], base[1][:, : T - 1])
    tok_c, log_c, _, _ = run_steered(lm, PROMPTS, ActivationAddition({1: v}, positions="last_and_generated"))
    tok_n, log_n, _, _ = run_steered(
        lm, PROMPTS, ActivationAddition({1: v}, positions="last_and_generated"), use_cache=False
    )
    assert torch.equal(tok_c, tok_n)
    torch.testing.assert_close(log_c, log_n, atol=2e-4, rtol=2e-4)


def test_vector_construction():
    g = torch.Generator().manual_seed(0)
    harmful = {1: torch.randn(10, H, generator=g) + 2, 2: torch.randn(10, H, generator=g)}
    harmless = {1: torch.randn(12, H, generator=g), 2: torch.randn(12, H, generator=g)}
    pseudo = {1: torch.randn(8, H, generator=g) + 1, 2: torch.randn(8, H, generator=g)}
    r = refusal_direction(harmful, harmless)
    torch.testing.assert_close(r[1], harmful[1].mean(0) - harmless[1].mean(0))
    fr = false_refusal_direction(pseudo, harmless, r)
    for layer in (1, 2):
        assert abs(float(fr[layer] @ r[layer])) < 1e-4
    vs = compute_vectors(harmful, harmless, pseudo, fingerprint={"hidden_size": H}, layer=1)
    assert set(vs.vectors) == {"refusal", "false_refusal", "condition", "center"}
    assert vs.metadata["layer"] == 1 and vs.metadata["cast"]["condition_layer"] == 1
    assert vs.metadata["cast"]["fit_balanced_acc"] > 0.8


def test_cast_decides_per_row(lm):
    base, _, mask, _ = forward_with(lm, PROMPTS, NoIntervention(), layers=[1])
    T = mask.shape[1]
    h_last = base[1][:, T - 1]
    c = h_last[2] - h_last.mean(0)  # only row 2 points along the condition
    center = h_last.mean(0)
    sims = torch.nn.functional.cosine_similarity(h_last - center, c[None], dim=-1)
    thr = float(sims.sort().values[-2] + sims.max()) / 2  # between the top two
    v = torch.randn(H) * 5
    cast = ConditionalSteering(c, 1, thr, v, behaviour_layers=[0, 2], mode="add", center=center)
    tok0, log0, _, _ = run_steered(lm, PROMPTS, NoIntervention())
    tok_c, log_c, ctx, _ = run_steered(lm, PROMPTS, cast)
    assert ctx.stats["cast"] == {"rows": 4, "triggered": 1}
    for i in (0, 1, 3):
        assert torch.equal(log_c[i], log0[i])
    assert not torch.allclose(log_c[2], log0[2])
    # the last prompt token is steered only after the condition layer (layer 2 here), so the first
    # logits already change; the same decision and positions without the KV cache
    tok_n, log_n, _, _ = run_steered(lm, PROMPTS, cast, use_cache=False)
    assert torch.equal(tok_c, tok_n)
    torch.testing.assert_close(log_c, log_n, atol=2e-4, rtol=2e-4)
    assert not torch.allclose(log_c[2, 0], log0[2, 0])
    ablate = ConditionalSteering(c, 1, thr, v, mode="ablate", compare="less", center=center)
    _, log_a, ctx_a, _ = run_steered(lm, PROMPTS, ablate)
    assert ctx_a.stats["cast"]["triggered"] == 3 and torch.equal(log_a[2], log0[2])
    # decided before generating: exactly the rows the hooks leave alone
    assert unsteered_rows(cast, lm, PROMPTS) == [True, True, False, True]
    assert unsteered_rows(ablate, lm, PROMPTS) == [False, False, True, False]


# ---- storage and registry ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vector_dir(lm, tmp_path_factory):
    return save_tiny_vectors(lm, tmp_path_factory.mktemp("vectors"))


def test_vectors_round_trip_and_refusal(lm, vector_dir):
    files = sorted(p.name for p in vector_dir.iterdir())
    assert files == ["vectors.json", "vectors.safetensors"]
    vs = SteeringVectors.load(vector_dir, expect_fingerprint=lm.fingerprint)
    assert sorted(vs.vectors["refusal"]) == [0, 1, 2] and vs.hidden_size == H
    other = tiny_lm("qwen2", hidden=H, layers=3, seed=9)
    with pytest.raises(CompatibilityError) as e:
        SteeringVectors.load(vector_dir, expect_fingerprint=other.fingerprint)
    assert other.fingerprint["embedding_digest"] in str(e.value)
    with pytest.raises(CompatibilityError, match="hidden size"):
        SteeringVectors.load(vector_dir, expect_hidden_size=64)


def test_registry(lm, bank_dir, vector_dir):
    assert set(INTERVENTIONS) == {
        "none",
        "system-prompt",
        "helpful-prompt",
        "els",
        "refusal-add",
        "refusal-ablation",
        "false-refusal-ablation",
        "cast",
        "els-lora",
        "els-compose",
    }
    assert isinstance(make_intervention("none", lm), NoIntervention)
    sp = make_intervention("system-prompt", lm)
    hp = make_intervention("helpful-prompt", lm)
    assert isinstance(sp, SystemPrompt) and isinstance(hp, SystemPrompt) and sp.text != hp.text
    assert hp.prepare_messages([{"role": "user", "content": "x"}])[0]["role"] == "system"
    e = make_intervention("els", lm, dir=bank_dir, eta=0.1, steps=2, top_k=1)
    assert isinstance(e, EnergySteering) and len(e.models) == 1
    add = make_intervention("refusal-add", lm, dir=vector_dir, coeff=2.0)
    assert isinstance(add, ActivationAddition) and list(add.vectors) == [1]
    add2 = make_intervention("refusal-add", lm, path=vector_dir, layers=[0, 2])
    assert sorted(add2.vectors) == [0, 2]
    abl = make_intervention("refusal-ablation", lm, dir=vector_dir)
    fra = make_intervention("false-refusal-ablation", lm, dir=vector_dir, layer=2)
    assert isinstance(abl, DirectionAblation) and isinstance(fra, DirectionAblation)
    cast = make_intervention("cast", lm, dir=vector_dir)
    assert isinstance(cast, ConditionalSteering) and cast.mode == "ablate" and cast.condition_layer == 1
    for iv in (e, add, abl, fra, cast):
        tok, _, _, _ = run_steered(lm, PROMPTS[:2], iv, max_new_tokens=2)
        assert tok.shape == (2, 2)
    with pytest.raises(AligntaxError, match="needs dir"):
        make_intervention("els", lm)
    with pytest.raises(AligntaxError, match="Unknown intervention"):
        make_intervention("magic", lm)
    with pytest.raises(AligntaxError, match="Unknown options"):
        make_intervention("refusal-ablation", lm, dir=vector_dir, colour="red")
    other = tiny_lm("qwen2", hidden=H, layers=3, seed=9)
    with pytest.raises(CompatibilityError):
        make_intervention("refusal-ablation", other, dir=vector_dir)


def test_bf16_eta_zero_identical():
    lm16 = tiny_lm("llama", hidden=H, layers=2)
    lm16.model.to(torch.bfloat16)
    st = EnergySteering(energy_models(layers=(1,)), eta=0.0, steps=2, scale_by_norm=False)
    _, log0, _, _ = run_steered(lm16, PROMPTS[:2], NoIntervention(), max_new_tokens=3)
    _, log1, _, _ = run_steered(lm16, PROMPTS[:2], st, max_new_tokens=3)
    assert torch.equal(log0, log1)
    st2 = EnergySteering(energy_models(layers=(1,)), eta=1.0, steps=2, scale_by_norm=False)
    _, log2, ctx, _ = run_steered(lm16, PROMPTS[:2], st2, max_new_tokens=3)
    assert torch.isfinite(log2).all() and ctx.stats["els"][1]["positions"] == 2 * 3


# ---- harm gate -------------------------------------------------------------------------------------------
def _split_gate(lm, layer=1):
    """A gate at ``layer`` (or the mean of one probe per layer of a list) that holds back exactly two
    of the four PROMPTS (rows 0..3)."""
    from aligntax.energy.gate import HarmGate

    layers = [layer] if isinstance(layer, int) else list(layer)
    states = capture(lm, PROMPTS, layers, progress=False)
    h = torch.stack([states[x] for x in layers], dim=1)  # [4, L, H]
    torch.manual_seed(3)
    w = torch.randn(len(layers), H)
    mu, sc = h.mean(0), h.std(0)
    s = (((h - mu) / sc) * w).sum(-1).mean(-1)
    srt = s.sort().values
    cut = float(srt[1] + srt[2]) / 2
    gate = HarmGate(layers, w, torch.full((len(layers),), -cut), mu, sc, fingerprint=lm.fingerprint)
    return gate, (s > cut)


def _unsteered_run_with_gate(lm, tmp_path):
    """PROMPTS as a benign data file, an unsteered run of it in ``tmp_path/base``, and a harm gate that
    holds back two of its rows: (eval settings, gate, held rows)."""
    import json

    from aligntax.runs.eval import EvalConfig, run_eval

    data = tmp_path / "p.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "prompt": p, "label": "benign"}) + "\n" for i, p in enumerate(PROMPTS)
        )
    )
    gate, held = _split_gate(lm)
    common = dict(
        data=[str(data)], judge="keyword", max_new_tokens=6, batch_size=4, dtype="fp32", progress=False
    )
    run_eval(EvalConfig(out=str(tmp_path / "base"), **common), lm=lm)
    return common, gate, held


@pytest.mark.parametrize("layer,steer", [(1, (1, 2)), ([1, 2], (2,))])
def test_harm_gate_holds_back_rows(lm, layer, steer):
    """Held rows are exactly unsteered; for a gate of several layers too (it reads the earlier ones and
    decides at the last, before steering)."""
    gate, held = _split_gate(lm, layer)
    assert int(held.sum()) == 2
    tok0, log0, _, _ = run_steered(lm, PROMPTS, NoIntervention())
    _, log_all, _, _ = run_steered(lm, PROMPTS, els(eta=2.0, layers=steer))
    for use_cache in (True, False):
        _, log_g, ctx, _ = run_steered(
            lm, PROMPTS, els(eta=2.0, layers=steer, gate=gate), use_cache=use_cache
        )
        for i in range(4):  # held rows are exactly unsteered, the others exactly steered
            ref = log0[i] if held[i] else log_all[i]
            torch.testing.assert_close(log_g[i], ref, rtol=0, atol=1e-5 if use_cache else 1e-4)
        assert ctx.stats["els_gate"]["held"] == 2
    assert not torch.equal(log_all, log0)
    # a gate threshold above every probability holds nothing back; one near 0 holds back every row
    _, log_none, _, _ = run_steered(
        lm, PROMPTS, els(eta=2.0, layers=steer, gate=gate, gate_threshold=1 - 1e-9)
    )
    _, log_every, _, _ = run_steered(lm, PROMPTS, els(eta=2.0, layers=steer, gate=gate, gate_threshold=1e-9))
    assert torch.equal(log_none, log_all) and torch.equal(log_every, log0)


@pytest.mark.parametrize("layer,steer", [(1, (1, 2)), ([1, 2], (2,))])
def test_unsteered_rows_are_the_gate_held_rows(lm, layer, steer):
    gate, held = _split_gate(lm, layer)
    assert unsteered_rows(els(eta=2.0, layers=steer, gate=gate), lm, PROMPTS) == held.tolist()
    assert unsteered_rows(els(eta=2.0), lm, PROMPTS) is None  # without a gate any row may be steered
    assert unsteered_rows(NoIntervention(), lm, PROMPTS) is None


def test_remembered_prefill_states_capture_once(lm, monkeypatch):
    """Inside ``remembered_prefill_states`` several settings of one gate decide from one capture; the
    decisions are those of a fresh capture, and nothing is remembered after the block."""
    import importlib

    from aligntax.activations.decisions import remembered_prefill_states

    cap = importlib.import_module("aligntax.activations.capture")

    gate, held = _split_gate(lm)
    calls, tokenised = [], []
    real, real_ids = cap.capture_seqs, cap.chat_ids
    monkeypatch.setattr(cap, "capture_seqs", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(cap, "chat_ids", lambda *a, **k: tokenised.append(1) or real_ids(*a, **k))
    with remembered_prefill_states():
        for eta in (0.5, 1.0, 2.0):
            assert unsteered_rows(els(eta=eta, gate=gate), lm, PROMPTS) == held.tolist()
        assert unsteered_rows(els(eta=1.0, gate=gate), lm, PROMPTS[:2]) == held.tolist()[:2]  # other prompts
    assert len(calls) == 2
    unsteered_rows(els(eta=1.0, gate=gate), lm, PROMPTS)
    assert len(calls) == 3
    assert len(tokenised) == 5  # each decision tokenises its prompts once, captured or remembered


def test_per_row_state_follows_rows_leaving_the_batch(lm):
    """Generation drops finished rows from the batch: the harm gate's and CAST's per-row decisions,
    the steered rows and strengths, and the prompt states a recorder takes go with them, so every
    answer is the one ``model.generate`` gives keeping finished rows, and the stats cover every row."""
    from aligntax.activations.recorder import PrefillRecorder

    gate, _ = _split_gate(lm)
    prompts = PROMPTS + ["a", "Tell me a story about a dragon", "zzz", "What is 2+2?"]
    base, _, mask, _ = forward_with(lm, prompts, NoIntervention(), layers=[1])
    h_last = base[1][:, mask.shape[1] - 1]
    c, center = h_last[2] - h_last.mean(0), h_last.mean(0)
    sims = torch.nn.functional.cosine_similarity(h_last - center, c[None], dim=-1)
    cast = ConditionalSteering(
        c, 1, float(sims.median()), torch.randn(H) * 5, behaviour_layers=[0, 2], mode="add", center=center
    )
    steer_rows = [i % 3 != 1 for i in range(len(prompts))]
    strengths = [0.5 + 0.25 * i for i in range(len(prompts))]
    ablate_all = DirectionAblation(torch.randn(H), layers=[1, 2], positions="all")  # not prefix-free
    cases = [
        (els(eta=2.0, gate=gate), {"steer_rows": steer_rows, "strengths": strengths}),
        (cast, {}),
        (PrefillRecorder(lm.model, [0, 2]), {}),
        (ablate_all, {"steer_rows": steer_rows}),
    ]
    assert [iv.prefix_free for iv, _ in cases] == [True, True, True, False]
    eos = lm.model.generation_config.eos_token_id
    try:
        for iv, kw in cases:
            lm.model.generation_config.eos_token_id = eos
            runs = {}
            ref_cfg = GenerationConfig(max_new_tokens=16, batch_size=16, drop_finished=False)
            long = generate(lm, prompts, ref_cfg, iv, progress=False, **kw)
            rows = [lm.tokenizer(g.response, add_special_tokens=False)["input_ids"] for g in long]
            lm.model.generation_config.eos_token_id = end_token_for_varied_lengths(rows)
            for drop in (False, True):
                cfg = GenerationConfig(max_new_tokens=16, batch_size=16, drop_finished=drop)
                gens = generate(lm, prompts, cfg, iv, progress=False, **kw)
                states = iv._last if isinstance(iv, PrefillRecorder) else None
                runs[drop] = ([(g.response, g.n_tokens) for g in gens], states)
            assert runs[True][0] == runs[False][0], iv.name
            assert len({n for _, n in runs[True][0]}) >= 3
            if isinstance(iv, PrefillRecorder):
                for layer in (0, 2):
                    assert runs[True][1][layer].shape[0] == len(prompts)
                    ref = runs[False][1][layer]  # fp32 rounding only: the shared prefix is computed apart
                    torch.testing.assert_close(
                        runs[True][1][layer], ref, rtol=0, atol=2e-6 * float(ref.abs().max())
                    )
    finally:
        lm.model.generation_config.eos_token_id = eos


def test_prefix_free_hooks_see_the_prompt_after_the_shared_prefix(lm):
    """Generation computes the prefix all prompts share once, without hooks, for prefix-free
    interventions: their prefill forward holds the rest of the prompts (ctx.prompt_len), and the
    last prompt token is still its last position."""
    from aligntax.generation.chat import build_messages, encode_chats, render_chat
    from aligntax.interventions.base import hidden_from_args, hooks_attached

    seen = {}

    class Probe(NoIntervention):
        def __init__(self, free):
            self.prefix_free = free

        def attach(self, model, ctx):
            return hooks_attached([(decoder_layers(model)[0], self.hook(ctx), True)])

        def hook(self, ctx):
            def fn(module, args, kwargs):
                h = hidden_from_args(args, kwargs)
                seen.setdefault(self.prefix_free, (h.shape[1], ctx.prompt_len))

            return fn

    width = encode_chats(
        lm.tokenizer, [render_chat(lm.tokenizer, build_messages(p)) for p in PROMPTS], "cpu"
    )["input_ids"].shape[1]
    outs = {
        free: generate(lm, PROMPTS, GenerationConfig(max_new_tokens=4), Probe(free), progress=False)
        for free in (True, False)
    }
    assert seen[False] == (width, width)
    assert seen[True][0] == seen[True][1] < width
    assert [g.response for g in outs[True]] == [g.response for g in outs[False]]


def test_gate_and_cast_stats_count_every_row_when_rows_leave(lm):
    from aligntax.generation.chat import build_messages, encode_chats, render_chat
    from aligntax.generation.generate import greedy_decode

    gate, held = _split_gate(lm)
    enc = encode_chats(lm.tokenizer, [render_chat(lm.tokenizer, build_messages(p)) for p in PROMPTS], "cpu")
    ref = greedy_decode(lm.model, enc["input_ids"], enc["attention_mask"], 8, set())
    end = end_token_for_varied_lengths(ref)
    ctx = SteerContext(prompt_len=enc["input_ids"].shape[1])
    with els(eta=2.0, gate=gate).attach(lm.model, ctx):
        out = greedy_decode(lm.model, enc["input_ids"], enc["attention_mask"], 8, {end}, ctx)
    assert any(len(r) < 8 for r in out)
    assert ctx.stats["els_gate"] == {"rows": 4, "held": int(held.sum())}
    assert ctx.row_state[next(iter(ctx.row_state))].shape[0] < 4  # the live state shrank with the batch


def test_eval_reuses_unsteered_answers_for_held_rows(lm, tmp_path):
    """A steered evaluation that copies the gate-held rows from an unsteered run gives the same samples
    as one that generates every row, and generates only the rows the gate lets through."""

    from aligntax.runs.eval import EvalConfig, run_eval
    from aligntax.runs.jsonl import read_jsonl

    common, gate, held = _unsteered_run_with_gate(lm, tmp_path)
    full = run_eval(
        EvalConfig(out=str(tmp_path / "full"), **common), lm=lm, intervention=els(eta=2.0, gate=gate)
    )
    fast = run_eval(
        EvalConfig(out=str(tmp_path / "fast"), reuse_unsteered=str(tmp_path / "base"), **common),
        lm=lm,
        intervention=els(eta=2.0, gate=gate),
    )
    key = lambda r: r["id"]  # noqa: E731
    rf = sorted(read_jsonl(tmp_path / "full" / "samples.jsonl"), key=key)
    rr = sorted(read_jsonl(tmp_path / "fast" / "samples.jsonl"), key=key)
    assert [r["response"] for r in rf] == [r["response"] for r in rr]
    assert [bool(r.get("reused")) for r in rr] == held.tolist()
    assert fast["timing"]["reused_unsteered_samples"] == 2 and fast["timing"]["new_samples"] == 2
    assert full["timing"]["new_samples"] == 4
    # only an unsteered, greedy run made with the same settings can be reused
    with pytest.raises(AligntaxError, match="must be an unsteered run"):
        run_eval(
            EvalConfig(out=str(tmp_path / "x1"), reuse_unsteered=str(tmp_path / "full"), **common),
            lm=lm,
            intervention=els(eta=2.0, gate=gate),
        )
    with pytest.raises(AligntaxError, match="max_new_tokens"):
        run_eval(
            EvalConfig(
                out=str(tmp_path / "x2"),
                reuse_unsteered=str(tmp_path / "base"),
                **{**common, "max_new_tokens": 5},
            ),
            lm=lm,
            intervention=els(eta=2.0, gate=gate),
        )
    with pytest.raises(AligntaxError, match="not an evaluation run"):
        run_eval(
            EvalConfig(out=str(tmp_path / "x3"), reuse_unsteered=str(tmp_path / "nowhere"), **common),
            lm=lm,
            intervention=els(eta=2.0, gate=gate),
        )


def test_knowns_reuses_unsteered_answers_for_held_questions(lm, tmp_path):
    """The known-answer check copies the questions the gate holds back from an unsteered knowns run: the
    same samples as generating every question, fewer generated."""
    import json

    from aligntax.metrics.knowns import load_known_answers
    from aligntax.runs.jsonl import read_jsonl
    from aligntax.runs.knowns import KnownsConfig, run_knowns

    gate, held = _split_gate(lm)
    items = load_known_answers(split="all", limit=len(PROMPTS))
    data = tmp_path / "k.jsonl"  # the four PROMPTS as questions (their answers do not matter here)
    data.write_text(
        "".join(
            json.dumps({**it.to_dict(), "prompt": p}) + "\n" for it, p in zip(items, PROMPTS, strict=True)
        )
    )
    common = dict(
        model="tiny",
        data=str(data),
        split="all",
        max_new_tokens=6,
        batch_size=4,
        dtype="fp32",
        progress=False,
    )
    run_knowns(KnownsConfig(out=str(tmp_path / "base"), **common), lm=lm)
    full = run_knowns(
        KnownsConfig(out=str(tmp_path / "full"), **common), lm=lm, intervention=els(eta=2.0, gate=gate)
    )
    fast = run_knowns(
        KnownsConfig(out=str(tmp_path / "fast"), reuse_unsteered=str(tmp_path / "base"), **common),
        lm=lm,
        intervention=els(eta=2.0, gate=gate),
    )
    by_prompt = {p: i for i, p in enumerate(PROMPTS)}
    rf = sorted(read_jsonl(tmp_path / "full" / "samples.jsonl"), key=lambda r: by_prompt[r["prompt"]])
    rr = sorted(read_jsonl(tmp_path / "fast" / "samples.jsonl"), key=lambda r: by_prompt[r["prompt"]])
    assert [r["response"] for r in rf] == [r["response"] for r in rr]
    assert [bool(r.get("reused")) for r in rr] == held.tolist()
    assert fast["timing"]["reused_unsteered_samples"] == 2 and fast["timing"]["new_samples"] == 2
    assert full["timing"]["new_samples"] == 4 and full["correct"] == fast["correct"]
    with pytest.raises(AligntaxError, match="must be unsteered"):
        run_knowns(
            KnownsConfig(out=str(tmp_path / "x"), reuse_unsteered=str(tmp_path / "full"), **common),
            lm=lm,
            intervention=els(eta=2.0, gate=gate),
        )


def test_harm_gate_must_decide_before_steering(lm):
    gate, _ = _split_gate(lm, layer=2)
    with pytest.raises(AligntaxError, match="before steering"):
        els(gate=gate)  # steering starts at layer 1
    with pytest.raises(AligntaxError, match="gate_threshold"):
        els(gate=_split_gate(lm)[0], gate_threshold=1.5)


def test_train_harm_gate_and_files(lm, bank_dir, tmp_path):
    from aligntax.energy.gate import HarmGate, train_harm_gate

    torch.manual_seed(0)
    n = 200
    y = torch.arange(n) % 2 == 0
    direction = torch.randn(H)
    acts = {
        0: torch.randn(n, H),
        1: torch.randn(n, H) + 4.0 * y[:, None].float() * direction / direction.norm(),
    }
    gate = train_harm_gate(acts, y, seed=0, fingerprint=lm.fingerprint)
    assert gate.layer == 1 and gate.info["val"]["acc"] > 0.9 and gate.info["cv_folds"] == 5
    assert gate.info["per_layer_val"]["0"]["balanced_acc"] < 0.7  # noise layer is near chance
    assert (gate.harmful(acts[1]) == y).float().mean() > 0.9
    assert gate.threshold == 0.5 and gate.info["recall_target"] is None
    # calibrated for recall: the threshold holds back 99% of the harmful prompts out of fold (never above 0.5)
    safe = train_harm_gate(acts, y, seed=0, recall=0.99)
    cv = safe.info["cv_at_threshold"]
    assert safe.threshold <= 0.5 and cv["harmful_caught"] >= 0.99
    assert safe.threshold == min(0.5, safe.info["cv_recall_thresholds"]["0.99"])
    assert torch.equal(safe.weight, gate.weight)  # the same probe, another threshold
    with pytest.raises(AligntaxError, match="recall"):
        train_harm_gate(acts, y, recall=1.0)
    with pytest.raises(Exception, match="both benign and harmful"):
        train_harm_gate(acts, torch.ones(n, dtype=torch.bool))
    with pytest.raises(AligntaxError, match="2 folds"):
        train_harm_gate(acts, y, folds=1)
    # saved beside an energy bank: from_dir(gate=...) loads it, checked against the model
    d = tmp_path / "bank"
    import shutil

    shutil.copytree(bank_dir, d)
    with pytest.raises(AligntaxError, match="no harm gate"):
        EnergySteering.from_dir(d, lm, gate=True)
    gate = HarmGate(
        0, gate.weight, gate.bias, gate.mean, gate.scale, fingerprint=lm.fingerprint
    )  # before every bank layer
    gate.save(d)
    back = HarmGate.load(d)
    assert torch.equal(back.weight, gate.weight) and back.layers == [0] and back.layer == 0
    st = EnergySteering.from_dir(d, lm, gate=0.7)
    assert st.gate_threshold == 0.7 and st.config()["gate"] == {"layer": 0, "threshold": 0.7}
    other = tiny_lm("qwen2", hidden=H, layers=3, seed=5)
    with pytest.raises(CompatibilityError):
        HarmGate.load(d, expect_fingerprint=other.fingerprint)


def test_from_dir_takes_the_tuned_setting(lm, bank_dir, tmp_path):
    import json
    import shutil

    d = tmp_path / "bank"
    shutil.copytree(bank_dir, d)
    plain = EnergySteering.from_dir(d, lm)
    assert (plain.eta, plain.steps, plain.threshold, len(plain.models)) == (0.35, 3, None, 1)
    assert plain.settings_from == "defaults"
    (d / "sweep").mkdir()
    (d / "sweep" / "best.json").write_text(
        json.dumps({"best": {"args": {"top_k": 1, "eta": 0.45, "steps": 2, "threshold": 0.0}}})
    )
    tuned = EnergySteering.from_dir(d, lm)
    assert (tuned.eta, tuned.steps, tuned.threshold, len(tuned.models)) == (0.45, 2, 0.0, 1)
    assert tuned.settings_from.endswith("best.json")
    mixed = EnergySteering.from_dir(d, lm, eta=0.1, threshold="none")
    assert (mixed.eta, mixed.steps, mixed.threshold) == (0.1, 2, None)
    assert "eta" in mixed.settings_from and "threshold" in mixed.settings_from
    # a sweep that selected a layer list: steering takes those layers, unless top_k or layers are given
    runner_up = EnergyBank.load(d).layers[1]
    (d / "sweep" / "best.json").write_text(
        json.dumps({"best": {"args": {"layers": [runner_up], "eta": 0.45, "steps": 2, "threshold": None}}})
    )
    assert sorted(EnergySteering.from_dir(d, lm).models) == [runner_up]
    assert len(EnergySteering.from_dir(d, lm, top_k=2).models) == 2
    assert sorted(EnergySteering.from_dir(d, lm, layers=[EnergyBank.load(d).layers[0]]).models) == [
        EnergyBank.load(d).layers[0]
    ]


def test_an_untuned_folder_steers_by_the_safe_defaults(lm, bank_dir, tmp_path, caplog):
    """No sweep/best.json: the harm gate at its saved threshold (where the folder has one), the row energy
    decision at 0, the first 16 generated tokens, eta 0.35 on the best validated layer; one note says so."""
    import logging
    import shutil

    import aligntax
    from aligntax.energy.gate import HarmGate
    from aligntax.interventions import els as els_mod

    d = tmp_path / "bank"
    shutil.copytree(bank_dir, d)
    best = EnergyBank.load(d).layers[0]
    els_mod._UNTUNED_NOTED.clear()
    with caplog.at_level(logging.WARNING, logger="aligntax"):
        no_gate = EnergySteering.from_dir(
            d, lm
        )  # a folder trained without a harm gate: no gate, the rest holds
        EnergySteering.from_dir(d, lm)
    assert (no_gate.gate, no_gate.horizon, no_gate.row_threshold, no_gate.eta) == (None, 16, 0.0, 0.35)
    assert sorted(no_gate.models) == [best]
    notes = [r.getMessage() for r in caplog.records if "untuned" in r.getMessage()]
    assert len(notes) == 1 and "aligntax els sweep" in notes[0] and "\n" not in notes[0]
    HarmGate(
        [0],
        torch.randn(1, H),
        torch.zeros(1),
        torch.zeros(1, H),
        torch.ones(1, H),
        threshold=0.4,
        fingerprint=lm.fingerprint,
    ).save(d)
    st = aligntax.load_intervention(d, lm)
    assert st.gate is not None and st.gate_threshold == 0.4
    assert (st.horizon, st.row_threshold, st.eta, sorted(st.models)) == (16, 0.0, 0.35, [best])
    cfg = st.config()
    assert (
        cfg["gate"] == {"layer": 0, "threshold": 0.4} and cfg["row_threshold"] == 0.0 and cfg["horizon"] == 16
    )
    # each default can still be turned off; with every safety setting given there is no note
    free = EnergySteering.from_dir(d, lm, gate="none", horizon="none", row_threshold="none")
    assert (free.gate, free.horizon, free.row_threshold) == (None, None, None)
    # each row is decided by the gate and the row energy before generating
    info = row_info(st, lm, PROMPTS[:3])
    assert all({"harm_p", "energy", "steered"} <= set(r) for r in info)
    assert all(r["steered"] == (r["harm_p"] < 0.4 and r["energy"] > 0.0) for r in info)


def test_harm_gate_ensemble_of_layers(lm, tmp_path):
    """Two layers that each carry a noisy copy of the signal: the mean of their probes' logits is more
    accurate out of fold than either alone, so the ensemble is kept when asked for; its logit is the
    mean of the per-layer logits, and it survives a save and load. A gate file of the
    one-layer format (bias in the sidecar) still loads."""
    import json

    from aligntax.energy.gate import HarmGate, train_harm_gate

    torch.manual_seed(1)
    n = 600
    y = torch.arange(n) % 2 == 0
    sig = y.float() * 2 - 1
    direction = torch.randn(H)
    direction /= direction.norm()
    acts = {layer: torch.randn(n, H) + 1.2 * (sig + torch.randn(n))[:, None] * direction for layer in (0, 1)}
    gate = train_harm_gate(acts, y, seed=0, recall=0.95, fingerprint=lm.fingerprint, ensemble=True)
    scores, passed = gate.info["candidate_scores"], gate.info["candidate_benign_passed_at_threshold"]
    assert gate.layers == [0, 1] and gate.layer == 1
    assert scores["ensemble"] > max(scores["0"], scores["1"]) and passed["ensemble"] > max(
        passed["0"], passed["1"]
    )
    assert gate.info["cv_at_threshold"]["benign_passed"] == pytest.approx(passed["ensemble"], abs=1e-6)
    single = [
        HarmGate(layer, gate.weight[i], gate.bias[i], gate.mean[i], gate.scale[i])
        for i, layer in enumerate((0, 1))
    ]
    x = gate.stack(acts)
    assert x.shape == (n, 2, H)
    torch.testing.assert_close(gate.logit(x), (single[0].logit(acts[0]) + single[1].logit(acts[1])) / 2)
    assert train_harm_gate(acts, y, seed=0, recall=0.95).info["ensemble_val"] is None  # off by default
    with pytest.raises(AligntaxError, match="no states for"):
        gate.stack({0: acts[0]})
    gate.save(tmp_path / "g")
    back = HarmGate.load(tmp_path / "g", expect_fingerprint=lm.fingerprint, expect_hidden_size=H)
    assert (
        back.layers == [0, 1]
        and torch.equal(back.logit(x), gate.logit(x))
        and back.threshold == gate.threshold
    )
    # the one-layer format: 1-D tensors, the bias in gate.json
    from safetensors.torch import save_file

    old = tmp_path / "old"
    old.mkdir()
    save_file(
        {"weight": single[0].weight[0], "mean": single[0].mean[0], "scale": single[0].scale[0]},
        str(old / "gate.safetensors"),
    )
    meta = json.loads((tmp_path / "g" / "gate.json").read_text())
    meta.update(layer=0, bias=float(single[0].bias[0]), threshold=0.3)
    meta.pop("layers")
    (old / "gate.json").write_text(json.dumps(meta))
    legacy = HarmGate.load(old)
    assert legacy.layers == [0] and torch.equal(legacy.logit(acts[0]), single[0].logit(acts[0]))


# ---- row energy decision and graded harm gate -------------------------------------------------------------
def _row_split_threshold(lm, iv):
    """A row threshold between the 2nd and 3rd lowest last-prompt-token energies of PROMPTS at ``iv``'s
    first steered block: two rows above it (steered), two below (held)."""
    e = torch.tensor([r["energy"] for r in row_info(iv, lm, PROMPTS)])
    srt = e.sort().values
    return float(srt[1] + srt[2]) / 2, e


def test_row_energy_decision_steers_exactly_the_high_energy_rows(lm):
    """With ``row_threshold`` a row is steered (exactly as without the decision) when its last prompt
    token's energy at the first steered block is above it, and left exactly unsteered otherwise; the
    decision is the one ``row_info`` / ``unsteered_rows`` report before generating."""
    probe = els(eta=2.0)
    thr, energy = _row_split_threshold(lm, probe)
    steered = energy > thr
    assert int(steered.sum()) == 2
    _, log0, _, _ = run_steered(lm, PROMPTS, NoIntervention())
    _, log_all, _, _ = run_steered(lm, PROMPTS, els(eta=2.0))
    iv = els(eta=2.0, row_threshold=thr)
    for use_cache in (True, False):
        _, log_r, ctx, _ = run_steered(lm, PROMPTS, iv, use_cache=use_cache)
        for i in range(4):
            ref = log_all[i] if steered[i] else log0[i]
            torch.testing.assert_close(log_r[i], ref, rtol=0, atol=1e-5 if use_cache else 1e-4)
        assert ctx.stats["els_row_energy"] == {"rows": 4, "held": 2}
    info = row_info(iv, lm, PROMPTS)
    assert [r["steered"] for r in info] == steered.tolist()
    assert unsteered_rows(iv, lm, PROMPTS) == (~steered).tolist()
    assert "harm_p" not in info[0] and info[0]["strength"] in (0.0, 1.0)
    assert iv.config()["row_threshold"] == thr and "row_threshold" not in els().config()


def test_row_energy_decision_and_gate_combine(lm):
    """A row is steered only when the harm gate passes it and its energy is above the row threshold."""
    gate, held = _split_gate(lm)
    thr, energy = _row_split_threshold(lm, els(eta=2.0))
    iv = els(eta=2.0, gate=gate, row_threshold=thr)
    want = (~held) & (energy > thr)
    info = row_info(iv, lm, PROMPTS)
    assert [r["steered"] for r in info] == want.tolist()
    assert all(0.0 <= r["harm_p"] <= 1.0 for r in info)
    _, log0, _, _ = run_steered(lm, PROMPTS, NoIntervention())
    _, log_all, _, _ = run_steered(lm, PROMPTS, els(eta=2.0))
    _, log_c, _, _ = run_steered(lm, PROMPTS, iv)
    for i in range(4):
        torch.testing.assert_close(log_c[i], log_all[i] if want[i] else log0[i], rtol=0, atol=1e-5)


def test_gate_ramp_scales_strength_by_harm_probability(lm):
    """With ``gate_ramp`` a row's step is (t - p) / (t - ramp) of the full step (1 below the ramp, 0 at
    the threshold): the moved state matches a run with that per-row strength given directly."""
    gate, _ = _split_gate(lm)
    p = gate.prob(gate.stack(capture(lm, PROMPTS, [1], progress=False)))
    t, ramp = float(p.max()) + 1e-3, float(p.min()) - 1e-3
    iv = els(eta=2.0, gate=gate, gate_threshold=min(t, 0.999), gate_ramp=max(ramp, 0.0))
    strength = iv.kernel(3).gate_scale(p)
    assert ((strength > 0) & (strength < 1)).any()
    info = row_info(iv, lm, PROMPTS)
    torch.testing.assert_close(torch.tensor([r["strength"] for r in info]), strength, rtol=0, atol=1e-4)
    s_ramp, _, _, _ = forward_with(lm, PROMPTS, iv, layers=[2])
    ctx_strength = els(eta=2.0)
    from aligntax.generation.chat import build_messages, encode_chats, render_chat

    texts = [render_chat(lm.tokenizer, build_messages(q)) for q in PROMPTS]
    enc = encode_chats(lm.tokenizer, texts, lm.device)
    ctx = SteerContext(prompt_len=enc["input_ids"].shape[1], strength=strength)
    with torch.no_grad(), ctx_strength.attach(lm.model, ctx):
        store, remove = record_block_inputs(lm.model, [2])
        try:
            lm.model(**enc, position_ids=position_ids_from_mask(enc["attention_mask"]), use_cache=False)
        finally:
            remove()
    torch.testing.assert_close(s_ramp[2], store[2][0], rtol=0, atol=1e-5)
    with pytest.raises(AligntaxError, match="gate_ramp"):
        els(eta=2.0, gate_ramp=0.1)  # a ramp needs a gate
    with pytest.raises(AligntaxError, match="gate_ramp"):
        els(eta=2.0, gate=gate, gate_threshold=0.3, gate_ramp=0.4)


def test_eval_records_per_row_steering(lm, tmp_path):
    """Every sample of a steered run records whether its row was steered, its strength, harm
    probability and energy; results.json summarises them per dataset and label; copied rows too."""
    import json

    from aligntax.runs.eval import EvalConfig, run_eval
    from aligntax.runs.jsonl import read_jsonl

    common, gate, held = _unsteered_run_with_gate(lm, tmp_path)
    res = run_eval(
        EvalConfig(out=str(tmp_path / "s"), reuse_unsteered=str(tmp_path / "base"), **common),
        lm=lm,
        intervention=els(eta=2.0, gate=gate),
    )
    rows = {r["id"]: r for r in read_jsonl(tmp_path / "s" / "samples.jsonl")}
    assert [rows[f"q{i}"]["steering"]["steered"] for i in range(4)] == (~held).tolist()
    assert all(bool(rows[f"q{i}"].get("reused")) == bool(held[i]) for i in range(4))
    summary = next(iter(res["steering"].values()))
    assert summary["rows"] == 4 and summary["steered"] == 2 and len(summary["harm_p"]) == 5
    assert "Rows steered" in (tmp_path / "s" / "report.md").read_text()
    base = json.loads((tmp_path / "base" / "results.json").read_text())
    assert "steering" not in base
