"""``Intervention.apply`` on a plain Hugging Face model, and the top-level ``load_model`` /
``load_intervention`` (tiny random models, fp32)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import aligntax
from aligntax.activations import capture
from aligntax.activations.decisions import row_info
from aligntax.energy import EnergyModel
from aligntax.errors import AligntaxError
from aligntax.generation import GenerationConfig, generate
from aligntax.interventions import (
    ConditionalSteering,
    EnergySteering,
    NoIntervention,
    SystemPrompt,
    make_intervention,
)
from tiny import PROMPTS, hook_counts, run_steered, save_tiny_bank, save_tiny_vectors, tiny_lm

H = 32
P3 = PROMPTS[:3]  # three prompts of different lengths: a left-padded batch
N = 6

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("qwen2", hidden=H, layers=3)


def els(eta=2.0, layers=(1, 2), **kw):
    torch.manual_seed(1)
    models = {layer: EnergyModel(H, [32, 16], layernorm=i % 2 == 0) for i, layer in enumerate(layers)}
    kw.setdefault("scale_by_norm", False)
    return EnergySteering(models, eta=eta, steps=3, **kw)


def split_gate(lm, layer=1):
    """A harm gate that holds back some but not all of P3."""
    from aligntax.energy.gate import HarmGate

    h = capture(lm, P3, [layer], progress=False)[layer]
    torch.manual_seed(3)
    w = torch.randn(1, H)
    mu, sc = h.mean(0, keepdim=True), h.std(0, keepdim=True)
    s = (((h[:, None] - mu) / sc) * w).sum(-1).mean(-1)
    srt = s.sort().values
    cut = float(srt[0] + srt[1]) / 2
    gate = HarmGate([layer], w, torch.full((1,), -cut), mu, sc, fingerprint=lm.fingerprint)
    return gate


def row_threshold(lm):
    e = torch.tensor([r["energy"] for r in row_info(els(), lm, P3)])
    srt = e.sort().values
    return float(srt[0] + srt[1]) / 2


@pytest.fixture(scope="module")
def vector_dir(lm, tmp_path_factory):
    return save_tiny_vectors(lm, tmp_path_factory.mktemp("vectors"))


@pytest.fixture(scope="module")
def bank_dir(lm, tmp_path_factory):
    return save_tiny_bank(lm, tmp_path_factory.mktemp("bank"), n=16, epochs=2)


def cast(lm, mode="add"):
    h = capture(lm, P3, [1], progress=False)[1]
    center = h.mean(0)
    c = h[2] - center
    sims = torch.nn.functional.cosine_similarity(h - center, c[None], dim=-1)
    thr = float(sims.sort().values[-2] + sims.max()) / 2  # only row 2 meets the condition
    torch.manual_seed(5)
    return ConditionalSteering(
        c, 1, thr, torch.randn(H) * 5, behaviour_layers=[0, 2], mode=mode, center=center
    )


def hf_batch(lm, prompts=P3, padding_side="left"):
    tok = lm.tokenizer
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in prompts
    ]
    return tok(texts, padding=True, padding_side=padding_side, add_special_tokens=False, return_tensors="pt")


def hf_generate(lm, batch, **kw):
    with torch.no_grad():
        return lm.model.generate(
            **batch,
            max_new_tokens=N,
            do_sample=False,
            pad_token_id=lm.tokenizer.pad_token_id,
            temperature=None,
            top_p=None,
            top_k=None,
            **kw,
        )


def as_generations(lm, batch, out):
    """``(response, n_tokens)`` per row, cut at the end token as aligntax's generation does."""
    from aligntax.generation.generate import eos_token_ids

    eos, res = eos_token_ids(lm), []
    for row in out[:, batch["input_ids"].shape[1] :].tolist():
        n = next((j for j, t in enumerate(row) if t in eos), len(row))
        res.append((lm.tokenizer.decode(row[:n], skip_special_tokens=True).strip(), n))
    return res


def own(lm, iv, **cfg):
    gens = generate(lm, P3, GenerationConfig(max_new_tokens=N, **cfg), iv, progress=False)
    return [(g.response, g.n_tokens) for g in gens]


INTERVENTIONS = {
    "els": lambda lm, d: els(),
    "els-gate": lambda lm, d: els(gate=split_gate(lm)),
    "els-horizon": lambda lm, d: els(horizon=2),
    "els-gate-horizon": lambda lm, d: els(gate=split_gate(lm), horizon=2),
    "els-row-threshold": lambda lm, d: els(row_threshold=row_threshold(lm)),
    "refusal-add": lambda lm, d: make_intervention("refusal-add", lm, dir=d, coeff=4.0),
    "refusal-ablation": lambda lm, d: aligntax.load_intervention(d, lm, name="refusal-ablation"),
    "false-refusal-ablation": lambda lm, d: aligntax.load_intervention(d, lm, name="false-refusal-ablation"),
    "cast-add": lambda lm, d: cast(lm, "add"),
    "cast-ablate": lambda lm, d: cast(lm, "ablate"),
    "cast-saved": lambda lm, d: aligntax.load_intervention(d, lm, name="cast"),
}


