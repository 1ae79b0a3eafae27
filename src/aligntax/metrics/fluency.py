"""Fluency of responses: perplexity of each response under a reference (normally the unsteered) model."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from aligntax.generation.chat import build_messages, render_chat

if TYPE_CHECKING:
    from aligntax.models.loader import LoadedModel


def response_nll(
    lm: LoadedModel,
    prompts: Sequence[str],
    responses: Sequence[str],
    batch_size: int = 16,
    progress: bool = False,
) -> list[tuple[float, int]]:
    """(summed negative log-likelihood, number of tokens) of each response given its chat prompt."""
    tok = lm.tokenizer
    seqs = []
    for p, r in zip(prompts, responses, strict=True):
        prompt_ids = tok(render_chat(tok, build_messages(p)), add_special_tokens=False)["input_ids"]
        resp_ids = tok(r, add_special_tokens=False)["input_ids"]
        seqs.append((prompt_ids, resp_ids))
    out: list[tuple[float, int]] = []
    pad = tok.pad_token_id
    for start in tqdm(range(0, len(seqs), batch_size), disable=not progress, desc="perplexity"):
        chunk = seqs[start : start + batch_size]
        width = max(len(p) + len(r) for p, r in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        target = torch.zeros_like(ids, dtype=torch.bool)
        for i, (p, r) in enumerate(chunk):
            n = len(p) + len(r)
            ids[i, width - n :] = torch.tensor(p + r)
            mask[i, width - n :] = 1
            target[i, width - len(r) :] = True
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = (
                lm.model(
                    input_ids=ids.to(lm.device),
                    attention_mask=mask.to(lm.device),
                    position_ids=pos.to(lm.device),
                )
                .logits.float()
                .cpu()
            )
        logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        tgt = target[:, 1:]
        for i in range(len(chunk)):
            out.append((float(-(logp[i][tgt[i]]).sum()), int(tgt[i].sum())))
    return out


def perplexity(
    lm: LoadedModel,
    prompts: Sequence[str],
    responses: Sequence[str],
    batch_size: int = 16,
    progress: bool = False,
) -> dict[str, Any]:
    """Token-weighted perplexity over all responses, and the median of per-response perplexities."""
    pairs = response_nll(lm, prompts, responses, batch_size, progress)
    tot_nll = sum(n for n, _ in pairs)
    tot_tok = sum(t for _, t in pairs)
    per = sorted(math.exp(n / t) for n, t in pairs if t > 0)
    return {
        "perplexity": math.exp(tot_nll / tot_tok) if tot_tok else float("nan"),
        "median_response_perplexity": per[len(per) // 2] if per else float("nan"),
        "n_responses": len(pairs),
        "n_tokens": tot_tok,
    }
