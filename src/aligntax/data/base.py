"""The common record every benchmark loader produces."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from aligntax.errors import DataError

Label = Literal["benign", "harmful"]
LABELS: tuple[str, ...] = ("benign", "harmful")


@dataclass(frozen=True)
class PromptItem:
    id: str
    prompt: str
    label: Label
    source: str
    category: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


# Spellings accepted for a label cell or argument (compared after strip + lower-case).
LABEL_ALIASES: dict[str, Label] = {
    "benign": "benign",
    "harmful": "harmful",
    "safe": "benign",
    "unsafe": "harmful",
    "harmless": "benign",
}


def normalize_label(value: object) -> Label | None:
    """Map a label cell or argument to ``"benign"``/``"harmful"``; ``None`` if it is not one of them."""
    if not isinstance(value, str):
        return None
    return LABEL_ALIASES.get(value.strip().lower())


def label_argument(label: str | None) -> Label | None:
    """A ``label=`` argument as ``"benign"``/``"harmful"`` (``None`` stays ``None``); DataError otherwise."""
    if label is None:
        return None
    value = normalize_label(label)
    if value is None:
        raise DataError(f"label must be 'benign' or 'harmful', got {label!r}")
    return value