@pytest.mark.parametrize("which", sorted(INTERVENTIONS))
def test_apply_generate_matches_own_generation(lm, vector_dir, which):
    """``with iv.apply(model): model.generate(left-padded batch)`` gives aligntax's own tokens (its
    greedy loop and its model.generate path) and the same logits as the hooks attached by generation."""
    iv = INTERVENTIONS[which](lm, vector_dir)
    batch = hf_batch(lm)
    before = hook_counts(lm.model)
    with iv.apply(lm.model) as applied:
        out = hf_generate(lm, batch)
    assert hook_counts(lm.model) == before and "generate" not in vars(lm.model)
    assert applied.calls == 1 and applied.ctx.prompt_len == batch["input_ids"].shape[1]
    got = as_generations(lm, batch, out)
    assert got == own(lm, iv) == own(lm, iv, drop_finished=False)
    # EOS suppressed, every row runs N steps: tokens equal, logits equal to attach's
    tok_ref, log_ref, _, _ = run_steered(lm, P3, iv, max_new_tokens=N)
    with iv.apply(lm.model):
        res = hf_generate(lm, batch, min_new_tokens=N, output_logits=True, return_dict_in_generate=True)
    plen = batch["input_ids"].shape[1]
    assert torch.equal(res.sequences[:, plen:], tok_ref)
    torch.testing.assert_close(torch.stack(res.logits, 1).float(), log_ref, rtol=0, atol=1e-5)
    _, log0, _, _ = run_steered(lm, P3, NoIntervention(), max_new_tokens=N)
    assert not torch.equal(log_ref, log0)  # the intervention does steer these prompts


def test_apply_resets_per_generate_call_and_without_cache(lm):
    """Each generate call in one ``with`` gets its own context (the horizon and the gate decision start
    again); without the KV cache too."""
    iv = els(gate=split_gate(lm), horizon=2)
    ref = own(lm, iv)
    batch, small = hf_batch(lm), hf_batch(lm, P3[:2])
    with iv.apply(lm.model) as applied:
        first = as_generations(lm, batch, hf_generate(lm, batch))
        hf_generate(lm, small)
        again = as_generations(lm, batch, hf_generate(lm, batch))
        nocache = as_generations(lm, batch, hf_generate(lm, batch, use_cache=False))
    assert first == again == nocache == ref
    assert applied.calls == 4 and applied.ctx.stats["els_gate"]["rows"] == 3


def test_apply_plain_forward_is_steered_like_attach(lm):
    from aligntax.interventions.base import SteerContext

    iv = els()
    batch = hf_batch(lm)
    ctx = SteerContext(prompt_len=batch["input_ids"].shape[1])
    with torch.no_grad():
        with iv.attach(lm.model, ctx):
            ref = lm.model(**batch).logits
        with iv.apply(lm.model):
            got = lm.model(**batch).logits
        plain = lm.model(**batch).logits
    assert torch.equal(got, ref) and not torch.equal(plain, ref)


def test_apply_refuses_message_rewriting_and_right_padding_and_cleans_up(lm):
    with pytest.raises(AligntaxError, match="rewrites the chat messages"):
        with SystemPrompt("Be safe.").apply(lm.model):
            pass
    before = hook_counts(lm.model)
    with pytest.raises(AligntaxError, match="left-padded"):
        with els().apply(lm.model):
            hf_generate(lm, hf_batch(lm, padding_side="right"))
    assert hook_counts(lm.model) == before and "generate" not in vars(lm.model)
    with pytest.raises(RuntimeError, match="boom"):
        with els().apply(lm.model):
            hf_generate(lm, hf_batch(lm))
            raise RuntimeError("boom")
    assert hook_counts(lm.model) == before and "generate" not in vars(lm.model)
    with NoIntervention().apply(lm.model):
        hf_generate(lm, hf_batch(lm))


