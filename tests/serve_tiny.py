"""A tiny, randomly initialised chat model with a self-contained tokenizer, for the server tests.

Nothing is downloaded: the tokenizer is a byte-level BPE trained in memory on a few sentences (with
multi-byte characters, so incremental decoding is exercised), wrapped with eos/pad tokens and a
ChatML-style chat template; the model is a 2-layer Qwen2 with hidden size 64.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from aligntax.interventions.base import (
    Intervention,
    SteerContext,
    hidden_from_args,
    hooks_attached,
    replace_hidden_in_args,
    steered_slice,
)
from aligntax.models.layers import decoder_layers
from aligntax.models.loader import LoadedModel
from tiny import CHATML_TEMPLATE, fast_tokenizer, make_tiny_lm

_CORPUS = [
    "Hello there, how are you today? I am fine, thank you.",
    "The quick brown fox jumps over the lazy dog.",
    "How do I kill a Python process? Use kill or pkill with the process id.",
    "Café, naïve, crème brûlée, 日本語のテキスト, and an emoji 🙂 or two 🚀.",
    "def add(a, b):\n    return a + b\n",
    "Energy landscape steering reduces over-refusal of safe prompts.",
]


def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        show_progress=False,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(_CORPUS * 4, trainer)
    return fast_tokenizer(bpe, CHATML_TEMPLATE, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def tiny_lm(seed: int = 0) -> LoadedModel:
    """A 2-layer Qwen2 with hidden size 64 around :func:`tiny_tokenizer`, with a fixed fingerprint."""
    return make_tiny_lm(
        tiny_tokenizer(),
        "qwen2",
        layers=2,
        hidden=64,
        seed=seed,
        dtype=None,
        spec="test:tiny-qwen2",
        source="memory",
        prepare=True,
        fingerprint={"spec": "test:tiny-qwen2", "embedding_digest": "0123456789abcdef"},
        tie_word_embeddings=False,
        initializer_range=0.2,
        bos_token_id=None,
    )


class AddVector(Intervention):
    """Adds a large fixed vector to the residual stream before the last decoder layer, per row scaled."""

    name = "addvec"

    def __init__(self, hidden: int, scale: float = 30.0, seed: int = 1, fail_strength: float | None = None):
        g = torch.Generator().manual_seed(seed)
        self.vector = torch.randn(hidden, generator=g) * scale
        self.fail_strength = fail_strength  # a batch holding a row of this strength raises (error tests)

    @contextmanager
    def attach(self, model, ctx: SteerContext):
        layer = decoder_layers(model)[-1]

        def hook(module, args, kwargs):
            if (
                self.fail_strength is not None
                and ctx.strength is not None
                and bool((ctx.strength == self.fail_strength).any())
            ):
                raise RuntimeError("test intervention failure")
            h = hidden_from_args(args, kwargs)
            sl = steered_slice(h.shape[1], ctx)
            scale = ctx.row_scale(h.shape[0], h.device, h.dtype)
            h = h.clone()
            h[:, sl] = h[:, sl] + scale * self.vector.to(h.device, h.dtype)
            return replace_hidden_in_args(args, kwargs, h)

        with hooks_attached([(layer, hook, True)]):
            yield
