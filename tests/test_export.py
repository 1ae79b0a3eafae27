"""``aligntax export``: vector steering baked into weights. The exported folder, loaded by plain
``transformers`` (no aligntax code), gives the greedy tokens of the hook-based intervention it stands
for (tiny random models, fp32); what has no exact weight form is refused; on the embedded model (bf16)
the exported ablation's refusal rate lies within the interval of the hook-based one."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from aligntax.bundles.export import bake, export_model, hook_equivalent
from aligntax.errors import AligntaxError
from aligntax.interventions import SteeringVectors
from aligntax.interventions.vectors import ActivationAddition
from tiny import PROMPTS, save_tiny_vectors, tiny_lm

H = 32
N = 10

pytestmark = pytest.mark.usefixtures("one_thread")


def generate(model, tok, prompts=PROMPTS, n=N):
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in prompts
    ]
    batch = tok(texts, padding=True, padding_side="left", add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **batch,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
            temperature=None,
            top_p=None,
            top_k=None,
        )
    return out[:, batch["input_ids"].shape[1] :]


def load_plain(folder):
    """The exported folder through transformers alone."""
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def tiny(arch):
    # Qwen2 and Gemma tie their embeddings, as the real ones do: the export unties them
    return tiny_lm(arch, hidden=H, layers=3, tie_word_embeddings=arch in ("qwen2", "gemma"))


@pytest.mark.parametrize("arch", ["qwen2", "llama", "mistral", "gemma"])
def test_exported_ablation_gives_the_hook_tokens(arch, tmp_path):
    lm = tiny(arch)
    vectors = save_tiny_vectors(lm, tmp_path / "v")
    before = {k: v.clone() for k, v in lm.model.state_dict().items()}
    out = export_model(lm, vectors, "refusal-ablation", tmp_path / "m", layer=1)
    assert all(
        torch.equal(v, lm.model.state_dict()[k]) for k, v in before.items()
    )  # the user's model is unchanged
    model, tok = load_plain(out)
    assert type(model) is type(lm.model)
    got = generate(model, tok)
    with hook_equivalent(vectors, lm, "refusal-ablation", layer=1).apply(lm.model):
        want = generate(lm.model, lm.tokenizer)
    assert torch.equal(got, want)
    assert not torch.equal(got, generate(lm.model, lm.tokenizer))  # the edit changes the answers
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in lm.model.modules()) == 0
    info = json.loads((out / "aligntax_export.json").read_text())
    assert info["method"] == "refusal-ablation" and info["layer"] == 1 and info["edit"] == "ablate"
    assert info["untied_embeddings"] == (arch in ("qwen2", "gemma"))
    assert len(info["writers"]) == 1 + 2 * 3  # embeddings, o_proj and down_proj of 3 blocks (no biases here)
    # the stream holds no component along the direction: every write is orthogonal to it
    r = SteeringVectors.load(vectors).get("refusal", 1)
    r = r / r.norm()
    with torch.no_grad():
        assert float((model.get_input_embeddings().weight @ r).abs().max()) < 1e-5
        assert float((r @ model.model.layers[0].mlp.down_proj.weight).abs().max()) < 1e-5


@pytest.mark.parametrize(
    "arch,layer", [("qwen2", 2), ("llama", 1), ("mistral", 2), ("qwen2", 0), ("gemma", 0)]
)
def test_exported_addition_gives_the_hook_tokens(arch, layer, tmp_path):
    lm = tiny(arch)
    torch.manual_seed(11)
    v = torch.randn(H) * 3
    d = SteeringVectors({"refusal": {layer: v}}, lm.fingerprint, {"layer": layer}).save(tmp_path / "v")
    out = export_model(lm, d, "refusal-add", tmp_path / "m", coeff=1.5)
    model, tok = load_plain(out)
    got = generate(model, tok)
    iv = hook_equivalent(d, lm, "refusal-add", coeff=1.5)
    assert isinstance(iv, ActivationAddition) and iv.positions == "all" and sorted(iv.vectors) == [layer]
    with iv.apply(lm.model):
        want = generate(lm.model, lm.tokenizer)
    assert torch.equal(got, want)
    assert not torch.equal(got, generate(lm.model, lm.tokenizer))
    info = json.loads((out / "aligntax_export.json").read_text())
    if layer == 0:
        assert info["writers"] == ["model.embed_tokens.weight"]
    else:
        assert info["writers"] == [f"model.layers.{layer - 1}.mlp.down_proj.bias"]
        assert info["architecture"] == "LlamaForCausalLM" and model.config.mlp_bias


def test_what_has_no_weight_form_is_refused(tmp_path):
    lm = tiny("qwen2")
    vectors = save_tiny_vectors(lm, tmp_path / "v")
    for method in ("els", "cast"):
        with pytest.raises(AligntaxError, match="cannot be baked into weights"):
            export_model(lm, vectors, method, tmp_path / method)
    with pytest.raises(AligntaxError, match="coeff 1"):
        export_model(lm, vectors, "refusal-ablation", tmp_path / "half", coeff=0.5)
    with pytest.raises(AligntaxError, match="Cannot export"):
        export_model(lm, vectors, "system-prompt", tmp_path / "sp")
    g2 = tiny_lm("gemma2", hidden=H, layers=2)
    with pytest.raises(AligntaxError, match="model type 'gemma2'"):  # norms after its sub-layer outputs
        bake(g2.model, "refusal-ablation", torch.randn(H), 1)
    for arch in ("gemma", "qwen3"):
        m = tiny_lm(arch, hidden=H, layers=2).model if arch == "gemma" else _qwen3()
        with pytest.raises(AligntaxError, match="no MLP bias"):
            bake(m, "refusal-add", torch.randn(H), 1)
    mistral = tiny_lm("mistral", hidden=H, layers=2, sliding_window=8)
    with pytest.raises(AligntaxError, match="sliding window"):
        bake(mistral.model, "refusal-add", torch.randn(H), 1)
    export_model(lm, vectors, "refusal-ablation", tmp_path / "m")
    with pytest.raises(AligntaxError, match="not empty"):
        export_model(lm, vectors, "refusal-ablation", tmp_path / "m")
    other = tiny_lm("qwen2", hidden=H, layers=3, seed=5)
    with pytest.raises(AligntaxError, match="another model"):
        export_model(other, vectors, "refusal-ablation", tmp_path / "other")


def _qwen3():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "qwen3",
        vocab_size=300,
        hidden_size=H,
        intermediate_size=2 * H,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    return AutoModelForCausalLM.from_config(cfg)


def test_cli_export(tmp_path):
    from aligntax.cli import app
    from aligntax.models import load_model

    lm = tiny("llama")
    lm.model.save_pretrained(tmp_path / "base")
    lm.tokenizer.save_pretrained(tmp_path / "base")
    base = load_model(str(tmp_path / "base"), dtype="fp32", device="cpu")
    vectors = save_tiny_vectors(base, tmp_path / "v")
    runner = CliRunner()
    res = runner.invoke(
        app,
        [
            "export",
            "--intervention",
            "refusal-add",
            "--vectors",
            str(vectors),
            "--out",
            str(tmp_path / "m"),
            "--layer",
            "2",
            "--coeff",
            "4",
            "--dtype",
            "fp32",
            "--model",
            str(tmp_path / "base"),
        ],
    )
    assert res.exit_code == 0, res.output
    model, tok = load_plain(tmp_path / "m")
    with hook_equivalent(vectors, base, "refusal-add", layer=2, coeff=4.0).apply(base.model):
        want = generate(base.model, base.tokenizer)
    assert torch.equal(generate(model, tok), want)
    res = runner.invoke(
        app,
        [
            "export",
            "--intervention",
            "els",
            "--vectors",
            str(vectors),
            "--out",
            str(tmp_path / "e"),
            "--model",
            str(tmp_path / "base"),
        ],
    )
    assert res.exit_code == 2 and "cannot be baked into weights" in res.output
    assert not (tmp_path / "e").exists()


@pytest.mark.slow
def test_embedded_exported_ablation_refuses_like_the_hooks(tmp_path, data_dir):
    """Refusal vectors of the embedded model from 64 train prompts; on 32 held-out harmful prompts (32 new
    tokens, bf16) the exported model's refusal rate lies within the Wilson interval of the hook-based
    ablation's."""
    from aligntax.data import load_prompt_sets
    from aligntax.generation import GenerationConfig
    from aligntax.generation import generate as at_generate
    from aligntax.interventions import compute_vectors
    from aligntax.judges import get_judge
    from aligntax.metrics.rates import wilson_interval
    from aligntax.models import load_model

    torch.set_num_threads(2)
    lm = load_model("embedded:qwen2.5-coder-0.5b-instruct", dtype="bf16", device="cpu")
    from aligntax.activations import capture

    harmful = [it.prompt for it in load_prompt_sets(["harmful-train"], limit=32)]
    harmless = [it.prompt for it in load_prompt_sets(["harmless-train"], limit=32)]
    layers = [10, 12, 14]
    vs = compute_vectors(
        capture(lm, harmful, layers, progress=False),
        capture(lm, harmless, layers, progress=False),
        fingerprint=lm.fingerprint,
        layer=12,
    )
    vectors = vs.save(tmp_path / "v")
    test = [it.prompt for it in load_prompt_sets(["harmful-val"], limit=32)]
    judge = get_judge("classifier")
    cfg = GenerationConfig(max_new_tokens=32, batch_size=32)

    def refusal(model_lm, iv=None):
        gens = at_generate(model_lm, test, cfg, iv, progress=False)
        return sum(v.refused for v in judge.judge(test, [g.response for g in gens]))

    base = refusal(lm)
    hooked = refusal(lm, hook_equivalent(vectors, lm, "refusal-ablation"))
    out = export_model(lm, vectors, "refusal-ablation", tmp_path / "m")
    exported = refusal(load_model(str(out), dtype="bf16", device="cpu"))
    lo, hi = wilson_interval(hooked, len(test))
    print(
        f"refused of {len(test)}: unsteered {base}, hook ablation {hooked} [{lo:.3f}, {hi:.3f}], exported {exported}"
    )
    assert hooked < base  # the direction does cut refusals
    assert lo <= exported / len(test) <= hi
