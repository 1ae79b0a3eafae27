"""Batched generation.

Prompts are sorted by token length so each batch wastes little padding, generated in batches with
left padding and the KV cache, and returned in the input order. Every batch runs inside the
intervention's ``attach`` context, so hooks exist only while the batch runs.

Greedy decoding with the KV cache runs its own loop (:func:`greedy_decode`):

- rows leave the batch, its KV cache and the steering context as soon as they finish
  (``model.generate`` keeps finished rows to the end of the batch);
- the prefix every prompt of a batch shares (the chat template's system turn, a system prompt) is
  computed once and the prefill holds only the rest of each prompt (:func:`prefix_cache`), when the
  intervention is :attr:`~aligntax.interventions.base.Intervention.prefix_free`.

In float32 it gives ``model.generate``'s tokens (tested); in bf16 a shrinking batch and the prefix
computed apart round differently, as another batch composition would. Sampling, decoding without
the KV cache, and models whose generation config changes greedy choices (repetition penalty, banned
words, ...) use ``model.generate``; ``GenerationConfig(drop_finished=False)`` asks for it too, and
``share_prefix=False`` keeps the own loop's prefill whole. The server's engine runs the same loop
(:func:`decode_loop`) with its own per-request token choice and stopping rules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from aligntax.generation.batching import GENERATION_BATCH_TOKENS, length_order_batches
from aligntax.generation.chat import build_messages, render_chat
from aligntax.generation.prefix import prefix_cache, prefixed_inputs, unpadded, usable_prefix
from aligntax.hooks import pad_left, with_cache
from aligntax.interventions.base import Intervention, NoIntervention, SteerContext
from aligntax.interventions.kernels import merge_stats

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from aligntax.models.loader import LoadedModel

# choose(logits [rows, vocab], alive rows) -> next tokens [rows]; ended(alive, tokens, step) -> bool [rows]
Choose = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Ended = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


@dataclass
class GenerationConfig:
    max_new_tokens: int = 64
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    batch_size: int = 32
    system: str | None = None
    use_cache: bool = True
    stop: list[str] = field(default_factory=list)
    drop_finished: bool = True  # greedy + KV cache: own loop, finished rows leave the batch (greedy_decode)
    share_prefix: bool = True  # own loop: the prefix all prompts of a batch share is computed once
    # a batch also holds at most this many padded prompt tokens (None: no limit); see generation.batching
    max_batch_tokens: int | None = GENERATION_BATCH_TOKENS

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Generation:
    prompt: str
    response: str
    n_prompt_tokens: int
    n_tokens: int
    finish_reason: str  # "stop" or "length"


def truncate_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    cut = min((text.find(s) for s in stops if s and s in text), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


# Generation-config fields that make ``model.generate``'s greedy choice differ from the plain argmax
# (with their neutral values): a model that sets one is decoded by ``model.generate``.
_GREEDY_CHANGERS = {
    "repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0),
    "bad_words_ids": (None,),
    "min_length": (None, 0),
    "min_new_tokens": (None, 0),
    "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "sequence_bias": (None,),
    "exponential_decay_length_penalty": (None,),
    "encoder_repetition_penalty": (None, 1.0),
    "renormalize_logits": (None, False),
    "watermarking_config": (None,),
}


def plain_greedy(model: PreTrainedModel) -> bool:
    """Whether ``model.generate``'s greedy decoding is the plain argmax for this model, so
    :func:`greedy_decode` gives the same tokens; also False for encoder-decoder models."""
    if getattr(model.config, "is_encoder_decoder", False):
        return False
    gc = getattr(model, "generation_config", None)
    return all(getattr(gc, k, None) in neutral for k, neutral in _GREEDY_CHANGERS.items())


def eos_token_ids(lm: LoadedModel) -> set[int]:
    """Token ids that end a response: the generation config's eos ids and the tokenizer's."""
    ids = getattr(lm.model.generation_config, "eos_token_id", None)
    ids = set(ids if isinstance(ids, list) else [ids]) | {lm.tokenizer.eos_token_id}
    return {int(i) for i in ids if i is not None}


@torch.no_grad()
def decode_loop(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
    eos_ids: set[int],
    ctx: SteerContext | None = None,
    cache: Any = None,
    cached: int = 0,
    choose: Choose | None = None,
    ended: Ended | None = None,
    out: list[list[int]] | None = None,
) -> list[list[int]]:
    """Decoding with the KV cache, left padding and position ids from the mask, as ``model.generate``
    does, except that a row leaves the batch as soon as it ends: its KV cache, mask and steering-context
    rows (:meth:`SteerContext.keep_rows`) go with it, so the steps that follow run on the rows still
    answering. ``cache`` may already hold ``cached`` tokens of every row (a shared prefix,
    :func:`prefix_cache`); ``input_ids`` then continue it.

    Each step, ``choose(logits, alive)`` picks the next token of every row still in the batch
    (``logits`` ``[rows, vocab]``; ``alive`` the rows' original indices, on the CPU; default: the argmax,
    greedy decoding) and ``ended(alive, tokens, step)`` says which of them end with that token (bool
    ``[rows]``; default: an end token of ``eos_ids``). Returns each row's new tokens, its last one
    included (as ``generate`` would, without the padding after it): appended to ``out`` when given (one
    list per row, so that ``ended`` can read them, this step's token already in), else to new lists."""
    from transformers import DynamicCache

    batch = input_ids.shape[0]
    if out is None:
        out = [[] for _ in range(batch)]
    elif len(out) != batch:
        raise ValueError(f"out holds {len(out)} token lists for a batch of {batch} rows.")
    if max_new_tokens <= 0 or batch == 0:
        return out
    cache = DynamicCache(config=model.config) if cache is None else cache
    if ended is None:
        eos = torch.tensor(sorted(eos_ids), device=input_ids.device)

        def ended(alive: torch.Tensor, tokens: torch.Tensor, step: int) -> torch.Tensor:
            return torch.isin(tokens, eos)

    alive = torch.arange(batch)  # original row of each row still in the batch
    mask, pos = prefixed_inputs(attention_mask, cached)
    ids = input_ids
    for step in range(max_new_tokens):
        logits = model(
            **with_cache(
                model,
                cache,
                input_ids=ids,
                attention_mask=mask,
                position_ids=pos,
                use_cache=True,
                logits_to_keep=1,
            )
        ).logits[:, -1, :]
        nxt = logits.argmax(-1) if choose is None else choose(logits, alive)
        for row, token in zip(alive.tolist(), nxt.tolist(), strict=True):
            out[row].append(token)
        running = ~ended(alive, nxt, step).to(nxt.device)
        if step == max_new_tokens - 1:
            break
        if not bool(running.all()):
            keep = running.nonzero().view(-1)
            if keep.numel() == 0:
                break
            keep_cpu = keep.cpu()
            cache.batch_select_indices(keep_cpu)
            alive, nxt, mask, pos = alive[keep_cpu], nxt[keep], mask[keep], pos[keep]
            if ctx is not None:
                ctx.keep_rows(keep_cpu)
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        ids, pos = nxt[:, None], pos[:, -1:] + 1
    return out


def greedy_decode(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
    eos_ids: set[int],
    ctx: SteerContext | None = None,
    cache: Any = None,
    cached: int = 0,
) -> list[list[int]]:
    """Greedy :func:`decode_loop`: the argmax each step, a row ending at an end token of ``eos_ids``."""
    return decode_loop(model, input_ids, attention_mask, max_new_tokens, eos_ids, ctx, cache, cached)


def decode_batch(
    model: PreTrainedModel,
    enc: dict[str, Any],
    intervention: Intervention,
    max_new_tokens: int,
    eos_ids: set[int],
    rows: torch.Tensor | None = None,
    strength: torch.Tensor | None = None,
    share_prefix: bool = True,
    choose: Choose | None = None,
    ended: Ended | None = None,
    out: list[list[int]] | None = None,
) -> tuple[list[list[int]], SteerContext]:
    """One left-padded batch (``input_ids``, ``attention_mask``) through :func:`decode_loop` (greedy
    unless ``choose`` / ``ended`` say otherwise; ``out`` as there) inside the intervention's
    ``attach``: the prefix its rows share is computed first, once and without the hooks, when the
    intervention is prefix-free (and ``share_prefix``). Returns each row's new tokens and the batch's
    :class:`SteerContext` (its stats)."""
    ids, mask, cache = enc["input_ids"], enc["attention_mask"], None
    prefix = usable_prefix(
        model, unpadded(ids, mask), share_prefix and intervention.prefix_free, max_new_tokens
    )
    if prefix:
        cache, ids, mask = prefix_cache(model, ids, mask, prefix)
    ctx = SteerContext(prompt_len=ids.shape[1], rows=rows, strength=strength)
    with torch.no_grad(), intervention.attach(model, ctx):
        return decode_loop(
            model, ids, mask, max_new_tokens, eos_ids, ctx, cache, prefix, choose, ended, out
        ), ctx


def _generate_batch(
    lm: LoadedModel,
    texts: list[str],
    seqs: list[list[int]],
    cfg: GenerationConfig,
    intervention: Intervention,
    rows: torch.Tensor | None,
    strength: torch.Tensor | None,
    batch_seed: int | None,
    stats: dict[str, Any] | None = None,
) -> list[Generation]:
    """One batch of already tokenised prompts (``seqs``: each text's ids, tokenised once per run)."""
    tok, model = lm.tokenizer, lm.model
    ids, mask = pad_left(seqs, tok.pad_token_id if tok.pad_token_id is not None else 0, lm.device)
    enc = {"input_ids": ids, "attention_mask": mask}
    eos_ids = eos_token_ids(lm)
    if cfg.drop_finished and cfg.use_cache and not cfg.do_sample and plain_greedy(model):
        new, ctx = decode_batch(
            model, enc, intervention, cfg.max_new_tokens, eos_ids, rows, strength, cfg.share_prefix
        )
    else:
        gen_kwargs = dict(
            max_new_tokens=cfg.max_new_tokens,
            do_sample=cfg.do_sample,
            use_cache=cfg.use_cache,
            pad_token_id=tok.pad_token_id,
        )
        if cfg.do_sample:
            gen_kwargs.update(temperature=cfg.temperature, top_p=cfg.top_p)
            if batch_seed is not None:
                torch.manual_seed(batch_seed)
        else:
            gen_kwargs.update(temperature=None, top_p=None, top_k=None)
        ctx = SteerContext(prompt_len=enc["input_ids"].shape[1], rows=rows, strength=strength)
        with torch.no_grad(), intervention.attach(model, ctx):
            new = model.generate(**enc, **gen_kwargs)[:, enc["input_ids"].shape[1] :].tolist()
    if stats is not None:
        merge_stats(stats, ctx.stats)
    results = []
    for i, row in enumerate(new):
        n = len(row)
        finish = "length"
        for j, t in enumerate(row):
            if t in eos_ids:
                n, finish = j, "stop"
                break
        text = tok.decode(row[:n], skip_special_tokens=True)
        text, stopped = truncate_at_stop(text, cfg.stop)
        results.append(
            Generation(
                prompt=texts[i],
                response=text.strip(),
                n_prompt_tokens=len(seqs[i]),
                n_tokens=n,
                finish_reason="stop" if stopped else finish,
            )
        )
    return results


def iter_generate(
    lm: LoadedModel,
    prompts: Sequence[str | list[dict[str, Any]]],
    cfg: GenerationConfig | None = None,
    intervention: Intervention | None = None,
    steer_rows: Sequence[bool] | None = None,
    strengths: Sequence[float] | None = None,
    progress: bool = True,
    desc: str = "generate",
    stats: dict[str, Any] | None = None,
) -> Iterator[tuple[list[int], list[Generation]]]:
    """Yield (input indices, generations) batch by batch, so callers can save as they go. Each prompt is
    rendered and tokenised once. ``stats``: a dict the steering statistics of every batch are merged
    into (:func:`aligntax.interventions.kernels.merge_stats`; e.g. ELS energy before/after per layer)."""
    cfg = cfg or GenerationConfig()
    intervention = intervention or NoIntervention()
    lm.require_chat_template()
    texts = [render_chat(lm.tokenizer, build_messages(p, cfg.system, intervention)) for p in prompts]
    seqs = lm.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    lengths = [len(x) for x in seqs]
    bar = tqdm(total=len(texts), desc=desc, disable=not progress, unit="prompt")
    try:
        for b, idx in enumerate(length_order_batches(lengths, cfg.batch_size, cfg.max_batch_tokens)):
            rows = torch.tensor([bool(steer_rows[i]) for i in idx]) if steer_rows is not None else None
            strength = torch.tensor([float(strengths[i]) for i in idx]) if strengths is not None else None
            seed = None if cfg.seed is None else cfg.seed + b
            gens = _generate_batch(
                lm,
                [texts[i] for i in idx],
                [seqs[i] for i in idx],
                cfg,
                intervention,
                rows,
                strength,
                seed,
                stats,
            )
            for i, g in zip(idx, gens, strict=True):
                p = prompts[i]
                g.prompt = p if isinstance(p, str) else texts[i]
            bar.update(len(idx))
            yield idx, gens
    finally:
        bar.close()


def generate(
    lm: LoadedModel,
    prompts: Sequence[str | list[dict[str, Any]]],
    cfg: GenerationConfig | None = None,
    intervention: Intervention | None = None,
    **kwargs: Any,
) -> list[Generation]:
    """Generate a response for every prompt; returns them in input order."""
    out: list[Generation | None] = [None] * len(prompts)
    for idx, gens in iter_generate(lm, prompts, cfg, intervention, **kwargs):
        for i, g in zip(idx, gens, strict=True):
            out[i] = g
    return out  # type: ignore[return-value]


def prompt_logits(
    lm: LoadedModel,
    prompts: Sequence[str | list[dict[str, Any]]],
    system: str | None = None,
    intervention: Intervention | None = None,
    batch_size: int = 32,
    progress: bool = False,
) -> torch.Tensor:
    """Next-token logits (float32, [N, vocab]) at the response start of each chat prompt, no generation."""
    intervention = intervention or NoIntervention()
    texts = [render_chat(lm.tokenizer, build_messages(p, system, intervention)) for p in prompts]
    return text_logits(lm, texts, intervention, batch_size, progress)


def text_logits(
    lm: LoadedModel,
    texts: Sequence[str],
    intervention: Intervention | None = None,
    batch_size: int = 32,
    progress: bool = False,
    desc: str = "score",
    share_prefix: bool = True,
) -> torch.Tensor:
    """Next-token logits (float32, [N, vocab], on the CPU, in input order) after each already rendered
    text: batches as given (left padding, position ids from the mask), the intervention attached to
    every forward with a :class:`SteerContext`, as in generation. The prefix all texts share (a
    persona, few-shot turns, the template's system turn) is computed once and each batch feeds only the
    rest (:mod:`aligntax.generation.prefix`), when the intervention is prefix-free and
    ``share_prefix``."""
    from aligntax.generation.prefix import repeated, run_prefix
    from aligntax.hooks import pad_left, position_ids_from_mask

    intervention = intervention or NoIntervention()
    model, tok = lm.model, lm.tokenizer
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    prefix = usable_prefix(model, ids, share_prefix and intervention.prefix_free)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    out = []
    with torch.no_grad():
        prefix_kv = (
            run_prefix(model, torch.tensor([ids[0][:prefix]], device=lm.device), 1) if prefix else None
        )
        for start in tqdm(range(0, len(ids), batch_size), disable=not progress, desc=desc):
            inp, mask = pad_left([x[prefix:] for x in ids[start : start + batch_size]], pad, lm.device)
            if prefix:
                mask, pos = prefixed_inputs(mask, prefix)
                extra = with_cache(model, repeated(prefix_kv, inp.shape[0]), use_cache=True)
            else:
                pos, extra = position_ids_from_mask(mask), dict(use_cache=False)
            ctx = SteerContext(prompt_len=inp.shape[1])
            with intervention.attach(model, ctx):
                logits = model(
                    input_ids=inp, attention_mask=mask, position_ids=pos, logits_to_keep=1, **extra
                ).logits[:, -1, :]
            out.append(logits.float().cpu())
    return torch.cat(out) if out else torch.empty(0)
