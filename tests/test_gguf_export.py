"""``aligntax export --format gguf`` on tiny random models (fp32): the GGUF file reads back in ``gguf``'s own
reader with llama.cpp's tensor names, the tokenizer and the chat template; loaded back by transformers it
is the same model (same weights, the same prompt ids from its own tokenizer) and gives the greedy tokens of
the hook-applied els-lora adapter or vector method it was made from; what a GGUF would not carry back is
refused before anything is written."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from aligntax.bundles.export import export_lora_model, export_model, hook_equivalent
from aligntax.bundles.gguf import greedy_agreement, read_summary, write_gguf
from aligntax.errors import AligntaxError
from aligntax.interventions.lora import ElsLora
from aligntax.models import LoadedModel, load_model
from aligntax.models.loader import model_fingerprint
from tiny import CHAT_TEMPLATE, PROMPTS, save_tiny_adapter, save_tiny_vectors, tiny_bpe_tokenizer, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

MORE = [*PROMPTS, "the kin is in the house", "what is a can of coke", "she sees the sun", "tell us a story"]


def bpe_lm(arch="qwen2", tied=False, seed=0):
    """A tiny random model with the BPE tokenizer (a GGUF needs merges)."""
    model = tiny_model(arch, hidden=32, layers=3, seed=seed, tie_word_embeddings=tied)
    tok = tiny_bpe_tokenizer()
    spec = f"tiny-{arch}"
    return LoadedModel(model, tok, spec, "tiny", model_fingerprint(model, tok, spec))


def expected_names(n_layers, arch, output):
    names = {"token_embd.weight", "output_norm.weight"} | ({"output.weight"} if output else set())
    for i in range(n_layers):
        names |= {
            f"blk.{i}.{t}.weight"
            for t in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate")
        }
        names |= {f"blk.{i}.ffn_up.weight", f"blk.{i}.ffn_down.weight"}
        if arch == "qwen2":
            names |= {f"blk.{i}.attn_{t}.bias" for t in ("q", "k", "v")}
    return names


@pytest.mark.parametrize(("arch", "tied"), [("qwen2", True), ("qwen2", False), ("llama", False)])
def test_gguf_reads_back_as_the_same_model(arch, tied, tmp_path):
    lm = bpe_lm(arch, tied)
    path = write_gguf(lm.model, lm.tokenizer, tmp_path / "m.gguf", dtype="f32", info={"method": "none"})
    s = read_summary(path)
    assert s["architecture"] == arch and s["file_type"] == 0
    assert set(s["tensors"]) == expected_names(3, arch, output=not tied)
    assert set(s["tensors"].values()) == {"F32"}
    assert s["chat_template"] == CHAT_TEMPLATE and s["tokenizer_model"] == "gpt2"
    assert s["pre_tokenizer"] == "gpt-2" and s["n_merges"] == 16 and s["n_tokens"] == 300
    assert s["eos_token_id"] == 1 and s["export"] == {"method": "none"}
    back = load_model(str(path), dtype="fp32", device="cpu")
    assert type(back.model) is type(lm.model)
    state = back.model.state_dict()
    # the weights are the same (Llama's query and key rows permuted and back)
    assert all(torch.equal(v, state[k]) for k, v in lm.model.state_dict().items())
    agree = greedy_agreement(lm, back, MORE, max_new_tokens=12)
    assert agree["same"] == agree["prompts"] == agree["same_prompt_ids"] == len(MORE)
    assert back.tokenizer.decode(back.tokenizer.encode(" the kin")) == " the kin"


def test_bf16_stores_matrices_in_bf16_and_vectors_in_f32(tmp_path):
    lm = bpe_lm("qwen2")
    s = read_summary(write_gguf(lm.model, lm.tokenizer, tmp_path / "m.gguf", dtype=torch.bfloat16))
    assert s["file_type"] == 32
    assert s["tensors"]["blk.0.attn_q.weight"] == "BF16" and s["tensors"]["token_embd.weight"] == "BF16"
    assert s["tensors"]["blk.0.attn_q.bias"] == "F32" and s["tensors"]["output_norm.weight"] == "F32"
    back = load_model(str(tmp_path / "m.gguf"), dtype="fp32", device="cpu")
    ref = lm.model.model.layers[0].self_attn.q_proj.weight.to(torch.bfloat16).float()
    assert torch.equal(back.model.model.layers[0].self_attn.q_proj.weight, ref)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_els_lora_gguf_gives_the_hook_tokens(arch, tmp_path):
    lm = bpe_lm(arch, tied=arch == "qwen2")
    adapter = save_tiny_adapter(lm, tmp_path / "adapter")
    out = export_lora_model(lm, adapter, tmp_path / "merged.gguf", scale=0.5, dtype="fp32", format="gguf")
    s = read_summary(out)
    assert s["export"]["method"] == "els-lora" and s["export"]["lora_scale"] == 0.5
    assert s["name"] == f"tiny-{arch} + els-lora"
    assert ("output.weight" in s["tensors"]) == (arch == "llama")  # the tied Qwen2 head is not written
    back = load_model(str(out), dtype="fp32", device="cpu")
    iv = ElsLora.load(adapter, lm, scale=0.5)
    agree = greedy_agreement(lm, back, MORE, max_new_tokens=12, intervention=iv)
    assert agree["same"] == len(MORE), agree
    plain = greedy_agreement(lm, back, MORE, max_new_tokens=12)  # the adapter changes the answers
    assert plain["same"] < len(MORE)
    with pytest.raises(AligntaxError, match="exists"):
        export_lora_model(lm, adapter, out, format="gguf")


def test_vector_export_gguf_gives_the_hook_tokens(tmp_path):
    lm = bpe_lm("qwen2", tied=True)
    vectors = save_tiny_vectors(lm, tmp_path / "vectors")
    out = export_model(lm, vectors, "refusal-ablation", tmp_path / "abl.gguf", dtype="fp32", format="gguf")
    s = read_summary(out)
    assert s["export"]["method"] == "refusal-ablation" and s["export"]["untied_embeddings"]
    assert "output.weight" in s["tensors"]  # the ablation unties the LM head from the edited embeddings
    back = load_model(str(out), dtype="fp32", device="cpu")
    iv = hook_equivalent(vectors, lm, "refusal-ablation")
    agree = greedy_agreement(lm, back, MORE, max_new_tokens=12, intervention=iv)
    assert agree["same"] == len(MORE), agree
    out = export_model(
        lm, vectors, "false-refusal-ablation", tmp_path / "fr.gguf", dtype="fp32", format="gguf"
    )
    iv = hook_equivalent(vectors, lm, "false-refusal-ablation")
    agree = greedy_agreement(lm, load_model(str(out), dtype="fp32", device="cpu"), MORE, 12, intervention=iv)
    assert agree["same"] == len(MORE), agree


def test_what_a_gguf_would_not_carry_is_refused(tmp_path):
    lm = bpe_lm("qwen2")
    vectors = save_tiny_vectors(lm, tmp_path / "vectors")
    with pytest.raises(
        AligntaxError, match="biases"
    ):  # qwen2 + addition after block 0: Llama with MLP biases
        export_model(lm, vectors, "refusal-add", tmp_path / "add.gguf", layer=1, format="gguf")
    assert not (tmp_path / "add.gguf").exists() and not list(tmp_path.glob("*.partial"))
    with pytest.raises(AligntaxError, match=r"\.gguf"):
        export_model(lm, vectors, "refusal-ablation", tmp_path / "abl", format="gguf")
    gemma = tiny_model("gemma", hidden=32, layers=2)
    with pytest.raises(AligntaxError, match="Qwen2 and Llama"):
        write_gguf(gemma, lm.tokenizer, tmp_path / "g.gguf")
    scaled = tiny_model("llama", hidden=32, layers=2)
    scaled.config.rope_parameters = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}
    with pytest.raises(AligntaxError, match="rotary"):
        write_gguf(scaled, lm.tokenizer, tmp_path / "s.gguf")
    from tiny import tiny_tokenizer

    with pytest.raises(AligntaxError, match="merges"):  # a vocabulary without merges loads back as nothing
        write_gguf(lm.model, tiny_tokenizer(), tmp_path / "t.gguf")
    assert not list(tmp_path.glob("*.gguf*"))


def test_cli_export_gguf(tmp_path, monkeypatch):
    from aligntax import cli

    lm = bpe_lm("qwen2", tied=True)
    adapter = save_tiny_adapter(lm, tmp_path / "adapter")
    loaded = []
    monkeypatch.setattr("aligntax.models.load_model", lambda spec, **kw: loaded.append(kw) or lm)
    out = tmp_path / "models" / "m.gguf"
    args = ["export", "--intervention", "els-lora", "--steer", str(adapter), "--model", "tiny"]
    res = CliRunner().invoke(cli.app, [*args, "--format", "gguf", "--out", str(out), "--dtype", "f32"])
    assert res.exit_code == 0, res.output
    assert (
        loaded == [{"dtype": "fp32", "device": "cpu"}] and read_summary(out)["export"]["method"] == "els-lora"
    )
    for bad, what in [(tmp_path / "m", ".gguf"), (out, "exists")]:
        res = CliRunner().invoke(cli.app, [*args, "--format", "gguf", "--out", str(bad)])
        assert res.exit_code == 2 and what in res.output
    res = CliRunner().invoke(cli.app, [*args, "--format", "onnx", "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "hf, gguf" in res.output
    assert len(loaded) == 1  # bad input fails before the model loads
