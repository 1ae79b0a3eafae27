"""Generation backends: ``hf`` (aligntax's own batched loop on a Hugging Face model, the default) and
``vllm`` (:mod:`aligntax.backends.vllm`: vLLM's continuous batching, steered through a worker extension;
an optional install, ``./run setup-vllm``)."""

from __future__ import annotations

from aligntax.errors import AligntaxError

BACKENDS = ("hf", "vllm")
LABELS = {"hf": "Hugging Face", "vllm": "vLLM"}  # each backend as reports name it


def check_backend(name: str | None) -> str:
    """The backend name, lower-cased; AligntaxError for an unknown one."""
    name = (name or "hf").strip().lower()
    if name not in BACKENDS:
        raise AligntaxError(f"Unknown backend '{name}'; use one of {', '.join(BACKENDS)}.")
    return name
