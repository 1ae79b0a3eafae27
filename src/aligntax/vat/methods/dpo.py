"""``dpo``: a LoRA adapter trained by direct preference optimisation (chosen: the target-consistent
Likert label, rejected: the opposite end; :func:`aligntax.vat.train.train_dpo`), saved and reused like
``lora``'s."""

from __future__ import annotations

from aligntax.interventions.base import Intervention
from aligntax.vat.methods.base import VatContext, register_vat
from aligntax.vat.methods.lora import TrainOptions, trained_adapter
from aligntax.vat.train import train_dpo


@register_vat("dpo", TrainOptions, "a LoRA adapter trained by DPO (chosen: the target-consistent label)")
def _dpo(ctx: VatContext, o: TrainOptions) -> Intervention:
    return trained_adapter("dpo", ctx, o, train_dpo)