def test_load_intervention_names_and_folders(lm, bank_dir, vector_dir, tmp_path):
    import sys

    assert isinstance(aligntax.load_intervention("none"), NoIntervention)
    assert isinstance(aligntax.load_intervention("system-prompt"), SystemPrompt)
    iv = aligntax.load_intervention(bank_dir, lm, eta=0.1, top_k=1)
    assert isinstance(iv, EnergySteering) and iv.config()["eta"] == 0.1 and len(iv.models) == 1
    assert aligntax.load_intervention("els", lm, dir=bank_dir, eta=0.1, top_k=1).config() == iv.config()
    abl = aligntax.load_intervention(str(vector_dir), lm, name="refusal-ablation")
    assert abl.config() == make_intervention("refusal-ablation", lm, dir=vector_dir).config()
    with pytest.raises(AligntaxError, match="name="):
        aligntax.load_intervention(vector_dir, lm)
    with pytest.raises(AligntaxError, match="neither"):
        aligntax.load_intervention(tmp_path, lm)
    with pytest.raises(AligntaxError, match="neither an intervention name"):
        aligntax.load_intervention(tmp_path / "missing", lm)
    assert aligntax.load_model is sys.modules["aligntax.models.loader"].load_model
    assert {"load_model", "load_intervention"} <= set(dir(aligntax))


def test_load_intervention_takes_a_plain_transformers_model(lm, bank_dir, vector_dir):
    """A PreTrainedModel (and its tokenizer) works where a LoadedModel does, fingerprint checked the same."""
    from aligntax.errors import CompatibilityError

    iv = aligntax.load_intervention(bank_dir, lm.model, lm.tokenizer, eta=0.1, top_k=1)
    assert iv.config() == aligntax.load_intervention(bank_dir, lm, eta=0.1, top_k=1).config()
    abl = aligntax.load_intervention(vector_dir, lm.model, name="refusal-ablation")  # no tokenizer
    assert abl.config() == make_intervention("refusal-ablation", lm, dir=vector_dir).config()
    with iv.apply(lm.model):
        hf_generate(lm, hf_batch(lm))
    other = tiny_lm("qwen2", hidden=H, layers=3, seed=5).model  # same shape, other weights
    with pytest.raises(CompatibilityError, match="made for another model.*embedding_digest"):
        aligntax.load_intervention(bank_dir, other, lm.tokenizer)
    with pytest.raises(AligntaxError, match="PreTrainedModel, got str"):
        aligntax.load_intervention(bank_dir, "tiny")


def test_an_fp32_artefact_fits_the_model_in_bf16(lm, bank_dir, vector_dir, caplog):
    """The fingerprint's digest is the same in float32 and bfloat16: a bank or vectors made in fp32 load for
    the same weights in bf16 (noted as converted, not refused), and steer."""
    import copy
    import logging

    from aligntax.artefacts import check_fingerprint
    from aligntax.models.loader import as_loaded_model

    bf16 = as_loaded_model(copy.deepcopy(lm.model).to(torch.bfloat16), lm.tokenizer)
    assert bf16.fingerprint["dtype"] == "bfloat16" and lm.fingerprint["dtype"] == "float32"
    assert bf16.fingerprint["embedding_digest"] == lm.fingerprint["embedding_digest"]
    assert bf16.fingerprint["embedding_digest_dtype"] != lm.fingerprint["embedding_digest_dtype"]  # as before
    with caplog.at_level(logging.INFO, logger="aligntax"):
        iv = aligntax.load_intervention(bank_dir, bf16, eta=0.1, top_k=1)
    assert "dtype differs (made in float32, the model runs in bfloat16): converted" in caplog.text
    aligntax.load_intervention(vector_dir, bf16, name="refusal-ablation")
    out = generate(bf16, P3, GenerationConfig(max_new_tokens=3, batch_size=4), intervention=iv)
    assert len(out) == 3
    # an artefact of an earlier version recorded the float32 digest of the rows: it still fits in float32
    legacy = dict(lm.fingerprint, embedding_digest=lm.fingerprint["embedding_digest_dtype"])
    legacy.pop("embedding_digest_dtype")
    check_fingerprint(legacy, lm.fingerprint)


def test_import_aligntax_is_light():
    import subprocess
    import sys

    code = "import sys, aligntax; assert 'torch' not in sys.modules and 'aligntax.api' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def _readme_library_example() -> str:
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    library = text.split("## Library", 1)[1]
    return re.search(r"```python\n(.*?)```", library, re.S).group(1)


@pytest.mark.slow
def test_readme_library_example_runs(tmp_path, monkeypatch, capsys):
    """The README's train -> steer -> generate example, as written, on the embedded model."""
    code = _readme_library_example()
    assert "iv.apply(lm.model)" in code and "load_intervention" in code
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    assert (tmp_path / "runs" / "vectors").is_dir()
    printed = capsys.readouterr().out
    assert printed.startswith("[") and printed.count("'") + printed.count('"') >= 4


def test_load_intervention_keeps_model_facts(bank_dir, lm):
    """An object that carries a fingerprint and sizes (the vLLM backend's model facts) is used as is."""
    from types import SimpleNamespace

    facts = SimpleNamespace(fingerprint=dict(lm.fingerprint), hidden_size=H, num_layers=3, tokenizer=None)
    assert aligntax.load_intervention(bank_dir, facts, eta=0.1, top_k=1).config()["eta"] == 0.1
