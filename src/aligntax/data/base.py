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
