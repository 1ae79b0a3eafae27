"""First-token refusal score: the model's probability of opening its response with a refusal, no generation.

The model runs here, next to the decode loop: one forward pass per batch (:func:`prompt_logits`, with
the system prompt and the intervention applied as in generation). What counts as a refusal opening and
how the probability is summed are the judge's (:mod:`aligntax.judges.first_token`), which only scores
logits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from aligntax.generation.generate import prompt_logits
from aligntax.interventions.base import Intervention
from aligntax.judges.first_token import REFUSAL_OPENINGS, refusal_mass, refusal_token_ids

if TYPE_CHECKING:
    from aligntax.models.loader import LoadedModel


def first_token_refusal_score(
    lm: LoadedModel,
    prompts: Sequence[str | list[dict[str, Any]]],
    system: str | None = None,
    intervention: Intervention | None = None,
    batch_size: int = 32,
    openings: Iterable[str] = REFUSAL_OPENINGS,
    token_ids: Sequence[int] | None = None,
    progress: bool = False,
) -> list[float]:
    """Per prompt, the probability the model's response starts with a refusal-opening token.

    ``lm`` is an ``aligntax.models.LoadedModel``; ``system`` and ``intervention`` are applied as in
    generation. ``token_ids`` overrides the ids derived from ``openings``.
    """
    if not prompts:
        return []
    ids = list(token_ids) if token_ids is not None else refusal_token_ids(lm.tokenizer, openings)
    logits = prompt_logits(
        lm, prompts, system=system, intervention=intervention, batch_size=batch_size, progress=progress
    )
    return [float(x) for x in refusal_mass(logits, ids).tolist()]
