"""Finding the decoder blocks of a causal LM (Llama, Qwen2/3, Gemma 1-3, Mistral, Phi, GPT-2, ...)."""

from __future__ import annotations

from torch import nn

from aligntax.errors import AligntaxError

# Attribute paths to the list of decoder blocks, tried in order.
_LAYER_PATHS = (
    "model.layers",  # Llama, Qwen2, Qwen3, Mistral, Gemma, Gemma2, Phi3, SmolLM
    "model.language_model.layers",  # Gemma3 (multimodal wrapper), Llava-style
    "language_model.model.layers",
    "transformer.h",  # GPT-2, GPT-J, Falcon
    "gpt_neox.layers",  # Pythia
    "model.decoder.layers",  # OPT
)


def _resolve(obj: object, path: str):
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ``nn.ModuleList`` of decoder blocks, or a clear error for an unknown architecture."""
    for path in _LAYER_PATHS:
        layers = _resolve(model, path)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            return layers
    raise AligntaxError(
        f"Cannot find the decoder layers of {type(model).__name__} "
        f"(model_type={getattr(getattr(model, 'config', None), 'model_type', '?')}); "
        f"looked for: {', '.join(_LAYER_PATHS)}"
    )


def resolve_layers(layers, model_or_n: nn.Module | int) -> list[int]:
    """Block indices from ``'all'``/None (every block), an int or a list of ints (negative indices count
    from the end), in the order given without repeats; a clear error for a block the model lacks. The
    one place where layer arguments are read: capture, steering methods and the CLI all use it."""
    n = model_or_n if isinstance(model_or_n, int) else len(decoder_layers(model_or_n))
    if layers is None or (isinstance(layers, str) and layers == "all"):
        return list(range(n))
    if isinstance(layers, int):
        layers = [layers]
    out: list[int] = []
    for layer in layers:
        layer = int(layer)
        idx = layer + n if layer < 0 else layer
        if not 0 <= idx < n:
            raise AligntaxError(
                f"Layer {layer} is out of range: the model has {n} decoder layers (0..{n - 1})."
            )
        if idx not in out:
            out.append(idx)
    return out


def _text_config(model: nn.Module):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def num_layers(model: nn.Module) -> int:
    return len(decoder_layers(model))


def hidden_size(model: nn.Module) -> int:
    cfg = _text_config(model)
    for key in ("hidden_size", "n_embd", "d_model"):
        if getattr(cfg, key, None):
            return int(getattr(cfg, key))
    raise AligntaxError(f"Cannot read the hidden size of {type(model).__name__}")
