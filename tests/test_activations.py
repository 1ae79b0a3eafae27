"""Residual-stream capture, activation caches and layer discovery on tiny random models."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from aligntax.activations import (
    ActivationCache,
    capture,
    capture_ids,
    capture_to_cache,
    chat_ids,
    residual_norms,
    resolve_layers,
)
from aligntax.errors import AligntaxError, CompatibilityError
from aligntax.models import decoder_layers, hidden_size, num_layers
from tiny import PROMPTS, tiny_lm, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("qwen2", hidden=32, layers=3)


def test_capture_last_equals_output_hidden_states(lm):
    acts = capture(lm, PROMPTS, "all", batch_size=4, progress=False)
    assert set(acts) == {0, 1, 2}
    seqs, _ = chat_ids(lm, PROMPTS)
    for i, s in enumerate(seqs):
        with torch.no_grad():
            out = lm.model(input_ids=torch.tensor([s]), output_hidden_states=True)
        for layer in range(3):
            # hidden_states[l] is the input to block l
            torch.testing.assert_close(
                acts[layer][i], out.hidden_states[layer][0, -1].float(), atol=1e-4, rtol=1e-4
            )
            assert acts[layer].dtype == torch.float32


def test_capture_is_padding_invariant(lm):
    batched = capture(lm, PROMPTS, [0, 2], batch_size=4, progress=False)
    single = capture(lm, PROMPTS, [0, 2], batch_size=1, progress=False)
    for layer in (0, 2):
        torch.testing.assert_close(batched[layer], single[layer], atol=1e-4, rtol=1e-4)


def test_capture_mean_and_response_positions(lm):
    responses = ["Sure, here it is.", "No.", "I cannot help with that request, sorry.", "Once upon a time"]
    resp, rows = capture(
        lm,
        PROMPTS,
        [1],
        position="response",
        responses=responses,
        batch_size=3,
        progress=False,
        return_index=True,
    )
    n_resp = [len(lm.tokenizer(r, add_special_tokens=False)["input_ids"]) for r in responses]
    assert resp[1].shape == (sum(n_resp), 32)
    assert rows.tolist() == [i for i, n in enumerate(n_resp) for _ in range(n)]
    mean = capture(lm, PROMPTS, [1], position="mean", responses=responses, batch_size=3, progress=False)
    for i in range(len(PROMPTS)):
        torch.testing.assert_close(mean[1][i], resp[1][rows == i].mean(0), atol=1e-4, rtol=1e-4)
    # Without responses, 'mean' averages the (unpadded) prompt tokens.
    seqs, _ = chat_ids(lm, PROMPTS)
    prompt_mean = capture(lm, PROMPTS, [1], position="mean", batch_size=4, progress=False)
    with torch.no_grad():
        out = lm.model(input_ids=torch.tensor([seqs[1]]), output_hidden_states=True)
    torch.testing.assert_close(prompt_mean[1][1], out.hidden_states[1][0].mean(0), atol=1e-4, rtol=1e-4)
    # The last response token state equals a manual forward over prompt + response.
    full, plens = chat_ids(lm, PROMPTS, responses=responses)
    with torch.no_grad():
        out = lm.model(input_ids=torch.tensor([full[2]]), output_hidden_states=True)
    torch.testing.assert_close(resp[1][rows == 2][-1], out.hidden_states[1][0, -1], atol=1e-4, rtol=1e-4)
    with pytest.raises(AligntaxError, match="needs the responses"):
        capture(lm, PROMPTS, [1], position="response", progress=False)


def test_capture_ids_validates(lm):
    with pytest.raises(AligntaxError, match="Unknown position"):
        capture_ids(lm.model, [[5, 6]], [0], position="first")
    with pytest.raises(AligntaxError, match="out of range"):
        resolve_layers(lm.model, [7])
    assert resolve_layers(lm.model, [-1, 0]) == [2, 0]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma", "gemma2", "mistral"])
def test_layer_discovery_and_capture(arch):
    model = tiny_model(arch, hidden=32, layers=2)
    assert len(decoder_layers(model)) == 2 == num_layers(model)
    assert hidden_size(model) == 32
    seqs = [[10, 11, 12, 13, 14], [20, 21, 22]]
    acts, _ = capture_ids(model, seqs, "all", batch_size=2)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([seqs[1]]), output_hidden_states=True)
    for layer in range(2):
        torch.testing.assert_close(
            acts[layer][1], out.hidden_states[layer][0, -1].float(), atol=1e-4, rtol=1e-4
        )


def test_layer_discovery_unknown_module():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(AligntaxError, match="Cannot find the decoder layers of Sequential"):
        decoder_layers(model)
    with pytest.raises(AligntaxError, match="Cannot find the decoder layers"):
        capture_ids(model, [[1, 2]], "all")


def test_residual_norms(lm):
    acts = capture(lm, PROMPTS, "all", progress=False)
    norms = residual_norms(acts)
    assert set(norms) == {0, 1, 2}
    for layer, a in acts.items():
        assert norms[layer] == pytest.approx(float(a.norm(dim=-1).median()))


def test_activation_cache_round_trip_and_resume(lm, tmp_path):
    ids = [f"p{i}" for i in range(len(PROMPTS))]
    labels = [{"label": "benign", "refused": i % 2 == 0} for i in range(len(PROMPTS))]
    d = tmp_path / "cache"
    # An interrupted capture: only the first two prompts were saved.
    capture_to_cache(lm, PROMPTS[:2], ids[:2], [0, 2], d, labels=labels[:2], progress=False)
    full = capture_to_cache(lm, PROMPTS, ids, [0, 2], d, labels=labels, shard_size=1, progress=False)
    side = json.loads((d / "cache.json").read_text())
    assert len(side["shards"]) == 3  # 1 shard first, then 2 one-prompt shards for the rest
    assert side["fingerprint"]["embedding_digest"] == lm.fingerprint["embedding_digest"]
    assert sorted(p.name for p in d.iterdir()) == [
        "cache.json",
        "shard-00000.safetensors",
        "shard-00001.safetensors",
        "shard-00002.safetensors",
    ]
    ref = capture(lm, PROMPTS, [0, 2], progress=False)
    assert full.prompt_ids == ids and full.labels == labels and full.layers == [0, 2]
    for layer in (0, 2):
        torch.testing.assert_close(full[layer], ref[layer], atol=1e-4, rtol=1e-4)
    # Nothing left to do: a rerun captures nothing new.
    again = capture_to_cache(lm, PROMPTS, ids, [0, 2], d, labels=labels, progress=False)
    assert len(json.loads((d / "cache.json").read_text())["shards"]) == 3 and len(again) == 4

    # save/load of an in-memory cache, response position with row index
    cache = ActivationCache(
        {1: torch.randn(5, 32)},
        "response",
        ["a", "b"],
        [1, 0],
        torch.tensor([0, 0, 1, 1, 1]),
        dict(lm.fingerprint),
        {"note": "x"},
    )
    cache.save(tmp_path / "c2")
    back = ActivationCache.load(tmp_path / "c2", expect_fingerprint=lm.fingerprint)
    assert torch.equal(back[1], cache[1]) and back.row_index.tolist() == [0, 0, 1, 1, 1]
    assert back.prompt_ids == ["a", "b"] and back.labels == [1, 0] and back.metadata == {"note": "x"}

    other = dict(lm.fingerprint, embedding_digest="0000000000000000")
    with pytest.raises(CompatibilityError, match="0000000000000000") as e:
        ActivationCache.load(d, expect_fingerprint=other)
    assert lm.fingerprint["embedding_digest"] in str(e.value)
    with pytest.raises(CompatibilityError, match="layers"):
        ActivationCache({1: torch.randn(1, 32)}, "last", ["z"], fingerprint=dict(lm.fingerprint)).append_to(d)


def test_prefill_recorder_gives_the_captured_states_and_leaves_the_model_alone(lm, tmp_path):
    from aligntax.activations.recorder import PrefillRecorder
    from aligntax.generation import GenerationConfig, generate, iter_generate

    cfg = GenerationConfig(max_new_tokens=4, batch_size=3)
    plain = generate(lm, PROMPTS, cfg, progress=False)
    rec = PrefillRecorder(lm.model, [0, 2])
    with pytest.raises(AligntaxError, match="No recorded batch"):
        rec.keep(["x"])
    texts = []
    for idx, gens in iter_generate(lm, PROMPTS, cfg, rec, progress=False):  # batches sorted by length
        rec.keep([f"p{i}" for i in idx], ["benign"] * len(idx))
        texts += [(i, g.response) for i, g in zip(idx, gens, strict=True)]
    assert [t for _, t in sorted(texts)] == [g.response for g in plain]  # answers unchanged
    assert sorted(rec.prompt_ids) == sorted(f"p{i}" for i in range(len(PROMPTS)))
    d = tmp_path / "rec"
    rec.save(lm, d)
    # the rest of the pipeline captures only what is missing: nothing
    ids = [f"p{i}" for i in range(len(PROMPTS))]
    cache = capture_to_cache(lm, PROMPTS, ids, [0, 2], d, progress=False)
    assert len(json.loads((d / "cache.json").read_text())["shards"]) == 1
    ref = capture(lm, PROMPTS, [0, 2], progress=False)
    order = [cache.prompt_ids.index(p) for p in ids]
    for layer in (0, 2):
        torch.testing.assert_close(cache[layer][order], ref[layer], atol=1e-4, rtol=1e-4)
    rec.save(lm, d)  # saving again adds nothing (ids already there)
    assert len(json.loads((d / "cache.json").read_text())["shards"]) == 1
    assert all(not b._forward_pre_hooks for b in decoder_layers(lm.model))
    # recording belongs to unsteered runs; a steered one is refused before anything is written
    from aligntax.runs.eval import EvalConfig, run_eval

    with pytest.raises(AligntaxError, match="only in an unsteered run"):
        run_eval(
            EvalConfig(data=["x"], out=str(tmp_path / "ev"), intervention="system-prompt"),
            lm=lm,
            recorder=PrefillRecorder(lm.model, [0]),
        )
    assert not (tmp_path / "ev").exists()


def test_capture_token_budget_regroups_rows_only(lm):
    seqs, _ = chat_ids(lm, PROMPTS)
    seqs = sorted(seqs, key=len, reverse=True)
    whole, rows_w = capture_ids(lm.model, seqs, [1, 2], batch_size=8, max_tokens=None)
    tight, rows_t = capture_ids(lm.model, seqs, [1, 2], batch_size=8, max_tokens=2 * len(seqs[0]))
    assert torch.equal(rows_w, rows_t)
    for layer in (1, 2):
        torch.testing.assert_close(whole[layer], tight[layer], atol=1e-4, rtol=1e-4)
