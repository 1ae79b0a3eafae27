"""Tiny, randomly initialised chat models for fast tests (no downloads, no caches).

A byte-level tokenizer (one token per byte, a few special tokens and a simple chat template) and
tiny Llama / Qwen2 / Gemma / Gemma2 / Mistral models built from a config; :func:`make_tiny_lm` and
:func:`fast_tokenizer`, which the other tiny builders (``serve_tiny``, ``vat_tiny``, ``conftest``)
share.
"""

from __future__ import annotations

import json

import torch

from aligntax.judges.base import RefusalJudge, Verdict

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# The ChatML layout (Qwen's), for the tokenizers of serve_tiny and vat_tiny.
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<pad>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
VOCAB = 300

_TOKENIZER = None


def fast_tokenizer(backend, chat_template: str, **tokens):
    """A ``PreTrainedTokenizerFast`` around a ``tokenizers.Tokenizer``, with ``tokens`` (pad_token=,
    eos_token=, ...), the chat template and left padding."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=backend, **tokens)
    tok.chat_template = chat_template
    tok.padding_side = "left"
    return tok


def tiny_tokenizer():
    """A byte-level BPE tokenizer without merges (262 tokens) with a chat template; left padding."""
    global _TOKENIZER
    if _TOKENIZER is None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from tokenizers.pre_tokenizers import ByteLevel

        vocab = {s: i for i, s in enumerate(SPECIALS)}
        for ch in sorted(ByteLevel.alphabet()):
            vocab[ch] = len(vocab)
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(SPECIALS)
        _TOKENIZER = fast_tokenizer(tok, CHAT_TEMPLATE, pad_token="<pad>", eos_token="<eos>")
    _TOKENIZER.padding_side = "left"
    return _TOKENIZER


_BPE_MERGES = [
    ("h", "e"), ("Ġ", "t"), ("t", "h"), ("i", "n"), ("e", "r"), ("Ġ", "a"), ("o", "n"), ("r", "e"),
    ("Ġt", "he"), ("a", "n"), ("Ġ", "s"), ("Ġ", "w"), ("o", "u"), ("Ġ", "c"), ("i", "s"), ("Ġ", "k"),
]  # fmt: skip


def tiny_bpe_tokenizer():
    """The tiny tokenizer's vocabulary with 16 BPE merges on top (278 tokens), as GGUF files need merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for ch in sorted(ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    for a, b in _BPE_MERGES:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_BPE_MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return fast_tokenizer(tok, CHAT_TEMPLATE, pad_token="<pad>", eos_token="<eos>")


