"""YAML config files with command-line overrides, into typed dataclasses."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, TypeVar

import yaml

from aligntax.errors import AligntaxError

T = TypeVar("T")


def load_config(cls: type[T], path: str | Path | None = None, **overrides: Any) -> T:
    """Build ``cls`` from a YAML file (optional) and overrides; overrides that are None are ignored."""
    values: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise AligntaxError(f"Config file not found: {p}")
        loaded = yaml.safe_load(p.read_text()) or {}
        if not isinstance(loaded, dict):
            raise AligntaxError(f"Config file {p} must hold a mapping of option: value")
        values.update({k.replace("-", "_"): v for k, v in loaded.items()})
    values.update({k: v for k, v in overrides.items() if v is not None})
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - known)
    if unknown:
        raise AligntaxError(f"Unknown config keys for {cls.__name__}: {', '.join(unknown)}; "
                            f"known: {', '.join(sorted(known))}")
    return cls(**values)
