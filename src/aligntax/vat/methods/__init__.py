"""The interventions ``aligntax vat run`` measures, by name, through one registry
(:data:`~aligntax.vat.methods.base.REGISTRY`):

- every method of the intervention registry (:mod:`aligntax.interventions.registry`: ``none``,
  ``system-prompt``, ``els``, ``refusal-ablation``, ``cast``, ...), built from its registered options
  (e.g. ``path``: the folder ``--steer`` or ``--vectors`` names), so the value tax of every steering
  method is measured the same way;
- the value-targeted methods registered on top of it, one module each: ``persona``, ``fewshot-K`` and
  ``persona-fewshot-K`` (:mod:`.prompting`), ``steer`` (:mod:`.steer`), ``lora`` / ``sft``
  (:mod:`.lora`), ``dpo`` (:mod:`.dpo`), ``adapter`` (:mod:`.adapter`), and the validation oracles
  ``oracle`` and ``uniform`` (:mod:`.oracle`).

``python -c "from aligntax.vat.methods import describe_vat; print(describe_vat())"`` lists the
value-targeted methods with their options.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from aligntax.errors import AligntaxError
from aligntax.interventions.base import Intervention
from aligntax.interventions.registry import describe
from aligntax.vat.items import ValueItem
from aligntax.vat.judge import JudgeConfig
from aligntax.vat.methods import dpo, lora, prompting, steer  # noqa: F401 - importing a module registers its methods
from aligntax.vat.methods.adapter import LoRAAdapter, guard_adapter_folder
from aligntax.vat.methods.base import REGISTRY, VAT_METHODS, VatContext, register_vat
from aligntax.vat.methods.lora import TrainOptions
from aligntax.vat.methods.oracle import OracleBias, OracleOptions
from aligntax.vat.methods.prompting import ValueFewShot, ValuePersona, build_fewshot, persona_text
from aligntax.vat.methods.steer import SteerOptions, compute_steering_vector
from aligntax.vat.schwartz import resolve_value

__all__ = [
    "INTERVENTIONS",
    "REGISTRY",
    "VAT_METHODS",
    "LoRAAdapter",
    "OracleBias",
    "OracleOptions",
    "SteerOptions",
    "TrainOptions",
    "ValueFewShot",
    "ValuePersona",
    "VatContext",
    "build_fewshot",
    "build_intervention",
    "compute_steering_vector",
    "describe_vat",
    "guard_adapter_folder",
    "persona_text",
    "register_vat",
]

# the names vat run offers, few-shot spelt with the usual K
INTERVENTIONS = tuple(
    dict.fromkeys(
        [
            "none",
            "persona",
            "fewshot-2",
            "fewshot-4",
            "fewshot-8",
            "persona-fewshot-2",
            "persona-fewshot-4",
            "persona-fewshot-8",
            "steer",
            "lora",
            "dpo",
            "els",
            "adapter",
            "oracle",
            "uniform",
            *(n for n in REGISTRY if n not in ("fewshot", "persona-fewshot")),
        ]
    )
)


def describe_vat() -> str:
    """The value-targeted methods and their options, one block each."""
    return describe(VAT_METHODS)


def build_intervention(
    name: str,
    lm,
    target: str,
    train_items: Sequence[ValueItem] = (),
    judge_cfg: JudgeConfig | None = None,
    *,
    seed: int = 0,
    exclude_ids: set[str] | None = None,
    progress: bool = False,
    options: dict | None = None,
    **method_options,
) -> Intervention:
    """Make the intervention ``name`` of :data:`REGISTRY` for the target value ``target``.

    ``options``: the method's own options (``intervention_args``, e.g. ``path`` for els or cast,
    ``strength`` for steer); one it does not take is refused. ``method_options`` may hold the options of
    several value-targeted methods (a sweep passing ``strength`` and ``steps`` to every method): each
    value-targeted method takes its own, the intervention registry's methods none, and a name no
    value-targeted method declares is refused (``energy_dir``, removed in 0.2, names ``options={"path": ...}``).
    Training-based methods use only ``train_items`` (never ``exclude_ids``, e.g. the evaluation ids).
    A method of the intervention registry is not aimed at any value: ``target`` then only names the
    value whose shift is reported as the gain."""
    key = name.strip().lower()
    t = resolve_value(target)
    loose = {k: v for k, v in method_options.items() if v is not None}
    if "energy_dir" in loose:
        raise AligntaxError(
            "energy_dir was removed in 0.2; give the folder as options={'path': DIR} (CHANGELOG.md)."
        )
    taken = {f.name for m in VAT_METHODS.values() for f in dataclasses.fields(m.options)}
    unknown = sorted(set(loose) - taken)
    if unknown:
        raise AligntaxError(
            f"Unknown options {', '.join(unknown)} (the value-targeted methods take "
            f"{', '.join(sorted(taken))}; a steering method's options go in options=)."
        )
    if key in ("lora", "sft", "dpo") and loose.get("adapter") is not None:
        raise AligntaxError(
            "--adapter evaluates an existing adapter (use --intervention adapter); "
            "lora/dpo train a new one into --adapter-dir"
        )
    try:
        method, implied = REGISTRY.resolve(key)
    except KeyError:
        raise AligntaxError(f"Unknown intervention '{name}'; use one of {', '.join(INTERVENTIONS)}") from None
    options = dict(options or {})
    if method.name not in VAT_METHODS:
        return method.make(lm, **options)
    own = {f.name for f in dataclasses.fields(method.options)}
    kwargs = {**{k: v for k, v in loose.items() if k in own}, **options, **implied}
    return method.make(
        VatContext(lm, t, train_items, judge_cfg or JudgeConfig(), seed, exclude_ids, progress), **kwargs
    )
