"""``steer``: the target's mean-difference vector added to the residual stream at one layer, with the
intervention registry's :class:`~aligntax.interventions.vectors.ActivationAddition` (at the last
prompt token and every generated token). Unlike the registry's vector methods, which read a saved
vector folder, the vector is computed here from the held-out training items of the target value."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from aligntax.activations.capture import capture
from aligntax.errors import AligntaxError
from aligntax.interventions.base import Intervention
from aligntax.interventions.options import option
from aligntax.interventions.vectors import ActivationAddition
from aligntax.vat.items import ValueItem
from aligntax.vat.judge import JudgeConfig, judgment_prompt
from aligntax.vat.methods.base import VatContext, register_vat, target_pool

__all__ = ["SteerOptions", "compute_steering_vector"]


def compute_steering_vector(
    lm,
    train_items: Sequence[ValueItem],
    target: str,
    judge_cfg: JudgeConfig | None = None,
    layer: int | None = None,
    strength: float = 1.0,
    exclude_ids: set[str] | None = None,
) -> ActivationAddition:
    """``strength`` times the difference in means (T-supporting minus T-violating) of the
    response-start activations of the judgment prompts of the target's training items, at ``layer``
    (default: the middle layer), added there. All judgment template variants are used."""
    judge_cfg = judge_cfg or JudgeConfig()
    t, sup, vio = target_pool(train_items, target, exclude_ids)
    if len(sup) < 2 or len(vio) < 2:
        raise AligntaxError(
            f"Steering needs at least 2 supporting and 2 violating {t} training items "
            f"(have {len(sup)} and {len(vio)}); raise --train-fraction."
        )
    layer = lm.num_layers // 2 if layer is None else int(layer)
    if not 0 <= layer < lm.num_layers:
        raise AligntaxError(f"layer must be in 0..{lm.num_layers - 1}")
    variants = judge_cfg.variants()

    def acts(items):
        prompts = [judgment_prompt(it, v, judge_cfg.scale) for it in items for v in variants]
        return capture(
            lm,
            prompts,
            [layer],
            position="last",
            system=judge_cfg.system,
            batch_size=judge_cfg.batch_size,
            progress=False,
        )[layer]

    vec = acts(sup).mean(0) - acts(vio).mean(0)
    return ActivationAddition({layer: vec}, coeff=strength, positions="last_and_generated", name="steer")


@dataclass
class SteerOptions:
    strength: float = option(
        "steer: multiplier of the target's mean-difference vector", 4.0, parse="float", check="finite"
    )
    layer: int | None = option(
        "steer: the vector's layer (default: the middle one); vector methods: the layer "
        "whose saved vector is used (default: the folder's)",
        parse="int",
        check="count",
    )


@register_vat("steer", SteerOptions, "the target's mean-difference vector added at one layer")
def _steer(ctx: VatContext, o: SteerOptions) -> Intervention:
    return compute_steering_vector(
        ctx.lm,
        ctx.train_items,
        ctx.target,
        ctx.judge_cfg,
        layer=o.layer,
        strength=o.strength,
        exclude_ids=ctx.exclude_ids,
    )
