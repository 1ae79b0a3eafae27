"""Parsing of model specs: Hub id, local directory, local .gguf file, or ``embedded:NAME``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from aligntax.errors import ModelSpecError

DEFAULT_MODEL = "embedded:qwen2.5-coder-0.5b-instruct"
SpecKind = Literal["embedded", "dir", "gguf", "hub"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$")


@dataclass(frozen=True)
class ModelSpec:
    raw: str
    kind: SpecKind
    value: str  # embedded name, path, or hub id


def parse_spec(spec: str) -> ModelSpec:
    from aligntax.models.embedded import EMBEDDED_MODELS, embedded_name

    spec = (spec or "").strip()
    if not spec:
        raise ModelSpecError("Empty model spec. Use e.g. " + DEFAULT_MODEL)
    if spec.startswith("embedded:"):
        return ModelSpec(spec, "embedded", embedded_name(spec.split(":", 1)[1]))
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelSpecError(f"GGUF file not found: {path}")
        return ModelSpec(spec, "gguf", str(path.resolve()))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSpecError(f"Directory {path} has no config.json: not a transformers model folder")
        return ModelSpec(spec, "dir", str(path.resolve()))
    if spec.startswith((".", "/", "~")) or path.exists():
        raise ModelSpecError(f"Model path not found or not usable: {spec}")
    if _HUB_ID.match(spec):
        return ModelSpec(spec, "hub", spec)
    raise ModelSpecError(
        f"Cannot understand model spec '{spec}'. Use a Hugging Face Hub id (org/name), a local model "
        f"directory, a .gguf file, or one of: " + ", ".join(f"embedded:{n}" for n in EMBEDDED_MODELS)
    )
