"""Batches under a row cap and a token budget.

On a CPU a batch of long prompts runs slower per token than several smaller ones (the activations
leave the caches), while short prompts and decoding gain from many rows. So a batch holds at most
``max_rows`` sequences and at most ``max_tokens`` padded tokens (rows times its longest sequence):
many rows of short prompts, fewer of long ones. ``bench/batch_size.py`` measures both limits.
"""

from __future__ import annotations

from collections.abc import Sequence

from aligntax.errors import AligntaxError

# padded prompt tokens per batch: capture (prefill only) and generation (prefill, then decoding, which
# gains from rows); see bench/batch_size.py
CAPTURE_BATCH_TOKENS = 2048
GENERATION_BATCH_TOKENS = 8192


def length_batches(lengths: Sequence[int], max_rows: int, max_tokens: int | None = None) -> list[range]:
    """Consecutive spans of ``lengths`` (in their order; sort longest first for little padding), each
    with at most ``max_rows`` items and, unless ``max_tokens`` is None, at most ``max_tokens`` padded
    tokens. A sequence longer than the budget gets a batch of its own."""
    if max_rows < 1:
        raise AligntaxError(f"batch size must be at least 1; got {max_rows}.")
    if max_tokens is not None and max_tokens < 1:
        raise AligntaxError(f"max_tokens must be at least 1 or None; got {max_tokens}.")
    spans, start, longest = [], 0, 0  # the open batch: lengths[start:i], its longest item
    for i, n in enumerate(map(int, lengths)):
        rows = i - start
        if rows and (
            rows >= max_rows or (max_tokens is not None and (rows + 1) * max(longest, n) > max_tokens)
        ):
            spans.append(range(start, i))
            start, longest = i, 0
        longest = max(longest, n)
    if start < len(lengths):
        spans.append(range(start, len(lengths)))
    return spans


def length_order_batches(
    lengths: Sequence[int], max_rows: int, max_tokens: int | None = None
) -> list[list[int]]:
    """The batches generation forms over prompts of these token ``lengths``: indices sorted longest first
    (ties by index), cut by :func:`length_batches`. The cut is greedy from each batch's start, so the
    prompts of any whole batches of this plan, given again in plan order, are batched the same way: a
    resumed run that generates only the batches still missing rows generates them as an uninterrupted
    run did."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    spans = length_batches([lengths[i] for i in order], max_rows, max_tokens)
    return [order[s.start : s.stop] for s in spans]
