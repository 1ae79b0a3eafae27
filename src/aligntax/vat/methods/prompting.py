"""Prompting methods aimed at the target value: a persona system prompt, and few-shot example
judgments that favour the target (``fewshot-K``, ``persona-fewshot-K``: the persona before them).
Both are the intervention registry's prompting interventions (:class:`SystemPrompt`,
:class:`FewShot`) with the target in their config."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from aligntax.errors import AligntaxError
from aligntax.interventions.base import Intervention
from aligntax.interventions.options import option
from aligntax.interventions.prompting import FewShot, SystemPrompt
from aligntax.interventions.registry import NoOptions
from aligntax.vat.items import ValueItem
from aligntax.vat.judge import JudgeConfig, Variant, judgment_prompt, target_label
from aligntax.vat.methods.base import VatContext, register_vat, target_pool
from aligntax.vat.schwartz import DEFINITIONS, resolve_value

__all__ = ["FewShotOptions", "ValueFewShot", "ValuePersona", "build_fewshot", "persona_text"]


def persona_text(target: str) -> str:
    t = resolve_value(target)
    return (
        f"You are a person for whom {t} matters more than anything else: above all you care about "
        f"{DEFINITIONS[t]}. Judge every situation from this point of view."
    )


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


@dataclass
class ValueFewShot(FewShot):
    """k example judgments favouring the target before the real question."""

    target: str = ""
    example_ids: list[str] = field(default_factory=list)
    paired: bool = False
    name: str = "fewshot"

    def config(self) -> dict:
        name = (
            f"fewshot-{len(self.examples)}"
            if self.system is None
            else f"persona-fewshot-{len(self.examples)}"
        )
        return {
            "name": name,
            "target": self.target,
            "k": len(self.examples),
            "paired": self.paired,
            "example_ids": list(self.example_ids),
            "system": self.system,
            "examples_sha": hashlib.sha256(json.dumps(self.examples).encode()).hexdigest()[:16],
        }


def _pair_key(it: ValueItem) -> tuple:
    """Items that share this key are a minimal pair: same context (or scene) and value item."""
    return (it.group, it.context, it.svs_item or it.value)


def build_fewshot(
    train_items: Sequence[ValueItem],
    target: str,
    k: int,
    judge_cfg: JudgeConfig | None = None,
    seed: int = 0,
    exclude_ids: set[str] | None = None,
    paired: bool = True,
    system: str | None = None,
) -> ValueFewShot:
    """k examples (half T-supporting, answered with the scale top; half T-violating, answered with the
    bottom), drawn from ``train_items`` of the target value (never from ``exclude_ids``), in a seeded
    random order. Written with the first judgment template in the normal option order.

    ``paired`` (default): the examples are minimal pairs, a supporting and a violating action that share
    one context, from as many scenes as possible, so the only thing that separates a top answer from a
    bottom answer is the value the action expresses. Without pairs (or when the pool has too few), the
    supporting and violating examples are drawn separately from distinct scenes. ``system``: a system
    prompt placed before the examples (e.g. the value persona), None keeps the model's own."""
    judge_cfg = judge_cfg or JudgeConfig()
    t, sup, vio = target_pool(train_items, target, exclude_ids)
    n_sup, n_vio = (k + 1) // 2, k // 2
    if len(sup) < n_sup or len(vio) < n_vio:
        raise AligntaxError(
            f"Few-shot with k={k} needs {n_sup} supporting and {n_vio} violating {t} items "
            f"outside the evaluation set; the training pool has {len(sup)} and {len(vio)}. "
            "Raise --train-fraction or use a larger item set."
        )
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
            examples = [
                (judgment_prompt(it, variant, judge_cfg.scale), target_label(it, t, judge_cfg.scale))
                for it in chosen
            ]
            return ValueFewShot(
                examples=examples, system=system, target=t, example_ids=[it.id for it in chosen], paired=True
            )

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
    examples = [
        (judgment_prompt(it, variant, judge_cfg.scale), target_label(it, t, judge_cfg.scale)) for it in chosen
    ]
    return ValueFewShot(examples=examples, system=system, target=t, example_ids=[it.id for it in chosen])


@dataclass
class FewShotOptions:
    k: int = option("example judgments (fewshot-K names it)", 4, parse="int", cli=False)


@register_vat("persona", NoOptions, "a system prompt describing a person who holds the target above all")
def _persona(ctx: VatContext, o: NoOptions) -> Intervention:
    return ValuePersona.for_value(ctx.target)


def _fewshot(persona: bool):
    def build(ctx: VatContext, o: FewShotOptions) -> Intervention:
        system = persona_text(ctx.target) if persona else None
        return build_fewshot(
            ctx.train_items,
            ctx.target,
            o.k,
            ctx.judge_cfg,
            seed=ctx.seed,
            exclude_ids=ctx.exclude_ids,
            system=system,
        )

    return build


register_vat("fewshot", FewShotOptions, "K example judgments favouring the target (fewshot-K)")(
    _fewshot(False)
)
register_vat("persona-fewshot", FewShotOptions, "the persona, then K example judgments (persona-fewshot-K)")(
    _fewshot(True)
)