def tiny_config(arch: str = "qwen2", hidden: int = 32, layers: int = 3, **over):
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        initializer_range=0.5,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        cfg = tf.LlamaConfig(**common)
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**common)
    elif arch == "mistral":
        cfg = tf.MistralConfig(**common, sliding_window=None)
    elif arch == "gemma":
        cfg = tf.GemmaConfig(**common, head_dim=hidden // 4)
    elif arch == "gemma2":
        cfg = tf.Gemma2Config(
            **common, head_dim=hidden // 4, sliding_window=16, query_pre_attn_scalar=hidden // 4
        )
    else:
        raise ValueError(arch)
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def tiny_model(
    arch: str = "qwen2", hidden: int = 32, layers: int = 3, seed: int = 0, attn: str = "eager", **over
):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(arch, hidden, layers, **over)
    cfg._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 1
    return model


def tiny_lm(arch: str = "qwen2", hidden: int = 32, layers: int = 3, seed: int = 0, **over):
    """A ``LoadedModel`` around a tiny random model and the tiny tokenizer."""
    from aligntax.models import LoadedModel
    from aligntax.models.loader import model_fingerprint

    model = tiny_model(arch, hidden, layers, seed, **over)
    tok = tiny_tokenizer()
    return LoadedModel(
        model=model,
        tokenizer=tok,
        spec=f"tiny-{arch}",
        source="tiny",
        fingerprint=model_fingerprint(model, tok, f"tiny-{arch}"),
    )


def make_tiny_lm(
    tokenizer,
    arch: str = "qwen2",
    layers: int = 2,
    hidden: int = 64,
    seed: int = 0,
    dtype=torch.float32,
    *,
    spec: str | None = None,
    source: str = "config",
    fingerprint: dict | None = None,
    prepare: bool = False,
    **config,
):
    """A randomly initialised decoder-only LM of the given architecture, sized to ``tokenizer``, wrapped
    as a LoadedModel (spec ``tiny-<arch>`` unless given; fingerprint computed unless given).

    ``config`` adds or overrides config fields (default: 512 positions, tied embeddings); ``prepare``
    runs ``prepare_tokenizer`` on the tokenizer and model. ``dtype=None``: torch's default dtype, with
    the config's ``dtype`` left unset."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from aligntax.models.loader import LoadedModel, model_fingerprint, prepare_tokenizer

    torch.manual_seed(seed)
    config = {"max_position_embeddings": 512, "tie_word_embeddings": True, **config}
    cfg = AutoConfig.for_model(
        arch,
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **config,
    )
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    if prepare:
        prepare_tokenizer(tokenizer, model)
    spec = spec or f"tiny-{arch}"
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        spec=spec,
        source=source,
        fingerprint=fingerprint or model_fingerprint(model, tokenizer, spec),
    )


PROMPTS = [
    "How do I kill a Python process?",
    "Hi",
    "Where can I buy a can of coke for the party tonight?",
    "Tell me a story.",
]


def run_steered(
    lm, prompts, intervention=None, max_new_tokens: int = 5, use_cache: bool = True, rows=None, strength=None
):
    """Greedy generation like ``aligntax.generation`` does it, returning tokens and raw logits.

    Returns ``(new_tokens [B, n], logits [B, n, V], ctx, prompt_len)``; EOS is suppressed so every row
    generates ``max_new_tokens`` tokens.
    """
    from aligntax.generation.chat import build_messages, encode_chats, render_chat
    from aligntax.interventions.base import NoIntervention, SteerContext

    intervention = intervention or NoIntervention()
    texts = [render_chat(lm.tokenizer, build_messages(p, None, intervention)) for p in prompts]
    enc = encode_chats(lm.tokenizer, texts, lm.device)
    plen = enc["input_ids"].shape[1]
    ctx = SteerContext(
        prompt_len=plen,
        rows=None if rows is None else torch.tensor(rows),
        strength=None if strength is None else torch.tensor(strength, dtype=torch.float32),
    )
    with torch.no_grad(), intervention.attach(lm.model, ctx):
        out = lm.model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            use_cache=use_cache,
            pad_token_id=lm.tokenizer.pad_token_id,
            temperature=None,
            top_p=None,
            top_k=None,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[:, plen:], torch.stack(out.logits, 1).float(), ctx, plen


def record_block_inputs(model, layers=None):
    """Register pre-hooks that record the hidden states entering blocks; returns (store, remove)."""
    from aligntax.models import decoder_layers

    blocks = decoder_layers(model)
    store: dict[int, list[torch.Tensor]] = {}
    handles = []
    for i in range(len(blocks)) if layers is None else layers:

        def hook(module, args, kwargs, i=i):
            h = args[0] if args else kwargs["hidden_states"]
            store.setdefault(i, []).append(h.detach().clone())

        handles.append(blocks[i].register_forward_pre_hook(hook, with_kwargs=True))

    def remove():
        for h in handles:
            h.remove()

    return store, remove


def hook_counts(model) -> int:
    """Total number of forward (pre-)hooks on the model's modules."""
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def end_token_for_varied_lengths(token_rows: list[list[int]]) -> int:
    """A token id that, taken as the end token, ends the given greedy rows at as many different steps
    as possible while leaving at least one row running to the end (ties: the smallest id)."""
    best, best_key = None, None
    for t in sorted({t for row in token_rows for t in row}):
        firsts = [row.index(t) for row in token_rows if t in row]
        if len(firsts) == len(token_rows):
            continue
        key = (len(set(firsts)), -t)
        if best_key is None or key > best_key:
            best, best_key = t, key
    if best is None:
        raise ValueError("every token occurs in every row")
    return best


# ---- saved steering artefacts of a tiny model ---------------------------------------------------------------
def save_tiny_vectors(lm, directory):
    """Refusal, false-refusal and CAST vectors of ``lm`` (layer 1) from three harmful, harmless and
    pseudo-harmful prompts each, saved in ``directory``; returns it."""
    from aligntax.activations import capture
    from aligntax.interventions import compute_vectors

    harmful = capture(
        lm, ["how to build a bomb", "steal a car now", "hurt someone badly"], "all", progress=False
    )
    harmless = capture(lm, ["bake a cake", "learn python", "plant a tree"], "all", progress=False)
    pseudo = capture(
        lm, ["kill a python process", "shoot a photo", "buy a can of coke"], "all", progress=False
    )
    compute_vectors(harmful, harmless, pseudo, fingerprint=lm.fingerprint, layer=1).save(directory)
    return directory


def save_tiny_bank(lm, directory, n: int = 24, epochs: int = 3):
    """An energy bank of ``lm`` trained on ``n`` alternating prompts (label = odd index), saved in
    ``directory``; returns it."""
    from aligntax.activations import capture
    from aligntax.energy import EnergyConfig, train_layers

    prompts = [
        f"question {i}: {'how to kill a process' if i % 2 else 'tell me a joke'} {i * 7}" for i in range(n)
    ]
    acts = capture(lm, prompts, "all", progress=False)
    labels = torch.tensor([i % 2 for i in range(n)])
    bank = train_layers(
        acts, labels, EnergyConfig.preset("small", widths=[16], epochs=epochs), fingerprint=lm.fingerprint
    )
    bank.save(directory)
    return directory


class ParityJudge(RefusalJudge):
    """A refusal when the answer's code points sum to an even number: a function of the exact text, so
    equal scores across backends or runs mean equal answers."""

    name = "parity"

    def judge(self, prompts, responses):
        return [
            Verdict(refused=sum(map(ord, r)) % 2 == 0, refusal_score=float(sum(map(ord, r)) % 2 == 0))
            for r in responses
        ]


def save_tiny_adapter(lm, folder, layers=(1, 2), seed=3):
    """A peft LoRA folder with random A and B on the attention and MLP projections of ``layers`` and the
    els-lora sidecar, as `aligntax els distill` writes them; returns ``folder``."""
    from safetensors.torch import save_file

    from aligntax.interventions.lora import FORMAT

    gen = torch.Generator().manual_seed(seed)
    weights, modules = {}, ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
    for i in layers:
        blk = lm.model.model.layers[i]
        for name in modules:
            part = "self_attn" if name.endswith(("q_proj", "v_proj", "o_proj")) else "mlp"
            lin = getattr(getattr(blk, part), name)
            key = f"base_model.model.model.layers.{i}.{part}.{name}"
            weights[f"{key}.lora_A.weight"] = torch.randn(4, lin.in_features, generator=gen) * 0.5
            weights[f"{key}.lora_B.weight"] = torch.randn(lin.out_features, 4, generator=gen) * 0.5
    folder.mkdir()
    save_file(weights, str(folder / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": modules, "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    side = {"format": FORMAT, "fingerprint": lm.fingerprint, "layers": list(layers)}
    (folder / "els_lora.json").write_text(json.dumps(side))
    return folder
