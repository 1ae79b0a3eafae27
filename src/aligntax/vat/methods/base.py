"""The value-targeted methods as a layer over the intervention registry.

``aligntax vat run --intervention NAME`` resolves every name in one place, :data:`REGISTRY`: the
steering and prompting methods of :data:`aligntax.interventions.options.METHODS` (``none``, ``els``,
``cast``, ...) under their own names, and the methods only the value alignment tax has (a persona,
few-shot judgments, a mean-difference vector, LoRA fine-tuning, the validation oracles) from
:data:`VAT_METHODS`. Those are registered with the same :func:`~aligntax.interventions.options.register`
and typed options dataclasses, but are built from a :class:`VatContext` (the model, the target value,
the held-out training items, the judge) instead of a model alone, and their names never shadow a
steering method's (:func:`register_vat` refuses one). The command-line options of ``vat run`` are read
from :data:`REGISTRY` as every steering command's are read from ``METHODS``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aligntax.errors import AligntaxError
from aligntax.interventions.options import Method, register
from aligntax.interventions.registry import METHODS
from aligntax.vat.items import ValueItem
from aligntax.vat.judge import JudgeConfig
from aligntax.vat.schwartz import resolve_value

__all__ = ["REGISTRY", "VAT_METHODS", "VatContext", "VatRegistry", "register_vat", "target_pool"]

VAT_METHODS: dict[str, Method] = {}  # the value-targeted methods: builders take a VatContext


def register_vat(name: str, options: type, help: str) -> Callable:
    """Decorator: register ``build(ctx: VatContext, options)`` as the value-targeted method ``name``; a
    name the intervention registry already holds is refused."""
    if name in METHODS:
        raise AligntaxError(
            f"'{name}' is a method of the intervention registry; a value-targeted method "
            "cannot take its name."
        )
    return register(name, options, help, VAT_METHODS)


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


_ALIASES = {"sft": "lora"}
_FEWSHOT = re.compile(r"^(?P<base>(?:persona-)?fewshot)-(?P<k>\d+)$")


class VatRegistry(Mapping[str, Method]):
    """Every method ``vat run`` takes, by name: the value-targeted methods, then the intervention
    registry's. ``fewshot-K`` and ``persona-fewshot-K`` name ``fewshot`` / ``persona-fewshot`` (with
    ``k`` = K, :meth:`resolve`, which refuses the bare names), ``sft`` names ``lora``. Iterating gives
    each registered method once, under its registered name."""

    def resolve(self, name: str) -> tuple[Method, dict]:
        """The method ``name`` stands for and the options the name carries (``fewshot-8``: ``k=8``);
        KeyError when it is none."""
        key = _ALIASES.get(name, name)
        m = _FEWSHOT.match(key)
        if m:
            return VAT_METHODS[m["base"]], {"k": int(m["k"])}
        if key in ("fewshot", "persona-fewshot"):
            raise AligntaxError(
                "few-shot interventions are named fewshot-K or persona-fewshot-K, e.g. fewshot-4"
            )
        if key in METHODS:
            return METHODS[key], {}
        return VAT_METHODS[key], {}

    def __getitem__(self, name: str) -> Method:
        if name in VAT_METHODS:
            return VAT_METHODS[name]
        return self.resolve(name)[0]

    def __iter__(self) -> Iterator[str]:
        yield from VAT_METHODS
        yield from METHODS

    def __len__(self) -> int:
        return len(VAT_METHODS) + len(METHODS)


REGISTRY = VatRegistry()


def target_pool(train_items: Sequence[ValueItem], target: str, exclude_ids: set[str] | None = None):
    """The target value's name and its supporting and violating training items (sorted by id): the
    data of few-shot examples, the steering vector and the adapters. Only congruent (or unlabelled)
    items, never ``exclude_ids``, so the methods are what they were before the incongruent items
    existed and the incongruent stratum tests them out of distribution."""
    t = resolve_value(target)
    exclude_ids = exclude_ids or set()
    pool = [
        it
        for it in train_items
        if it.value == t and it.id not in exclude_ids and it.desirability != "incongruent"
    ]
    sup = sorted((it for it in pool if it.polarity > 0), key=lambda it: it.id)
    vio = sorted((it for it in pool if it.polarity < 0), key=lambda it: it.id)
    return t, sup, vio
