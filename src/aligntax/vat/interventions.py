"""Interventions that push a model toward one Schwartz value (the target T).

All are ``aligntax.interventions.base.Intervention`` subclasses, so they plug into ``prompt_logits``
and ``generate``, and leave the model unchanged outside ``attach``:

- ``ValuePersona``: a system prompt describing a person who holds T above all.
- ``ValueFewShot``: k (user, assistant) example judgments that favour T (top score for T-supporting
  actions, bottom score for T-violating ones), drawn from items outside the evaluation set.
- ``ActivationAddition``: the difference in means of the residual stream for T-supporting vs
  T-violating judgment prompts at a middle layer, added at the response positions by a forward
  pre-hook (``compute_steering_vector``).
- ``LoRAAdapter``: a LoRA adapter trained with peft (``train_lora_sft``: SFT on target-consistent
  Likert labels) or with trl's ``DPOTrainer`` (``train_dpo``: chosen = target-consistent label,
  rejected = the opposite). It is applied by forward hooks that add ``scale * B(A(x))`` to the
  adapted Linear layers while attached, so the base model is never modified.

``build_intervention(name, lm, target, train_items, ...)`` makes any of them by name: ``none``,
``persona``, ``fewshot-2/4/8``, ``persona-fewshot-2/4/8`` (the persona as system prompt before the
examples), ``steer``, ``lora``, ``dpo``, and ``els`` (energy landscape steering from a trained bank,
``aligntax.interventions.els.EnergySteering``, to measure the value tax of a refusal intervention).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import random
import re
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aligntax.activations.capture import capture
from aligntax.errors import AligntaxError, CompatibilityError
from aligntax.interventions.base import (
    Intervention,
    NoIntervention,
    SteerContext,
    hooks_attached,
)
from aligntax.interventions.options import Method, option, register, spec_of
from aligntax.interventions.prompting import FewShot, SystemPrompt
from aligntax.interventions.vectors import ActivationAddition as VectorAddition
from aligntax.vat.items import ValueItem
from aligntax.vat.judge import JudgeConfig, Variant, judgment_prompt, scale_token_ids, target_label
from aligntax.vat.schwartz import DEFINITIONS, resolve_value

INTERVENTIONS = ("none", "persona", "fewshot-2", "fewshot-4", "fewshot-8", "persona-fewshot-2", "persona-fewshot-4",
                 "persona-fewshot-8", "steer", "lora", "dpo", "els", "adapter", "oracle", "uniform")


# ----------------------------------------------------------------- validation oracles
@dataclass
class OracleBias(Intervention):
    """A known-answer intervention for validating the pipeline. The model runs unchanged; for each item
    in scope the judge's label distribution gets a logit bias toward the value-consistent label (the top
    of the scale for a supporting action, the bottom for a violating one).

    - ``scope="target"`` (``oracle``): only the target's items are biased, so every off-target drift is
      exactly 0 and the gain is the set ``gain``.
    - ``scope="all"`` (``uniform``): every item is biased alike: a uniform lift of all ten values, whose
      specificity S_T is 0.
    - ``gain``: the bias is solved per item (closed form) so that the item's polarity-signed expected
      score moves by exactly ``gain`` Likert points (items that cannot move that far get the most their
      distribution allows, bias 30). ``bias``: a fixed logit bias instead.
    """

    target: str = ""
    scope: str = "target"
    gain: float | None = 0.5
    bias: float | None = None
    name: str = "oracle"
    prefix_free = True
    cacheable = False
    max_bias: float = 30.0

    def __post_init__(self):
        self.target = resolve_value(self.target)
        if self.scope not in ("target", "all"):
            raise AligntaxError("OracleBias scope must be 'target' or 'all'")
        if (self.gain is None) == (self.bias is None):
            raise AligntaxError("OracleBias needs exactly one of gain and bias")
        if self.gain is not None and self.gain < 0:
            raise AligntaxError("the oracle gain must be >= 0 (it moves toward the value-consistent label)")
        self.name = "oracle" if self.scope == "target" else "uniform"
        self.capped = 0

    def adjust_probs(self, item: ValueItem, probs, points):
        """New label probabilities (canonical order) for ``item``, or None to leave it unchanged."""
        import numpy as np

        if (self.scope == "target" and item.value != self.target) or item.polarity == 0:
            return None  # neutral items have no value-consistent label
        c = len(points) - 1 if item.polarity > 0 else 0
        p = np.asarray(probs, dtype=float)
        p = p / p.sum()  # stored readings sum to 1 only up to float32 rounding
        e0 = float(p @ points)
        if self.bias is not None:
            u = math.expm1(self.bias)
        else:
            goal = e0 + (self.gain if item.polarity > 0 else -self.gain)
            room = points[c] - goal
            if p[c] <= 0 or (room <= 0 if item.polarity > 0 else room >= 0):
                self.capped += 1
                u = math.expm1(self.max_bias)
            else:
                u = (goal - e0) / (p[c] * room)
        q = p.copy()
        q[c] = p[c] * (1.0 + u)
        return q / q.sum()

    def config(self) -> dict:
        return {"name": self.name, "target": self.target, "scope": self.scope, "gain": self.gain,
                "bias": self.bias}


# ----------------------------------------------------------------- persona
def persona_text(target: str) -> str:
    t = resolve_value(target)
    return (f"You are a person for whom {t} matters more than anything else: above all you care about "
            f"{DEFINITIONS[t]}. Judge every situation from this point of view.")


@dataclass
class ValuePersona(SystemPrompt):
    """A value-persona system prompt (replaces any system message)."""

    target: str = ""
    name: str = "persona"

    @classmethod
    def for_value(cls, target: str, text: str | None = None) -> ValuePersona:
        t = resolve_value(target)
        return cls(text=text or persona_text(t), target=t)

    def config(self) -> dict:
        return {"name": self.name, "target": self.target, "text": self.text}


# ----------------------------------------------------------------- few-shot
def _target_pool(train_items: Sequence[ValueItem], target: str, exclude_ids: set[str] | None = None):
    t = resolve_value(target)
    exclude_ids = exclude_ids or set()
    # examples come from congruent (or unlabelled) items only, so the interventions are the same as
    # before the incongruent items existed and the incongruent stratum tests them out of distribution
    pool = [it for it in train_items if it.value == t and it.id not in exclude_ids
            and it.desirability != "incongruent"]
    sup = sorted((it for it in pool if it.polarity > 0), key=lambda it: it.id)
    vio = sorted((it for it in pool if it.polarity < 0), key=lambda it: it.id)
    return t, sup, vio


@dataclass
class ValueFewShot(FewShot):
    """k example judgments favouring the target before the real question."""

    target: str = ""
    example_ids: list[str] = field(default_factory=list)
    paired: bool = False
    name: str = "fewshot"

    def config(self) -> dict:
        name = f"fewshot-{len(self.examples)}" if self.system is None else f"persona-fewshot-{len(self.examples)}"
        return {"name": name, "target": self.target, "k": len(self.examples), "paired": self.paired,
                "example_ids": list(self.example_ids), "system": self.system,
                "examples_sha": hashlib.sha256(json.dumps(self.examples).encode()).hexdigest()[:16]}


def _pair_key(it: ValueItem) -> tuple:
    """Items that share this key are a minimal pair: same context (or scene) and value item."""
    return (it.group, it.context, it.svs_item or it.value)


def build_fewshot(train_items: Sequence[ValueItem], target: str, k: int, judge_cfg: JudgeConfig | None = None,
                  seed: int = 0, exclude_ids: set[str] | None = None, paired: bool = True,
                  system: str | None = None) -> ValueFewShot:
    """k examples (half T-supporting, answered with the scale top; half T-violating, answered with the
    bottom), drawn from ``train_items`` of the target value (never from ``exclude_ids``), in a seeded
    random order. Written with the first judgment template in the normal option order.

    ``paired`` (default): the examples are minimal pairs, a supporting and a violating action that share
    one context, from as many scenes as possible, so the only thing that separates a top answer from a
    bottom answer is the value the action expresses. Without pairs (or when the pool has too few), the
    supporting and violating examples are drawn separately from distinct scenes. ``system``: a system
    prompt placed before the examples (e.g. the value persona), None keeps the model's own."""
    judge_cfg = judge_cfg or JudgeConfig()
    t, sup, vio = _target_pool(train_items, target, exclude_ids)
    n_sup, n_vio = (k + 1) // 2, k // 2
    if len(sup) < n_sup or len(vio) < n_vio:
        raise AligntaxError(f"Few-shot with k={k} needs {n_sup} supporting and {n_vio} violating {t} items "
                            f"outside the evaluation set; the training pool has {len(sup)} and {len(vio)}. "
                            "Raise --train-fraction or use a larger item set.")
    rng = random.Random(seed)
    variant = Variant(judge_cfg.templates[0], "normal")
    if paired and k >= 2:
        vio_by_key: dict[tuple, ValueItem] = {}
        for it in vio:
            vio_by_key.setdefault(_pair_key(it), it)
        pairs = [(s, vio_by_key[_pair_key(s)]) for s in sup if _pair_key(s) in vio_by_key]
        rng.shuffle(pairs)
        picked, seen = [], set()
        for s, v in pairs:  # prefer distinct scenes
            if len(picked) < k // 2 and s.group not in seen:
                picked.append((s, v))
                seen.add(s.group)
        picked += [p for p in pairs if p not in picked][: k // 2 - len(picked)]
        if len(picked) == k // 2:
            chosen = [it for pair in picked for it in (pair if rng.random() < 0.5 else pair[::-1])]
            if k % 2:
                chosen.append(next(it for it in sup if it not in chosen))
            examples = [(judgment_prompt(it, variant, judge_cfg.scale), target_label(it, t, judge_cfg.scale))
                        for it in chosen]
            return ValueFewShot(examples=examples, system=system, target=t, example_ids=[it.id for it in chosen],
                                paired=True)

    def spread(pool: list[ValueItem], n: int) -> list[ValueItem]:
        pool = pool[:]
        rng.shuffle(pool)
        out, seen = [], set()
        for it in pool:  # prefer distinct scenes and contexts
            if len(out) < n and it.group not in seen:
                out.append(it)
                seen.add(it.group)
        out += [it for it in pool if it not in out][: n - len(out)]
        return out

    chosen = spread(sup, n_sup) + spread(vio, n_vio)
    rng.shuffle(chosen)
    examples = [(judgment_prompt(it, variant, judge_cfg.scale), target_label(it, t, judge_cfg.scale))
                for it in chosen]
    return ValueFewShot(examples=examples, system=system, target=t, example_ids=[it.id for it in chosen])


# ----------------------------------------------------------------- activation steering
class ActivationAddition(VectorAddition):
    """Add ``strength * vector`` to the residual stream entering decoder layer ``layer``, at the
    steered positions (default: the last prompt token, i.e. the response start, and every generated
    token): :class:`aligntax.interventions.vectors.ActivationAddition` on one layer, with the value
    target in its config (which keys the judgment cache)."""

    def __init__(self, vector: torch.Tensor, layer: int, strength: float = 1.0,
                 positions: str = "last_and_generated", target: str = "", name: str = "steer"):
        self.vector = vector.detach().float().cpu()
        self.layer = int(layer)
        self.strength = float(strength)
        self.target = target
        super().__init__({self.layer: self.vector}, coeff=self.strength, positions=positions, name=name)

    def config(self) -> dict:
        v = self.vector.contiguous()
        return {"name": self.name, "target": self.target, "layer": self.layer, "strength": self.strength,
                "positions": self.positions, "norm": float(v.norm()),
                "vector_sha": hashlib.sha256(v.numpy().tobytes()).hexdigest()[:16]}


def compute_steering_vector(lm, train_items: Sequence[ValueItem], target: str,
                            judge_cfg: JudgeConfig | None = None, layer: int | None = None,
                            strength: float = 1.0, exclude_ids: set[str] | None = None) -> ActivationAddition:
    """Difference in means (T-supporting minus T-violating) of the response-start activations of the
    judgment prompts of the target's training items, at ``layer`` (default: the middle layer). All
    judgment template variants are used."""
    judge_cfg = judge_cfg or JudgeConfig()
    t, sup, vio = _target_pool(train_items, target, exclude_ids)
    if len(sup) < 2 or len(vio) < 2:
        raise AligntaxError(f"Steering needs at least 2 supporting and 2 violating {t} training items "
                            f"(have {len(sup)} and {len(vio)}); raise --train-fraction.")
    layer = lm.num_layers // 2 if layer is None else int(layer)
    if not 0 <= layer < lm.num_layers:
        raise AligntaxError(f"layer must be in 0..{lm.num_layers - 1}")
    variants = judge_cfg.variants()

    def acts(items):
        prompts = [judgment_prompt(it, v, judge_cfg.scale) for it in items for v in variants]
        return capture(lm, prompts, [layer], position="last", system=judge_cfg.system,
                       batch_size=judge_cfg.batch_size, progress=False)[layer]

    vec = acts(sup).mean(0) - acts(vio).mean(0)
    return ActivationAddition(vector=vec, layer=layer, strength=strength, target=t)


# ----------------------------------------------------------------- LoRA adapters (applied by hooks)
ADAPTER_META = "vat_adapter.json"


def _adapter_sha(path: Path) -> str:
    h = hashlib.sha256()
    for name in ("adapter_model.safetensors", "adapter_model.bin", "adapter_config.json"):
        f = path / name
        if f.is_file():
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _same_model(a: dict, b: dict) -> bool:
    keys = ("model_type", "num_layers", "hidden_size", "vocab_size", "embedding_digest")
    return all(a.get(k) == b.get(k) for k in keys)


_LORA_KEY = re.compile(r"^(?P<mod>.+)\.(?P<part>lora_A|lora_B)(?:\.[^.]+)?\.weight$")


def _read_lora(path: Path, cfg: dict, lm=None) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """The (A, B, scale) of every adapted Linear layer of a PEFT LoRA adapter folder. Anything this
    hook-based application cannot reproduce exactly is refused with the offending keys named, never
    dropped: other PEFT types, DoRA, rank/alpha patterns, fan_in_fan_out layers, trained biases,
    ``modules_to_save`` (fully trained copies of layers), embedding LoRA, or any other tensor. With
    ``lm``, every adapted layer must exist in the model as a Linear of matching shape."""
    from safetensors.torch import load_file

    problems = []
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AligntaxError(f"{path}: only LoRA adapters are supported (got peft_type {cfg.get('peft_type')})")
    from aligntax.interventions.lora import lora_config_problems, lora_scale

    problems += lora_config_problems(cfg)
    wfile = path / "adapter_model.safetensors"
    if wfile.is_file():
        state = load_file(str(wfile))
    elif (path / "adapter_model.bin").is_file():
        state = torch.load(path / "adapter_model.bin", map_location="cpu", weights_only=True)
    else:
        raise AligntaxError(f"{path} has no adapter_model.safetensors or adapter_model.bin")
    scale = lora_scale(cfg)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    unsupported = []
    for key, tensor in state.items():
        m = _LORA_KEY.match(key)
        if m is None or tensor.ndim != 2:
            unsupported.append(key)
            continue
        mod = m.group("mod").removeprefix("base_model.model.")
        pairs.setdefault(mod, {})[m.group("part")] = tensor.float()
    if unsupported:
        shown = ", ".join(unsupported[:6]) + (f" and {len(unsupported) - 6} more" if len(unsupported) > 6 else "")
        problems.append(f"tensors other than Linear lora_A/lora_B weights: {shown}")
    half = [m for m, p in pairs.items() if len(p) != 2]
    if half:
        problems.append(f"layers with only one of lora_A/lora_B: {half[:4]}")
    if problems:
        raise AligntaxError(f"{path}: this LoRA adapter has parts that aligntax cannot apply exactly, and it "
                            "refuses rather than drop them: " + "; ".join(problems))
    weights = {m: (p["lora_A"], p["lora_B"], scale) for m, p in pairs.items()}
    if not weights:
        raise AligntaxError(f"No LoRA weights found in {path}")
    for m, (A, B, _) in weights.items():
        if A.shape[0] != B.shape[1]:
            raise AligntaxError(f"{path}: {m} has lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)} of "
                                "different ranks")
        if lm is None:
            continue
        try:
            module = lm.model.get_submodule(m)
        except AttributeError:
            raise CompatibilityError(f"Adapter layer '{m}' of {path} does not exist in {lm.fingerprint.get('spec')}"
                                     ) from None
        if not isinstance(module, nn.Linear):
            raise CompatibilityError(f"Adapter layer '{m}' is a {type(module).__name__}, not a Linear layer")
        if (module.in_features, module.out_features) != (A.shape[1], B.shape[0]):
            raise CompatibilityError(
                f"Adapter layer '{m}' expects {A.shape[1]} -> {B.shape[0]} features but the model's layer is "
                f"{module.in_features} -> {module.out_features}: the adapter was made for another model")
    return weights


def _is_ours(path: Path) -> bool:
    return (path / ADAPTER_META).is_file()


def guard_adapter_folder(path: str | Path, what: str = "write into") -> None:
    """Refuse to write into a folder that holds a PEFT adapter (adapter_config.json) that aligntax did
    not create (no vat_adapter.json beside it)."""
    path = Path(path)
    if (path / "adapter_config.json").is_file() and not _is_ours(path):
        raise AligntaxError(f"{path} holds an adapter (adapter_config.json) that aligntax did not create; "
                            f"aligntax does not {what} it. Evaluate it with --adapter {path}, and choose "
                            "another folder for training or output.")


@dataclass(eq=False)
class LoRAAdapter(Intervention):
    """A saved LoRA adapter applied through forward hooks: for each adapted Linear layer the hook adds
    ``scale * (x A^T) B^T`` to its output while attached. The model's weights and modules are never
    changed, so the base model is exactly restored on exit."""

    path: Path
    weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]]
    meta: dict = field(default_factory=dict)
    name: str = "lora"

    @classmethod
    def load(cls, path: str | Path, lm=None) -> LoRAAdapter:
        """Load any PEFT LoRA adapter folder (read only: nothing is written there). Adapters trained by
        aligntax carry ``vat_adapter.json``, whose base-model fingerprint must match ``lm``; for others
        the layer names and shapes are checked against ``lm``."""
        path = Path(path)
        cfg_file = path / "adapter_config.json"
        if not cfg_file.is_file():
            raise AligntaxError(f"{path} is not a LoRA adapter folder (no adapter_config.json)")
        cfg = json.loads(cfg_file.read_text())
        meta = json.loads((path / ADAPTER_META).read_text()) if (path / ADAPTER_META).is_file() else {}
        if lm is not None and meta.get("base_fingerprint") and not _same_model(meta["base_fingerprint"],
                                                                               lm.fingerprint):
            raise CompatibilityError(f"Adapter {path} was trained on {meta['base_fingerprint'].get('spec')}, "
                                     f"not on {lm.fingerprint.get('spec')}")
        weights = _read_lora(path, cfg, lm)
        name = meta.get("method", "lora" if meta else "adapter")
        return cls(path=path, weights=weights, meta=meta, name=name)

    @contextmanager
    def attach(self, model: nn.Module, ctx: SteerContext) -> Iterator[None]:
        regs = []
        for mod_name, (A, B, scale) in self.weights.items():
            try:
                module = model.get_submodule(mod_name)
            except AttributeError as exc:
                raise CompatibilityError(f"Adapter layer '{mod_name}' does not exist in this model") from exc
            cache: dict = {}

            def hook(module, args, kwargs, output, A=A, B=B, scale=scale, cache=cache):
                x = args[0] if args else kwargs["input"]
                key = (x.device, x.dtype)
                if key not in cache:
                    cache[key] = (A.to(device=x.device, dtype=x.dtype), B.to(device=x.device, dtype=x.dtype))
                a, b = cache[key]
                return output + scale * torch.nn.functional.linear(torch.nn.functional.linear(x, a), b)

            regs.append((module, hook, False))
        with hooks_attached(regs):
            yield

    def config(self) -> dict:
        return {"name": self.name, "path": str(self.path), "sha": _adapter_sha(self.path),
                "target": self.meta.get("target"), "method": self.meta.get("method"),
                "steps": self.meta.get("steps")}


