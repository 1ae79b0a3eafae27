"""A prompt prefix every row of a batch shares (the chat template's system turn, a persona, few-shot
turns), computed once.

With left padding the rows' prefixes sit at different columns. Here the prefix's KV cache is computed
for one row at positions 0..P-1 and repeated for every row, and the rest of each row follows it,
left-padded, with positions from the mask (so the padding between prefix and rest is skipped): every
real token attends to the same tokens at the same positions as in the whole prompt, and the prefill
holds only the rest. A sliding attention window counts columns, not positions, so it must cover the
whole sequence (:func:`prefix_fits`). Hooks must not need the prefix's states: interventions say so
with :attr:`aligntax.interventions.base.Intervention.prefix_free`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from aligntax.hooks import position_ids_from_mask, with_cache

if TYPE_CHECKING:
    from transformers import Cache, PretrainedConfig, PreTrainedModel


def common_prefix_len(seqs: Sequence[Sequence[int]]) -> int:
    """How many leading tokens all sequences share, leaving each at least one token of its own."""
    if not seqs:
        return 0
    limit = min(len(s) for s in seqs) - 1
    first = seqs[0]
    for s in seqs[1:]:
        k = 0
        while k < limit and s[k] == first[k]:
            k += 1
        limit = k
    return max(limit, 0)


def unpadded(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """The token ids of each row of a left-padded batch, without the padding."""
    width = input_ids.shape[1]
    return [input_ids[i, width - n :].tolist() for i, n in enumerate(attention_mask.sum(1).tolist())]


def usable_prefix(
    model: PreTrainedModel, seqs: Sequence[Sequence[int]], prefix_free: bool, new_tokens: int = 0
) -> int:
    """How many leading tokens of ``seqs`` to compute once, apart (:func:`common_prefix_len`): 0 when
    the hooks at work need the prefix's states (``prefix_free`` False) or the model's attention window
    does not cover the sequences plus ``new_tokens`` (:func:`prefix_fits`)."""
    if not seqs or not prefix_free or not prefix_fits(model, max(len(x) for x in seqs), new_tokens):
        return 0
    return common_prefix_len(seqs)


def attention_window(config: PretrainedConfig) -> int | None:
    """The smallest sliding attention window of a model (None: every layer attends to all tokens)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        sliding = any("sliding" in str(t) for t in types)
    else:
        sliding = bool(getattr(config, "use_sliding_window", True))
    return int(window) if window and sliding else None


def prefix_fits(model: PreTrainedModel, width: int, max_new_tokens: int) -> bool:
    """Whether a shared prefix may be cached apart from the rest of the prompts (:func:`prefix_cache`):
    the padding between them shifts KV columns against positions, so a sliding attention window
    (which counts columns) must cover the whole sequence."""
    window = attention_window(model.config)
    return window is None or width + max_new_tokens <= window


def split_prefix(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, prefix: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A left-padded batch whose rows share their first ``prefix`` tokens, split into the prefix
    (``[1, prefix]``) and the rest of each row, left-padded (``suffix_ids``, ``suffix_mask``)."""
    lens = attention_mask.sum(1)
    width = input_ids.shape[1]
    rest = int(lens.max()) - prefix
    start = width - int(lens[0])
    cols = torch.arange(rest, device=input_ids.device)[None]
    suffix_mask = (cols >= rest - (lens - prefix)[:, None]).to(attention_mask.dtype)
    return input_ids[0:1, start : start + prefix], input_ids[:, width - rest :], suffix_mask


def run_prefix(
    model: PreTrainedModel, prefix_ids: torch.Tensor, rows: int, forward: Callable[..., Any] | None = None
) -> Cache:
    """The KV cache of a prefix every row shares: computed once (one row), then repeated for ``rows``
    rows. ``forward(**kwargs)`` runs the model (default: ``model(**kwargs)``)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    (forward or model)(
        **with_cache(
            model,
            cache,
            input_ids=prefix_ids,
            use_cache=True,
            logits_to_keep=1,
            position_ids=torch.arange(prefix_ids.shape[1], device=prefix_ids.device)[None],
        )
    )
    cache.batch_repeat_interleave(rows)
    return cache


@torch.no_grad()
def prefix_cache(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prefix: int,
    forward: Callable[..., Any] | None = None,
) -> tuple[Cache, torch.Tensor, torch.Tensor]:
    """Split a left-padded batch whose rows share their first ``prefix`` tokens: the KV cache of the
    prefix, computed once (one row) and repeated for every row, and the rest of each row, left-padded
    (``(cache, suffix_ids, suffix_mask)``). The prefix keeps positions 0..prefix-1 and the rest follows
    it (positions from the mask, so the padding between them is skipped): the same attention inputs
    as the whole prompts, at a fraction of the prefill. ``forward`` as in :func:`run_prefix`."""
    prefix_ids, suffix_ids, suffix_mask = split_prefix(input_ids, attention_mask, prefix)
    return run_prefix(model, prefix_ids, input_ids.shape[0], forward), suffix_ids, suffix_mask


def repeated(prefix_kv: Cache, rows: int) -> Cache:
    """A copy of a one-row prefix cache (:func:`run_prefix` with ``rows=1``) repeated for ``rows`` rows."""
    cache = copy.deepcopy(prefix_kv)
    cache.batch_repeat_interleave(rows)
    return cache


def prefixed_inputs(rest_mask: torch.Tensor, prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(attention_mask, position_ids)`` for a forward of the rest of each row after a cached prefix of
    ``prefix`` tokens: the mask covers prefix and rest, the positions the rest only."""
    full = torch.cat([rest_mask.new_ones(rest_mask.shape[0], prefix), rest_mask], dim=1)
    return full, position_ids_from_mask(full)[:, prefix:]
