"""Training the value-targeted LoRA adapters on the held-out items of the target value.

- :func:`train_lora_sft` (``lora``): supervised fine-tuning with peft that teaches the
  target-consistent Likert label at the response start.
- :func:`train_dpo` (``dpo``): trl's ``DPOTrainer``, chosen = the target-consistent label, rejected =
  the opposite end of the scale.

Both train a copy of the model (``lm.model`` is never changed), save the adapter in peft's format
with ``vat_adapter.json`` beside it, and return it loaded as a
:class:`~aligntax.vat.methods.adapter.LoRAAdapter` (applied by hooks)."""

from __future__ import annotations

import copy
import json
import random
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from aligntax.errors import AligntaxError
from aligntax.vat.items import ValueItem
from aligntax.vat.judge import JudgeConfig, judgment_prompt, scale_token_ids, target_label
from aligntax.vat.methods.adapter import ADAPTER_META, LoRAAdapter, guard_adapter_folder
from aligntax.vat.methods.base import target_pool

__all__ = ["train_dpo", "train_lora_sft"]


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


def _training_examples(
    lm, train_items: Sequence[ValueItem], target: str, judge_cfg: JudgeConfig, exclude_ids: set[str] | None
):
    t, sup, vio = target_pool(train_items, target, exclude_ids)
    if not sup or not vio:
        raise AligntaxError(
            f"Training needs supporting and violating {t} items outside the evaluation set "
            f"(have {len(sup)} and {len(vio)}); raise --train-fraction."
        )
    rows = []
    for it in sup + vio:
        for v in judge_cfg.variants():
            rows.append(
                (
                    it,
                    v,
                    judgment_prompt(it, v, judge_cfg.scale),
                    target_label(it, t, judge_cfg.scale, v.order),
                    target_label(it, t, judge_cfg.scale, v.order, supportive=False),
                )
            )
    return t, rows


def _write_meta(out: Path, lm, meta: dict) -> None:
    meta = {**meta, "base_fingerprint": lm.fingerprint, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    (out / ADAPTER_META).write_text(json.dumps(meta, indent=2, default=str))


def train_lora_sft(
    lm,
    train_items: Sequence[ValueItem],
    target: str,
    out_dir: str | Path,
    judge_cfg: JudgeConfig | None = None,
    steps: int = 30,
    lr: float = 5e-4,
    r: int = 8,
    alpha: int = 16,
    batch_size: int = 4,
    seed: int = 0,
    target_modules: Sequence[str] | None = None,
    exclude_ids: set[str] | None = None,
    progress: bool = False,
) -> LoRAAdapter:
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
    peft_model = get_peft_model(
        model, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=mods, task_type="CAUSAL_LM")
    )
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
    _write_meta(
        out,
        lm,
        {
            "method": "lora",
            "target": t,
            "steps": steps,
            "lr": lr,
            "r": r,
            "alpha": alpha,
            "batch_size": batch_size,
            "seed": seed,
            "target_modules": mods,
            "judge": judge_cfg.to_dict(),
            "train_ids": sorted({it.id for it, *_ in rows}),
            "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None,
            "losses": losses,
        },
    )
    del peft_model, model
    return LoRAAdapter.load(out, lm)


def train_dpo(
    lm,
    train_items: Sequence[ValueItem],
    target: str,
    out_dir: str | Path,
    judge_cfg: JudgeConfig | None = None,
    steps: int = 20,
    lr: float = 5e-5,
    beta: float = 0.1,
    r: int = 8,
    alpha: int = 16,
    batch_size: int = 2,
    seed: int = 0,
    target_modules: Sequence[str] | None = None,
    exclude_ids: set[str] | None = None,
) -> LoRAAdapter:
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

    data = Dataset.from_list(
        [
            {
                "prompt": convo(p),
                "chosen": [{"role": "assistant", "content": good}],
                "rejected": [{"role": "assistant", "content": bad}],
            }
            for _, _, p, good, bad in rows
        ]
    )
    model = copy.deepcopy(lm.model)
    mods = _lora_targets(model, target_modules)
    tok = lm.tokenizer
    saved_side = tok.padding_side
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        args = DPOConfig(
            output_dir=tmp,
            max_steps=steps,
            per_device_train_batch_size=batch_size,
            learning_rate=lr,
            beta=beta,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            bf16=False,
            gradient_checkpointing=False,
            use_cpu=not torch.cuda.is_available(),
            seed=seed,
            max_length=1024,
            disable_tqdm=True,
            lr_scheduler_type="constant",
            warmup_steps=0,
            dataloader_num_workers=0,
        )
        bars_were_on = datasets_logging.is_progress_bar_enabled()
        datasets_logging.disable_progress_bar()
        try:
            trainer = DPOTrainer(
                model=model,
                args=args,
                train_dataset=data,
                processing_class=tok,
                peft_config=LoraConfig(
                    r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=mods, task_type="CAUSAL_LM"
                ),
            )
            for cb in (PrinterCallback, ProgressCallback):
                trainer.remove_callback(cb)
            result = trainer.train()
        finally:
            tok.padding_side = saved_side
            if bars_were_on:
                datasets_logging.enable_progress_bar()
        trainer.model.save_pretrained(str(out))
        history = [h for h in trainer.state.log_history if "loss" in h]
    _write_meta(
        out,
        lm,
        {
            "method": "dpo",
            "target": t,
            "steps": steps,
            "lr": lr,
            "beta": beta,
            "r": r,
            "alpha": alpha,
            "batch_size": batch_size,
            "seed": seed,
            "target_modules": mods,
            "judge": judge_cfg.to_dict(),
            "train_ids": sorted({it.id for it, *_ in rows}),
            "train_loss": getattr(result, "training_loss", None),
            "log": [{k: h[k] for k in h if isinstance(h[k], int | float)} for h in history],
        },
    )
    del trainer, model
    return LoRAAdapter.load(out, lm)
