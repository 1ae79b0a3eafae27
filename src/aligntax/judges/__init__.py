"""Refusal judges: keyword, prefix, classifier (default), llm; plus first-token refusal scoring of logits."""

from typing import TYPE_CHECKING, Any

from aligntax.judges.base import RefusalJudge, Verdict
from aligntax.judges.first_token import (
    REFUSAL_OPENINGS,
    refusal_mass,
    refusal_token_ids,
)
from aligntax.judges.io import judge_jsonl, read_pairs
from aligntax.judges.keyword import (
    DEFAULT_REFUSAL_PHRASES,
    DEFAULT_REFUSAL_PREFIXES,
    GCG_TEST_PREFIXES,
    KeywordJudge,
    PrefixJudge,
)
from aligntax.judges.registry import DEFAULT_JUDGE, available_judges, get_judge

if TYPE_CHECKING:  # loaded on first use (below), for type checkers
    from aligntax.judges.classifier import ClassifierJudge
    from aligntax.judges.llm import LLMJudge


def __getattr__(name: str) -> Any:
    # The classifier and LLM judges import torch/httpx machinery; load them on first use.
    if name == "ClassifierJudge":
        from aligntax.judges.classifier import ClassifierJudge

        return ClassifierJudge
    if name == "LLMJudge":
        from aligntax.judges.llm import LLMJudge

        return LLMJudge
    raise AttributeError(f"module 'aligntax.judges' has no attribute {name!r}")


__all__ = [
    "DEFAULT_JUDGE",
    "DEFAULT_REFUSAL_PHRASES",
    "DEFAULT_REFUSAL_PREFIXES",
    "GCG_TEST_PREFIXES",
    "REFUSAL_OPENINGS",
    "ClassifierJudge",
    "KeywordJudge",
    "LLMJudge",
    "PrefixJudge",
    "RefusalJudge",
    "Verdict",
    "available_judges",
    "get_judge",
    "judge_jsonl",
    "read_pairs",
    "refusal_mass",
    "refusal_token_ids",
]
