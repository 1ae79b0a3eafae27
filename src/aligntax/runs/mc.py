"""The ``aligntax mc`` run: score a multiple-choice set with the model (steered or not) and write the folder.

One forward pass per question (batched, longest first, through
:func:`aligntax.generation.generate.text_logits`, so the intervention acts as in a generation step);
the questions, the prompt text and the scoring of the logits are :mod:`aligntax.metrics.mc`'s.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from aligntax.errors import AligntaxError, DataError
from aligntax.interventions.base import Intervention, NoIntervention
from aligntax.metrics.mc import (
    BUILTIN,
    BUILTIN_PATH,
    MCItem,
    MCScore,
    load_mc,
    mc_results,
    mc_score,
    mc_text,
    option_token_ids,
)
from aligntax.runfolder import check_settings, run_lock, write_json_atomic, write_jsonl_atomic


def score_items(
    lm,
    items: Sequence[MCItem],
    intervention: Intervention | None = None,
    system: str | None = None,
    batch_size: int = 16,
    progress: bool = False,
) -> list[MCScore]:
    """Score every question with one forward pass each (batched, longest first), in input order."""
    from aligntax.generation.generate import text_logits

    if batch_size < 1:
        raise AligntaxError("batch_size must be >= 1.")
    intervention = intervention or NoIntervention()
    lm.require_chat_template()
    tok = lm.tokenizer
    letter_ids = option_token_ids(tok, max((len(it.choices) for it in items), default=2))
    texts = [mc_text(tok, it, system, intervention) for it in items]
    lengths = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    order = sorted(range(len(texts)), key=lambda i: (-lengths[i], i))
    logp_sorted = torch.log_softmax(
        text_logits(lm, [texts[i] for i in order], intervention, batch_size, progress, desc="mc"), dim=-1
    )
    out: list[MCScore | None] = [None] * len(items)
    for row, i in enumerate(order):
        out[i] = mc_score(logp_sorted[row], letter_ids, len(items[i].choices))
    return out  # type: ignore[return-value]


def mc_accuracy(
    lm,
    items: Sequence[MCItem],
    intervention: Intervention | None = None,
    system: str | None = None,
    batch_size: int = 16,
    progress: bool = False,
) -> dict:
    """Accuracy with a Wilson 95% interval, per subject, the mean letter mass, and one row per item
    (:func:`aligntax.metrics.mc.mc_results` of :func:`score_items`)."""
    if not items:
        raise DataError("No multiple-choice questions to score.")
    return mc_results(items, score_items(lm, items, intervention, system, batch_size, progress))


@dataclass
class MCConfig:
    """Settings of ``aligntax mc``."""

    out: str
    model: str
    data: str = BUILTIN
    limit: int | None = None
    system: str | None = None
    batch_size: int = 16
    dtype: str = "bf16"
    intervention: str | None = None
    intervention_args: dict = field(default_factory=dict)
    progress: bool = True


# The settings that change a score: a rerun into a folder holding results must agree on them.
_RESULT_FIELDS = ("model", "data", "limit", "system", "dtype", "intervention", "intervention_args")


def run_mc(
    cfg: MCConfig, lm=None, intervention: Intervention | None = None, items: Sequence[MCItem] | None = None
) -> dict:
    """Score the set and write ``OUT/samples.jsonl`` (one line per question) and ``OUT/results.json``;
    ``items``: the questions to score (a subset of ``cfg.data``), instead of loading them.

    One pass scores every question, so a rerun after a kill scores them all again; the folder keeps the
    run-folder contract all the same (lock, ``config.json`` header refusing other settings once results
    exist, atomic files: the samples and results appear whole, together at the end)."""
    out = Path(cfg.out)
    with run_lock(out):
        bound = (out / "results.json").is_file() or (out / "samples.jsonl").is_file()
        check_settings(out, "config.json", asdict(cfg), _RESULT_FIELDS, bound, "multiple-choice run")
        return _run_mc(cfg, out, lm, intervention, items)


def _run_mc(
    cfg: MCConfig, out: Path, lm, intervention: Intervention | None, items: Sequence[MCItem] | None
) -> dict:
    items = list(items) if items is not None else load_mc(cfg.data, cfg.limit)
    if lm is None:
        from aligntax.models import load_model

        lm = load_model(cfg.model, dtype=cfg.dtype)
    if intervention is None and cfg.intervention and cfg.intervention != "none":
        from aligntax.interventions.registry import make_intervention

        intervention = make_intervention(cfg.intervention, lm, **cfg.intervention_args)
    t0 = time.perf_counter()
    res = mc_accuracy(lm, items, intervention, cfg.system, cfg.batch_size, cfg.progress)
    seconds = time.perf_counter() - t0
    write_jsonl_atomic(out / "samples.jsonl", res.pop("rows"))
    results = {
        "config": asdict(cfg),
        "data": str(BUILTIN_PATH) if cfg.data == BUILTIN else cfg.data,
        "intervention": intervention.config() if intervention is not None else None,
        "model_fingerprint": getattr(lm, "fingerprint", None),
        **res,
        "seconds": round(seconds, 2),
    }
    write_json_atomic(out / "results.json", results, default=str)
    return results
