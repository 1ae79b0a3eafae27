"""A harm gate for energy steering: a linear probe that tells harmful prompts from benign ones.

ELS moves a state downhill on an energy that is high for false refusals *and* for jailbreak
compliance. On a small model the energy mostly learns "refusing is bad", so steering a harmful prompt
downhill can talk the model out of a correct refusal. The gate decides once per row, at the last
prompt token, whether the prompt is harmful: ``p = sigmoid(w . (h - mean) / scale + b)`` on the
residual stream entering one block. Rows with ``p >= threshold`` are not steered for the rest of
the generation; the others are steered as usual. The probe needs no judge: its labels are the
prompt sets' own (benign or harmful), so it can be trained on many more prompts than the energy
models, including harmful prompts written in the same style as the benign ones (OR-Bench toxic), so
that it learns harm rather than style.

Saved beside the energy bank as ``gate.safetensors`` + ``gate.json`` (model fingerprint, layer,
normalisation, regularisation, per-layer validation metrics).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from aligntax.activations.compat import TensorArtefact
from aligntax.errors import AligntaxError, DataError

FORMAT = "aligntax.harm-gate/1"
_FILES = TensorArtefact(FORMAT, "gate.json", "gate.safetensors", what="harm gate")


@dataclass
class HarmGate:
    """Logistic probe ``p(harmful | h)`` on the state entering block ``layer`` at the last prompt token."""

    layer: int
    weight: torch.Tensor  # [d]
    bias: float
    mean: torch.Tensor  # [d]
    scale: torch.Tensor  # [d]
    threshold: float = 0.5
    fingerprint: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.layer = int(self.layer)
        self.weight = self.weight.detach().float().flatten().cpu()
        self.mean = self.mean.detach().float().flatten().cpu()
        self.scale = self.scale.detach().float().flatten().cpu().clamp_min(1e-6)
        if not (self.weight.shape == self.mean.shape == self.scale.shape):
            raise AligntaxError("Harm gate weight, mean and scale must have the same length.")
        if not 0.0 < self.threshold < 1.0:
            raise AligntaxError(f"Harm gate threshold must be in (0, 1); got {self.threshold}.")
        self._on: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @property
    def dim(self) -> int:
        return int(self.weight.numel())

    def logit(self, h: torch.Tensor) -> torch.Tensor:
        """Logit of p(harmful) for states ``[..., d]`` (float32)."""
        if h.shape[-1] != self.dim:
            raise AligntaxError(f"Harm gate expects hidden size {self.dim}, got states of shape {tuple(h.shape)}.")
        key = str(h.device)
        if key not in self._on:
            self._on[key] = tuple(t.to(h.device) for t in (self.weight, self.mean, self.scale))
        w, mu, sc = self._on[key]
        return ((h.float() - mu) / sc) @ w + self.bias

    def prob(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logit(h))

    def harmful(self, h: torch.Tensor, threshold: float | None = None) -> torch.Tensor:
        """Bool ``[...]``: the rows the gate holds back (p >= threshold)."""
        return self.prob(h) >= (self.threshold if threshold is None else float(threshold))

    # ---- disk -------------------------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        return _FILES.save(directory, {"weight": self.weight.contiguous(), "mean": self.mean.contiguous(),
                                       "scale": self.scale.contiguous()},
                           {"fingerprint": self.fingerprint, "hidden_size": self.dim, "layer": self.layer,
                            "bias": self.bias, "threshold": self.threshold, "info": self.info})

    @classmethod
    def load(cls, directory: str | Path, expect_fingerprint: dict | None = None,
             expect_hidden_size: int | None = None) -> HarmGate:
        meta, t = _FILES.load(directory, expect_fingerprint, expect_hidden_size)
        return cls(meta["layer"], t["weight"], float(meta["bias"]), t["mean"], t["scale"],
                   float(meta.get("threshold", 0.5)), meta["fingerprint"], meta.get("info") or {})

    @staticmethod
    def exists(directory: str | Path) -> bool:
        return (Path(directory) / _FILES.sidecar).is_file()


def _fit_logistic(x: torch.Tensor, y: torch.Tensor, l2: float, max_iter: int = 200) -> tuple[torch.Tensor, float]:
    """L2-regularised logistic regression by L-BFGS on standardised features; classes weighted equally."""
    w = torch.zeros(x.shape[1], requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    pos = y.float().mean().clamp(1e-6, 1 - 1e-6)
    weights = torch.where(y > 0, 0.5 / pos, 0.5 / (1 - pos))
    opt = torch.optim.LBFGS([w, b], max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ w + b, y.float(), weight=weights)
        loss = loss + l2 * (w * w).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return w.detach(), float(b.detach())


def _rates(logit: torch.Tensor, y: torch.Tensor) -> dict:
    pred = logit >= 0
    yb = y.bool()
    return {"acc": float((pred == yb).float().mean()),
            "harmful_caught": float(pred[yb].float().mean()) if yb.any() else float("nan"),
            "benign_passed": float((~pred[~yb]).float().mean()) if (~yb).any() else float("nan")}


def train_harm_gate(acts_by_layer: dict[int, torch.Tensor], harmful: Sequence[bool] | torch.Tensor,
                    layers: Sequence[int] | None = None, l2: float = 1e-2, folds: int = 5,
                    seed: int = 0, fingerprint: dict | None = None, metadata: dict | None = None,
                    recall: float | None = None) -> HarmGate:
    """Score one probe per candidate layer by ``folds``-fold cross-validated balanced accuracy, keep the
    best layer (ties: the earlier layer), and refit it on all the data.

    Cross-validation rather than one split: the candidate layers differ by about a point, which is
    the noise of a single 20% split. The gate's threshold is 0.5, or with ``recall`` the out-of-fold
    probability above which that share of the harmful prompts falls (never above 0.5): a gate is a
    safety device, and a harmful prompt it lets through may be steered out of its refusal."""
    y = torch.as_tensor(harmful).bool().flatten()
    if y.all() or not y.any():
        raise DataError("The harm gate needs both benign and harmful prompts.")
    if folds < 2:
        raise AligntaxError(f"The harm gate needs at least 2 folds; got {folds}.")
    if recall is not None and not 0.0 < recall < 1.0:
        raise AligntaxError(f"The harm gate's recall target must be in (0, 1); got {recall}.")
    cand = sorted(int(x) for x in (layers if layers is not None else acts_by_layer))
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    splits = [perm[i::folds] for i in range(folds)]
    per_layer, oof = {}, {}
    for layer in cand:
        x = acts_by_layer[layer].float()
        if len(x) != len(y):
            raise DataError(f"Layer {layer}: {len(x)} states but {len(y)} labels.")
        if not torch.isfinite(x).all():
            raise DataError(f"Layer {layer}: activations contain NaN or inf.")
        logits = torch.empty(len(y))
        for va in splits:
            tr = torch.ones(len(y), dtype=torch.bool)
            tr[va] = False
            mu, sd = x[tr].mean(0), x[tr].std(0).clamp_min(1e-6)
            w, b = _fit_logistic((x[tr] - mu) / sd, y[tr], l2)
            logits[va] = ((x[va] - mu) / sd) @ w + b
        per_layer[layer] = _rates(logits, y)
        oof[layer] = logits
        per_layer[layer]["balanced_acc"] = (per_layer[layer]["harmful_caught"] + per_layer[layer]["benign_passed"]) / 2
    best = max(cand, key=lambda layer: (round(per_layer[layer]["balanced_acc"], 6), -layer))
    # out of fold: the probability above which a given share of the harmful prompts falls
    p_oof = torch.sigmoid(oof[best])
    harm_p = p_oof[y].sort().values

    def at_recall(r: float) -> float:
        return max(1e-6, float(harm_p[min(len(harm_p) - 1, int((1 - r) * len(harm_p)))]))

    recall_thresholds = {str(r): at_recall(r) for r in sorted({0.9, 0.95, 0.98, 0.99, *([recall] if recall else [])})}
    threshold = 0.5 if recall is None else min(0.5, at_recall(recall))
    cv_at_threshold = {"harmful_caught": float((p_oof[y] >= threshold).float().mean()),
                       "benign_passed": float((p_oof[~y] < threshold).float().mean())}
    x = acts_by_layer[best].float()
    mu, sd = x.mean(0), x.std(0).clamp_min(1e-6)
    w, b = _fit_logistic((x - mu) / sd, y, l2)
    info = {"val": per_layer[best], "cv_folds": folds, "recall_target": recall,
            "cv_at_threshold": cv_at_threshold, "cv_recall_thresholds": recall_thresholds, "per_layer_val": {str(k): v for k, v in per_layer.items()},
            "l2": l2, "n": len(y), "n_harmful": int(y.sum()), "train_fit": _rates(((x - mu) / sd) @ w + b, y),
            **(metadata or {})}
    return HarmGate(best, w, b, mu, sd, threshold, dict(fingerprint or {}), info)
