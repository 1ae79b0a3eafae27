"""A selected steering setting as a folder's one file: ``selection.json``.

``aligntax demo`` (and ``aligntax els sweep`` for its folder) choose one setting on validation data: plain
ELS, the els-lora adapter, or ELS on top of the adapter (``els-compose``). The folder that holds the choice
records it in ``selection.json`` (format :data:`FORMAT`): the intervention's name, its options, the model
it was made for and what the choice was made on. Every command that takes ``--steer DIR`` applies exactly
that setting when ``DIR`` holds one (options given beside it override the recorded ones), and so does
:func:`aligntax.load_intervention`.

Folder options (``path``, ``adapter``) are written relative to the selection's folder, so a folder moved or
copied elsewhere still applies the same setting.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aligntax.errors import AligntaxError

__all__ = ["FORMAT", "FOLDER_KEYS", "SELECTION", "is_selection_dir", "read_selection", "selection_record"]

FORMAT = "aligntax.selection/1"
SELECTION = "selection.json"
FOLDER_KEYS = ("path", "adapter", "vectors")  # options that name a folder


def is_selection_dir(path: str | Path | None) -> bool:
    """Whether ``path`` is a folder holding a selected setting (``selection.json``)."""
    return path is not None and (Path(path) / SELECTION).is_file()


def selection_record(folder: str | Path, name: str, args: dict[str, Any], **meta: Any) -> dict[str, Any]:
    """The ``selection.json`` content for the setting ``name`` / ``args`` chosen in ``folder``: folder options
    made relative to ``folder`` where they lie inside it; ``meta`` (the model, what it was chosen on, the
    validation scores) kept as given."""
    root = Path(folder).resolve()
    rel = {}
    for key, value in args.items():
        if key in FOLDER_KEYS and value is not None:
            p = Path(value).resolve()
            value = str(p.relative_to(root)) if p.is_relative_to(root) else str(p)
        rel[key] = value
    return {"format": FORMAT, "intervention": name, "args": rel, **meta}


def read_selection(folder: str | Path) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """``(name, args, record)`` of the setting selected in ``folder``: folder options resolved against it."""
    folder = Path(folder)
    path = folder / SELECTION
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AligntaxError(f"{path}: cannot read the selected setting ({exc}).") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise AligntaxError(f"{path} is not a selected setting (format {FORMAT}).")
    name, args = record.get("intervention"), record.get("args")
    if not isinstance(name, str) or not isinstance(args, dict):
        raise AligntaxError(f"{path}: 'intervention' and 'args' are missing.")
    resolved = {
        k: (str(folder / v) if k in FOLDER_KEYS and isinstance(v, str) and not Path(v).is_absolute() else v)
        for k, v in args.items()
    }
    return name, resolved, record
