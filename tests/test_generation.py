"""Generation invariants on tiny random models (fp32 for exactness)."""

import pytest
import torch

from aligntax.generation import GenerationConfig, generate, prompt_logits
from aligntax.interventions import SystemPrompt
from tiny import end_token_for_varied_lengths
from tiny import tiny_lm as byte_tiny_lm

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
    no_cache = generate(
        tiny_lm, PROMPTS, GenerationConfig(max_new_tokens=10, batch_size=8, use_cache=False), progress=False
    )
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
        cut = generate(tiny_lm, PROMPTS[:1], GenerationConfig(max_new_tokens=6, stop=[stop]), progress=False)[
            0
        ]
        assert stop not in cut.response and cut.finish_reason == "stop"


def _ids(gens):
    return [(g.response, g.n_tokens, g.finish_reason) for g in gens]


@pytest.mark.parametrize("arch", ["qwen2", "gemma2", "llama"])
def test_dropping_finished_rows_equals_generate(arch):
    """Greedy decoding that drops finished rows from the batch and its KV cache gives, row for row,
    what ``model.generate`` gives keeping them (gemma2: sliding-window cache layers)."""
    lm = byte_tiny_lm(arch, layers=2)
    prompts = PROMPTS + ["a", "Tell me a story about a dragon", "zzz", "What is 2+2?"]
    ref_cfg = GenerationConfig(max_new_tokens=20, batch_size=16, drop_finished=False)
    long = generate(lm, prompts, ref_cfg, progress=False)
    rows = [lm.tokenizer(g.response, add_special_tokens=False)["input_ids"] for g in long]
    lm.model.generation_config.eos_token_id = end_token_for_varied_lengths(rows)
    kept = generate(lm, prompts, ref_cfg, progress=False)
    dropped = generate(lm, prompts, GenerationConfig(max_new_tokens=20, batch_size=16), progress=False)
    assert _ids(dropped) == _ids(kept)
    ends = {g.n_tokens for g in kept if g.finish_reason == "stop"}
    assert len(ends) >= 3 and any(g.finish_reason == "length" for g in kept)  # rows leave at several steps


def test_greedy_decode_only_where_it_is_plain_argmax(tiny_lm):
    from aligntax.generation.generate import plain_greedy

    assert plain_greedy(tiny_lm.model)
    tiny_lm.model.generation_config.repetition_penalty = 1.3
    try:
        assert not plain_greedy(tiny_lm.model)  # generate() applies the penalty: it decodes such a model
        penalised = generate(tiny_lm, PROMPTS, GenerationConfig(max_new_tokens=12), progress=False)
        reference = generate(
            tiny_lm, PROMPTS, GenerationConfig(max_new_tokens=12, drop_finished=False), progress=False
        )
        assert _ids(penalised) == _ids(reference)
    finally:
        tiny_lm.model.generation_config.repetition_penalty = 1.0


def test_shared_prefix_cached_once_gives_the_prompts_logits():
    """The prefix every prompt shares, computed once and repeated, plus the rest of each prompt with
    padding between them: the same next-token logits as the whole left-padded prompts."""
    from aligntax.activations.capture import position_ids_from_mask
    from aligntax.generation.chat import build_messages, encode_chats, render_chat
    from aligntax.generation.generate import greedy_decode
    from aligntax.generation.prefix import common_prefix_len, prefix_cache, unpadded
    from aligntax.hooks import with_cache

    lm = byte_tiny_lm("qwen2", layers=2)
    texts = [render_chat(lm.tokenizer, build_messages(p, "Be brief.")) for p in PROMPTS]
    enc = encode_chats(lm.tokenizer, texts, "cpu")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    prefix = common_prefix_len(unpadded(ids, mask))
    shared = lm.tokenizer(
        render_chat(lm.tokenizer, build_messages("", "Be brief.")), add_special_tokens=False
    )
    assert prefix >= 10 and prefix <= len(shared["input_ids"])  # the system turn and the user tag
    with torch.no_grad():
        full = lm.model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits[
            :, -1
        ]
        cache, rest, rest_mask = prefix_cache(lm.model, ids, mask, prefix)
        assert rest.shape[1] == ids.shape[1] - prefix and cache.get_seq_length() == prefix
        both = torch.cat([torch.ones(len(PROMPTS), prefix, dtype=mask.dtype), rest_mask], 1)
        split = lm.model(
            **with_cache(
                lm.model,
                cache,
                input_ids=rest,
                attention_mask=both,
                position_ids=position_ids_from_mask(both)[:, prefix:],
            )
        ).logits[:, -1]
    torch.testing.assert_close(split, full, rtol=1e-4, atol=1e-4)
    assert (
        common_prefix_len(unpadded(ids[:1], mask[:1])) == int(mask[0].sum()) - 1
    )  # one row: all but its last token
    eos = {lm.tokenizer.eos_token_id}
    cache, rest, rest_mask = prefix_cache(lm.model, ids, mask, prefix)
    assert greedy_decode(lm.model, rest, rest_mask, 6, eos, cache=cache, cached=prefix) == greedy_decode(
        lm.model, ids, mask, 6, eos
    )


