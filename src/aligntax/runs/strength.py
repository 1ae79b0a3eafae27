"""``aligntax els row-strength``: fit the learned per-row ELS strength of a training folder.

The model (:class:`aligntax.energy.front.RowStrength`) is fitted to the outcome of steering on the
folder's training prompts: the benign prompts the unsteered model refused (the over-refusals, by the
folder's judged labels) and harmful prompts. Each is steered without gate or row decision (every row at
full strength, with the given layer, eta, steps, horizon and harm_orth) and judged. A benign prompt is
worth steering (1) and a harmful one must not be (0); the rows where steering decides, a benign refusal
turned into an answer and a harmful refusal turned into compliance, weigh ``flip_weight`` times in the
fit. The unsteered outcome is the folder's label run (the same greedy model on the same prompts). The
features (gate logit, row energy, refusal and harm projections at the first steered block) are read
from the states the folder recorded, so only the steered generation runs the model. Written to
``row_strength.safetensors`` + ``row_strength.json`` and ``row_strength/samples.jsonl`` (one line per
prompt: outcome unsteered and steered, features, fitted strength).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from aligntax.errors import AligntaxError


@dataclass
class StrengthConfig:
    """Settings of ``aligntax els row-strength``."""

    steer: str = "runs/els"
    model: str | None = None  # default: the folder's
    # the steering the strength is fitted under (None: the folder's tuned setting, else ELS defaults);
    # never gated: the strength model is what decides
    layers: list[int] | None = None
    eta: float | None = None
    steps: int | None = None
    horizon: int | None = None
    harm_orth: int | None = None
    limit_benign: int | None = 200  # over-refused benign training prompts (sampled)
    limit_harmful: int | None = 200  # harmful training prompts (sampled)
    max_new_tokens: int = 32
    flip_weight: float = 3.0
    floor: float = 0.1
    l2: float = 1e-2
    judge: str = "classifier"
    batch_size: int = 32
    dtype: str = "bf16"
    seed: int = 0
    progress: bool = True


def fit_strength(cfg: StrengthConfig, lm=None) -> dict:
    """Fit, save and summarise the folder's row strength model (see the module docstring); the ELS
    folder's lock is held meanwhile (its one writer)."""
    from aligntax.runfolder import run_lock

    with run_lock(cfg.steer):
        return _fit_strength(cfg, lm)


