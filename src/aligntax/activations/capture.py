"""Capturing the residual stream entering chosen decoder blocks.

The state entering block ``l`` is read with a forward *pre*-hook on the block (as the ELS paper does);
it equals ``hidden_states[l]`` of a forward with ``output_hidden_states=True``. Sequences are batched
with left padding and explicit position ids (``cumsum(mask) - 1``, as ``generate`` uses), so the
captured states match the ones seen during generation and do not depend on the padding.

Positions:

- ``last``: the last prompt token (the token just before the response).
- ``mean``: the mean over response tokens, or over the (unpadded) prompt tokens when there is no response.
- ``response``: every response token; the result stacks all of them (``[sum of response lengths, d]``)
  and :func:`capture_ids` also returns the row each one came from.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from aligntax.errors import AligntaxError
from aligntax.generation.batching import CAPTURE_BATCH_TOKENS, length_batches
from aligntax.hooks import hidden_from_args, pad_left, position_ids_from_mask, with_cache
from aligntax.models.layers import decoder_layers, hidden_size
from aligntax.models.layers import resolve_layers as _resolve_layers

POSITIONS = ("last", "mean", "response")


def resolve_layers(model: nn.Module, layers: int | str | Sequence[int] | None) -> list[int]:
    """Block indices of ``model`` (:func:`aligntax.models.layers.resolve_layers`)."""
    return _resolve_layers(layers, model)


def require_finite(h: torch.Tensor, layer: int) -> None:
    if not torch.isfinite(h).all():
        raise AligntaxError(f"Non-finite hidden states entering layer {layer}; the model produced NaN/inf.")


@torch.no_grad()
def capture_ids(
    model: nn.Module,
    sequences: Sequence[Sequence[int]],
    layers: int | str | Sequence[int],
    position: str = "last",
    prompt_lens: Sequence[int] | None = None,
    batch_size: int = 32,
    pad_id: int = 0,
    progress: bool = False,
    desc: str = "capture",
    max_tokens: int | None = CAPTURE_BATCH_TOKENS,
    share_prefix: bool = True,
) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """Capture from token id sequences (prompt ids, optionally followed by response ids).

    ``share_prefix``: a prefix every sequence of a batch shares is computed once (False: every forward
    holds whole sequences, for hooks that read each prompt's last token in the forward that holds it).

    ``prompt_lens[i]`` is the number of prompt tokens of sequence ``i`` (default: the whole sequence is
    the prompt). Returns ``({layer: float32 tensor [M, d]}, row_index [M])``: M is the number of
    sequences for ``last``/``mean`` and the number of response tokens for ``response``. A batch holds
    at most ``batch_size`` sequences and ``max_tokens`` padded tokens (:func:`length_batches`).
    """
    from aligntax.generation.prefix import prefix_cache, prefixed_inputs, usable_prefix

    if position not in POSITIONS:
        raise AligntaxError(f"Unknown position '{position}'; use one of {', '.join(POSITIONS)}.")
    blocks = decoder_layers(model)
    layer_ids = resolve_layers(model, layers)
    seqs = [list(map(int, s)) for s in sequences]
    plens = [len(s) for s in seqs] if prompt_lens is None else [int(p) for p in prompt_lens]
    if len(plens) != len(seqs):
        raise AligntaxError(f"{len(seqs)} sequences but {len(plens)} prompt lengths.")
    for i, (s, p) in enumerate(zip(seqs, plens, strict=True)):
        if not 1 <= p <= len(s):
            raise AligntaxError(
                f"Sequence {i}: prompt length {p} but {len(s)} tokens (need 1 <= prompt <= all)."
            )
    device = next(model.parameters()).device
    out: dict[int, list[torch.Tensor]] = {layer: [] for layer in layer_ids}
    rows: list[torch.Tensor] = []
    current: dict[int, torch.Tensor] = {}

    def make_hook(layer: int):
        def hook(module, args, kwargs):
            current[layer] = hidden_from_args(args, kwargs).detach()

        return hook

    last_layer = max(layer_ids)
    handles = [
        blocks[layer].register_forward_pre_hook(make_hook(layer), with_kwargs=True) for layer in layer_ids
    ]

    class _Stop(Exception):
        pass

    def stop_hook(module, args, kwargs):
        raise _Stop

    # Nothing after the last captured block is needed: stop the forward there.
    if last_layer + 1 < len(blocks):
        handles.append(blocks[last_layer + 1].register_forward_pre_hook(stop_hook, with_kwargs=True))

    def stopped(**kwargs) -> None:
        try:
            model(**kwargs)
        except _Stop:
            pass

    try:
        for span in tqdm(
            length_batches([len(s) for s in seqs], batch_size, max_tokens),
            disable=not progress,
            desc=desc,
            unit="batch",
        ):
            batch, bp = seqs[span.start : span.stop], plens[span.start : span.stop]
            ids, mask = pad_left(batch, pad_id, device)
            current.clear()
            # "last" reads one position per row: a prefix every row shares (chat template, system
            # prompt) is computed once and the batch's forward holds only the rest of each row
            prefix = min(usable_prefix(model, batch, position == "last"), min(bp) - 1) if share_prefix else 0
            if prefix > 0:
                cache, ids, mask = prefix_cache(model, ids, mask, prefix, forward=stopped)
                full, pos = prefixed_inputs(mask, prefix)
                kwargs = with_cache(model, cache, use_cache=True)
                batch = [s[prefix:] for s in batch]
                bp = [p - prefix for p in bp]
            else:
                full, pos, kwargs = mask, position_ids_from_mask(mask), dict(use_cache=False)
            stopped(input_ids=ids, attention_mask=full, position_ids=pos, **kwargs)
            width = ids.shape[1]
            for layer in layer_ids:
                h = current[layer].float()
                require_finite(h[mask.bool()], layer)
                picked = []
                for i, (s, p) in enumerate(zip(batch, bp, strict=True)):
                    off = width - len(s)
                    if position == "last":
                        picked.append(h[i, off + p - 1][None])
                    elif position == "mean":
                        lo, hi = (off + p, width) if p < len(s) else (off, width)
                        picked.append(h[i, lo:hi].mean(0, keepdim=True))
                    else:
                        picked.append(h[i, off + p : width])
                out[layer].append(torch.cat(picked).cpu())
            if position == "response":
                rows.append(
                    torch.cat(
                        [
                            torch.full((len(s) - p,), span.start + i, dtype=torch.long)
                            for i, (s, p) in enumerate(zip(batch, bp, strict=True))
                        ]
                    )
                )
            else:
                rows.append(torch.arange(span.start, span.stop))
    finally:
        for h in handles:
            h.remove()
    d = hidden_size(model)
    acts = {layer: (torch.cat(v) if v else torch.empty(0, d)) for layer, v in out.items()}
    return acts, (torch.cat(rows) if rows else torch.empty(0, dtype=torch.long))


def chat_ids(
    lm,
    prompts: Sequence[str | list[dict]],
    system: str | None = None,
    intervention=None,
    responses: Sequence[str] | None = None,
) -> tuple[list[list[int]], list[int]]:
    """Token ids of the chat-templated prompts (with the generation prompt), plus response ids if given.

    The response is tokenised on its own and appended, as generation would produce it after the prompt.
    """
    from aligntax.generation.chat import build_messages, render_chat

    lm.require_chat_template()
    tok = lm.tokenizer
    texts = [render_chat(tok, build_messages(p, system, intervention)) for p in prompts]
    prompt_ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    if responses is None:
        return prompt_ids, [len(p) for p in prompt_ids]
    if len(responses) != len(prompts):
        raise AligntaxError(f"{len(prompts)} prompts but {len(responses)} responses.")
    seqs = [
        p + tok(r, add_special_tokens=False)["input_ids"] for p, r in zip(prompt_ids, responses, strict=True)
    ]
    return seqs, [len(p) for p in prompt_ids]


def capture(
    lm,
    prompts: Sequence[str | list[dict]],
    layers: int | str | Sequence[int] = "all",
    position: str = "last",
    system: str | None = None,
    batch_size: int = 32,
    responses: Sequence[str] | None = None,
    progress: bool = True,
    intervention=None,
    return_index: bool = False,
    max_tokens: int | None = CAPTURE_BATCH_TOKENS,
    share_prefix: bool = True,
):
    """Residual stream entering ``layers`` of ``lm`` for chat prompts: ``{layer: float32 [N, d]}``.

    Uses the tokenizer's chat template (with ``system`` and the intervention's message changes, if any).
    For ``position='response'`` the result has one row per response token; pass ``return_index=True``
    to also get the prompt index of each row. ``max_tokens``: padded tokens per batch (:func:`capture_ids`).
    """
    if position == "response" and responses is None:
        raise AligntaxError("position='response' needs the responses.")
    seqs, plens = chat_ids(lm, prompts, system, intervention, responses)
    return capture_seqs(lm, seqs, plens, layers, position, batch_size, progress, return_index, max_tokens)


def capture_seqs(
    lm,
    seqs: Sequence[Sequence[int]],
    prompt_lens: Sequence[int],
    layers: int | str | Sequence[int] = "all",
    position: str = "last",
    batch_size: int = 32,
    progress: bool = True,
    return_index: bool = False,
    max_tokens: int | None = CAPTURE_BATCH_TOKENS,
    share_prefix: bool = True,
):
    """:func:`capture` from token ids already built (:func:`chat_ids`), in their order: batches of
    sequences of similar length, so that they carry little padding."""
    pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
    # Sort by length so batches carry little padding, then restore the input order.
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    acts, rows = capture_ids(
        lm.model,
        [seqs[i] for i in order],
        layers,
        position,
        [prompt_lens[i] for i in order],
        batch_size,
        pad,
        progress,
        max_tokens=max_tokens,
        share_prefix=share_prefix,
    )
    order_t = torch.tensor(order, dtype=torch.long)
    orig_rows = order_t[rows] if len(rows) else rows
    if position == "response":
        perm = torch.sort(orig_rows, stable=True).indices
    else:
        perm = torch.argsort(order_t)
    acts = {layer: a[perm] for layer, a in acts.items()}
    return (acts, orig_rows[perm]) if return_index else acts


def residual_norms(acts_by_layer: dict[int, torch.Tensor]) -> dict[int, float]:
    """Median L2 norm of the captured states per layer (for per-layer step scaling)."""
    return {
        int(layer): float(a.float().norm(dim=-1).median()) for layer, a in acts_by_layer.items() if len(a)
    }


def measure_residual_norms(
    lm,
    prompts: Sequence[str | list[dict]],
    layers="all",
    system: str | None = None,
    batch_size: int = 32,
    progress: bool = False,
) -> dict[int, float]:
    """Capture the last prompt token at ``layers`` and return the median norm per layer."""
    return residual_norms(capture(lm, prompts, layers, "last", system, batch_size, progress=progress))