def test_decode_loop_appends_to_given_lists_before_ended_reads_them():
    """``decode_loop(out=...)`` appends each row's token to the caller's lists before ``ended`` runs, so
    a stopping rule can read them without a copy; the tokens are those of plain greedy decoding."""
    import pytest

    from aligntax.generation.chat import build_messages, encode_chats, render_chat
    from aligntax.generation.generate import decode_loop, greedy_decode

    lm = byte_tiny_lm("qwen2", layers=2)
    enc = encode_chats(lm.tokenizer, [render_chat(lm.tokenizer, build_messages(p)) for p in PROMPTS], "cpu")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    ref = greedy_decode(lm.model, ids, mask, 5, set())
    lists: list[list[int]] = [[] for _ in PROMPTS]
    seen = []

    def ended(alive, tokens, step):
        seen.append([len(lists[i]) for i in alive.tolist()])
        assert [lists[i][-1] for i in alive.tolist()] == tokens.tolist()
        return alive == 0  # row 0 leaves after its first token

    with torch.no_grad():
        got = decode_loop(lm.model, ids, mask, 5, set(), ended=ended, out=lists)
    assert got is lists and lists[0] == ref[0][:1] and lists[1:] == [r for r in ref[1:]]
    assert seen[0] == [1] * len(PROMPTS) and seen[1] == [2] * (len(PROMPTS) - 1)
    with pytest.raises(ValueError, match="token lists"):
        decode_loop(lm.model, ids, mask, 5, set(), out=[[]])


def test_length_batches_respect_row_cap_and_token_budget():
    from aligntax.errors import AligntaxError
    from aligntax.generation.batching import length_batches

    lengths = [50, 40, 40, 30, 10, 10, 10, 10, 10, 5]
    spans = length_batches(lengths, max_rows=4, max_tokens=100)
    assert [list(s) for s in spans] == [[0, 1], [2, 3], [4, 5, 6, 7], [8, 9]]
    assert sum(len(s) for s in spans) == len(lengths)
    for s in spans:  # rows times the longest row, never over the budget (a row alone may exceed it)
        assert len(s) <= 4 and (len(s) == 1 or len(s) * max(lengths[i] for i in s) <= 100)
    assert [list(s) for s in length_batches([500, 1], 8, 100)] == [[0], [1]]  # too long: a batch of its own
    assert [len(s) for s in length_batches(lengths, 3)] == [3, 3, 3, 1]  # no budget: the row cap only
    assert length_batches([], 4, 100) == []
    with pytest.raises(AligntaxError, match="batch size"):
        length_batches(lengths, 0)
    with pytest.raises(AligntaxError, match="max_tokens"):
        length_batches(lengths, 4, 0)


def test_token_budget_splits_batches_without_changing_answers(tiny_lm):
    """A token budget only regroups the rows: the same greedy answers (fp32), in more batches."""
    from aligntax.generation import iter_generate

    whole = GenerationConfig(max_new_tokens=8, batch_size=8, max_batch_tokens=None)
    tight = GenerationConfig(max_new_tokens=8, batch_size=8, max_batch_tokens=60)
    batches = [idx for idx, _ in iter_generate(tiny_lm, PROMPTS, tight, progress=False)]
    assert len(batches) > 1 and sorted(i for b in batches for i in b) == list(range(len(PROMPTS)))
    a = generate(tiny_lm, PROMPTS, whole, progress=False)
    b = generate(tiny_lm, PROMPTS, tight, progress=False)
    assert [g.response for g in a] == [g.response for g in b]
