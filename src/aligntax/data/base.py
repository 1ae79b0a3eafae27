"""The common record every benchmark loader produces."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

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
