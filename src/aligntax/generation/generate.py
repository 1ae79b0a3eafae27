"""Batched generation.

Prompts are sorted by token length so each batch wastes little padding, generated in batches with
left padding and the KV cache, and returned in the input order. Every batch runs inside the
intervention's ``attach`` context, so hooks exist only while the batch runs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm

from aligntax.generation.chat import build_messages, encode_chats, render_chat
from aligntax.interventions.base import Intervention, NoIntervention, SteerContext


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

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Generation:
    prompt: str
    response: str
    n_prompt_tokens: int
    n_tokens: int
    finish_reason: str  # "stop" or "length"


def _truncate_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    cut = min((text.find(s) for s in stops if s and s in text), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def _generate_batch(lm, texts: list[str], cfg: GenerationConfig, intervention: Intervention,
                    rows: torch.Tensor | None, strength: torch.Tensor | None, batch_seed: int | None):
    tok, model = lm.tokenizer, lm.model
    enc = encode_chats(tok, texts, lm.device)
    ctx = SteerContext(prompt_len=enc["input_ids"].shape[1], rows=rows, strength=strength)
    gen_kwargs = dict(max_new_tokens=cfg.max_new_tokens, do_sample=cfg.do_sample, use_cache=cfg.use_cache,
                      pad_token_id=tok.pad_token_id)
    if cfg.do_sample:
        gen_kwargs.update(temperature=cfg.temperature, top_p=cfg.top_p)
        if batch_seed is not None:
            torch.manual_seed(batch_seed)
    else:
        gen_kwargs.update(temperature=None, top_p=None, top_k=None)
    with torch.no_grad(), intervention.attach(model, ctx):
        out = model.generate(**enc, **gen_kwargs)
    new = out[:, enc["input_ids"].shape[1]:]
    eos_ids = model.generation_config.eos_token_id
    eos_ids = set(eos_ids if isinstance(eos_ids, list) else [eos_ids]) | {tok.eos_token_id}
    results = []
    for i, row in enumerate(new.tolist()):
        n = len(row)
        finish = "length"
        for j, t in enumerate(row):
            if t in eos_ids:
                n, finish = j, "stop"
                break
        text = tok.decode(row[:n], skip_special_tokens=True)
        text, stopped = _truncate_at_stop(text, cfg.stop)
        results.append(Generation(
            prompt=texts[i], response=text.strip(), n_prompt_tokens=int(enc["attention_mask"][i].sum()),
            n_tokens=n, finish_reason="stop" if stopped else finish))
    return results


def iter_generate(lm, prompts: Sequence[str | list[dict]], cfg: GenerationConfig | None = None,
                  intervention: Intervention | None = None, steer_rows: Sequence[bool] | None = None,
                  strengths: Sequence[float] | None = None, progress: bool = True,
                  desc: str = "generate") -> Iterator[tuple[list[int], list[Generation]]]:
    """Yield (input indices, generations) batch by batch, so callers can save as they go."""
    cfg = cfg or GenerationConfig()
    intervention = intervention or NoIntervention()
    lm.require_chat_template()
    texts = [render_chat(lm.tokenizer, build_messages(p, cfg.system, intervention)) for p in prompts]
    lengths = [len(lm.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    order = sorted(range(len(texts)), key=lambda i: (-lengths[i], i))
    bar = tqdm(total=len(texts), desc=desc, disable=not progress, unit="prompt")
    try:
        for b, start in enumerate(range(0, len(order), cfg.batch_size)):
            idx = order[start:start + cfg.batch_size]
            rows = torch.tensor([bool(steer_rows[i]) for i in idx]) if steer_rows is not None else None
            strength = torch.tensor([float(strengths[i]) for i in idx]) if strengths is not None else None
            seed = None if cfg.seed is None else cfg.seed + b
            gens = _generate_batch(lm, [texts[i] for i in idx], cfg, intervention, rows, strength, seed)
            for i, g in zip(idx, gens, strict=True):
                g.prompt = prompts[i] if isinstance(prompts[i], str) else texts[i]
            bar.update(len(idx))
            yield idx, gens
    finally:
        bar.close()


def generate(lm, prompts: Sequence[str | list[dict]], cfg: GenerationConfig | None = None,
             intervention: Intervention | None = None, **kwargs) -> list[Generation]:
    """Generate a response for every prompt; returns them in input order."""
    out: list[Generation | None] = [None] * len(prompts)
    for idx, gens in iter_generate(lm, prompts, cfg, intervention, **kwargs):
        for i, g in zip(idx, gens, strict=True):
            out[i] = g
    return out  # type: ignore[return-value]


def prompt_logits(lm, prompts: Sequence[str | list[dict]], system: str | None = None,
                  intervention: Intervention | None = None, batch_size: int = 32,
                  progress: bool = False) -> torch.Tensor:
    """Next-token logits (float32, [N, vocab]) at the response start of each chat prompt, no generation."""
    intervention = intervention or NoIntervention()
    texts = [render_chat(lm.tokenizer, build_messages(p, system, intervention)) for p in prompts]
    return text_logits(lm, texts, intervention, batch_size, progress)


def text_logits(lm, texts: Sequence[str], intervention: Intervention | None = None, batch_size: int = 32,
                progress: bool = False, desc: str = "score") -> torch.Tensor:
    """Next-token logits (float32, [N, vocab], on the CPU, in input order) after each already rendered
    text: batches as given (left padding, position ids from the mask), the intervention attached to
    every forward with a :class:`SteerContext`, as in generation."""
    from aligntax.activations.capture import position_ids_from_mask

    intervention = intervention or NoIntervention()
    out = []
    for start in tqdm(range(0, len(texts), batch_size), disable=not progress, desc=desc):
        enc = encode_chats(lm.tokenizer, list(texts[start:start + batch_size]), lm.device)
        mask = enc["attention_mask"]
        ctx = SteerContext(prompt_len=enc["input_ids"].shape[1])
        with torch.no_grad(), intervention.attach(lm.model, ctx):
            logits = lm.model(input_ids=enc["input_ids"], attention_mask=mask,
                              position_ids=position_ids_from_mask(mask), use_cache=False,
                              logits_to_keep=1).logits[:, -1, :]
        out.append(logits.float().cpu())
    return torch.cat(out) if out else torch.empty(0)
