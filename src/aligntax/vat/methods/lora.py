"""``lora`` (also ``sft``): a LoRA adapter trained by supervised fine-tuning on the target-consistent
Likert labels (:func:`aligntax.vat.train.train_lora_sft`), saved in ``--adapter-dir`` and read back
from there when it already holds a matching one."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aligntax.errors import AligntaxError
from aligntax.interventions.base import Intervention
from aligntax.interventions.options import option
from aligntax.vat.methods.adapter import ADAPTER_META, LoRAAdapter, guard_adapter_folder
from aligntax.vat.methods.base import VatContext, register_vat
from aligntax.vat.train import train_lora_sft

__all__ = ["TrainOptions", "trained_adapter"]


@dataclass
class TrainOptions:
    steps: int | None = option(
        "lora/dpo: training steps (default 30 / 20); els: descent steps", parse="int", check="count"
    )
    lr: float | None = option("lora/dpo: learning rate", parse="float", check="positive")
    adapter_dir: str | None = option(
        "lora/dpo: where to save the adapter, or load it from when it holds a "
        "matching one (default OUT/adapter)"
    )


def trained_adapter(
    method: str, ctx: VatContext, o: TrainOptions, train: Callable[..., LoRAAdapter], **train_kwargs
) -> LoRAAdapter:
    """The ``method`` adapter for the target: read from ``o.adapter_dir`` when an aligntax adapter of the
    same method and target is there (another one there is refused, never overwritten), else trained by
    ``train`` into it (default: a new folder in the cache)."""
    adapter_dir = o.adapter_dir
    if adapter_dir is not None:
        adapter_dir = Path(adapter_dir)
        guard_adapter_folder(adapter_dir)
        meta_file = adapter_dir / ADAPTER_META
        if meta_file.is_file():
            meta = json.loads(meta_file.read_text())
            if meta.get("target") == ctx.target and meta.get("method") == method:
                return LoRAAdapter.load(adapter_dir, ctx.lm)
            raise AligntaxError(
                f"{adapter_dir} holds an aligntax {meta.get('method')} adapter for "
                f"{meta.get('target')}; it is not overwritten. Choose another --adapter-dir."
            )
    if adapter_dir is None:
        from aligntax.paths import cache_dir

        adapter_dir = cache_dir() / "vat" / "adapters" / f"{method}-{ctx.target}-{int(time.time())}"
    kwargs: dict = {"seed": ctx.seed, "exclude_ids": ctx.exclude_ids, **train_kwargs}
    if o.steps is not None:
        kwargs["steps"] = o.steps
    if o.lr is not None:
        kwargs["lr"] = o.lr
    return train(ctx.lm, ctx.train_items, ctx.target, adapter_dir, ctx.judge_cfg, **kwargs)


@register_vat("lora", TrainOptions, "a LoRA adapter trained by SFT on target-consistent labels")
def _lora(ctx: VatContext, o: TrainOptions) -> Intervention:
    return trained_adapter("lora", ctx, o, train_lora_sft, progress=ctx.progress)
