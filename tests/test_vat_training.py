"""LoRA SFT and DPO value interventions on a tiny random model: the adapter is applied by hooks that
match peft exactly, training moves the target label, and the base model is never changed."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from aligntax.vat.items import load_builtin, split_items
from aligntax.vat.judge import JudgeConfig, LikertScale, Variant, judgment_prompt


@pytest.fixture(scope="module")
def setup():
    from vat_tiny import tiny_lm

    lm = tiny_lm(seed=1)
    ev, tr = split_items(load_builtin(), 0.2, seed=0)
    return lm, ev, tr


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _unchanged(model, ref):
    sd = model.state_dict()
    return (
        set(sd) == set(ref)
        and all(torch.equal(sd[k], ref[k]) for k in ref)
        and not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    )


def test_lora_sft_adapter(setup, tmp_path):
    from peft import PeftModel

    from aligntax.generation import prompt_logits
    from aligntax.vat.methods import LoRAAdapter, build_intervention
    from aligntax.vat.train import train_lora_sft

    lm, ev, tr = setup
    ref = _state(lm.model)
    n_modules = len(list(lm.model.modules()))
    cfg = JudgeConfig(templates=("acceptable",), orders=("normal", "reversed"))
    ad = train_lora_sft(
        lm,
        tr,
        "Security",
        tmp_path / "ad",
        cfg,
        steps=12,
        lr=3e-2,
        batch_size=4,
        exclude_ids={it.id for it in ev},
    )
    assert _unchanged(lm.model, ref) and len(list(lm.model.modules())) == n_modules
    meta = json.loads((tmp_path / "ad" / "vat_adapter.json").read_text())
    assert (
        meta["target"] == "Security"
        and meta["method"] == "lora"
        and meta["base_fingerprint"] == lm.fingerprint
    )
    assert (tmp_path / "ad" / "adapter_config.json").is_file()
    assert not set(meta["train_ids"]) & {it.id for it in ev}
    assert meta["loss_last"] < meta["loss_first"]

    prompts = [judgment_prompt(it, Variant("acceptable"), LikertScale()) for it in ev[:3]]
    base = prompt_logits(lm, prompts)
    hooked = prompt_logits(lm, prompts, intervention=ad)
    assert not torch.allclose(base, hooked)
    peft_model = PeftModel.from_pretrained(copy.deepcopy(lm.model), str(tmp_path / "ad")).eval()

    class Shim:  # prompt_logits on the peft-wrapped copy
        model, tokenizer, device = peft_model, lm.tokenizer, lm.device

    assert torch.allclose(prompt_logits(Shim, prompts), hooked, atol=1e-4)
    assert torch.allclose(prompt_logits(lm, prompts), base)  # detached again
    assert _unchanged(lm.model, ref)

    # reloading by folder, and the factory reusing a matching adapter
    again = LoRAAdapter.load(tmp_path / "ad", lm)
    assert again.config()["sha"] == ad.config()["sha"]
    reused = build_intervention("lora", lm, "Security", tr, cfg, adapter_dir=tmp_path / "ad")
    assert reused.config()["sha"] == ad.config()["sha"]


def test_dpo_adapter(setup, tmp_path):
    from aligntax.generation import prompt_logits
    from aligntax.vat.train import train_dpo

    lm, ev, tr = setup
    ref = _state(lm.model)
    side = lm.tokenizer.padding_side
    ad = train_dpo(
        lm,
        tr,
        "Hedonism",
        tmp_path / "dpo",
        JudgeConfig(),
        steps=2,
        lr=1e-3,
        batch_size=2,
        exclude_ids={it.id for it in ev},
    )
    assert _unchanged(lm.model, ref) and lm.tokenizer.padding_side == side
    meta = json.loads((tmp_path / "dpo" / "vat_adapter.json").read_text())
    assert meta["method"] == "dpo" and meta["target"] == "Hedonism" and meta["steps"] == 2
    assert ad.config()["method"] == "dpo" and ad.name == "dpo"
    prompts = [judgment_prompt(ev[0], Variant("acceptable"), LikertScale())]
    assert not torch.allclose(prompt_logits(lm, prompts), prompt_logits(lm, prompts, intervention=ad))
    assert _unchanged(lm.model, ref)
