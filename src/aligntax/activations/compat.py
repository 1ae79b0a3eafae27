"""Shared helpers for saved artefacts: model fingerprints and JSON sidecars.

Every artefact made from a model's activations (activation caches, energy banks, steering vectors)
records the model fingerprint (``LoadedModel.fingerprint``) and refuses to load for another model.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from aligntax.errors import CompatibilityError

# The fingerprint keys that decide whether an artefact fits a model (the spec string may differ:
# the same weights can be loaded from the Hub, a folder or the embedded cache).
FINGERPRINT_KEYS = ("model_type", "hidden_size", "num_layers", "embedding_digest")


def _describe(fp: dict) -> str:
    parts = [f"{k}={fp.get(k)!r}" for k in ("spec", *FINGERPRINT_KEYS) if k in fp]
    return ", ".join(parts) if parts else "no fingerprint"


def check_fingerprint(saved: dict | None, expected: dict | None, what: str = "artefact") -> None:
    """Raise ``CompatibilityError`` when ``saved`` (from the artefact) does not fit ``expected`` (the model).

    Keys absent from either side are not compared; an artefact with no fingerprint is refused when a
    fingerprint is expected.
    """
    if expected is None:
        return
    if not saved:
        raise CompatibilityError(
            f"This {what} has no model fingerprint, so it cannot be checked against the model "
            f"({_describe(expected)}); re-create it with this version of aligntax."
        )
    diffs = [k for k in FINGERPRINT_KEYS if k in saved and k in expected and saved[k] != expected[k]]
    if diffs:
        raise CompatibilityError(
            f"This {what} was made for another model: it has {_describe(saved)}, but the model has "
            f"{_describe(expected)} (differs in {', '.join(diffs)})."
        )


def check_hidden_size(saved_dim: int, expected_dim: int | None, what: str, saved_fp: dict | None = None,
                      expected_fp: dict | None = None) -> None:
    if expected_dim is not None and int(saved_dim) != int(expected_dim):
        raise CompatibilityError(
            f"This {what} expects hidden size {saved_dim} ({_describe(saved_fp or {})}), but the model has "
            f"hidden size {expected_dim} ({_describe(expected_fp or {})})."
        )


def _clean(obj):
    """JSON-safe copy: tuples to lists, non-finite floats to None, tensors refused."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if hasattr(obj, "item") and getattr(obj, "ndim", 1) == 0:
        return _clean(obj.item())
    return obj


def write_json(path: Path, obj: dict) -> None:
    """Write JSON atomically (temp file then rename)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_clean(obj), indent=2, sort_keys=False))
    os.replace(tmp, path)


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())
