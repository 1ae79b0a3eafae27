"""A tiny random chat model with a word-level tokenizer, for the VAT tests (no downloads)."""

from __future__ import annotations

import json
import re

from aligntax.vat.items import builtin_path
from tiny import CHATML_TEMPLATE, fast_tokenizer, make_tiny_lm

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]"]


def tiny_tokenizer(extra_text: str = ""):
    """A word-level fast tokenizer whose vocabulary covers the built-in items, the judgment templates
    and the persona prompts; digits 0-9 are single tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from aligntax.vat.judge import TEMPLATES
    from aligntax.vat.methods import persona_text
    from aligntax.vat.schwartz import VALUES

    text = builtin_path().read_text(encoding="utf-8")
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    corpus = " ".join(r["context"] + " " + r["action"] for r in rows)
    corpus += " " + " ".join(TEMPLATES.values()) + " " + " ".join(persona_text(v) for v in VALUES)
    corpus += " completely unacceptable acceptable system user assistant " + extra_text
    words = sorted(set(re.findall(r"\w+|[^\w\s]", corpus)) | {str(d) for d in range(10)})
    vocab = {tok: i for i, tok in enumerate(SPECIAL + [w for w in words if w not in SPECIAL])}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)]
    )
    tk.decoder = decoders.WordPiece(prefix="##")
    tok = fast_tokenizer(
        tk,
        CHATML_TEMPLATE,
        unk_token="[UNK]",
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        bos_token=None,
    )
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tok


def tiny_lm(seed: int = 0, layers: int = 4, hidden: int = 64):
    """A ``LoadedModel`` around a randomly initialised 4-layer Qwen2 with the tiny tokenizer."""
    return make_tiny_lm(
        tiny_tokenizer(),
        "qwen2",
        layers,
        hidden,
        seed,
        dtype=None,
        spec=f"tiny-random-qwen2-{seed}",
        source="tiny",
        prepare=True,
        max_position_embeddings=2048,
        bos_token_id=None,
    )
