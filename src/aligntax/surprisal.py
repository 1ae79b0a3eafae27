"""A prompt's own surprisal under the model: how far a prompt lies from the text the model expects.

The mean negative log-likelihood (nats per token) of the user message's tokens inside the chat template,
each predicted from everything before it. Optimised jailbreak suffixes (GCG, DSN) are strings of odd
tokens a model would never write, far above any natural prompt; ELS holds such prompts back
(``max_prompt_surprisal``) because its energy models never saw anything like them (docs/RESULTS.md 3.7).

Torch only, like :mod:`aligntax.hooks`: the steering hooks call :func:`span_nll` inside a forward;
:func:`aligntax.activations.decisions.prompt_surprisal` scores prompts given as text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from aligntax.errors import AligntaxError
from aligntax.hooks import pad_left, position_ids_from_mask

__all__ = ["logprob_nll", "nearest_rank", "scored_positions", "seqs_nll", "span_nll", "template_span"]


def template_span(tokenizer: Any, system: str | None = None) -> tuple[int, int]:
    """Token counts of the chat template's text before and after the user message (the same for every
    prompt with this ``system`` prompt): the user message's tokens lie between them."""
    if not getattr(tokenizer, "chat_template", None):
        raise AligntaxError("This model's tokenizer has no chat template; the prompt surprisal needs one.")
    marker = "\x00MARK\x00"
    messages = [{"role": "system", "content": system}] if system is not None else []
    text = tokenizer.apply_chat_template(
        [*messages, {"role": "user", "content": marker}], add_generation_prompt=True, tokenize=False
    )
    head, tail = text.split(marker)
    return (
        len(tokenizer(head, add_special_tokens=False)["input_ids"]),
        len(tokenizer(tail, add_special_tokens=False)["input_ids"]),
    )


def scored_positions(prompt_len: int, span: tuple[int, int]) -> range:
    """The positions (0-based, in a prompt of ``prompt_len`` tokens) of the tokens whose NLL makes the
    prompt surprisal: after the template's first ``span[0]`` tokens (never the first token, which
    nothing predicts) and before its last ``span[1]``; at least one."""
    start = max(span[0], 1)
    return range(start, max(prompt_len - span[1], start + 1))


def logprob_nll(token_logprobs: Sequence[float | None], span: tuple[int, int]) -> float:
    """The prompt surprisal from the log-probabilities of a prompt's own tokens (``token_logprobs[p]``:
    token ``p`` given the tokens before it; ``[0]`` is None), as an engine reports them: the mean NLL
    over :func:`scored_positions`."""
    scored = [token_logprobs[p] for p in scored_positions(len(token_logprobs), span)]
    if any(v is None for v in scored):
        raise AligntaxError("The prompt surprisal needs the log-probability of every scored prompt token.")
    return -sum(float(v) for v in scored if v is not None) / len(scored)


def span_nll(
    model: nn.Module, ids: torch.Tensor, prompt_lens: torch.Tensor, span: tuple[int, int]
) -> torch.Tensor:
    """Per row of the left-padded prompts ``ids`` ``[B, T]`` (row ``r``'s prompt: its last
    ``prompt_lens[r]`` tokens), the mean NLL (float32 ``[B]``) of the tokens after the first ``span[0]``
    and before the last ``span[1]`` of its prompt, from one forward of the model without the KV cache
    (the decoder's last states, then the output layer on those positions only)."""
    b, t = ids.shape
    lens = prompt_lens.to(ids.device).long().view(-1)
    mask = (torch.arange(t, device=ids.device)[None, :] >= (t - lens)[:, None]).long()
    decoder: Any = model.get_decoder()  # type: ignore[operator]
    head: Any = model.get_output_embeddings()  # type: ignore[operator]
    if decoder is None or head is None:
        raise AligntaxError(f"{type(model).__name__}: no decoder and output layer to score the prompt with.")
    with torch.no_grad():
        hidden = decoder(
            input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), use_cache=False
        ).last_hidden_state
        # every row's scored positions in one list: (row, position of the predicted token)
        rows: list[int] = []
        cols: list[int] = []
        for r in range(b):
            scored = scored_positions(int(lens[r]), span)
            rows += [r] * len(scored)
            cols += (t - int(lens[r]) + p for p in scored)
        row_idx = torch.tensor(rows, device=ids.device)
        col_idx = torch.tensor(cols, device=ids.device)
        nll = torch.empty(len(rows), dtype=torch.float32, device=ids.device)
        for c in range(0, len(rows), _CHUNK):  # the output layer on a bounded number of positions at once
            ri, ci = row_idx[c : c + _CHUNK], col_idx[c : c + _CHUNK]
            logits = head(hidden[ri, ci - 1]).float()
            nll[c : c + _CHUNK] = torch.logsumexp(logits, dim=-1) - logits.gather(1, ids[ri, ci, None])[:, 0]
        total = torch.zeros(b, dtype=torch.float32, device=ids.device).index_add_(0, row_idx, nll)
        count = torch.zeros(b, dtype=torch.float32, device=ids.device).index_add_(
            0, row_idx, torch.ones_like(nll)
        )
    return (total / count).cpu()


# positions scored by one output-layer call (bounds the float32 logits to _CHUNK x vocabulary)
_CHUNK = 128


def seqs_nll(
    lm: Any, seqs: Sequence[Sequence[int]], span: tuple[int, int], batch_size: int = 16
) -> torch.Tensor:
    """:func:`span_nll` of each token sequence (a chat-templated prompt) of ``lm``, in order (float32
    ``[N]`` on the CPU), in left-padded batches of similar length."""
    pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out = torch.empty(len(seqs), dtype=torch.float32)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        ids, _ = pad_left([list(seqs[i]) for i in idx], pad, lm.device)
        out[idx] = span_nll(lm.model, ids, torch.tensor([len(seqs[i]) for i in idx]), span)
    return out


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` by nearest rank: one of the values (a cut-off that is one prompt's
    own surprisal)."""
    ys = sorted(values)
    if not ys:
        raise AligntaxError("No values to take a quantile of.")
    return ys[min(len(ys) - 1, max(0, round(q * (len(ys) - 1))))]
