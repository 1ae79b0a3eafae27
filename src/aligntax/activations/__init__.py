"""Residual-stream activations entering decoder blocks: capture, caching on disk, norms."""

from aligntax.activations.cache import ActivationCache, capture_to_cache
from aligntax.activations.capture import (
    POSITIONS,
    capture,
    capture_ids,
    capture_seqs,
    chat_ids,
    measure_residual_norms,
    position_ids_from_mask,
    residual_norms,
    resolve_layers,
)

__all__ = [
    "POSITIONS",
    "ActivationCache",
    "capture",
    "capture_ids",
    "capture_seqs",
    "capture_to_cache",
    "chat_ids",
    "measure_residual_norms",
    "position_ids_from_mask",
    "residual_norms",
    "resolve_layers",
]
