"""A tiny random chat model with a word-level tokenizer, for tests and smoke runs (no downloads)."""

from __future__ import annotations

import json
import re

import torch

from aligntax.vat.items import builtin_path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]"]


def tiny_tokenizer(extra_text: str = ""):
    """A word-level fast tokenizer whose vocabulary covers the built-in items, the judgment templates
    and the persona prompts; digits 0-9 are single tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from aligntax.vat.interventions import persona_text
    from aligntax.vat.judge import TEMPLATES
    from aligntax.vat.schwartz import VALUES

    text = builtin_path().read_text(encoding="utf-8")
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    corpus = " ".join(r["context"] + " " + r["action"] for r in rows)
    corpus += " " + " ".join(TEMPLATES.values()) + " " + " ".join(persona_text(v) for v in VALUES)
    corpus += " completely unacceptable acceptable system user assistant " + extra_text
    words = sorted(set(re.findall(r"\w+|[^\w\s]", corpus)) | {str(d) for d in range(10)})
    vocab = {tok: i for i, tok in enumerate(SPECIAL + [w for w in words if w not in SPECIAL])}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                pre_tokenizers.Digits(individual_digits=True)])
    tk.decoder = decoders.WordPiece(prefix="##")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", pad_token="<|endoftext|>",
                                  eos_token="<|im_end|>", bos_token=None)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHAT_TEMPLATE
    tok.padding_side = "left"
    return tok


def tiny_lm(seed: int = 0, layers: int = 4, hidden: int = 64):
    """A ``LoadedModel`` around a randomly initialised 4-layer Qwen2 with the tiny tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from aligntax.models.loader import LoadedModel, model_fingerprint, prepare_tokenizer

    tok = tiny_tokenizer()
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2048, tie_word_embeddings=True,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    model = Qwen2ForCausalLM(cfg).eval()
    prepare_tokenizer(tok, model)
    spec = f"tiny-random-qwen2-{seed}"
    return LoadedModel(model=model, tokenizer=tok, spec=spec, source="tiny",
                       fingerprint=model_fingerprint(model, tok, spec))
