"""Saved artefacts: model fingerprints, JSON sidecars and safetensors files.

Every artefact made from a model's activations (activation caches, energy banks, harm gates, steering
vectors, adapters) records the model fingerprint (``LoadedModel.fingerprint``) and refuses to load for
another model. The module sits at the bottom of the package graph (it imports only ``aligntax.errors``
and the atomic writes of ``aligntax.runfolder``), so the packages that save artefacts (energy,
interventions, activations, bundles, runs) all reach it.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from aligntax.errors import CompatibilityError, DataError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("aligntax")

# The fingerprint keys that decide whether an artefact fits a model (the spec string may differ:
# the same weights can be loaded from the Hub, a folder or the embedded cache).
FINGERPRINT_KEYS = ("model_type", "hidden_size", "num_layers", "embedding_digest")


def fingerprint_diffs(saved: dict, expected: dict, keys: tuple[str, ...] = FINGERPRINT_KEYS) -> list[str]:
    """The ``keys`` in which two fingerprints differ (keys absent from either side are not compared).

    The model's dtype is never compared: ``embedding_digest`` is the same in every dtype, and a saved
    digest equal to the model's ``embedding_digest_dtype`` (the dtype-specific digest of earlier
    versions) is a match too."""
    same_digest = {expected.get("embedding_digest"), expected.get("embedding_digest_dtype")} - {None}
    return [
        k
        for k in keys
        if k in saved
        and k in expected
        and saved[k] != expected[k]
        and not (k == "embedding_digest" and saved[k] in same_digest)
    ]


# Where an artefact folder records the model it was made for: the spec it was given (``model``; a folder
# holding a selected setting names it in selection.json), and the
# fingerprint of its sidecar (whose ``spec`` is how the model was named when it was loaded). An ELS folder
# (``aligntax els train``) has train_config.json and energy.json; an els-lora adapter els_lora.json; a
# vector folder vectors.json.
_MODEL_RECORDS = (
    "selection.json",
    "train_config.json",
    "els_lora.json",
    "energy.json",
    "vectors.json",
    "gate.json",
)


def folder_model(folder: str | Path | None) -> tuple[str | None, dict]:
    """``(spec, fingerprint)`` of the model an artefact folder (ELS, els-lora adapter, vectors) was made
    for, read from its sidecars without loading anything: the spec is the one it was trained with (None
    when no file names one), the fingerprint its sidecar's ({} when none has one)."""
    if folder is None:
        return None, {}
    path = Path(folder).expanduser()
    spec, fp = None, {}
    for name in _MODEL_RECORDS:
        file = path / name
        if not file.is_file():
            continue
        try:
            meta = json.loads(file.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(meta, dict):
            continue
        saved = meta.get("fingerprint") if isinstance(meta.get("fingerprint"), dict) else {}
        fp = fp or saved
        named = meta.get("model") or (meta.get("config") or {}).get("model") or saved.get("spec")
        spec = spec or (named if isinstance(named, str) and named else None)
    return spec, fp


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
    diffs = fingerprint_diffs(saved, expected)
    if diffs:
        raise CompatibilityError(
            f"This {what} was made for another model: it has {_describe(saved)}, but the model has "
            f"{_describe(expected)} (differs in {', '.join(diffs)})."
        )
    if saved.get("dtype") and expected.get("dtype") and saved["dtype"] != expected["dtype"]:
        log.info(
            "%s: dtype differs (made in %s, the model runs in %s): converted",
            what,
            saved["dtype"],
            expected["dtype"],
        )


def check_hidden_size(
    saved_dim: int,
    expected_dim: int | None,
    what: str,
    saved_fp: dict | None = None,
    expected_fp: dict | None = None,
) -> None:
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
    """Write JSON atomically (temp file, fsync, rename: :func:`aligntax.runfolder.write_text_atomic`)."""
    from aligntax.runfolder import write_text_atomic

    write_text_atomic(path, json.dumps(_clean(obj), indent=2, sort_keys=False))


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def check_format(meta: dict, fmt: str, sidecar: Path, noun: str) -> None:
    """Raise ``DataError`` unless the sidecar ``meta`` (read from ``sidecar``) has format ``fmt``."""
    if meta.get("format") != fmt:
        raise DataError(f"{sidecar} is not an aligntax {noun} (format {meta.get('format')!r}).")


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, fmt: str) -> None:
    """Write a safetensors file atomically (temp file, fsync, rename), with ``fmt`` in its metadata."""
    from safetensors.torch import save_file

    from aligntax.runfolder import atomic_file

    with atomic_file(path) as tmp:
        save_file(tensors, str(tmp), metadata={"format": fmt})


@dataclass(frozen=True)
class TensorArtefact:
    """A folder holding one safetensors file and a JSON sidecar with the format, the model fingerprint
    and the hidden size (energy banks, steering vectors). The nouns name it in messages: ``what`` in
    compatibility errors, ``missing`` when the folder lacks the files, ``kind`` for a wrong format
    (both default to ``what``)."""

    format: str
    sidecar: str
    weights: str
    what: str
    missing: str = ""
    kind: str = ""

    def save(self, directory: str | Path, tensors: dict[str, torch.Tensor], meta: dict) -> Path:
        """Write the tensors, then the sidecar (``format`` first, then ``meta``); returns the folder."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_tensors(tensors, directory / self.weights, self.format)
        write_json(directory / self.sidecar, {"format": self.format, **meta})
        return directory

    def load(
        self,
        directory: str | Path,
        expect_fingerprint: dict | None = None,
        expect_hidden_size: int | None = None,
        device: str = "cpu",
    ) -> tuple[dict, dict[str, torch.Tensor]]:
        """The sidecar and the tensors, after checking the format, the fingerprint and the hidden size
        (from ``expect_fingerprint`` when not given); the sidecar's ``fingerprint`` is ``{}`` if unset."""
        from safetensors.torch import load_file

        directory = Path(directory)
        side = directory / self.sidecar
        if not side.is_file() or not (directory / self.weights).is_file():
            raise DataError(
                f"No {self.missing or self.what} in {directory} (need {self.sidecar} and {self.weights})."
            )
        meta = read_json(side)
        check_format(meta, self.format, side, self.kind or self.what)
        saved_fp = meta.get("fingerprint") or {}
        meta["fingerprint"] = saved_fp
        what = f"{self.what} {directory}"
        check_fingerprint(saved_fp, expect_fingerprint, what)
        if expect_hidden_size is None and expect_fingerprint is not None:
            expect_hidden_size = expect_fingerprint.get("hidden_size")
        check_hidden_size(meta["hidden_size"], expect_hidden_size, what, saved_fp, expect_fingerprint)
        return meta, load_file(str(directory / self.weights), device=str(device))
