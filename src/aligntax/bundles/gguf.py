"""A model with its steering in the weights, written as one GGUF file for llama.cpp and ollama.

``aligntax export --format gguf`` writes what the Hugging Face export writes (the els-lora adapter merged,
or a vector method baked in) as a GGUF file with the ``gguf`` package (llama.cpp's own writer), laid out
as llama.cpp's ``convert_hf_to_gguf.py`` lays out these architectures:

- **Tensors** get llama.cpp's names (``token_embd``, ``blk.N.attn_q`` ... ``ffn_down``, ``output_norm``,
  ``output``; ``gguf.get_tensor_name_map``); ``output`` is left out when the LM head is tied to the
  embeddings. Llama's query and key rows are permuted into llama.cpp's rotary layout (the converter's
  ``permute``); Qwen2's are not. Matrices are stored in the chosen type (f32, f16 or bf16), vectors
  (norms, biases) in f32, as the converter stores them. No quantisation.
- **Hyper-parameters**: context length, widths, block count, heads, the RMS-norm epsilon, the rotary base
  (and, for Llama, the vocabulary size and rotary dimension).
- **Tokenizer**: a byte-level BPE vocabulary (``tokenizer.ggml.model`` ``gpt2``) with llama.cpp's token
  types (added special tokens ``CONTROL``, other added tokens ``USER_DEFINED``, ids the tokenizer lacks
  ``[PADn]`` ``UNUSED``), the merges, the special token ids and the chat template
  (``gguf.SpecialVocab``), and the pre-tokenizer llama.cpp must split with (``tokenizer.ggml.pre``), read
  from the tokenizer's own pre-tokenizer: the Qwen2 and Llama 3 split patterns, GPT-2's byte-level
  split, or SmolLM's digits-then-GPT-2.
- ``aligntax.export``: what was merged or baked in, as JSON.

Only what loads back unchanged is written: Qwen2 (full attention) and Llama without attention or MLP
biases and with plain rotary embeddings; anything else is refused before a file is written
(:func:`check_model`). :func:`read_summary` reads a file back with ``gguf.GGUFReader``;
:func:`greedy_agreement` compares the greedy tokens of two models on the same prompts.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from aligntax.errors import AligntaxError

__all__ = ["GGUF_TYPES", "check_model", "greedy_agreement", "read_summary", "write_gguf"]

GGUF_TYPES = ("f32", "f16", "bf16")
_TORCH_TYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
# model_type -> the llama.cpp architecture it is written as
_ARCHS = {"qwen2": "QWEN2", "llama": "LLAMA"}
# the split patterns of the pre-tokenizers llama.cpp knows by these names (tokenizer.json's Split regex)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {_QWEN2_SPLIT: "qwen2", _LLAMA3_SPLIT: "llama-bpe"}


# ---- what can be written ------------------------------------------------------------------------------------
def _text_config(model: nn.Module):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _rope(cfg) -> tuple[float, dict]:
    """The rotary base and the rest of the rotary parameters (transformers 4 and 5 spell them apart)."""
    params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", None))
    return float(theta if theta is not None else 10000.0), params


def check_model(model: nn.Module) -> str:
    """The llama.cpp architecture ``model`` is written as (``qwen2`` or ``llama``); AligntaxError naming what
    no GGUF of these architectures carries, so it would not load back as the same model."""
    cfg = _text_config(model)
    mt = getattr(cfg, "model_type", None)
    if mt not in _ARCHS:
        raise AligntaxError(
            f"A GGUF export is written for Qwen2 and Llama models; this is a '{mt}' model. "
            "Export it as a Hugging Face folder (--format hf) and convert that with llama.cpp's converter."
        )
    _, params = _rope(cfg)
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind != "default":
        raise AligntaxError(
            f"This {mt} model scales its rotary embeddings ('{kind}'), which the GGUF export does not write; "
            "export it as a Hugging Face folder (--format hf) and convert that with llama.cpp's converter."
        )
    if mt == "qwen2" and (
        getattr(cfg, "use_sliding_window", False)
        or any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or []))
    ):
        raise AligntaxError(
            "This Qwen2 model uses sliding-window attention, which a qwen2 GGUF does not carry."
        )
    if mt == "llama" and (getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False)):
        raise AligntaxError(
            "This Llama model has attention or MLP biases (an activation addition after block 0 is one), "
            "which a llama GGUF loaded by transformers drops; export it as a Hugging Face folder (--format hf), "
            "or add the vector at block 0 (--layer 0), which goes into the embeddings."
        )
    return mt


# ---- tokenizer ----------------------------------------------------------------------------------------------
def _pre_tokenizer(tokenizer) -> str:
    """llama.cpp's name for the way ``tokenizer`` splits text before BPE (``tokenizer.ggml.pre``)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise AligntaxError("A GGUF export needs a fast (tokenizers) tokenizer.")
    spec = json.loads(backend.to_str())
    if (spec.get("model") or {}).get("type") != "BPE":
        raise AligntaxError(
            f"The GGUF export writes byte-level BPE vocabularies; this tokenizer is "
            f"{(spec.get('model') or {}).get('type')}. Export a Hugging Face folder (--format hf) instead."
        )
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") for p in parts]
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"
    if (
        kinds == ["Digits", "ByteLevel"]
        and parts[0].get("individual_digits")
        and parts[1].get("use_regex", True)
    ):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not parts[1].get("use_regex", True):
        pattern = (parts[0].get("pattern") or {}).get("Regex")
        if pattern in _SPLITS:
            return _SPLITS[pattern]
    raise AligntaxError(
        f"The tokenizer's pre-tokenizer ({json.dumps(pre)[:200]}) is none the GGUF export knows "
        "(the Qwen2 and Llama 3 splits, GPT-2's, SmolLM's); export a Hugging Face folder (--format hf)."
    )


