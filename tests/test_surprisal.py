"""The prompt surprisal domain of ELS (``max_prompt_surprisal``) on a tiny random model: the surprisal the
hooks score inside generation is the library's (batched equals unbatched, left padding equals right), rows
above the cut-off answer exactly as the unsteered model and the others exactly as without the cut-off, the
records carry each row's value, and the user's model is left without hooks."""

from __future__ import annotations

import pytest
import torch

from aligntax.activations.decisions import prompt_surprisal
from aligntax.errors import AligntaxError
from aligntax.interventions.registry import make_intervention
from aligntax.surprisal import span_nll, template_span
from tiny import PROMPTS, hook_counts, run_steered, save_tiny_bank, tiny_lm

pytestmark = pytest.mark.usefixtures("one_thread")

OPTS = dict(layers=[2], eta=2.0, horizon=3, gate="none", row_threshold="none")


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    lm = tiny_lm("qwen2", hidden=32, layers=4)
    return lm, save_tiny_bank(lm, tmp_path_factory.mktemp("surprisal") / "els")


def _right_padded(lm, prompt: str) -> float:
    """The mean NLL of the user message's tokens, from a forward of the prompt alone (no padding)."""
    from aligntax.activations.capture import chat_ids

    seq = chat_ids(lm, [prompt])[0][0]
    head, tail = template_span(lm.tokenizer)
    with torch.no_grad():
        logits = lm.model(input_ids=torch.tensor([seq])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    target = torch.tensor(seq[head : len(seq) - tail])
    return float(-logp[head - 1 : len(seq) - tail - 1].gather(1, target[:, None]).mean())


def test_surprisal_is_the_user_tokens_mean_nll_whatever_the_batch(parts):
    lm, _ = parts
    batched = prompt_surprisal(lm, PROMPTS, batch_size=16)
    alone = [prompt_surprisal(lm, [p])[0] for p in PROMPTS]
    plain = [_right_padded(lm, p) for p in PROMPTS]
    assert batched == pytest.approx(alone, abs=1e-4) and batched == pytest.approx(plain, abs=1e-4)
    assert len({round(v, 3) for v in batched}) > len(PROMPTS) // 2  # it tells prompts apart


def test_rows_above_the_cut_off_are_held_back_exactly(parts):
    """Inside generation the hooks score each prompt in a nested forward of the model (every hook standing
    aside): the rows above the cut-off run exactly as unsteered, the others exactly as without the cut-off;
    the decision records give the same values; no hook is left behind."""
    from aligntax.activations.decisions import row_info, unsteered_rows

    lm, els = parts
    nll = prompt_surprisal(lm, PROMPTS)
    cut = sorted(nll)[len(nll) // 2]
    inside = [v <= cut for v in nll]
    assert 0 < sum(inside) < len(inside)
    before = hook_counts(lm.model)
    iv = make_intervention("els", lm, path=str(els), max_prompt_surprisal=cut, **OPTS)
    assert not iv.prefix_free  # the nested forward needs the whole prompt
    records = row_info(iv, lm, PROMPTS)
    assert [r["prompt_nll"] for r in records] == pytest.approx(nll, abs=1e-3)
    assert [r["steered"] for r in records] == inside
    assert unsteered_rows(iv, lm, PROMPTS) == [not x for x in inside]
    base = run_steered(lm, PROMPTS)
    free = run_steered(lm, PROMPTS, make_intervention("els", lm, path=str(els), **OPTS))
    toks, logits, ctx, _ = run_steered(lm, PROMPTS, iv)
    touched = 0
    for i, ok in enumerate(inside):
        want = free if ok else base
        assert torch.equal(toks[i], want[0][i]) and torch.allclose(logits[i], want[1][i], atol=1e-5), i
        touched += ok and not torch.allclose(logits[i], base[1][i], atol=1e-5)
    assert touched > 0  # the rows inside the domain are steered
    assert ctx.stats["els_domain"] == {"rows": len(PROMPTS), "held": len(PROMPTS) - sum(inside)}
    assert hook_counts(lm.model) == before
    toks_nc, logits_nc, _, _ = run_steered(lm, PROMPTS, iv, use_cache=False)
    assert torch.equal(toks_nc, toks) and torch.allclose(logits_nc, logits, atol=1e-4)


def test_the_surprisal_domain_in_aligntax_generation(parts):
    """Through aligntax's own loop (finished rows dropped, batches of mixed lengths), rows above the cut-off
    answer as unsteered and the others as without it."""
    from aligntax.generation import GenerationConfig, generate

    lm, els = parts
    nll = prompt_surprisal(lm, PROMPTS)
    cut = sorted(nll)[len(nll) // 2]
    cfg = GenerationConfig(max_new_tokens=6, batch_size=4)
    base = [g.response for g in generate(lm, PROMPTS, cfg, progress=False)]
    free_iv = make_intervention("els", lm, path=str(els), **OPTS)
    free = [g.response for g in generate(lm, PROMPTS, cfg, free_iv, progress=False)]
    held = make_intervention("els", lm, path=str(els), max_prompt_surprisal=cut, **OPTS)
    got = [g.response for g in generate(lm, PROMPTS, cfg, held, progress=False)]
    assert got == [f if v <= cut else b for f, b, v in zip(free, base, nll, strict=True)]
    assert free != base


def test_the_domain_needs_the_template_span(parts):
    from aligntax.energy.bank import EnergyBank
    from aligntax.interventions.els import EnergySteering

    lm, els = parts
    bank = EnergyBank.load(els)
    with pytest.raises(AligntaxError, match="surprisal_span"):
        EnergySteering.from_bank(bank, layers=[2], scale_by_norm=False, max_prompt_surprisal=5.0)
    ok = EnergySteering.from_bank(
        bank, layers=[2], scale_by_norm=False, max_prompt_surprisal=5.0, surprisal_span=(3, 2)
    )
    assert ok.kernel(lm.num_layers).prompt_nll_span == (3, 2)


def test_span_nll_of_a_padded_row_ignores_the_padding(parts):
    lm, _ = parts
    from aligntax.activations.capture import chat_ids
    from aligntax.hooks import pad_left

    seqs = chat_ids(lm, PROMPTS[:3])[0]
    span = template_span(lm.tokenizer)
    ids, _ = pad_left(seqs, 0, lm.device)
    both = span_nll(lm.model, ids, torch.tensor([len(s) for s in seqs]), span)
    for r, s in enumerate(seqs):
        one = span_nll(lm.model, torch.tensor([s]), torch.tensor([len(s)]), span)
        assert float(both[r]) == pytest.approx(float(one[0]), abs=1e-4)


def test_the_vllm_backend_refuses_the_surprisal_domain(parts):
    """vLLM's steering sees no prompt logits: a setting with the domain is refused by name, one without it
    is registered."""
    from aligntax.backends.vllm.steering import BatchSteering

    lm, els = parts
    st = BatchSteering()
    held = make_intervention("els", lm, path=str(els), max_prompt_surprisal=5.0, **OPTS)
    with pytest.raises(AligntaxError, match="max_prompt_surprisal"):
        st.register("held", held.kernel(lm.num_layers))
    st.register("free", make_intervention("els", lm, path=str(els), **OPTS).kernel(lm.num_layers))
    assert list(st.presets) == ["free"]
