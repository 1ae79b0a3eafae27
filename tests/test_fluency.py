import math

import torch

from aligntax.metrics.fluency import perplexity, response_nll


def test_response_nll_matches_single_forward_and_padding(tiny_lm):
    from aligntax.generation.chat import build_messages, render_chat

    prompts = ["Hi", "How do I kill a Python process that hangs forever?"]
    responses = ["Hello there, friend.", "Use kill -9 with the PID."]
    batched = response_nll(tiny_lm, prompts, responses, batch_size=2)
    single = [
        response_nll(tiny_lm, [p], [r], batch_size=1)[0] for p, r in zip(prompts, responses, strict=True)
    ]
    for (a, na), (b, nb) in zip(batched, single, strict=True):
        assert na == nb > 0 and math.isclose(a, b, rel_tol=1e-4)
    # manual: one unpadded forward over prompt + response
    tok = tiny_lm.tokenizer
    p_ids = tok(render_chat(tok, build_messages(prompts[1])), add_special_tokens=False)["input_ids"]
    r_ids = tok(responses[1], add_special_tokens=False)["input_ids"]
    ids = torch.tensor([p_ids + r_ids])
    with torch.no_grad():
        logp = torch.log_softmax(tiny_lm.model(input_ids=ids).logits.float()[0, :-1], -1)
    nll = -sum(logp[len(p_ids) - 1 + j, t].item() for j, t in enumerate(r_ids))
    assert math.isclose(batched[1][0], nll, rel_tol=1e-4)


def test_perplexity_summary(tiny_lm):
    res = perplexity(tiny_lm, ["a", "b"], ["some words here", "more words"])
    assert res["n_responses"] == 2 and res["n_tokens"] > 0 and res["perplexity"] > 1