def _looks_special(token: str) -> bool:
    """llama.cpp's converter marks these added tokens CONTROL even when the tokenizer does not."""
    return (
        token in ("<pad>", "<mask>")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def _vocab(tokenizer, n_vocab: int) -> tuple[list[str], list[int]]:
    """Every id's token and llama.cpp token type, ``n_vocab`` long (the embedding's rows)."""
    from gguf import TokenType

    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= n_vocab:
        raise AligntaxError(f"The tokenizer has ids past the model's {n_vocab} embedding rows.")
    reverse = {i: t for t, i in vocab.items()}
    added = dict(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(int(TokenType.UNUSED))
            continue
        token = reverse[i]
        if i in added:
            if not added[i].normalized:  # llama.cpp matches added tokens in the pre-normalised text
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            special = added[i].special or _looks_special(token)
            types.append(int(TokenType.CONTROL if special else TokenType.USER_DEFINED))
        else:
            types.append(int(TokenType.NORMAL))
        tokens.append(token)
    return tokens, types


def _add_tokenizer(writer, tokenizer, config, n_vocab: int) -> None:
    from gguf import SpecialVocab

    pre = _pre_tokenizer(tokenizer)
    tokens, types = _vocab(tokenizer, n_vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    with tempfile.TemporaryDirectory() as tmp:  # SpecialVocab reads the files save_pretrained writes
        tokenizer.save_pretrained(tmp)
        config.to_json_file(os.path.join(tmp, "config.json"))
        special = SpecialVocab(tmp, load_merges=True, n_vocab=n_vocab)
    if not special.merges:
        raise AligntaxError("The tokenizer has no BPE merges to write.")
    if special.chat_template is None and getattr(tokenizer, "chat_template", None):
        special.chat_template = tokenizer.chat_template
    if special.chat_template is None:
        raise AligntaxError("The tokenizer has no chat template; a chat GGUF needs one.")
    special.add_to_gguf(writer, quiet=True)


# ---- tensors ------------------------------------------------------------------------------------------------
def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's rotary layout of a Llama query or key projection (``convert_hf_to_gguf``'s ``permute``)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tied(model: nn.Module) -> bool:
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    return head is None or head.weight is emb.weight or head.weight.data_ptr() == emb.weight.data_ptr()


def _tensors(model: nn.Module, arch, mt: str, dtype: str):
    """``(gguf name, numpy array, raw type or None)`` of every weight, in the model's order."""
    import gguf

    cfg = _text_config(model)
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    raw = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16}
    tied = _tied(model)
    out = []
    for key, t in model.state_dict().items():
        if key == "lm_head.weight" and tied:
            continue
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise AligntaxError(f"The GGUF export has no llama.cpp name for the tensor '{key}'.")
        t = t.detach().to("cpu", torch.float32)
        if mt == "llama" and key.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in key else cfg.num_key_value_heads
            t = _permute(t, heads)
        if t.ndim <= 1 or dtype == "f32":  # vectors stay f32, as llama.cpp's converter keeps them
            out.append((name, t.numpy(), raw["f32"]))
        elif dtype == "f16":
            out.append((name, t.to(torch.float16).numpy(), raw["f16"]))
        else:  # bf16: the bytes of torch's rounding, typed for the writer
            out.append(
                (
                    name,
                    t.to(torch.bfloat16).contiguous().view(torch.uint8).numpy(),
                    gguf.GGMLQuantizationType.BF16,
                )
            )
    return out


# ---- writing ------------------------------------------------------------------------------------------------
def write_gguf(
    model: nn.Module,
    tokenizer,
    path: str | Path,
    dtype: str | torch.dtype | None = None,
    name: str | None = None,
    info: dict | None = None,
) -> Path:
    """Write ``model`` and ``tokenizer`` (with its chat template) as the GGUF file ``path``; returns it.

    ``dtype``: of the matrices, ``f32``, ``f16`` or ``bf16`` (a torch dtype is accepted; default: the
    model's). ``name``: ``general.name``. ``info``: stored as JSON under ``aligntax.export``. The file is
    written beside ``path`` and renamed into place, so no half-written file is left."""
    import gguf

    mt = check_model(model)
    if dtype is None:
        dtype = next(model.parameters()).dtype
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_TYPES:
            raise AligntaxError(f"A GGUF export is written in {', '.join(GGUF_TYPES)}, not {dtype}.")
        dtype = _TORCH_TYPES[dtype]
    dtype = {"fp32": "f32", "fp16": "f16", "float32": "f32", "float16": "f16", "bfloat16": "bf16"}.get(
        dtype, dtype
    )
    if dtype not in GGUF_TYPES:
        raise AligntaxError(f"A GGUF export is written in {', '.join(GGUF_TYPES)}, not {dtype}.")
    path = Path(path)
    if path.suffix != ".gguf":
        raise AligntaxError(f"The GGUF file's name must end in .gguf: {path}")
    cfg = _text_config(model)
    arch = getattr(gguf.MODEL_ARCH, _ARCHS[mt])
    n_vocab = model.get_input_embeddings().weight.shape[0]
    tensors = _tensors(model, arch, mt, dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(str(tmp), gguf.MODEL_ARCH_NAMES[arch])
    try:
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_name(name or getattr(cfg, "_name_or_path", None) or mt)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        writer.add_context_length(int(cfg.max_position_embeddings))
        writer.add_embedding_length(int(cfg.hidden_size))
        writer.add_block_count(int(cfg.num_hidden_layers))
        writer.add_feed_forward_length(int(cfg.intermediate_size))
        writer.add_head_count(int(cfg.num_attention_heads))
        writer.add_head_count_kv(int(cfg.num_key_value_heads or cfg.num_attention_heads))
        writer.add_rope_freq_base(_rope(cfg)[0])
        writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
        if mt == "llama":
            writer.add_vocab_size(int(n_vocab))
            writer.add_rope_dimension_count(int(head_dim))
        if head_dim != cfg.hidden_size // cfg.num_attention_heads:
            writer.add_key_length(int(head_dim))
            writer.add_value_length(int(head_dim))
        ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16}
        writer.add_file_type(int(ftype.get(dtype, gguf.LlamaFileType.MOSTLY_BF16)))
        _add_tokenizer(writer, tokenizer, model.config, n_vocab)
        if info:
            writer.add_string("aligntax.export", json.dumps(info, default=str))
        for tname, array, raw_dtype in tensors:
            writer.add_tensor(tname, array, raw_dtype=raw_dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    return path


# ---- reading back -------------------------------------------------------------------------------------------
def read_summary(path: str | Path) -> dict:
    """What ``gguf.GGUFReader`` reads from a GGUF file: its architecture, tensor names and types, chat
    template, tokenizer model and pre-tokenizer, vocabulary size and the ``aligntax.export`` record."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def field(key):
        f = reader.fields.get(key)
        if f is None:
            return None
        if f.types and f.types[0].name == "ARRAY":
            return len(f.data)
        return f.contents()

    info = field("aligntax.export")
    return {
        "architecture": field("general.architecture"),
        "name": field("general.name"),
        "file_type": field("general.file_type"),
        "tensors": {t.name: t.tensor_type.name for t in reader.tensors},
        "chat_template": field("tokenizer.chat_template"),
        "tokenizer_model": field("tokenizer.ggml.model"),
        "pre_tokenizer": field("tokenizer.ggml.pre"),
        "n_tokens": field("tokenizer.ggml.tokens"),
        "n_merges": field("tokenizer.ggml.merges"),
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
        "export": json.loads(info) if info else None,
    }


@torch.no_grad()
def greedy_agreement(
    reference,
    other,
    prompts: Sequence[str],
    max_new_tokens: int = 48,
    batch_size: int = 16,
    intervention=None,
) -> dict:
    """Greedy answers of two loaded models (``reference`` with ``intervention``'s hooks, if given) to the
    same chat prompts, rendered and tokenised once by ``reference``'s tokenizer, compared token by token.

    Returns the count of prompts, of answers with the same tokens throughout (``same``), their share,
    the index of the first differing token of each differing answer, and whether ``other``'s own
    tokenizer renders and tokenises every prompt to the same ids (``same_prompt_ids``)."""
    from contextlib import nullcontext

    tok, otok = reference.tokenizer, other.tokenizer
    rows, same_ids = [], 0
    for p in prompts:
        msgs = [{"role": "user", "content": p}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        oids = otok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        same_ids += list(oids["input_ids"] if isinstance(oids, dict) else oids) == ids
        rows.append(ids)
    stops = {tok.eos_token_id, *(_ids(reference.model.generation_config.eos_token_id))}

    def answers(lm, ctx):
        out = []
        with ctx:
            for s in range(0, len(rows), batch_size):
                batch = rows[s : s + batch_size]
                width = max(map(len, batch))
                pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
                ids = torch.tensor([[pad] * (width - len(r)) + r for r in batch], device=lm.device)
                mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in batch], device=lm.device)
                gen = lm.model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=pad,
                    eos_token_id=sorted(x for x in stops if x is not None),
                )
                for row in gen[:, width:].tolist():
                    cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
                    out.append(row[:cut])
        return out

    ref = answers(
        reference, intervention.apply(reference.model) if intervention is not None else nullcontext()
    )
    oth = answers(other, nullcontext())
    first = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), min(len(x), len(y)))
        for x, y in zip(ref, oth, strict=True)
        if x != y
    ]
    n = len(rows)
    same = n - len(first)
    return {
        "prompts": n,
        "same": same,
        "share": same / n if n else 0.0,
        "first_difference": first,
        "same_prompt_ids": same_ids,
        "max_new_tokens": max_new_tokens,
    }


def _ids(x) -> list:
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]
