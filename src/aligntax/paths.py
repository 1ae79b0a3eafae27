"""Where aligntax keeps its caches."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root cache directory; override with ``ALIGNTAX_CACHE``."""
    root = os.environ.get("ALIGNTAX_CACHE")
    path = Path(root) if root else Path.home() / ".cache" / "aligntax"
    path.mkdir(parents=True, exist_ok=True)
    return path


def shared_data_dir() -> Path | None:
    """The benchmark data folder, from ``ALIGNTAX_DATA`` or a ``shared/data`` beside the checkout."""
    env = os.environ.get("ALIGNTAX_DATA")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    for parent in here.parents:
        cand = parent.parent / "shared" / "data"
        if cand.is_dir():
            return cand
    cand = Path.cwd().parent / "shared" / "data"
    return cand if cand.is_dir() else None


def fetched_data_dir() -> Path:
    """Where ``aligntax data fetch`` stores benchmark files: ``data/`` under the cache directory, laid out
    like the shared data folder (``refusal/...``). Not created here."""
    root = os.environ.get("ALIGNTAX_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "aligntax") / "data"
