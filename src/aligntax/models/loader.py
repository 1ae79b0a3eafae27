"""Loading a model spec into a ready-to-generate (model, tokenizer) pair."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from aligntax.errors import AligntaxError, ModelSpecError
from aligntax.models.layers import hidden_size, num_layers
from aligntax.models.spec import DEFAULT_MODEL, ModelSpec, parse_spec

DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype.lower()]
    except KeyError:
        raise AligntaxError(f"Unknown dtype '{dtype}'; use one of {sorted(DTYPES)}") from None


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer, set up for left-padded batched chat generation."""

    model: Any
    tokenizer: Any
    spec: str
    source: str
    fingerprint: dict = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def num_layers(self) -> int:
        return num_layers(self.model)

    @property
    def hidden_size(self) -> int:
        return hidden_size(self.model)

    def require_chat_template(self) -> None:
        if not getattr(self.tokenizer, "chat_template", None):
            raise AligntaxError(
                f"Model '{self.spec}' has no chat template, which this command needs. Use an instruct/chat "
                "model or a tokenizer folder with a chat_template."
            )


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false") or os.environ.get(
        "TRANSFORMERS_OFFLINE", "0"
    ) not in ("0", "", "false")


def embedding_digests(rows: torch.Tensor) -> tuple[str, str]:
    """The digests of the first embedding rows: (``embedding_digest``, ``embedding_digest_dtype``).

    ``embedding_digest`` reads the rows as bfloat16 holds them, so the same weights loaded in float32,
    bfloat16 or float16 (from a bf16 checkpoint) give the same digest and an artefact made in one dtype
    fits the model in another. ``embedding_digest_dtype`` reads them as the loaded dtype holds them (the
    digest of earlier versions): artefacts that recorded it still load for the model in that dtype."""
    rows = rows.detach().cpu()
    exact = rows.float().contiguous()
    shared = rows.to(torch.bfloat16).float().contiguous()
    return tuple(hashlib.sha256(r.numpy().round(3).tobytes()).hexdigest()[:16] for r in (shared, exact))


def model_fingerprint(model, tokenizer, spec: str) -> dict:
    """Identity of a model for artefact compatibility: architecture, sizes and a weight digest (the same in
    every dtype, :func:`embedding_digests`); ``dtype`` is informational, never compared."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    emb = model.get_input_embeddings().weight
    digest, exact = embedding_digests(emb[: min(64, emb.shape[0])])
    return {
        "spec": spec,
        "model_type": getattr(cfg, "model_type", None),
        "num_layers": num_layers(model),
        "hidden_size": hidden_size(model),
        "vocab_size": int(emb.shape[0]),
        "embedding_digest": digest,
        "embedding_digest_dtype": exact,
        "dtype": str(emb.dtype).removeprefix("torch."),
    }


def as_loaded_model(model, tokenizer=None) -> LoadedModel:
    """``model`` as a :class:`LoadedModel`: a LoadedModel is returned as is; a plain transformers
    ``PreTrainedModel`` (with its tokenizer, optional) is wrapped, with its fingerprint computed, so
    that artefacts are checked against it the same way. The tokenizer is not modified. Anything else
    that carries ``fingerprint`` and ``hidden_size`` (the vLLM backend's model facts) is returned as is."""
    if isinstance(model, LoadedModel) or (
        not isinstance(model, torch.nn.Module)
        and hasattr(model, "fingerprint")
        and hasattr(model, "hidden_size")
    ):
        return model
    if not (
        isinstance(model, torch.nn.Module)
        and hasattr(model, "config")
        and hasattr(model, "get_input_embeddings")
    ):
        raise AligntaxError(
            f"Expected a model loaded by aligntax.load_model or a transformers PreTrainedModel, "
            f"got {type(model).__name__}."
        )
    spec = getattr(model.config, "_name_or_path", None) or type(model).__name__
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        spec=spec,
        source=spec,
        fingerprint=model_fingerprint(model, tokenizer, spec),
    )