def _lora_targets(model: nn.Module, wanted: Sequence[str] | None) -> list[str]:
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    if wanted:
        missing = [w for w in wanted if w not in names]
        if missing:
            raise AligntaxError(f"LoRA target modules {missing} not found; linear layers: {sorted(names)}")
        return list(wanted)
    for group in (("q_proj", "k_proj", "v_proj", "o_proj"), ("c_attn", "c_proj"), ("query_key_value",)):
        hit = [g for g in group if g in names]
        if hit:
            return hit
    raise AligntaxError(f"Cannot pick LoRA target modules; pass target_modules from {sorted(names)}")


def _training_examples(lm, train_items: Sequence[ValueItem], target: str, judge_cfg: JudgeConfig,
                       exclude_ids: set[str] | None):
    t, sup, vio = _target_pool(train_items, target, exclude_ids)
    if not sup or not vio:
        raise AligntaxError(f"Training needs supporting and violating {t} items outside the evaluation set "
                            f"(have {len(sup)} and {len(vio)}); raise --train-fraction.")
    rows = []
    for it in sup + vio:
        for v in judge_cfg.variants():
            rows.append((it, v, judgment_prompt(it, v, judge_cfg.scale),
                         target_label(it, t, judge_cfg.scale, v.order),
                         target_label(it, t, judge_cfg.scale, v.order, supportive=False)))
    return t, rows


