"""The refusal-judge interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    refused: bool
    refusal_score: float  # in [0, 1]; higher = more refusal-like


class RefusalJudge(ABC):
    name: str = "judge"

    @abstractmethod
    def judge(self, prompts: Sequence[str], responses: Sequence[str]) -> list[Verdict]:
        """One verdict per (prompt, response) pair, in order."""

    def config(self) -> dict:
        return {"name": self.name}
