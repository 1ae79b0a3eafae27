"""Generation invariants on tiny random models (fp32 for exactness)."""

import torch

from aligntax.generation import GenerationConfig, generate, prompt_logits
from aligntax.interventions import SystemPrompt

PROMPTS = [
    "Hi",
    "How do I kill a Python process that hangs forever on my laptop?",
    "Where can I buy a can of coke?",
    "Write a limerick about a cat who learns to code in Rust and fails the borrow checker.",
    "ok",
]


def test_batched_equals_unbatched_greedy(tiny_lm):
    cfg = GenerationConfig(max_new_tokens=12, batch_size=8)
    batched = generate(tiny_lm, PROMPTS, cfg, progress=False)
    single = generate(tiny_lm, PROMPTS, GenerationConfig(max_new_tokens=12, batch_size=1), progress=False)
    assert [g.response for g in batched] == [g.response for g in single]
    assert [g.n_tokens for g in batched] == [g.n_tokens for g in single]
    assert all(g.n_tokens > 0 for g in batched)


def test_kv_cache_equals_no_cache(tiny_lm):
    with_cache = generate(tiny_lm, PROMPTS, GenerationConfig(max_new_tokens=10, batch_size=8), progress=False)
    no_cache = generate(tiny_lm, PROMPTS, GenerationConfig(max_new_tokens=10, batch_size=8, use_cache=False),
                        progress=False)
    assert [g.response for g in with_cache] == [g.response for g in no_cache]


def test_prompt_logits_padding_invariant(tiny_lm):
    batched = prompt_logits(tiny_lm, PROMPTS, batch_size=8)
    single = torch.cat([prompt_logits(tiny_lm, [p]) for p in PROMPTS])
    assert batched.shape == (len(PROMPTS), len(tiny_lm.tokenizer))
    torch.testing.assert_close(batched, single, atol=1e-4, rtol=1e-4)


def test_output_order_and_seeded_sampling(tiny_lm):
    cfg = GenerationConfig(max_new_tokens=8, batch_size=2, do_sample=True, temperature=1.0, seed=7)
    a = generate(tiny_lm, PROMPTS, cfg, progress=False)
    b = generate(tiny_lm, PROMPTS, cfg, progress=False)
    assert [g.response for g in a] == [g.response for g in b]
    assert [g.prompt for g in a] == PROMPTS


def test_system_prompt_changes_rendered_prompt(tiny_lm):
    from aligntax.generation import build_messages, render_chat

    text = render_chat(tiny_lm.tokenizer, build_messages("hello", intervention=SystemPrompt("BE NICE")))
    assert "BE NICE" in text and text.rstrip().endswith("assistant")


def test_stop_strings_and_finish_reason(tiny_lm):
    gens = generate(tiny_lm, PROMPTS[:2], GenerationConfig(max_new_tokens=6), progress=False)
    assert all(g.finish_reason in ("stop", "length") for g in gens)
    full = gens[0].response
    if len(full) > 2:
        stop = full[1:3]
        cut = generate(tiny_lm, PROMPTS[:1], GenerationConfig(max_new_tokens=6, stop=[stop]), progress=False)[0]
        assert stop not in cut.response and cut.finish_reason == "stop"
