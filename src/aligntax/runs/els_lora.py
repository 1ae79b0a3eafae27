"""ELS distilled into a LoRA adapter: ``aligntax els distill``.

A small LoRA on the attention and MLP of the blocks ELS steers (and ``before`` blocks before each) is
trained so that the state leaving the last steered block matches, teacher-forced:

- on benign prompts (the ELS folder's benign training prompts and the benign halves of the contrast
  pairs), the state *with the ELS intervention applied* (its tuned setting: row energy decision,
  horizon, and with ``benign_target="els"`` its harm gate; with ``"label"`` the gate is left out on
  these rows, whose label already says benign), over the prompt tokens and the first ``horizon``
  tokens of the ELS-steered answer;
- on harmful prompts (the harmful twin of every benign contrast half kept, then the folder's harmful
  training prompts and the harm gate's extra harmful prompts, ``limit_harmful`` of these), the
  *unsteered* state over the prompt and the model's answer, weighted ``preserve_weight``; with
  ``harmful_target="refusal"`` the state with the folder's refusal vector added at the last steered
  block (``refusal_coeff`` times), over the prompt and the answer the model gives so (the per-query
  target of ACTOR: refusal removed where the label says benign, added where it says harmful);
- on everyday rows (``retain``: the folder's harmless instructions, and GSM8K training questions asked
  as the reasoning check asks them, ``limit_retain`` in all), the *unsteered* state over the prompt and
  the model's own answer, weighted ``retain_weight``; and the model's answers themselves: with
  ``retain_ce`` the cross-entropy of the adapted model's next-token distribution against the model's own
  greedy answer tokens (the full forward past the adapted blocks), so what the model answers where it
  never refused stays its answer, not only its state.

The state loss is the squared error divided by the median squared norm of the preserved targets. Each
row's target and the input of the first adapted block are captured in one forward (the teacher's hooks
on); training runs the adapted blocks from that input (it does not depend on the adapter), and the
blocks after them only for the everyday rows' answer term.

The work runs in phases, each a function returning a small record: :func:`distill_prompts`
(:class:`DistillPrompts`), :func:`distill_answers` (:class:`DistillAnswers`), :func:`distill_targets`
(:class:`DistillTargets`), :func:`train_adapter` (:class:`TrainedAdapter`), :func:`write_adapter`.
The folder is a standard peft adapter (``adapter_config.json``, ``adapter_model.safetensors``) plus
``els_lora.json`` (:mod:`aligntax.interventions.lora`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from aligntax.errors import AligntaxError
from aligntax.runfolder import (
    LOCK_NAME,
    WHERE_NAME,
    atomic_files,
    check_settings,
    is_temp,
    run_lock,
    write_json_atomic,
)

__all__ = [
    "BENIGN_TARGETS",
    "DEFAULT_MODULES",
    "HARMFUL_TARGETS",
    "RETAIN_SOURCES",
    "DistillAnswers",
    "DistillConfig",
    "DistillPrompts",
    "DistillTargets",
    "TrainedAdapter",
    "distill_answers",
    "distill_els_lora",
    "distill_prompts",
    "distill_targets",
    "train_adapter",
    "write_adapter",
]

BENIGN_TARGETS = ("els", "label")
HARMFUL_TARGETS = ("unsteered", "refusal")
DEFAULT_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# where everyday rows come from: the ELS folder's harmless instructions, and GSM8K training questions
# (the rows before the reasoning check's validation split), asked as the reasoning check asks them
RETAIN_SOURCES = ("harmless", "gsm8k-train")


@dataclass
class DistillConfig:
    """Settings of ``aligntax els distill``."""

    steer: str = "runs/els"  # the ELS folder (aligntax els train; its tuned setting from els sweep)
    out: str = "runs/els-lora"
    model: str | None = None  # default: the model the ELS folder was trained on
    layers: list[int] | None = (
        None  # adapted blocks (default: each steered block and ``before`` blocks before it)
    )
    before: int = 2
    modules: list[str] = field(default_factory=lambda: list(DEFAULT_MODULES))
    rank: int = 8
    alpha: float | None = None  # default 2 x rank
    epochs: int = 6
    lr: float = 1e-3
    batch_size: int = 16
    limit_benign: int | None = 300  # benign training prompts (sampled), plus the benign contrast halves
    limit_harmful: int | None = 300  # harmful prompts besides the contrast halves (which are all kept)
    pairs: list[str] = field(default_factory=lambda: ["contrast-pairs"])
    limit_pairs: int | None = None  # contrast pairs kept (both halves; None: all), sampled by pair
    preserve_weight: float = 3.0  # weight of the harmful rows' targets
    benign_target: str = (
        "label"  # benign rows: "els" (ELS's own decision, harm gate included) or "label" (no gate)
    )
    harmful_target: str = "refusal"  # harmful rows: "unsteered" or "refusal" (the refusal vector added)
    refusal_coeff: float = 1.0  # the refusal vector's strength for harmful_target="refusal"
    answer_tokens: int = 16  # benign: ELS-steered answer tokens when the ELS setting has no horizon
    harmful_answer_tokens: int = 32  # harmful rows' answers (unsteered or with the refusal vector)
    retain: list[str] = field(default_factory=lambda: list(RETAIN_SOURCES))  # everyday rows' sources
    limit_retain: int | None = 300  # everyday rows in all (split evenly over the sources)
    retain_weight: float = 3.0  # weight of their state term, as the harmful rows' preserve weight
    retain_ce: float = 1.0  # weight of their answer term (0: states only)
    retain_answer_tokens: int = 48  # their answers' tokens (the known-answer check's length)
    loss_passes: bool = True  # score the loss before and after training (two passes without gradients)
    els: dict = field(default_factory=dict)  # ELS options over the folder's tuned setting (eta=, gate=, ...)
    dtype: str = "bf16"
    seed: int = 0
    progress: bool = True


@dataclass
class DistillPrompts:
    """The rows of a distillation: prompt items (``.prompt``, ``.source``, ``.id``) per kind."""

    benign: list
    harmful: list
    retain: list


@dataclass
class DistillAnswers:
    """The teacher's answer text per row (benign: ELS-steered, ``horizon`` tokens; harmful: unsteered or
    with the refusal vector; everyday: the model's own), and how many unsteered answers were generated
    here (not taken from the label run of ``els train``)."""

    benign: list[str]
    harmful: list[str]
    retain: list[str]
    generated: int


@dataclass
class Row:
    """One training row: the input of the first adapted block ``x`` and the target leaving the last one
    ``y`` (``[len, d]`` each, the prompt and the answer), its weight and kind; everyday rows also carry
    their token ids and prompt length (the answer term's labels)."""

    x: torch.Tensor
    y: torch.Tensor
    weight: float
    kind: str
    ids: list[int] | None = None
    plen: int = 0


@dataclass
class DistillTargets:
    rows: list[Row]
    norm2: float  # median squared norm of the preserved targets (the state loss's unit)
    tokens: int
    benign_steered: int  # rows ELS itself steers (its decision), for the summary
    harmful_steered: int


@dataclass
class TrainedAdapter:
    model: nn.Module  # the peft model (adapted blocks)
    names: list[str]
    alpha: float
    before: dict
    after: dict
    history: list[dict]
    seconds: dict = field(default_factory=dict)  # per phase of the run, for the summary


@dataclass
class Blocks:
    """Where the adapter goes: the adapted blocks, the target block (the last steered one), the steered
    blocks and the ELS answer horizon."""

    layers: list[int]
    target: int
    steered: list[int]
    horizon: int

    @property
    def first(self) -> int:
        return self.layers[0]


# ------------------------------------------------------------------------------------------ checks
def _check_config(cfg: DistillConfig) -> None:
    weights = (cfg.preserve_weight, cfg.retain_weight, cfg.retain_ce)
    if not (
        cfg.rank >= 1
        and cfg.epochs >= 1
        and cfg.batch_size >= 1
        and cfg.lr > 0
        and all(w >= 0 and math.isfinite(w) for w in weights)
    ):
        raise AligntaxError(
            "rank, epochs and batch_size must be at least 1, lr positive and preserve_weight, retain_weight "
            "and retain_ce finite and >= 0."
        )
    if cfg.benign_target not in BENIGN_TARGETS:
        raise AligntaxError(
            f"benign_target must be one of {', '.join(BENIGN_TARGETS)}; got {cfg.benign_target!r}."
        )
    if cfg.harmful_target not in HARMFUL_TARGETS:
        raise AligntaxError(
            f"harmful_target must be one of {', '.join(HARMFUL_TARGETS)}; got {cfg.harmful_target!r}."
        )
    unknown = sorted(set(cfg.retain) - set(RETAIN_SOURCES))
    if unknown:
        raise AligntaxError(f"retain takes {', '.join(RETAIN_SOURCES)}; got {', '.join(unknown)}.")
    if cfg.limit_pairs is not None and cfg.limit_pairs < 0:
        raise AligntaxError("limit_pairs must be >= 0 (or None: every pair).")
    steer = Path(cfg.steer)
    if cfg.harmful_target == "refusal" and not (steer / "vectors" / "vectors.safetensors").is_file():
        raise AligntaxError(
            f"harmful_target 'refusal' needs the refusal vectors of {steer}/vectors "
            "(written by `aligntax els train`)."
        )


def _blocks(cfg: DistillConfig, els, n_blocks: int) -> Blocks:
    steered = sorted(els.models)
    target = max(steered)
    layers = (
        sorted({int(x) for x in cfg.layers})
        if cfg.layers
        else sorted({s - k for s in steered for k in range(cfg.before + 1) if s - k >= 0})
    )
    if not layers or not 0 <= layers[0] or layers[-1] >= n_blocks:
        raise AligntaxError(f"Adapter blocks {layers} do not exist: the model has {n_blocks} blocks.")
    if layers[-1] > target:
        raise AligntaxError(
            f"Adapter blocks {layers} go past the last steered block {target}, whose output is "
            "the target: an adapter there cannot change it."
        )
    if layers[0] > steered[0]:
        raise AligntaxError(
            f"The first adapter block ({layers[0]}) comes after the first steered block ({steered[0]}); "
            "the adapter must start at or before it."
        )
    horizon = els.horizon if els.horizon is not None else int(cfg.answer_tokens)
    return Blocks(layers, target, steered, horizon)


# ------------------------------------------------------------------------------------------ phase 1: rows
def _sampled(items: list, limit: int | None, seed: int) -> list:
    from aligntax.runs.eval import sampled

    return sampled(items, limit, seed)


def _dedupe(items: list, seen: set) -> list:
    out = []
    for it in items:
        key = it.prompt.strip()
        if key not in seen:
            seen.add(key)
            out.append(it)
    return out


def _pairs(cfg: DistillConfig) -> list:
    """The contrast pairs' prompts, ``limit_pairs`` pairs sampled (both halves of each)."""
    from aligntax.runs.eval import load_prompt_sets

    pairs = load_prompt_sets(cfg.pairs) if cfg.pairs else []
    if cfg.limit_pairs is None:
        return pairs
    keys = sorted({_pair_key(it) for it in pairs})
    keep = set(_sampled(keys, cfg.limit_pairs, cfg.seed))
    return [it for it in pairs if _pair_key(it) in keep]


def _pair_key(item) -> str:
    """Which pair a contrast prompt belongs to: its category (``pair-001``), else its id without the
    ``-benign`` / ``-harmful`` ending."""
    import re

    return item.category or re.sub(r"-(benign|harmful)$", "", item.id)


def _retain_items(cfg: DistillConfig, tcfg) -> list:
    """Everyday rows: ``limit_retain`` in all, split evenly over ``cfg.retain``'s sources."""
    from aligntax.data.base import PromptItem
    from aligntax.metrics.knowns import GSM8K_INSTRUCTION, GSM8K_VAL_FROM
    from aligntax.runs.eval import load_prompt_sets

    if not cfg.retain or (cfg.limit_retain is not None and cfg.limit_retain <= 0):
        return []
    share = None if cfg.limit_retain is None else -(-cfg.limit_retain // len(cfg.retain))
    out: list = []
    for source in cfg.retain:
        if source == "harmless":
            items = load_prompt_sets(tcfg.harmless, tcfg.limit_harmless)
        else:  # GSM8K train, before the validation tail, asked as the reasoning check asks
            items = [
                PromptItem(it.id, f"{it.prompt}\n\n{GSM8K_INSTRUCTION}", "benign", it.source)
                for it in load_prompt_sets(["gsm8k-train"])
                if int(it.id.rsplit(":", 1)[1]) < GSM8K_VAL_FROM
            ]
        out += _sampled(items, share, cfg.seed)
    return out[: cfg.limit_retain] if cfg.limit_retain is not None else out


def distill_prompts(cfg: DistillConfig) -> DistillPrompts:
    """The benign, the harmful and the everyday rows of a distillation (see the module docstring),
    without repeats."""
    from aligntax.config import load_config
    from aligntax.runs.els_train import ELSTrainConfig, gate_items, training_items

    path = Path(cfg.steer) / "train_config.json"
    if not path.is_file():
        raise AligntaxError(f"{cfg.steer} has no train_config.json: give an `aligntax els train` folder.")
    tcfg = load_config(ELSTrainConfig, path)
    benign, harmful = training_items(tcfg)
    pairs = _pairs(cfg)
    seen: set = set()
    b = _dedupe(
        _sampled(benign, cfg.limit_benign, cfg.seed) + [it for it in pairs if it.label == "benign"], seen
    )
    twins = _dedupe([it for it in pairs if it.label == "harmful"], seen)
    h = _dedupe(harmful, seen)
    limit = cfg.limit_harmful
    if limit is None or len(h) < limit:
        extra = [it for it in gate_items(tcfg)[2] if it.label == "harmful"] if tcfg.gate else []
        extra = _dedupe(extra, set(seen))
        need = None if limit is None else limit - len(h)
        h += _dedupe(_sampled(extra, need, cfg.seed), seen)
    retain = _dedupe(_retain_items(cfg, tcfg), seen)
    return DistillPrompts(b, twins + (h[:limit] if limit is not None else h), retain)


# ------------------------------------------------------------------------------------------ phase 2: answers
def _generate(lm, items: list, n_tokens: int, iv, desc: str, progress: bool) -> list[str]:
    from aligntax.generation import GenerationConfig, generate

    if not items:
        return []
    config = GenerationConfig(max_new_tokens=n_tokens, batch_size=64)
    return [
        g.response
        for g in generate(lm, [it.prompt for it in items], config, iv, progress=progress, desc=desc)
    ]


def distill_answers(
    cfg: DistillConfig, lm, rows: DistillPrompts, teachers: dict, horizon: int
) -> DistillAnswers:
    """The teachers' answers (see :class:`DistillAnswers`). The label run of ``els train`` supplies the
    unsteered answers it has: for harmful rows with unsteered targets, and for benign rows the ELS teacher
    leaves exactly unsteered (its decision holds them back, so its answer is the unsteered one); the rest
    are generated."""
    from aligntax.activations.decisions import unsteered_rows
    from aligntax.runs.jsonl import read_jsonl

    labels = Path(cfg.steer) / "labels" / "samples.jsonl"
    known = {(r["source"], r["id"]): r["response"] for r in read_jsonl(labels)} if labels.is_file() else {}
    held = unsteered_rows(teachers["benign"], lm, [it.prompt for it in rows.benign]) or [False] * len(
        rows.benign
    )
    copied = {
        i
        for i, (it, h) in enumerate(zip(rows.benign, held, strict=True))
        if h and (it.source, it.id) in known
    }
    todo = [it for i, it in enumerate(rows.benign) if i not in copied]
    new = iter(_generate(lm, todo, horizon, teachers["benign"], "distill: steered answers", cfg.progress))
    benign = [known[(it.source, it.id)] if i in copied else next(new) for i, it in enumerate(rows.benign)]
    generated = 0  # unsteered answers generated here (not taken from the label run)
    if teachers["harmful"] is not None:
        harmful = _generate(
            lm,
            rows.harmful,
            cfg.harmful_answer_tokens,
            teachers["harmful"],
            "distill: refusal answers",
            cfg.progress,
        )
    else:
        missing = [it for it in rows.harmful if (it.source, it.id) not in known]
        answers = _generate(
            lm, missing, cfg.harmful_answer_tokens, None, "distill: unsteered answers", cfg.progress
        )
        got = {**known, **{(it.source, it.id): a for it, a in zip(missing, answers, strict=True)}}
        harmful = [got[(it.source, it.id)] for it in rows.harmful]
        generated += len(missing)
    retain = _generate(
        lm, rows.retain, cfg.retain_answer_tokens, None, "distill: everyday answers", cfg.progress
    )
    return DistillAnswers(benign, harmful, retain, generated + len(retain))


# ------------------------------------------------------------------------------------------ phase 3: targets
class _Pass(nn.Module):
    """A decoder block left out of training: hands its input on (its output is never read)."""

    def __init__(self, attention_type=None):
        super().__init__()
        if attention_type is not None:
            self.attention_type = attention_type

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class _Stop(Exception):
    def __init__(self, output):
        self.output = output


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def _capture(
    lm, seqs: list[list[int]], plens: list[int], blocks: Blocks, iv, progress: bool, desc: str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence (prompt + answer token ids, prompt length): the states entering the first adapted
    block (before any edit there) and leaving the target block, with ``iv``'s hooks on (None:
    unsteered), one teacher-forced forward per batch (left-padded), ``[len, d]`` each."""
    from tqdm.auto import tqdm

    from aligntax.hooks import position_ids_from_mask
    from aligntax.interventions.base import SteerContext
    from aligntax.models.layers import decoder_layers

    layers = decoder_layers(lm.model)
    pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    out: list = [None] * len(seqs)
    got: dict = {}

    def pre(module, args, kwargs):
        got["x"] = (args[0] if args else kwargs["hidden_states"]).detach()

    def post(module, args, kwargs, output):
        raise _Stop(_first(output).detach())

    for start in tqdm(range(0, len(order), 16), disable=not progress, desc=desc):
        idx = order[start : start + 16]
        p = max(plens[i] for i in idx)
        a = max(len(seqs[i]) - plens[i] for i in idx)
        ids = torch.full((len(idx), p + a), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(idx):
            s, n = seqs[i], plens[i]
            ids[r, p - n : p - n + len(s)] = torch.tensor(s)
            mask[r, p - n : p - n + len(s)] = 1
        ids, mask = ids.to(lm.device), mask.to(lm.device)
        h_pre = layers[blocks.first].register_forward_pre_hook(pre, with_kwargs=True, prepend=True)
        h_post = layers[blocks.target].register_forward_hook(post, with_kwargs=True)
        try:
            with torch.no_grad():
                if iv is None:
                    stop = _run(lm.model, ids, mask, position_ids_from_mask(mask))
                else:
                    with iv.attach(lm.model, SteerContext(prompt_len=p)):
                        stop = _run(lm.model, ids, mask, position_ids_from_mask(mask))
        finally:
            h_pre.remove()
            h_post.remove()
        for r, i in enumerate(idx):
            lo, hi = p - plens[i], p - plens[i] + len(seqs[i])
            out[i] = (got["x"][r, lo:hi].cpu().clone(), stop[r, lo:hi].cpu().clone())
    return out


def _run(model, ids, mask, pos):
    try:
        model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
    except _Stop as s:
        return s.output
    raise AligntaxError("The forward did not reach the target block.")


def distill_targets(
    cfg: DistillConfig, lm, rows: DistillPrompts, answers: DistillAnswers, teachers: dict, blocks: Blocks
) -> DistillTargets:
    """Each row's captured input and target (see :class:`Row`), teacher hooks on as its kind says."""
    from aligntax.activations.capture import chat_ids
    from aligntax.activations.decisions import row_info

    def seqs(items, texts, cut=None):
        if not items:
            return [], []
        s, p = chat_ids(lm, [it.prompt for it in items], responses=texts)
        return ([x[: n + cut] for x, n in zip(s, p, strict=True)] if cut is not None else s), p

    b_seqs, b_plens = seqs(rows.benign, answers.benign, blocks.horizon)
    h_seqs, h_plens = seqs(rows.harmful, answers.harmful)
    r_seqs, r_plens = seqs(rows.retain, answers.retain)
    bar = cfg.progress
    b = _capture(lm, b_seqs, b_plens, blocks, teachers["benign"], bar, "distill: steered states")
    h = _capture(lm, h_seqs, h_plens, blocks, teachers["harmful"], bar, "distill: harmful states")
    r = _capture(lm, r_seqs, r_plens, blocks, None, bar, "distill: everyday states")
    preserved = [y for _, y in h + r]
    norm2 = float(torch.cat([y.float().norm(dim=-1) for y in preserved]).median()) ** 2
    out = [Row(x, y, 1.0, "benign") for x, y in b]
    out += [Row(x, y, float(cfg.preserve_weight), "harmful") for x, y in h]
    out += [
        Row(x, y, float(cfg.retain_weight), "retain", ids, plen)
        for (x, y), ids, plen in zip(r, r_seqs, r_plens, strict=True)
    ]
    info_b = row_info(teachers["benign"], lm, [it.prompt for it in rows.benign]) or []
    info_h = row_info(teachers["els"], lm, [it.prompt for it in rows.harmful]) or []
    return DistillTargets(
        out,
        norm2,
        sum(len(s) for s in b_seqs + h_seqs + r_seqs),
        sum(bool(i["steered"]) for i in info_b) if info_b else len(rows.benign),
        sum(bool(i["steered"]) for i in info_h) if info_h else len(rows.harmful),
    )


# ------------------------------------------------------------------------------------------ phase 4: training
def _train_model(model: nn.Module, first: int, last: int, tail: bool) -> nn.Module:
    """A copy of ``model``'s structure sharing its weights (never copied), whose blocks before ``first``
    (and after ``last``, unless ``tail``) are :class:`_Pass`."""
    from aligntax.models.layers import decoder_layers

    blocks = decoder_layers(model)
    memo: dict = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    memo.update(
        {
            id(b): _Pass(getattr(b, "attention_type", None))
            for i, b in enumerate(blocks)
            if i < first or (i > last and not tail)
        }
    )
    if tail:
        memo.update({id(b): b for i, b in enumerate(blocks) if i > last})
    return copy.deepcopy(model, memo).eval()


def _forward_from(model: nn.Module, blocks: Blocks, x, mask, pos, to_end: bool):
    """From ``x`` entering the first adapted block: the state leaving the target block, and with
    ``to_end`` the final normed hidden state too (``(state, final or None)``)."""
    from aligntax.hooks import replace_hidden_in_args
    from aligntax.models.layers import decoder_layers

    layers = decoder_layers(model)
    got: dict = {}

    def pre(module, args, kwargs):
        return replace_hidden_in_args(args, kwargs, x)

    def post(module, args, kwargs, output):
        got["state"] = _first(output)
        if not to_end:
            raise _Stop(got["state"])

    h1 = layers[blocks.first].register_forward_pre_hook(pre, with_kwargs=True, prepend=True)
    h2 = layers[blocks.target].register_forward_hook(post, with_kwargs=True)
    body = getattr(model, "model", model)  # the decoder stack without the LM head
    try:
        try:
            final = body(inputs_embeds=x, attention_mask=mask, position_ids=pos, use_cache=False)
        except _Stop:
            return got["state"], None
    finally:
        h1.remove()
        h2.remove()
    return got["state"], final.last_hidden_state


def _batch(rows: list[Row], device, dtype):
    """Left-padded ``(x, target, mask, position ids)``."""
    width = max(len(r.x) for r in rows)
    d = rows[0].x.shape[-1]
    x = torch.zeros(len(rows), width, d, dtype=dtype)
    y = torch.zeros(len(rows), width, d, dtype=torch.float32)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r.x)
        x[i, width - n :] = r.x.to(dtype)
        y[i, width - n :] = r.y.float()
        mask[i, width - n :] = 1
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    return x.to(device), y.to(device), mask.to(device), pos.to(device)


def _answer_ce(lm, rows: list[Row], final: torch.Tensor, width: int) -> torch.Tensor:
    """Per row, the mean cross-entropy of the model's next-token distributions over its answer against
    the answer's tokens (rows without an answer: 0)."""
    head = lm.model.get_output_embeddings()
    out = []
    for i, r in enumerate(rows):
        if r.ids is None or len(r.ids) <= r.plen:
            out.append(final.new_zeros((), dtype=torch.float32))
            continue
        off = width - len(r.ids)
        states = final[i, off + r.plen - 1 : off + len(r.ids) - 1]  # each predicts the next answer token
        logits = head(states).float()
        labels = torch.tensor(r.ids[r.plen :], device=logits.device)
        out.append(nn.functional.cross_entropy(logits, labels))
    return torch.stack(out)


def _batches(rows: list[Row], size: int, rng: random.Random | None) -> list[list[int]]:
    """Batches of similar length (little padding), in random order when ``rng`` is given."""
    order = list(range(len(rows)))
    if rng is not None:
        rng.shuffle(order)
    chunks = [order[i : i + size * 8] for i in range(0, len(order), size * 8)]
    out = []
    for c in chunks:
        c = sorted(c, key=lambda i: len(rows[i].x))
        out += [c[i : i + size] for i in range(0, len(c), size)]
    if rng is not None:
        rng.shuffle(out)
    return out


def _epoch(lm, model, targets: DistillTargets, cfg: DistillConfig, blocks: Blocks, opt, rng) -> dict:
    """One pass over the rows (training when ``opt`` is given); mean loss per kind (the everyday rows'
    answer term as ``retain_ce``)."""
    from tqdm.auto import tqdm

    rows = targets.rows
    dtype = next(p for p in lm.model.parameters()).dtype
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    train = opt is not None
    for idx in tqdm(
        _batches(rows, cfg.batch_size, rng if train else None),
        disable=not cfg.progress,
        desc="distill: train" if train else "distill: eval",
    ):
        batch = [rows[i] for i in idx]
        x, y, mask, pos = _batch(batch, lm.device, dtype)
        w = torch.tensor([r.weight for r in batch], device=lm.device)
        to_end = cfg.retain_ce > 0 and any(r.ids is not None for r in batch)
        with torch.set_grad_enabled(train):
            h, final = _forward_from(model, blocks, x, mask, pos, to_end)
            err = ((h.float() - y) ** 2).sum(-1) / targets.norm2  # [B, T]
            per_row = (err * mask).sum(-1) / mask.sum(-1)
            loss = (w * per_row).sum() / len(idx)
            ce = None
            if final is not None:
                ce = _answer_ce(lm, batch, final, x.shape[1])
                loss = loss + cfg.retain_ce * ce.sum() / len(idx)
        if train:
            opt.zero_grad()
            loss.backward()
            opt.step()
        row_err = per_row.detach().cpu().tolist()
        row_ce = None if ce is None else ce.detach().cpu().tolist()
        for j, r in enumerate(batch):
            sums[r.kind] = sums.get(r.kind, 0.0) + row_err[j]
            counts[r.kind] = counts.get(r.kind, 0) + 1
            if row_ce is not None and r.ids is not None:
                sums["retain_ce"] = sums.get("retain_ce", 0.0) + row_ce[j]
                counts["retain_ce"] = counts.get("retain_ce", 0) + 1
    kinds = ("benign", "harmful", "retain", "retain_ce")
    return {k: round(sums[k] / counts[k], 6) if counts.get(k) else None for k in kinds}


def train_adapter(cfg: DistillConfig, lm, targets: DistillTargets, blocks: Blocks) -> TrainedAdapter:
    """Fit the LoRA on the adapted blocks (the blocks after them run, frozen, for the answer term)."""
    from peft import LoraConfig, get_peft_model

    from aligntax.models.layers import decoder_layers

    torch.manual_seed(cfg.seed)
    tail = cfg.retain_ce > 0 and any(r.ids is not None for r in targets.rows)
    model = _train_model(lm.model, blocks.first, blocks.target, tail)
    frozen = [p for p in lm.model.parameters() if p.requires_grad]
    for p in frozen:  # the shared weights take no gradient (restored below)
        p.requires_grad_(False)
    try:
        prefix = _blocks_prefix(model)
        names = [
            f"{prefix}.{i}.{path}"
            for i in blocks.layers
            for path in _module_paths(decoder_layers(model)[i], cfg.modules)
        ]
        alpha = float(cfg.alpha) if cfg.alpha is not None else 2.0 * cfg.rank
        peft_model = get_peft_model(
            model,
            LoraConfig(
                r=cfg.rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=names, task_type="CAUSAL_LM"
            ),
        )
        params = [p for p in peft_model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
        rng = random.Random(cfg.seed)
        before = _epoch(lm, model, targets, cfg, blocks, None, rng) if cfg.loss_passes else {}
        history = [
            {"epoch": e + 1, **_epoch(lm, model, targets, cfg, blocks, opt, rng)} for e in range(cfg.epochs)
        ]
        after = _epoch(lm, model, targets, cfg, blocks, None, rng) if cfg.loss_passes else {}
    finally:
        for p in frozen:
            p.requires_grad_(True)
    return TrainedAdapter(peft_model, names, alpha, before, after, history)


# ------------------------------------------------------------------------------------------ phase 5: folder
def _sha256(path: Path) -> str | None:
    if not path.is_file():
        return None
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _count(items) -> dict:
    out: dict[str, int] = {}
    for it in items:
        out[it.source] = out.get(it.source, 0) + 1
    return out


def write_adapter(
    cfg: DistillConfig,
    lm,
    els,
    blocks: Blocks,
    rows: DistillPrompts,
    answers: DistillAnswers,
    targets: DistillTargets,
    trained: TrainedAdapter,
    seconds: float,
) -> dict:
    """The peft folder and its sidecar ``els_lora.json``; returns the sidecar."""
    from aligntax.interventions.lora import FORMAT, SIDECAR, ElsLora

    out, steer = Path(cfg.out), Path(cfg.steer)
    with atomic_files(out) as tmp:  # each file renamed into place whole; the sidecar last
        trained.model.save_pretrained(str(tmp), safe_serialization=True)
        for stray in tmp.glob("*.bin"):  # only safetensors ship
            stray.unlink()
    hyper = {k: v for k, v in asdict(cfg).items() if k not in ("steer", "out", "model", "els", "progress")}
    meta = {
        "format": FORMAT,
        "model": lm.spec,  # the model it was distilled on: the default of every command that takes the folder
        "fingerprint": dict(lm.fingerprint or {}),
        "layers": blocks.layers,
        "target_block": blocks.target,
        "steered_layers": blocks.steered,
        "modules": trained.names,
        "horizon": blocks.horizon,
        "hyper": {**hyper, "alpha": trained.alpha},
        "source": {
            "path": str(steer),
            "els": els.config(),
            "energy_sha256": _sha256(steer / "energy.safetensors"),
            "gate_sha256": _sha256(steer / "gate.safetensors"),
        },
        "data": {
            "benign": len(rows.benign),
            "harmful": len(rows.harmful),
            "retain": len(rows.retain),
            "pairs": cfg.pairs,
            "benign_sources": _count(rows.benign),
            "harmful_sources": _count(rows.harmful),
            "retain_sources": _count(rows.retain),
            "benign_steered_by_els": targets.benign_steered,
            "harmful_steered_by_els": targets.harmful_steered,
            "answers_generated": answers.generated,
            "tokens": targets.tokens,
        },
        "loss": {
            "norm2": targets.norm2,
            "before": trained.before,
            "after": trained.after,
            "epochs": trained.history,
        },
        "seconds": round(seconds, 1),
        "phase_seconds": trained.seconds,
        "config": asdict(cfg),
    }
    write_json_atomic(out / SIDECAR, meta)
    ElsLora.load(out, lm)  # what was written loads for this model
    return meta


# ------------------------------------------------------------------------------------------ the run
def _teachers(cfg: DistillConfig, lm) -> dict:
    """The interventions whose states the rows learn: ``els`` (as tuned), ``benign`` (ELS, without its
    harm gate for label targets), ``harmful`` (the refusal vector added; None: unsteered)."""
    from aligntax.interventions.registry import make_intervention

    steer = str(cfg.steer)
    els = make_intervention("els", lm, path=steer, **cfg.els)
    benign = (
        els
        if cfg.benign_target == "els"
        else make_intervention("els", lm, path=steer, **{**cfg.els, "gate": "none"})
    )
    harmful = None
    if cfg.harmful_target == "refusal":
        harmful = make_intervention(
            "refusal-add",
            lm,
            path=str(Path(steer) / "vectors"),
            layers=[max(els.models)],
            coeff=float(cfg.refusal_coeff),
        )
    return {"els": els, "benign": benign, "harmful": harmful}


def _model_for(cfg: DistillConfig):
    from aligntax.models import load_model

    model = cfg.model
    if model is None:
        tc = Path(cfg.steer) / "train_config.json"
        model = json.loads(tc.read_text()).get("model") if tc.is_file() else None
    if not model:
        raise AligntaxError("Give --model: the ELS folder names no model.")
    return load_model(model, dtype=cfg.dtype)


def distill_els_lora(
    cfg: DistillConfig,
    lm=None,
    benign: list | None = None,
    harmful: list | None = None,
    retain: list | None = None,
) -> dict:
    """Train the adapter (see the module docstring), write it to ``cfg.out`` and return the summary
    written to its ``els_lora.json``. ``benign`` / ``harmful`` (and ``retain``, default none): prompt items
    (``.prompt``, ``.source``, ``.id``) instead of :func:`distill_prompts`. A rerun into the same folder
    resumes: a finished adapter with the same settings is returned as it is, other settings are refused,
    and a distillation killed before it finished starts again."""
    out = Path(cfg.out)
    ours = {DISTILL_HEADER, LOCK_NAME, WHERE_NAME, f"{LOCK_NAME}.guard"}
    if (
        out.exists()
        and not (out / DISTILL_HEADER).is_file()
        and any(p.name not in ours and not is_temp(p.name) for p in out.iterdir())  # a killed write's temp
    ):
        raise AligntaxError(f"{out} exists and is not empty; choose a new folder for the adapter.")
    _check_config(cfg)
    with run_lock(out):  # one writer per adapter folder
        return _distill(cfg, out, lm, benign, harmful, retain)


# The settings the adapter depends on: all but where it is written and the progress bars. A folder
# holding a finished adapter (its sidecar) refuses others; a distillation killed before its sidecar was
# written starts again (every phase is in memory), and one that finished is not redone.
DISTILL_HEADER = "distill_config.json"
_DISTILL_KEYS = tuple(f for f in DistillConfig.__dataclass_fields__ if f not in ("out", "progress"))


def _distill(cfg: DistillConfig, out: Path, lm, benign, harmful, retain) -> dict:
    from aligntax.interventions.lora import SIDECAR
    from aligntax.models.layers import decoder_layers

    done = (out / SIDECAR).is_file()
    check_settings(out, DISTILL_HEADER, asdict(cfg), _DISTILL_KEYS, done, "distilled adapter")
    if done:
        return json.loads((out / SIDECAR).read_text())
    t0 = time.perf_counter()
    lm = lm if lm is not None else _model_for(cfg)
    teachers = _teachers(cfg, lm)
    blocks = _blocks(cfg, teachers["els"], len(decoder_layers(lm.model)))
    if benign is None or harmful is None:
        rows = distill_prompts(cfg)
    else:
        rows = DistillPrompts(list(benign), list(harmful), list(retain or []))
    if not rows.benign or not rows.harmful:
        raise AligntaxError("Distillation needs benign and harmful prompts.")
    laps = {"prompts": time.perf_counter() - t0}

    def lap(name: str) -> None:
        laps[name] = time.perf_counter() - t0 - sum(laps.values())

    answers = distill_answers(cfg, lm, rows, teachers, blocks.horizon)
    lap("answers")
    targets = distill_targets(cfg, lm, rows, answers, teachers, blocks)
    lap("targets")
    trained = train_adapter(cfg, lm, targets, blocks)
    lap("training")
    trained.seconds = {k: round(v, 1) for k, v in laps.items()}
    return write_adapter(
        cfg, lm, teachers["els"], blocks, rows, answers, targets, trained, time.perf_counter() - t0
    )


def _blocks_prefix(model: nn.Module) -> str:
    from aligntax.models.layers import decoder_layers

    blocks = decoder_layers(model)
    for name, mod in model.named_modules():
        if mod is blocks:
            return name
    raise AligntaxError("Cannot name the decoder blocks of this model.")


def _module_paths(block: nn.Module, wanted: list[str]) -> list[str]:
    """The paths inside ``block`` of its Linear layers whose last name is in ``wanted``."""
    paths = [
        name
        for name, m in block.named_modules()
        if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in wanted
    ]
    found = {p.rsplit(".", 1)[-1] for p in paths}
    missing = [w for w in wanted if w not in found]
    if missing:
        have = sorted(
            {name.rsplit(".", 1)[-1] for name, m in block.named_modules() if isinstance(m, nn.Linear)}
        )
        raise AligntaxError(f"The blocks have no Linear layers named {missing}; they have {have}.")
    return paths