def _load_hub_or_dir(source: str, dtype: torch.dtype, is_hub: bool, device_map: str | dict | None = None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(source)
        extra = {"device_map": device_map} if device_map is not None else {}
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **extra)
    except OSError as exc:
        if is_hub:
            hint = (
                "The Hugging Face Hub is not reachable (offline mode or no network). "
                if hub_offline() or "offline" in str(exc).lower() or "connect" in str(exc).lower()
                else ""
            )
            raise ModelSpecError(
                f"Could not load Hub model '{source}'. {hint}Use an embedded model "
                f"(e.g. {DEFAULT_MODEL}) or a local path. Details: {str(exc).splitlines()[0]}"
            ) from exc
        raise ModelSpecError(f"Could not load model folder '{source}': {exc}") from exc
    return model, tok


def default_device() -> str:
    """Where a model loads when no device is named: ``ALIGNTAX_DEVICE`` (``--device``), else CUDA when
    present, else the CPU."""
    return os.environ.get("ALIGNTAX_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")


def load_model(
    spec: str | ModelSpec = DEFAULT_MODEL,
    dtype: str | torch.dtype = "bf16",
    device: str | None = None,
    device_map: str | dict | None = None,
) -> LoadedModel:
    """Load any supported model spec. bf16 on CPU by default; ``device`` defaults to ``ALIGNTAX_DEVICE``
    (what the command line's ``--device`` sets), else CUDA if present, else the CPU.

    ``device_map`` (``"auto"``, or accelerate's ``{module: device}``) splits a model larger than one
    device over several (Hugging Face models only; ``device`` is then not used): inputs go to the
    device of the first parameters (:attr:`LoadedModel.device`), and steering follows each hidden
    state's device."""
    from aligntax.models.embedded import fetch_embedded, load_gguf

    ms = spec if isinstance(spec, ModelSpec) else parse_spec(spec)
    torch_dtype = resolve_dtype(dtype)
    if device_map is not None and ms.kind == "gguf":
        raise AligntaxError(
            "device_map splits Hugging Face models only; convert the .gguf file to a model "
            "folder first, or load it on one device."
        )
    if ms.kind == "embedded":
        source = str(fetch_embedded(ms.value))
        model, tok = _load_hub_or_dir(source, torch_dtype, is_hub=False, device_map=device_map)
    elif ms.kind == "dir":
        source = ms.value
        model, tok = _load_hub_or_dir(source, torch_dtype, is_hub=False, device_map=device_map)
    elif ms.kind == "gguf":
        source = ms.value
        model, tok = load_gguf(Path(source))
        model = model.to(torch_dtype)
    else:
        source = ms.value
        model, tok = _load_hub_or_dir(source, torch_dtype, is_hub=True, device_map=device_map)
    if device_map is None:
        model = model.to(device or default_device())
    model = model.eval()
    prepare_tokenizer(tok, model)
    return LoadedModel(
        model=model,
        tokenizer=tok,
        spec=ms.raw,
        source=source,
        fingerprint=model_fingerprint(model, tok, ms.raw),
    )


def prepare_tokenizer(tok, model=None) -> None:
    """Left padding with a defined pad token, as batched generation needs."""
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if model is not None and getattr(model.generation_config, "pad_token_id", None) is None:
        model.generation_config.pad_token_id = tok.pad_token_id


def model_info(spec: str) -> dict:
    """Architecture facts for ``aligntax models info``."""
    lm = load_model(spec, dtype="bf16", device="cpu")
    cfg = lm.model.config
    return {
        "spec": lm.spec,
        "source": lm.source,
        "architecture": (cfg.architectures or [type(lm.model).__name__])[0],
        "model_type": cfg.model_type,
        "num_layers": lm.num_layers,
        "hidden_size": lm.hidden_size,
        "vocab_size": lm.fingerprint["vocab_size"],
        "dtype": str(lm.dtype).replace("torch.", ""),
        "parameters": sum(p.numel() for p in lm.model.parameters()),
        "chat_template": bool(getattr(lm.tokenizer, "chat_template", None)),
        "cache_path": lm.source if parse_spec(spec).kind == "embedded" else None,
        "fingerprint": lm.fingerprint,
    }