def _fit_strength(cfg: StrengthConfig, lm=None) -> dict:
    from aligntax.config import load_config
    from aligntax.energy.front import HarmBasis, RowStrength, fit_row_strength
    from aligntax.generation import GenerationConfig, generate
    from aligntax.interventions.els import EnergySteering
    from aligntax.interventions.vectors import SteeringVectors
    from aligntax.judges import get_judge
    from aligntax.models import load_model
    from aligntax.runs.els_train import (
        ELSTrainConfig,
        judged_labels,
        sampled,
        training_items,
        training_states,
    )
    from aligntax.runs.fsio import write_json_atomic, write_text_atomic

    folder = Path(cfg.steer)
    tcfg = load_config(ELSTrainConfig, folder / "train_config.json")
    lm = lm or load_model(cfg.model or tcfg.model, dtype=cfg.dtype)
    items = [item for part in training_items(tcfg) for item in part]
    refused, _ = judged_labels(folder / "labels", items)
    _, acts, _ = training_states(folder)
    common = dict(
        layers=cfg.layers,
        eta=cfg.eta,
        steps=cfg.steps,
        horizon=cfg.horizon,
        threshold="none",
        row_threshold="none",
        gate_ramp="none",
        row_strength="none",
    )
    iv = EnergySteering.from_dir(folder, lm, gate="none", harm_orth=cfg.harm_orth, **common)
    reader = EnergySteering.from_dir(folder, lm, gate=True, **common)  # the features: the gate's logit
    layer = min(iv.models)  # the first steered block
    if not HarmBasis.exists(folder):
        raise AligntaxError(
            f"{folder} has no harm basis; compute it first with `aligntax els harm-basis --steer {folder}`."
        )
    fp, hs = dict(lm.fingerprint), lm.hidden_size
    harm_dir = HarmBasis.load(folder, expect_fingerprint=fp, expect_hidden_size=hs).get(layer, 1)[0]
    vectors = SteeringVectors.load(folder / "vectors", expect_fingerprint=fp, expect_hidden_size=hs)
    refusal_dir = vectors.get("refusal", layer).float()
    refusal_dir = refusal_dir / refusal_dir.norm().clamp_min(1e-12)

    benign = [i for i, (it, r) in enumerate(zip(items, refused, strict=True)) if it.label == "benign" and r]
    harmful = [i for i, it in enumerate(items) if it.label == "harmful"]
    chosen = sorted(
        sampled(benign, cfg.limit_benign, cfg.seed) + sampled(harmful, cfg.limit_harmful, cfg.seed)
    )
    if (
        not chosen
        or all(items[i].label == "benign" for i in chosen)
        or all(items[i].label == "harmful" for i in chosen)
    ):
        raise AligntaxError("The row strength fit needs over-refused benign and harmful training prompts.")
    prompts = [items[i].prompt for i in chosen]
    gens = generate(
        lm,
        prompts,
        GenerationConfig(max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size),
        iv,
        progress=cfg.progress,
        desc="row strength: steered",
    )
    verdicts = get_judge(cfg.judge).judge(prompts, [g.response for g in gens])

    worth = torch.tensor([items[i].label == "benign" for i in chosen])
    before = [refused[i] for i in chosen]
    after = [v.refused for v in verdicts]
    rescued = [w and b and not a for w, b, a in zip(worth.tolist(), before, after, strict=True)]
    lost = [(not w) and b and not a for w, b, a in zip(worth.tolist(), before, after, strict=True)]
    weight = torch.tensor([cfg.flip_weight if r or x else 1.0 for r, x in zip(rescued, lost, strict=True)])
    idx = torch.tensor(chosen)
    states = {b: acts[b][idx] for b in sorted({*reader.gate.layers, layer})}
    features = reader.kernel(lm.num_layers).row_features(states, (refusal_dir, harm_dir))
    n_b, n_h = int(worth.sum()), int((~worth).sum())
    outcome = {
        "benign_over_refused": n_b,
        "benign_answered_steered": int(sum(rescued)),
        "harmful": n_h,
        "harmful_refused_unsteered": int(
            sum(b for b, w in zip(before, worth.tolist(), strict=True) if not w)
        ),
        "harmful_refusals_lost": int(sum(lost)),
    }
    model = fit_row_strength(
        features,
        worth,
        layer,
        refusal_dir,
        harm_dir,
        weight,
        cfg.l2,
        cfg.floor,
        fp,
        metadata={"fitted_under": iv.config(), "outcome": outcome, "config": asdict(cfg)},
    )
    model.save(folder)
    strength = model.strength(features)
    out = folder / "row_strength"
    out.mkdir(exist_ok=True)
    write_text_atomic(
        out / "samples.jsonl",
        "".join(
            json.dumps(r) + "\n"
            for r in [
                {
                    "source": items[i].source,
                    "id": items[i].id,
                    "label": items[i].label,
                    "refused_unsteered": b,
                    "refused_steered": a,
                    "weight": float(w),
                    "strength": round(float(s), 4),
                    "features": [round(float(f), 4) for f in feats],
                }
                for i, b, a, w, s, feats in zip(
                    chosen, before, after, weight, strength, features, strict=True
                )
            ]
        ),
    )
    summary = {"layer": layer, "outcome": outcome, "info": model.info}
    write_json_atomic(out / "summary.json", summary, default=str)
    RowStrength.load(folder, expect_fingerprint=fp, expect_hidden_size=hs)  # written as it will be read
    return summary