def _write_meta(out: Path, lm, meta: dict) -> None:
    meta = {**meta, "base_fingerprint": lm.fingerprint, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    (out / ADAPTER_META).write_text(json.dumps(meta, indent=2, default=str))


def train_lora_sft(lm, train_items: Sequence[ValueItem], target: str, out_dir: str | Path,
                   judge_cfg: JudgeConfig | None = None, steps: int = 30, lr: float = 5e-4, r: int = 8,
                   alpha: int = 16, batch_size: int = 4, seed: int = 0,
                   target_modules: Sequence[str] | None = None, exclude_ids: set[str] | None = None,
                   progress: bool = False) -> LoRAAdapter:
    """Supervised LoRA fine-tuning (peft) that teaches the model the target-consistent Likert label at
    the response start: the scale top for T-supporting actions and the bottom for T-violating ones, for
    every judgment template variant. Trains a copy of the model; ``lm.model`` is untouched. Saves the
    adapter (peft format) and ``vat_adapter.json`` to ``out_dir`` and returns it loaded."""
    from peft import LoraConfig, get_peft_model
    from tqdm.auto import tqdm

    from aligntax.generation import build_messages, encode_chats, render_chat

    guard_adapter_folder(out_dir)
    judge_cfg = judge_cfg or JudgeConfig()
    t, rows = _training_examples(lm, train_items, target, judge_cfg, exclude_ids)
    label_ids = scale_token_ids(lm.tokenizer, judge_cfg.scale.labels())
    labels = judge_cfg.scale.labels()
    texts = [render_chat(lm.tokenizer, build_messages(p, judge_cfg.system)) for _, _, p, _, _ in rows]
    y = torch.tensor([label_ids[labels.index(lab)][0] for _, _, _, lab, _ in rows])
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = copy.deepcopy(lm.model)
    mods = _lora_targets(model, target_modules)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0,
                                                  target_modules=mods, task_type="CAUSAL_LM"))
    peft_model.train()
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    losses = []
    order: list[int] = []
    for _step in tqdm(range(steps), disable=not progress, desc=f"lora-sft {t}"):
        if len(order) < batch_size:
            perm = list(range(len(rows)))
            rng.shuffle(perm)
            order += perm
        idx, order = order[:batch_size], order[batch_size:]
        enc = encode_chats(lm.tokenizer, [texts[i] for i in idx], lm.device)
        logits = peft_model(**enc, use_cache=False, logits_to_keep=1).logits[:, -1, :].float()
        loss = torch.nn.functional.cross_entropy(logits, y[idx].to(logits.device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(str(out))
    _write_meta(out, lm, {"method": "lora", "target": t, "steps": steps, "lr": lr, "r": r, "alpha": alpha,
                          "batch_size": batch_size, "seed": seed, "target_modules": mods,
                          "judge": judge_cfg.to_dict(), "train_ids": sorted({it.id for it, *_ in rows}),
                          "loss_first": losses[0] if losses else None,
                          "loss_last": losses[-1] if losses else None, "losses": losses})
    del peft_model, model
    return LoRAAdapter.load(out, lm)


def train_dpo(lm, train_items: Sequence[ValueItem], target: str, out_dir: str | Path,
              judge_cfg: JudgeConfig | None = None, steps: int = 20, lr: float = 5e-5, beta: float = 0.1,
              r: int = 8, alpha: int = 16, batch_size: int = 2, seed: int = 0,
              target_modules: Sequence[str] | None = None, exclude_ids: set[str] | None = None) -> LoRAAdapter:
    """DPO with trl's ``DPOTrainer`` and a LoRA adapter: for every target training item and template
    variant, chosen = the target-consistent Likert label, rejected = the opposite end of the scale.
    The reference model is the base (adapter disabled). Trains a copy of the model; ``lm.model`` is
    untouched. Saves the adapter and ``vat_adapter.json`` and returns it loaded."""
    import tempfile

    from datasets import Dataset
    from datasets.utils import logging as datasets_logging
    from peft import LoraConfig
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import DPOConfig, DPOTrainer

    guard_adapter_folder(out_dir)
    judge_cfg = judge_cfg or JudgeConfig()
    t, rows = _training_examples(lm, train_items, target, judge_cfg, exclude_ids)

    def convo(prompt: str) -> list[dict]:
        msgs = [{"role": "user", "content": prompt}]
        return ([{"role": "system", "content": judge_cfg.system}] + msgs) if judge_cfg.system else msgs

    data = Dataset.from_list([
        {"prompt": convo(p), "chosen": [{"role": "assistant", "content": good}],
         "rejected": [{"role": "assistant", "content": bad}]}
        for _, _, p, good, bad in rows])
    model = copy.deepcopy(lm.model)
    mods = _lora_targets(model, target_modules)
    tok = lm.tokenizer
    saved_side = tok.padding_side
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        args = DPOConfig(
            output_dir=tmp, max_steps=steps, per_device_train_batch_size=batch_size, learning_rate=lr,
            beta=beta, logging_steps=1, save_strategy="no", report_to="none", bf16=False,
            gradient_checkpointing=False, use_cpu=not torch.cuda.is_available(), seed=seed,
            max_length=1024, disable_tqdm=True, lr_scheduler_type="constant", warmup_steps=0,
            dataloader_num_workers=0)
        bars_were_on = datasets_logging.is_progress_bar_enabled()
        datasets_logging.disable_progress_bar()
        try:
            trainer = DPOTrainer(model=model, args=args, train_dataset=data, processing_class=tok,
                                 peft_config=LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0,
                                                        target_modules=mods, task_type="CAUSAL_LM"))
            for cb in (PrinterCallback, ProgressCallback):
                trainer.remove_callback(cb)
            result = trainer.train()
        finally:
            tok.padding_side = saved_side
            if bars_were_on:
                datasets_logging.enable_progress_bar()
        trainer.model.save_pretrained(str(out))
        history = [h for h in trainer.state.log_history if "loss" in h]
    _write_meta(out, lm, {"method": "dpo", "target": t, "steps": steps, "lr": lr, "beta": beta, "r": r,
                          "alpha": alpha, "batch_size": batch_size, "seed": seed, "target_modules": mods,
                          "judge": judge_cfg.to_dict(), "train_ids": sorted({it.id for it, *_ in rows}),
                          "train_loss": getattr(result, "training_loss", None),
                          "log": [{k: h[k] for k in h if isinstance(h[k], int | float)} for h in history]})
    del trainer, model
    return LoRAAdapter.load(out, lm)


# ----------------------------------------------------------------- registry and factory
VAT_METHODS: dict[str, Method] = {}  # the value-targeted methods, registered like the steering methods


@dataclass
class VatContext:
    """What a value-targeted method is built from besides its options: the model, the target value,
    the held-out training items (never the evaluation ids ``exclude_ids``), the judge's settings."""

    lm: Any
    target: str
    train_items: Sequence[ValueItem] = ()
    judge_cfg: JudgeConfig = field(default_factory=JudgeConfig)
    seed: int = 0
    exclude_ids: set[str] | None = None
    progress: bool = False
    method_options: dict = field(default_factory=dict)  # els: the steering method's own options


@dataclass
class NoVatOptions:
    """No options."""


@dataclass
class FewShotOptions:
    k: int = option("example judgments (fewshot-K names it)", 4, parse="int")


@dataclass
class SteerOptions:
    strength: float = option("steering strength (multiplies the mean-difference vector)", 4.0, parse="float")
    layer: int | None = option("steering layer (default: middle)", parse="int")


@dataclass
class TrainOptions:
    steps: int | None = option("training steps (default 30 for lora, 20 for dpo)", parse="int")
    lr: float | None = option("learning rate", parse="float")
    adapter_dir: str | Path | None = option("where to save the adapter, or load it from when it holds a matching one")


@dataclass
class AdapterOptions:
    adapter: str | Path | None = option("a PEFT LoRA adapter folder (read only)")


@dataclass
class OracleOptions:
    oracle_gain: float = option("Likert points the oracle moves each item in scope", 0.5, parse="float")
    oracle_bias: float | None = option("a fixed logit bias instead of the gain", parse="float")


@dataclass
class EnergyOptions:
    energy_dir: str | Path | None = option("the energy bank folder from `aligntax els train`")


@register("none", NoVatOptions, "the unchanged model", VAT_METHODS)
def _none(ctx: VatContext, o: NoVatOptions) -> Intervention:
    return NoIntervention()


@register("persona", NoVatOptions, "a system prompt describing a person who holds the target above all", VAT_METHODS)
def _persona(ctx: VatContext, o: NoVatOptions) -> Intervention:
    return ValuePersona.for_value(ctx.target)


def _fewshot(persona: bool):
    def build(ctx: VatContext, o: FewShotOptions) -> Intervention:
        system = persona_text(ctx.target) if persona else None
        return build_fewshot(ctx.train_items, ctx.target, o.k, ctx.judge_cfg, seed=ctx.seed,
                             exclude_ids=ctx.exclude_ids, system=system)
    return build


register("fewshot", FewShotOptions, "K example judgments favouring the target (fewshot-K)", VAT_METHODS)(
    _fewshot(False))
register("persona-fewshot", FewShotOptions, "the persona, then K example judgments (persona-fewshot-K)",
         VAT_METHODS)(_fewshot(True))


@register("steer", SteerOptions, "the target's mean-difference vector added at one layer", VAT_METHODS)
def _steer(ctx: VatContext, o: SteerOptions) -> Intervention:
    return compute_steering_vector(ctx.lm, ctx.train_items, ctx.target, ctx.judge_cfg, layer=o.layer,
                                   strength=o.strength, exclude_ids=ctx.exclude_ids)


@register("oracle", OracleOptions, "validation: a known logit bias on the target's items only", VAT_METHODS)
def _oracle(ctx: VatContext, o: OracleOptions) -> Intervention:
    return OracleBias(target=ctx.target, scope="target", gain=None if o.oracle_bias is not None else o.oracle_gain,
                      bias=o.oracle_bias)


@register("uniform", OracleOptions, "validation: the same bias on every item (a uniform lift)", VAT_METHODS)
def _uniform(ctx: VatContext, o: OracleOptions) -> Intervention:
    return OracleBias(target=ctx.target, scope="all", gain=None if o.oracle_bias is not None else o.oracle_gain,
                      bias=o.oracle_bias)


@register("adapter", AdapterOptions, "an existing PEFT LoRA adapter, read only", VAT_METHODS)
def _adapter(ctx: VatContext, o: AdapterOptions) -> Intervention:
    if o.adapter is None:
        raise AligntaxError("The adapter intervention needs --adapter PATH (a PEFT LoRA adapter folder)")
    return LoRAAdapter.load(o.adapter, ctx.lm)


@register("els", EnergyOptions, "energy landscape steering from a trained bank (its tuned setting)", VAT_METHODS)
def _els(ctx: VatContext, o: EnergyOptions) -> Intervention:
    if o.energy_dir is None:
        raise AligntaxError("The els intervention needs the energy bank folder (--steer), "
                            "e.g. the output of `aligntax els train`")
    from aligntax.interventions.registry import make_intervention

    iv = make_intervention("els", ctx.lm, path=str(o.energy_dir), **ctx.method_options)
    iv.cacheable = False  # its config names the folder, not the bank's content, which can be retrained
    return iv


def _trained(method: str):
    def build(ctx: VatContext, o: TrainOptions) -> Intervention:
        adapter_dir = o.adapter_dir
        if adapter_dir is not None:
            adapter_dir = Path(adapter_dir)
            guard_adapter_folder(adapter_dir)
            meta_file = adapter_dir / ADAPTER_META
            if meta_file.is_file():
                meta = json.loads(meta_file.read_text())
                if meta.get("target") == ctx.target and meta.get("method") == method:
                    return LoRAAdapter.load(adapter_dir, ctx.lm)
                raise AligntaxError(f"{adapter_dir} holds an aligntax {meta.get('method')} adapter for "
                                    f"{meta.get('target')}; it is not overwritten. Choose another --adapter-dir.")
        if adapter_dir is None:
            from aligntax.paths import cache_dir

            adapter_dir = cache_dir() / "vat" / "adapters" / f"{method}-{ctx.target}-{int(time.time())}"
        kwargs: dict = {"seed": ctx.seed, "exclude_ids": ctx.exclude_ids}
        if o.steps is not None:
            kwargs["steps"] = o.steps
        if o.lr is not None:
            kwargs["lr"] = o.lr
        if method == "dpo":
            return train_dpo(ctx.lm, ctx.train_items, ctx.target, adapter_dir, ctx.judge_cfg, **kwargs)
        return train_lora_sft(ctx.lm, ctx.train_items, ctx.target, adapter_dir, ctx.judge_cfg,
                              progress=ctx.progress, **kwargs)
    return build


register("lora", TrainOptions, "a LoRA adapter trained by SFT on target-consistent labels", VAT_METHODS)(
    _trained("lora"))
register("dpo", TrainOptions, "a LoRA adapter trained by DPO (chosen: the target-consistent label)",
         VAT_METHODS)(_trained("dpo"))
_ALIASES = {"sft": "lora"}
_FEWSHOT = re.compile(r"^(?P<base>(?:persona-)?fewshot)-(?P<k>\d+)$")


def vat_method(name: str) -> tuple[Method, dict]:
    """The registered value-targeted method a name stands for, with the options the name carries
    (``fewshot-8`` is ``fewshot`` with ``k=8``); KeyError when it is none of them."""
    key = _ALIASES.get(name, name)
    m = _FEWSHOT.match(key)
    if m:
        return VAT_METHODS[m["base"]], {"k": int(m["k"])}
    if key in ("fewshot", "persona-fewshot"):
        raise AligntaxError("few-shot interventions are named fewshot-K or persona-fewshot-K, e.g. fewshot-4")
    return VAT_METHODS[key], {}


def describe_vat() -> str:
    """The value-targeted methods and their options, one block each."""
    lines = []
    for m in VAT_METHODS.values():
        lines.append(f"{m.name}: {m.help}")
        for f in dataclasses.fields(m.options):
            lines.append(f"    {f.name}: {spec_of(f).help}")
    return "\n".join(lines)


def build_intervention(name: str, lm, target: str, train_items: Sequence[ValueItem] = (),
                       judge_cfg: JudgeConfig | None = None, *, seed: int = 0, exclude_ids: set[str] | None = None,
                       progress: bool = False, options: dict | None = None, **method_options) -> Intervention:
    """Make an intervention by name. The value-targeted methods are registered in :data:`VAT_METHODS`
    with a typed options dataclass each (:func:`describe_vat`): none, persona, fewshot-K,
    persona-fewshot-K, steer (``strength``, ``layer``), lora / dpo (``steps``, ``lr``, ``adapter_dir``:
    where the adapter is saved, or loaded from when it already holds a matching one), adapter
    (``adapter``: a PEFT LoRA folder, read only), els (``energy_dir``: a bank from ``aligntax els
    train`` with its tuned setting; not aimed at any value, so ``target`` only names the value its gain
    is reported for), and the validation oracles ``oracle`` (target items only) and ``uniform`` (every
    item) with ``oracle_gain`` / ``oracle_bias``. ``method_options`` may hold the options of several
    methods (a command line offers them all); each method takes its own. Training-based methods use only
    ``train_items`` (never ``exclude_ids``, e.g. the evaluation ids).

    Any other method of the steering registry (:mod:`aligntax.interventions.registry`: refusal-ablation,
    cast, system-prompt, ...) is built from it with ``options`` (its registered options, e.g. ``path``),
    so the value tax of every steering method is measured the same way; ``options`` also reach ``els``."""
    key = name.strip().lower()
    t = resolve_value(target)
    ctx = VatContext(lm, t, train_items, judge_cfg or JudgeConfig(), seed, exclude_ids, progress, dict(options or {}))
    taken = {f.name for m in VAT_METHODS.values() for f in dataclasses.fields(m.options)}
    unknown = sorted(set(method_options) - taken)
    if unknown:
        raise AligntaxError(f"Unknown options {', '.join(unknown)} (the value-targeted methods take "
                            f"{', '.join(sorted(taken))}; a steering method's options go in options=).")
    if key in ("lora", "sft", "dpo") and method_options.get("adapter") is not None:
        raise AligntaxError("--adapter evaluates an existing adapter (use --intervention adapter); "
                            "lora/dpo train a new one into --adapter-dir")
    try:
        method, implied = vat_method(key)
    except KeyError:
        method = None
    if method is not None:
        return method.make(ctx, only_known=True, **method_options, **implied)
    from aligntax.interventions.registry import METHODS, make_intervention

    if key in METHODS:
        iv = make_intervention(key, lm, **(options or {}))
        iv.cacheable = False  # its config names its folder, not the content
        return iv
    raise AligntaxError(f"Unknown intervention '{name}'; use one of {', '.join(INTERVENTIONS)} or a registered "
                        f"method ({', '.join(METHODS)})")
