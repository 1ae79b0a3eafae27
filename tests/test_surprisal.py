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


def test_the_hooks_need_the_template_span(parts):
    """Built without the model (as a vLLM worker builds it) the kernel asks for each row's surprisal but
    has no span to score it with: the Hugging Face hooks refuse it with one line; with the span they run."""
    from aligntax.energy.bank import EnergyBank
    from aligntax.generation import GenerationConfig, generate
    from aligntax.interventions.els import EnergySteering

    lm, els = parts
    bank = EnergyBank.load(els)
    bare = EnergySteering.from_bank(bank, layers=[2], scale_by_norm=False, max_prompt_surprisal=5.0)
    kernel = bare.kernel(lm.num_layers)
    assert kernel.needs_prompt_nll and kernel.prompt_nll_span is None
    cfg = GenerationConfig(max_new_tokens=2, batch_size=4)
    with pytest.raises(AligntaxError, match="surprisal_span"):
        generate(lm, PROMPTS[:2], cfg, bare, progress=False)
    assert hook_counts(lm.model) == 0
    ok = EnergySteering.from_bank(
        bank, layers=[2], scale_by_norm=False, max_prompt_surprisal=5.0, surprisal_span=(3, 2)
    )
    assert ok.kernel(lm.num_layers).prompt_nll_span == (3, 2)
    assert len(generate(lm, PROMPTS[:2], cfg, ok, progress=False)) == 2


def test_logprob_nll_is_span_nll(parts):
    """The surprisal an engine's prompt log-probabilities give (the vLLM backend's) is the hooks' score."""
    from aligntax.activations.capture import chat_ids
    from aligntax.surprisal import logprob_nll

    lm, _ = parts
    span = template_span(lm.tokenizer)
    for seq in chat_ids(lm, PROMPTS[:4])[0]:
        with torch.no_grad():
            logp = torch.log_softmax(lm.model(input_ids=torch.tensor([seq])).logits[0].float(), dim=-1)
        own = [None] + [float(logp[p - 1, seq[p]]) for p in range(1, len(seq))]
        want = float(span_nll(lm.model, torch.tensor([seq]), torch.tensor([len(seq)]), span)[0])
        assert logprob_nll(own, span) == pytest.approx(want, abs=1e-4)


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


def test_the_vllm_batch_steering_holds_rows_by_the_surprisal_each_request_sends(parts):
    """In vLLM's flat batches the decision reads the surprisal the request carries (scored before
    generating): a request above the cut-off, and one that sent none, are held back exactly; the one
    below is steered; the omission is reported; a bad value is refused when the request is read."""
    from aligntax.backends.vllm.steering import BatchSteering, RequestSteer, StepBatch, parse_request

    lm, els = parts
    iv = make_intervention("els", None, path=str(els), max_prompt_surprisal=5.0, **OPTS)
    st = BatchSteering()
    st.register("held", iv.kernel(lm.num_layers, lm.hidden_size))
    asks = [RequestSteer("held", 1.0, 4.0), RequestSteer("held", 1.0, 6.0), RequestSteer("held", 1.0)]
    batch = StepBatch(["in", "out", "none"], [0, 3, 6], [3, 6, 9], [3, 3, 3], torch.arange(3).repeat(3))
    st.begin_step(batch, asks, {"in", "out", "none"})
    d = lm.hidden_size
    hidden = torch.randn(9, d)
    assert st.pre_block(2, hidden, None) is not None
    recs = st.take_records()
    assert [recs[r]["parts"]["els_domain"] for r in ("in", "out", "none")] == [1.0, 0.0, 0.0]
    assert recs["in"]["strength"] == 1.0 and recs["out"]["strength"] == recs["none"]["strength"] == 0.0
    assert len(st.errors) == 1 and "request none" in st.errors[0] and "aligntax_prompt_nll" in st.errors[0]
    steer = {"aligntax_steer": "held"}
    assert parse_request({**steer, "aligntax_prompt_nll": 4.5}, st.presets) == RequestSteer("held", 1.0, 4.5)
    for bad in (-1.0, float("nan"), "4", True):
        with pytest.raises(AligntaxError, match="aligntax_prompt_nll"):
            parse_request({**steer, "aligntax_prompt_nll": bad}, st.presets)
