"""A bank of per-layer energy models for one LLM, ranked by validation accuracy, saved without pickle.

Layout of a bank folder::

    energy.json            # format, model fingerprint, config, layers (ranked), per-layer architecture,
                           # input normalisation kind, median residual norm, data summary, metrics
    energy.safetensors     # "layer.<l>.<parameter or buffer>" for every layer
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from aligntax.artefacts import TensorArtefact
from aligntax.energy.model import EnergyConfig, EnergyModel
from aligntax.energy.train import EnergyTrainer, rank_key
from aligntax.errors import AligntaxError, DataError

FORMAT = "aligntax.energy/1"
SIDECAR = "energy.json"
WEIGHTS = "energy.safetensors"
_FILES = TensorArtefact(FORMAT, SIDECAR, WEIGHTS, what="energy bank")


@dataclass
class EnergyBank:
    """Energy models by layer, with metrics; ``layers`` is ranked best first."""

    models: dict[int, EnergyModel]
    config: EnergyConfig = field(default_factory=EnergyConfig)
    fingerprint: dict[str, Any] = field(default_factory=dict)
    # per layer: metrics, train_metrics, data, best_epoch
    info: dict[int, dict[str, Any]] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.models = {int(k): m.eval() for k, m in self.models.items()}
        self.info = {int(k): v for k, v in self.info.items()}
        dims = {m.dim for m in self.models.values()}
        if len(dims) > 1:
            raise AligntaxError(f"Energy models of one bank must share the hidden size; got {sorted(dims)}.")

    @property
    def hidden_size(self) -> int:
        return next(iter(self.models.values())).dim if self.models else 0

    @property
    def layers(self) -> list[int]:
        """Layers ranked by validation accuracy, then AUROC (best first)."""
        return sorted(
            self.models, key=lambda layer: (tuple(-x for x in rank_key(self.metrics(layer))), layer)
        )

    def metrics(self, layer: int) -> dict[str, Any]:
        metrics: dict[str, Any] = self.info.get(int(layer), {}).get("metrics", {})
        return metrics

    def median_norm(self, layer: int) -> float | None:
        v = self.info.get(int(layer), {}).get("data", {}).get("median_norm")
        return float(v) if v is not None else None

    def top(self, k: int) -> list[int]:
        return self.layers[:k]

    def __getitem__(self, layer: int) -> EnergyModel:
        return self.models[int(layer)]

    def summary(self) -> list[dict[str, Any]]:
        """One row per layer (ranked): layer, val acc, AUROC, mean energies, median norm."""
        rows = []
        for rank, layer in enumerate(self.layers):
            m = self.metrics(layer)
            rows.append(
                {
                    "rank": rank,
                    "layer": layer,
                    "val_acc": m.get("acc"),
                    "val_auroc": m.get("auroc"),
                    "val_balanced_acc": m.get("balanced_acc"),
                    "median_norm": self.median_norm(layer),
                }
            )
        return rows

    # ---- disk -------------------------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        tensors = {
            f"layer.{layer}.{name}": t.detach().float().cpu().contiguous()
            for layer, m in self.models.items()
            for name, t in m.state_dict().items()
        }
        return _FILES.save(
            directory,
            tensors,
            {
                "fingerprint": self.fingerprint,
                "hidden_size": self.hidden_size,
                "layers": self.layers,
                "config": self.config.to_dict(),
                "normalization": self.config.normalize,
                "arch": {str(layer): m.arch() for layer, m in self.models.items()},
                "info": {str(layer): self.info.get(layer, {}) for layer in self.models},
                "metadata": self.metadata,
            },
        )

    @classmethod
    def load(
        cls,
        directory: str | Path,
        expect_fingerprint: dict[str, Any] | None = None,
        expect_hidden_size: int | None = None,
        layers: Sequence[int] | None = None,
        map_location: str | torch.device = "cpu",
    ) -> EnergyBank:
        """Load a bank; refuse one made for another model (``CompatibilityError`` naming both)."""
        directory = Path(directory)
        meta, tensors = _FILES.load(
            directory, expect_fingerprint, expect_hidden_size, device=str(map_location)
        )
        want = [int(x) for x in (layers if layers is not None else meta["arch"].keys())]
        models = {}
        for layer in want:
            arch = meta["arch"].get(str(layer))
            if arch is None:
                raise DataError(
                    f"Energy bank {directory} has no model for layer {layer} "
                    f"(it has layers {sorted(int(k) for k in meta['arch'])})."
                )
            m = EnergyModel(arch["dim"], arch["widths"], arch["layernorm"], arch["dropout"])
            prefix = f"layer.{layer}."
            state = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
            m.load_state_dict(state, strict=True)
            models[layer] = m.to(map_location).eval()
        info = {int(k): v for k, v in meta.get("info", {}).items() if int(k) in models}
        return cls(
            models,
            EnergyConfig.from_dict(meta.get("config", {})),
            meta["fingerprint"],
            info,
            meta.get("metadata") or {},
        )


def train_layers(
    acts_by_layer: dict[int, torch.Tensor],
    labels: Sequence[int] | torch.Tensor,
    config: EnergyConfig | None = None,
    fingerprint: dict[str, Any] | None = None,
    layers: Sequence[int] | None = None,
    progress: bool = False,
    metadata: dict[str, Any] | None = None,
) -> EnergyBank:
    """Train one energy model per layer; ``labels[i]`` is 1 for a bad (undesirable) state, 0 for good.

    See :func:`aligntax.energy.state_labels` to derive them from prompt labels and refusals.
    """
    config = config or EnergyConfig()
    y = torch.as_tensor(labels).long().flatten()
    if not set(y.unique().tolist()) <= {0, 1}:
        raise DataError("labels must be 0 (good) or 1 (bad).")
    models: dict[int, EnergyModel] = {}
    info: dict[int, dict[str, Any]] = {}
    todo = list(layers if layers is not None else sorted(acts_by_layer))
    bar = tqdm(total=len(todo) * config.folds, desc="energy models", unit="model", disable=not progress)
    for layer in todo:
        x = acts_by_layer[layer]
        if len(x) != len(y):
            raise DataError(f"Layer {layer}: {len(x)} states but {len(y)} labels.")
        trainer, good, bad = EnergyTrainer(config), x[y == 0], x[y == 1]
        runs = []
        for f in range(config.folds):
            runs.append(trainer.train(good, bad, fold=f))
            bar.update()
        res = runs[0]
        models[int(layer)] = res.model
        info[int(layer)] = {
            "metrics": _mean_metrics([r.metrics for r in runs]),
            "train_metrics": res.train_metrics,
            "data": res.data,
            "best_epoch": res.best_epoch,
            "epochs_run": len(res.history),
        }
        if config.folds > 1:
            info[int(layer)]["fold_metrics"] = [r.metrics for r in runs]
        m = info[int(layer)]["metrics"]
        bar.set_postfix_str(f"layer {layer}: val acc {m['acc']:.3f} auroc {m['auroc']:.3f}")
    bar.close()
    meta = {
        "n_states": len(y),
        "folds": config.folds,
        "n_good": int((y == 0).sum()),
        "n_bad": int((y == 1).sum()),
        **(metadata or {}),
    }
    return EnergyBank(models, config, dict(fingerprint or {}), info, meta)


def _mean_metrics(per_fold: list[dict[str, Any]]) -> dict[str, Any]:
    """Validation metrics averaged over folds (counts summed); one fold is returned as it is."""
    if len(per_fold) == 1:
        return per_fold[0]
    out: dict[str, Any] = {}
    for key in per_fold[0]:
        vals = [float(m[key]) for m in per_fold if m.get(key) is not None]
        if key.startswith("n_"):
            out[key] = int(sum(vals))
        else:
            finite = [v for v in vals if v == v]
            out[key] = sum(finite) / len(finite) if finite else float("nan")
    return out
