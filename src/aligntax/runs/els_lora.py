"""ELS distilled into a LoRA adapter: ``aligntax els distill``.

A small LoRA on the attention and MLP of the blocks ELS steers (and ``before`` blocks before each) is
trained so that the state leaving the last steered block matches, teacher-forced:

- on benign prompts (the ELS folder's benign training prompts and the benign halves of the contrast
  pairs), the state *with the ELS intervention applied* (its tuned setting: row energy decision,
  horizon, and with ``benign_target="els"`` its harm gate; with ``"label"`` the gate is left out on
  these rows, whose label already says benign), over the prompt tokens and the first ``horizon``
  tokens of the ELS-steered answer;
- on harmful prompts (every harmful half of the contrast pairs, the twin of each benign half, then
  the folder's harmful training prompts and the harm gate's extra harmful prompts, ``limit_harmful``
  of these), the *unsteered* state, over the prompt and the model's whole (unsteered) answer,
  weighted ``preserve_weight`` times; with ``harmful_target="refusal"`` the state with the folder's
  refusal vector added at the last steered block (``refusal_coeff`` times), over the prompt and the
  answer the model gives so (the per-query target of ACTOR: refusal removed where the label says
  benign, added where it says harmful);
- on everyday instructions (the folder's harmless prompts, ``limit_retain`` of them), the *unsteered*
  state over the prompt and the model's answer, weighted ``retain_weight``: what the model does where
  it never refused is kept (known answers, ordinary help).

The loss is the squared error of the states divided by the median squared norm of the harmful and
everyday rows' targets.
Both targets and the input of the first adapted block are captured in one forward per batch (ELS
hooks on), so training runs only the adapted blocks (the input of the first adapted block does not
depend on the adapter). The ELS rule reads a harm gate the adapter cannot see; the adapter must learn
the harm distinction itself from the preserve term.

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
from aligntax.runs.fsio import write_json_atomic

__all__ = [
    "BENIGN_TARGETS",
    "DEFAULT_MODULES",
    "HARMFUL_TARGETS",
    "DistillConfig",
    "distill_els_lora",
    "distill_prompts",
]

BENIGN_TARGETS = ("els", "label")
HARMFUL_TARGETS = ("unsteered", "refusal")
DEFAULT_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


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
    preserve_weight: float = 3.0  # weight of the harmful rows' (unsteered) targets
    benign_target: str = (
        "label"  # benign rows: "els" (ELS's own decision, harm gate included) or "label" (no gate)
    )
    harmful_target: str = "refusal"  # harmful rows: "unsteered" or "refusal" (the refusal vector added)
    refusal_coeff: float = 1.0  # the refusal vector's strength for harmful_target="refusal"
    answer_tokens: int = 16  # benign: ELS-steered answer tokens when the ELS setting has no horizon
    harmful_answer_tokens: int = 32  # unsteered answers generated for kept prompts the label run lacks
    limit_retain: int | None = 300  # everyday instructions kept unsteered (the folder's harmless prompts)
    retain_weight: float = 3.0  # as the harmful rows' preserve weight
    els: dict = field(default_factory=dict)  # ELS options over the folder's tuned setting (eta=, gate=, ...)
    dtype: str = "bf16"
    seed: int = 0
    progress: bool = True


def _dedupe(items: list, seen: set) -> list:
    out = []
    for it in items:
        key = it.prompt.strip()
        if key not in seen:
            seen.add(key)
            out.append(it)
    return out


def distill_prompts(cfg: DistillConfig) -> tuple[list, list, list]:
    """The benign, the harmful and the retained (everyday) prompts of a distillation (see the module
    docstring), without repeats."""
    from aligntax.config import load_config
    from aligntax.runs.els_train import ELSTrainConfig, gate_items, sampled, training_items
    from aligntax.runs.eval import load_prompt_sets

    path = Path(cfg.steer) / "train_config.json"
    if not path.is_file():
        raise AligntaxError(f"{cfg.steer} has no train_config.json: give an `aligntax els train` folder.")
    tcfg = load_config(ELSTrainConfig, path)
    benign, harmful = training_items(tcfg)
    pairs = load_prompt_sets(cfg.pairs) if cfg.pairs else []
    seen: set = set()
    b = _dedupe(
        sampled(benign, cfg.limit_benign, cfg.seed) + [it for it in pairs if it.label == "benign"], seen
    )
    twins = _dedupe([it for it in pairs if it.label == "harmful"], seen)
    h = _dedupe(harmful, seen)
    limit = cfg.limit_harmful
    if limit is None or len(h) < limit:
        extra = [it for it in gate_items(tcfg)[2] if it.label == "harmful"] if tcfg.gate else []
        extra = _dedupe(extra, set(seen))
        need = None if limit is None else limit - len(h)
        h += _dedupe(sampled(extra, need, cfg.seed), seen)
    retain = []
    if cfg.limit_retain is None or cfg.limit_retain > 0:
        retain = _dedupe(
            sampled(load_prompt_sets(tcfg.harmless, tcfg.limit_harmless), cfg.limit_retain, cfg.seed), seen
        )
    return b, twins + (h[:limit] if limit is not None else h), retain


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
    lm,
    seqs: list[list[int]],
    plens: list[int],
    first: int,
    last: int,
    iv,
    batch_size: int,
    progress: bool,
    desc: str,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence (prompt + answer token ids, prompt length): the states entering block ``first``
    (before any edit there) and leaving block ``last``, with ``iv``'s hooks on (None: unsteered), one
    teacher-forced forward per batch (prompts left-padded, answers right-padded), ``[len, d]`` each."""
    from tqdm.auto import tqdm

    from aligntax.hooks import position_ids_from_mask
    from aligntax.interventions.base import SteerContext
    from aligntax.models.layers import decoder_layers

    blocks = decoder_layers(lm.model)
    pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    out: list = [None] * len(seqs)
    got: dict = {}

    def pre(module, args, kwargs):
        got["x"] = (args[0] if args else kwargs["hidden_states"]).detach()

    def post(module, args, kwargs, output):
        raise _Stop(_first(output).detach())

    for start in tqdm(range(0, len(order), batch_size), disable=not progress, desc=desc):
        idx = order[start : start + batch_size]
        p = max(plens[i] for i in idx)
        a = max(len(seqs[i]) - plens[i] for i in idx)
        ids = torch.full((len(idx), p + a), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(idx):
            s, n = seqs[i], plens[i]
            ids[r, p - n : p - n + len(s)] = torch.tensor(s)
            mask[r, p - n : p - n + len(s)] = 1
        ids, mask = ids.to(lm.device), mask.to(lm.device)
        ctx = SteerContext(prompt_len=p)
        h_pre = blocks[first].register_forward_pre_hook(pre, with_kwargs=True, prepend=True)
        h_post = blocks[last].register_forward_hook(post, with_kwargs=True)
        try:
            with torch.no_grad():
                if iv is None:
                    stop = _run(lm.model, ids, mask, position_ids_from_mask(mask))
                else:
                    with iv.attach(lm.model, ctx):
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


def _train_model(model: nn.Module, first: int, last: int) -> nn.Module:
    """A copy of ``model`` whose blocks outside ``first..last`` are :class:`_Pass` (never copied)."""
    from aligntax.models.layers import decoder_layers

    blocks = decoder_layers(model)
    memo = {
        id(b): _Pass(getattr(b, "attention_type", None))
        for i, b in enumerate(blocks)
        if not first <= i <= last
    }
    return copy.deepcopy(model, memo).eval()


def _sub_forward(
    model: nn.Module, first: int, last: int, x: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor
) -> torch.Tensor:
    """The state leaving block ``last`` when ``x`` enters block ``first`` (blocks before are passed)."""
    from aligntax.hooks import replace_hidden_in_args
    from aligntax.models.layers import decoder_layers

    blocks = decoder_layers(model)

    def pre(module, args, kwargs):
        return replace_hidden_in_args(args, kwargs, x)

    def post(module, args, kwargs, output):
        raise _Stop(_first(output))

    h1 = blocks[first].register_forward_pre_hook(pre, with_kwargs=True, prepend=True)
    h2 = blocks[last].register_forward_hook(post, with_kwargs=True)
    try:
        try:
            model(inputs_embeds=x, attention_mask=mask, position_ids=pos, use_cache=False)
        except _Stop as s:
            return s.output
    finally:
        h1.remove()
        h2.remove()
    raise AligntaxError("The forward did not reach the target block.")


def _batch(rows: list, device, dtype):
    """Left-padded ``(x, target, mask, position ids)`` from per-row ``(x [len, d], y [len, d])``."""
    width = max(len(x) for x, _ in rows)
    d = rows[0][0].shape[-1]
    x = torch.zeros(len(rows), width, d, dtype=dtype)
    y = torch.zeros(len(rows), width, d, dtype=torch.float32)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, (xi, yi) in enumerate(rows):
        n = len(xi)
        x[r, width - n :] = xi.to(dtype)
        y[r, width - n :] = yi.float()
        mask[r, width - n :] = 1
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    return x.to(device), y.to(device), mask.to(device), pos.to(device)


def _sha256(path: Path) -> str | None:
    if not path.is_file():
        return None
    return hashlib.sha256(path.read_bytes()).hexdigest()


def distill_els_lora(
    cfg: DistillConfig,
    lm=None,
    benign: list | None = None,
    harmful: list | None = None,
    retain: list | None = None,
) -> dict:
    """Train the adapter (see the module docstring), write it to ``cfg.out`` and return the summary
    written to its ``els_lora.json``. ``benign`` / ``harmful`` (and ``retain``, default none): prompt items
    (``.prompt``, ``.source``, ``.id``) instead of :func:`distill_prompts`."""
    from peft import LoraConfig, get_peft_model
    from tqdm.auto import tqdm

    from aligntax.activations.capture import chat_ids
    from aligntax.activations.decisions import row_info
    from aligntax.generation import GenerationConfig, generate
    from aligntax.interventions.lora import FORMAT, SIDECAR, ElsLora
    from aligntax.interventions.registry import make_intervention
    from aligntax.models import load_model
    from aligntax.models.layers import decoder_layers
    from aligntax.runs.jsonl import read_jsonl

    t0 = time.perf_counter()
    steer, out = Path(cfg.steer), Path(cfg.out)
    if out.exists() and any(out.iterdir()):
        raise AligntaxError(f"{out} exists and is not empty; choose a new folder for the adapter.")
    if not (
        cfg.rank >= 1
        and cfg.epochs >= 1
        and cfg.batch_size >= 1
        and cfg.lr > 0
        and all(w >= 0 and math.isfinite(w) for w in (cfg.preserve_weight, cfg.retain_weight))
    ):
        raise AligntaxError(
            "rank, epochs and batch_size must be at least 1, lr positive and preserve_weight and "
            "retain_weight finite and >= 0."
        )
    if cfg.benign_target not in BENIGN_TARGETS:
        raise AligntaxError(
            f"benign_target must be one of {', '.join(BENIGN_TARGETS)}; got {cfg.benign_target!r}."
        )
    if cfg.harmful_target not in HARMFUL_TARGETS:
        raise AligntaxError(
            f"harmful_target must be one of {', '.join(HARMFUL_TARGETS)}; got {cfg.harmful_target!r}."
        )
    if cfg.harmful_target == "refusal" and not (steer / "vectors" / "vectors.safetensors").is_file():
        raise AligntaxError(
            f"harmful_target 'refusal' needs the refusal vectors of {steer}/vectors "
            "(written by `aligntax els train`)."
        )
    if lm is None:
        model = cfg.model
        if model is None:
            tc = steer / "train_config.json"
            model = json.loads(tc.read_text()).get("model") if tc.is_file() else None
        if not model:
            raise AligntaxError("Give --model: the ELS folder names no model.")
        lm = load_model(model, dtype=cfg.dtype)
    els = make_intervention("els", lm, path=str(steer), **cfg.els)
    # the benign rows' teacher: ELS as tuned, or (label) the same setting without its harm gate
    els_b = (
        els
        if cfg.benign_target == "els"
        else make_intervention("els", lm, path=str(steer), **{**cfg.els, "gate": "none"})
    )
    steered = sorted(els.models)
    n = len(decoder_layers(lm.model))
    target = max(steered)
    layers = (
        sorted({int(x) for x in cfg.layers})
        if cfg.layers
        else sorted({s - k for s in steered for k in range(cfg.before + 1) if s - k >= 0})
    )
    if not layers or not 0 <= layers[0] or layers[-1] >= n:
        raise AligntaxError(f"Adapter blocks {layers} do not exist: the model has {n} blocks.")
    if layers[-1] > target:
        raise AligntaxError(
            f"Adapter blocks {layers} go past the last steered block {target}, whose output is "
            "the target: an adapter there cannot change it."
        )
    first = layers[0]
    if first > steered[0]:
        raise AligntaxError(
            f"The first adapter block ({first}) comes after the first steered block ({steered[0]}); "
            "the adapter must start at or before it."
        )
    horizon = els.horizon if els.horizon is not None else int(cfg.answer_tokens)
    if benign is None or harmful is None:
        benign, harmful, retain = distill_prompts(cfg)
    retain = list(retain or [])
    if not benign or not harmful:
        raise AligntaxError("Distillation needs benign and harmful prompts.")

    # answers: benign ones ELS-steered (the first `horizon` tokens); harmful ones unsteered, from the
    # label run where it answered them, else generated (or, for refusal targets, with the refusal vector
    # added); everyday ones unsteered, generated
    def gen(items, n_tokens, iv, desc):
        return [
            g.response
            for g in generate(
                lm,
                [it.prompt for it in items],
                GenerationConfig(max_new_tokens=n_tokens, batch_size=32),
                iv,
                progress=cfg.progress,
                desc=desc,
            )
        ]

    refuse = (
        make_intervention(
            "refusal-add", lm, path=str(steer / "vectors"), layers=[target], coeff=float(cfg.refusal_coeff)
        )
        if cfg.harmful_target == "refusal"
        else None
    )
    kept = retain if refuse is not None else harmful + retain  # rows whose target is the unsteered state
    b_answers = gen(benign, horizon, els_b, "distill: steered answers")
    labels = steer / "labels" / "samples.jsonl"
    known = {(r["source"], r["id"]): r["response"] for r in read_jsonl(labels)} if labels.is_file() else {}
    missing = [it for it in kept if (it.source, it.id) not in known]
    new = (
        dict(
            zip(
                [(it.source, it.id) for it in missing],
                gen(missing, cfg.harmful_answer_tokens, None, "distill: unsteered answers"),
                strict=True,
            )
        )
        if missing
        else {}
    )
    k_answers = [known.get((it.source, it.id), new.get((it.source, it.id))) for it in kept]
    b_seqs, b_plens = chat_ids(lm, [it.prompt for it in benign], responses=b_answers)
    b_seqs = [s[: p + horizon] for s, p in zip(b_seqs, b_plens, strict=True)]
    k_seqs, k_plens = chat_ids(lm, [it.prompt for it in kept], responses=k_answers) if kept else ([], [])

    # targets: the state leaving the last steered block, ELS on (benign), off (kept rows), the refusal
    # vector added (harmful rows, refusal targets)
    b_rows = _capture(lm, b_seqs, b_plens, first, target, els_b, 16, cfg.progress, "distill: steered states")
    k_rows = _capture(lm, k_seqs, k_plens, first, target, None, 16, cfg.progress, "distill: unsteered states")
    r_seqs = []
    if refuse is not None:
        r_answers = gen(harmful, cfg.harmful_answer_tokens, refuse, "distill: refusal answers")
        r_seqs, r_plens = chat_ids(lm, [it.prompt for it in harmful], responses=r_answers)
        k_rows = (
            _capture(lm, r_seqs, r_plens, first, target, refuse, 16, cfg.progress, "distill: refusal states")
            + k_rows
        )
    norms = torch.cat([y.float().norm(dim=-1) for _, y in k_rows])
    norm2 = float(norms.median()) ** 2
    # which rows ELS steers (its harm gate and row energy decision), for the summary
    info_b = row_info(els_b, lm, [it.prompt for it in benign]) or [{"steered": True}] * len(benign)
    info_h = row_info(els, lm, [it.prompt for it in harmful]) or [{"steered": True}] * len(harmful)

    # train: the adapted blocks only, from the captured inputs
    torch.manual_seed(cfg.seed)
    model = _train_model(lm.model, first, target)
    prefix = _blocks_prefix(model)
    names = [
        f"{prefix}.{i}.{path}"
        for i in layers
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
    kinds = (
        [(1.0, "benign")] * len(b_rows)
        + [(float(cfg.preserve_weight), "harmful")] * len(harmful)
        + [(float(cfg.retain_weight), "retain")] * len(retain)
    )
    rows = [(r, w, kind) for r, (w, kind) in zip(b_rows + k_rows, kinds, strict=True)]
    rng = random.Random(cfg.seed)
    dtype = next(p for p in lm.model.parameters()).dtype
    history = []

    def run_epoch(train: bool) -> dict:
        order = list(range(len(rows)))
        if train:
            rng.shuffle(order)
        # batches of similar length (little padding), in random order
        chunks = [order[i : i + cfg.batch_size * 8] for i in range(0, len(order), cfg.batch_size * 8)]
        batches = []
        for c in chunks:
            c = sorted(c, key=lambda i: len(rows[i][0][0]))
            batches += [c[i : i + cfg.batch_size] for i in range(0, len(c), cfg.batch_size)]
        if train:
            rng.shuffle(batches)
        sums = {"benign": 0.0, "harmful": 0.0, "retain": 0.0}
        counts = {"benign": 0, "harmful": 0, "retain": 0}
        for idx in tqdm(
            batches, disable=not cfg.progress, desc="distill: train" if train else "distill: eval"
        ):
            x, y, mask, pos = _batch([rows[i][0] for i in idx], lm.device, dtype)
            w = torch.tensor([rows[i][1] for i in idx], device=lm.device)
            with torch.set_grad_enabled(train):
                h = _sub_forward(model, first, target, x, mask, pos).float()
                err = ((h - y) ** 2).sum(-1) / norm2  # [B, T]
                per_row = (err * mask).sum(-1) / mask.sum(-1)
                loss = (w * per_row).sum() / len(idx)
            if train:
                opt.zero_grad()
                loss.backward()
                opt.step()
            for i, v in zip(idx, per_row.detach().cpu().tolist(), strict=True):
                sums[rows[i][2]] += v
                counts[rows[i][2]] += 1
        return {k: round(sums[k] / counts[k], 6) if counts[k] else None for k in sums}

    before = run_epoch(False)
    for epoch in range(cfg.epochs):
        history.append({"epoch": epoch + 1, **run_epoch(True)})
    after = run_epoch(False)
    out.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(str(out), safe_serialization=True)
    for stray in out.glob("*.bin"):  # only safetensors ship
        stray.unlink()
    meta = {
        "format": FORMAT,
        "fingerprint": dict(lm.fingerprint or {}),
        "layers": layers,
        "target_block": target,
        "steered_layers": steered,
        "modules": names,
        "horizon": horizon,
        "hyper": {
            "rank": cfg.rank,
            "alpha": alpha,
            "epochs": cfg.epochs,
            "lr": cfg.lr,
            "batch_size": cfg.batch_size,
            "preserve_weight": cfg.preserve_weight,
            "benign_target": cfg.benign_target,
            "harmful_target": cfg.harmful_target,
            "refusal_coeff": cfg.refusal_coeff,
            "limit_benign": cfg.limit_benign,
            "limit_harmful": cfg.limit_harmful,
            "answer_tokens": cfg.answer_tokens,
            "harmful_answer_tokens": cfg.harmful_answer_tokens,
            "limit_retain": cfg.limit_retain,
            "retain_weight": cfg.retain_weight,
            "seed": cfg.seed,
            "dtype": cfg.dtype,
            "modules": cfg.modules,
            "before": cfg.before,
        },
        "source": {
            "path": str(steer),
            "els": els.config(),
            "energy_sha256": _sha256(steer / "energy.safetensors"),
            "gate_sha256": _sha256(steer / "gate.safetensors"),
        },
        "data": {
            "benign": len(benign),
            "harmful": len(harmful),
            "retain": len(retain),
            "pairs": cfg.pairs,
            "benign_sources": _count(benign),
            "harmful_sources": _count(harmful),
            "retain_sources": _count(retain),
            "benign_steered_by_els": sum(bool(r["steered"]) for r in info_b),
            "harmful_steered_by_els": sum(bool(r["steered"]) for r in info_h),
            "answers_generated": len(missing),
            "tokens": sum(len(s) for s in b_seqs + k_seqs + r_seqs),
        },
        "loss": {"norm2": norm2, "before": before, "after": after, "epochs": history},
        "seconds": round(time.perf_counter() - t0, 1),
        "config": asdict(cfg),
    }
    write_json_atomic(out / SIDECAR, meta)
    ElsLora.load(out, lm)  # what was written loads for this model
    return meta


def _count(items) -> dict:
    out: dict[str, int] = {}
    for it in items:
        out[it.source] = out.get(it.source, 0) + 1
    return out


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
