"""Shared fixtures: tiny randomly initialised chat models built from a config, and data paths."""

from __future__ import annotations

import pytest
import torch

from aligntax.models.embedded import converted_dir, is_fetched
from aligntax.paths import shared_data_dir

QWEN = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture(scope="session")
def qwen_tokenizer():
    """The real Qwen2.5 tokenizer (with its chat template), from the embedded model cache."""
    from transformers import AutoTokenizer

    from aligntax.models.loader import prepare_tokenizer

    if not is_fetched(QWEN):
        pytest.skip("embedded model not fetched (run ./run setup)")
    tok = AutoTokenizer.from_pretrained(converted_dir(QWEN))
    prepare_tokenizer(tok)
    return tok


def make_tiny_lm(tokenizer, arch: str = "qwen2", layers: int = 2, hidden: int = 64, seed: int = 0,
                 dtype=torch.float32):
    """A randomly initialised decoder-only LM of the given architecture, wrapped as a LoadedModel."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from aligntax.models.loader import LoadedModel, model_fingerprint

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(arch, vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                               num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=512, tie_word_embeddings=True,
                               pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return LoadedModel(model=model, tokenizer=tokenizer, spec=f"tiny-{arch}", source="config",
                       fingerprint=model_fingerprint(model, tokenizer, f"tiny-{arch}"))


@pytest.fixture()
def tiny_lm(qwen_tokenizer):
    return make_tiny_lm(qwen_tokenizer)


@pytest.fixture(scope="session")
def data_dir():
    d = shared_data_dir()
    if d is None:
        pytest.skip("benchmark data folder not found (set ALIGNTAX_DATA)")
    return d
