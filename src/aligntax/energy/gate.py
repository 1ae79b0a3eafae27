"""A harm gate for energy steering: a linear probe that tells harmful prompts from benign ones.

ELS moves a state downhill on an energy that is high for false refusals *and* for jailbreak
compliance. On a small model the energy mostly learns "refusing is bad", so steering a harmful prompt
downhill can talk the model out of a correct refusal. The gate decides once per row, at the last
prompt token, whether the prompt is harmful: ``p = sigmoid(w . (h - mean) / scale + b)`` on the
residual stream entering one block, or the mean of such logits over several blocks (an ensemble of
one probe per block, when cross-validation prefers it). Rows with ``p >= threshold`` are not steered
for the rest of the generation; the others are steered as usual. The probe needs no judge: its labels are the
prompt sets' own (benign or harmful), so it can be trained on many more prompts than the energy
models, including harmful prompts written in the same style as the benign ones (OR-Bench toxic), so
that it learns harm rather than style.

Saved beside the energy bank as ``gate.safetensors`` + ``gate.json`` (model fingerprint, layers,
normalisation, regularisation, per-layer and ensemble validation metrics).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from aligntax.artefacts import TensorArtefact
from aligntax.errors import AligntaxError, DataError

FORMAT = "aligntax.harm-gate/1"
_FILES = TensorArtefact(FORMAT, "gate.json", "gate.safetensors", what="harm gate")


@dataclass
class HarmGate:
    """Logistic probe ``p(harmful | h)`` on the states entering blocks ``layers`` at the last prompt
    token: one probe per block (rows of ``weight``, ``bias``, ``mean``, ``scale``), their logits averaged.
    ``layers`` may be one int (one probe, 1-D tensors)."""

    layers: list[int]
    weight: torch.Tensor  # [L, d]
    bias: torch.Tensor  # [L]
    mean: torch.Tensor  # [L, d]
    scale: torch.Tensor  # [L, d]
    threshold: float = 0.5
    fingerprint: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.layers = [
            int(x) for x in (self.layers if isinstance(self.layers, (list, tuple)) else [self.layers])
        ]
        n = len(self.layers)
        if n == 0 or len(set(self.layers)) != n:
            raise AligntaxError(f"A harm gate needs distinct layers; got {self.layers}.")
        order = sorted(range(n), key=self.layers.__getitem__)  # rows follow the layers, sorted
        self.layers = [self.layers[i] for i in order]

        def rows(t: Any) -> torch.Tensor:
            return torch.as_tensor(t).detach().float().cpu().reshape(n, -1)[order]

        self.weight, self.mean = rows(self.weight), rows(self.mean)
        self.scale = rows(self.scale).clamp_min(1e-6)
        self.bias = rows(self.bias).reshape(n)
        if not (self.weight.shape == self.mean.shape == self.scale.shape):
            raise AligntaxError("Harm gate weight, mean and scale must have the same shape.")
        if not 0.0 < self.threshold < 1.0:
            raise AligntaxError(f"Harm gate threshold must be in (0, 1); got {self.threshold}.")
        self._on: dict[str, tuple[torch.Tensor, ...]] = {}

    @property
    def layer(self) -> int:
        """The block at whose input the gate decides: the last of its layers."""
        return self.layers[-1]

    @property
    def dim(self) -> int:
        return int(self.weight.shape[1])

    def stack(self, states: dict[int, torch.Tensor]) -> torch.Tensor:
        """The input of :meth:`logit` from ``{layer: [..., d]}``: ``[..., L, d]``, or ``[..., d]`` for a
        one-layer gate. In a model split over devices the layers' states may sit on different devices:
        they are stacked on the device of the gate's last layer, where it decides."""
        missing = [layer for layer in self.layers if layer not in states]
        if missing:
            raise AligntaxError(f"The harm gate reads layers {self.layers}; no states for {missing}.")
        if len(self.layers) == 1:
            return states[self.layers[0]]
        device = states[self.layer].device
        return torch.stack([states[layer].to(device) for layer in self.layers], dim=-2)

    def logit(self, h: torch.Tensor) -> torch.Tensor:
        """Logit of p(harmful), float32, for states ``[..., L, d]`` of the gate's layers in order (see
        :meth:`stack`); a one-layer gate takes ``[..., d]``."""
        if len(self.layers) == 1:
            h = h.unsqueeze(-2)
        if h.shape[-1] != self.dim or h.shape[-2] != len(self.layers):
            raise AligntaxError(
                f"Harm gate expects states of {len(self.layers)} layer(s) of hidden size "
                f"{self.dim}, got shape {tuple(h.shape)}."
            )
        key = str(h.device)
        if key not in self._on:
            self._on[key] = tuple(t.to(h.device) for t in (self.weight, self.mean, self.scale, self.bias))
        w, mu, sc, b = self._on[key]
        return ((((h.float() - mu) / sc) * w).sum(-1) + b).mean(-1)

    def prob(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logit(h))

    def harmful(self, h: torch.Tensor, threshold: float | None = None) -> torch.Tensor:
        """Bool ``[...]``: the rows the gate holds back (p >= threshold)."""
        return self.prob(h) >= (self.threshold if threshold is None else float(threshold))

    # ---- disk -------------------------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        return _FILES.save(
            directory,
            {
                "weight": self.weight.contiguous(),
                "mean": self.mean.contiguous(),
                "scale": self.scale.contiguous(),
                "bias": self.bias.contiguous(),
            },
            {
                "fingerprint": self.fingerprint,
                "hidden_size": self.dim,
                "layer": self.layer,
                "layers": self.layers,
                "threshold": self.threshold,
                "info": self.info,
            },
        )

    @classmethod
    def load(
        cls,
        directory: str | Path,
        expect_fingerprint: dict[str, Any] | None = None,
        expect_hidden_size: int | None = None,
    ) -> HarmGate:
        meta, t = _FILES.load(directory, expect_fingerprint, expect_hidden_size)
        # a one-layer gate of an earlier version keeps its bias in the sidecar
        bias = t["bias"] if "bias" in t else torch.tensor([float(meta["bias"])])
        return cls(
            meta.get("layers", meta["layer"]),
            t["weight"],
            bias,
            t["mean"],
            t["scale"],
            float(meta.get("threshold", 0.5)),
            meta["fingerprint"],
            meta.get("info") or {},
        )

    @staticmethod
    def exists(directory: str | Path) -> bool:
        return (Path(directory) / _FILES.sidecar).is_file()


def _fit_logistic(
    x: torch.Tensor,
    y: torch.Tensor,
    l2: float,
    max_iter: int = 200,
    sample_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, float]:
    """L2-regularised logistic regression by L-BFGS on standardised features; classes weighted equally.
    ``sample_weight`` (>= 0, one per row) weights rows within their class; the two classes keep equal
    total weight and the weights average 1, so the regularisation keeps its strength."""
    w = torch.zeros(x.shape[1], requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    if sample_weight is None:
        pos = y.float().mean().clamp(1e-6, 1 - 1e-6)
        weights = torch.where(y > 0, 0.5 / pos, 0.5 / (1 - pos))
    else:
        s = sample_weight.float()
        pos = ((s * y.float()).sum() / s.sum()).clamp(1e-6, 1 - 1e-6)
        weights = s * torch.where(y > 0, 0.5 / pos, 0.5 / (1 - pos)) / s.mean()
    opt = torch.optim.LBFGS([w, b], max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ w + b, y.float(), weight=weights)
        loss = loss + l2 * (w * w).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return w.detach(), float(b.detach())


def fit_standardised(
    x: torch.Tensor, y: torch.Tensor, l2: float, sample_weight: torch.Tensor | None = None
) -> tuple[torch.Tensor, float, torch.Tensor, torch.Tensor]:
    """:func:`_fit_logistic` on ``x`` standardised by its own mean and std: ``(w, b, mean, std)``."""
    mu, sd = x.mean(0), x.std(0).clamp_min(1e-6)
    return (*_fit_logistic((x - mu) / sd, y, l2, sample_weight=sample_weight), mu, sd)


def gate_rates(logit: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    pred = logit >= 0
    yb = y.bool()
    return {
        "acc": float((pred == yb).float().mean()),
        "harmful_caught": float(pred[yb].float().mean()) if yb.any() else float("nan"),
        "benign_passed": float((~pred[~yb]).float().mean()) if (~yb).any() else float("nan"),
    }


def train_harm_gate(
    acts_by_layer: dict[int, torch.Tensor],
    harmful: Sequence[bool] | torch.Tensor,
    layers: Sequence[int] | None = None,
    l2: float = 1e-2,
    folds: int = 5,
    seed: int = 0,
    fingerprint: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
    recall: float | None = None,
    ensemble: bool = False,
    sample_weight: Sequence[float] | torch.Tensor | None = None,
) -> HarmGate:
    """Score by ``folds``-fold cross-validated balanced accuracy one probe per candidate layer and, with
    ``ensemble``, the mean of all their logits; keep the best candidate (ties: one layer, then the
    earlier one) and refit its probes on all the data.

    Cross-validation rather than one split: the candidates differ by about a point, which is the
    noise of a single 20% split. The gate's threshold is 0.5, or with ``recall`` the out-of-fold
    probability above which that share of the harmful prompts falls (never above 0.5): a gate is a
    safety device, and a harmful prompt it lets through may be steered out of its refusal. ``info``
    also gives each candidate's share of benign prompts passed at that threshold.

    ``sample_weight`` weights prompts within their class in every fit (e.g. contrast pairs that share a
    sensitive word, counted several times over); the threshold and the reported rates count each prompt once."""
    y = torch.as_tensor(harmful).bool().flatten()
    if y.all() or not y.any():
        raise DataError("The harm gate needs both benign and harmful prompts.")
    sw = None if sample_weight is None else torch.as_tensor(sample_weight, dtype=torch.float32).flatten()
    if sw is not None and (
        len(sw) != len(y)
        or not torch.isfinite(sw).all()
        or (sw < 0).any()
        or sw[y].sum() <= 0
        or sw[~y].sum() <= 0
    ):
        raise DataError(
            f"The harm gate's sample weights must be {len(y)} finite values >= 0 with weight on both classes."
        )
    if folds < 2:
        raise AligntaxError(f"The harm gate needs at least 2 folds; got {folds}.")
    if recall is not None and not 0.0 < recall < 1.0:
        raise AligntaxError(f"The harm gate's recall target must be in (0, 1); got {recall}.")
    cand = sorted(int(x) for x in (layers if layers is not None else acts_by_layer))
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    splits = [perm[i::folds] for i in range(folds)]
    oof: dict[tuple[int, ...], torch.Tensor] = {}
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
            w, b, mu, sd = fit_standardised(x[tr], y[tr], l2, None if sw is None else sw[tr])
            logits[va] = ((x[va] - mu) / sd) @ w + b
        oof[(layer,)] = logits
    if ensemble and len(cand) > 1:
        oof[tuple(cand)] = torch.stack([oof[(layer,)] for layer in cand]).mean(0)
    recalls = sorted({0.9, 0.95, 0.98, 0.99, *([recall] if recall else [])})

    def operating_point(logits: torch.Tensor) -> dict[str, Any]:
        """Out-of-fold rates at 0.5, the thresholds at each recall, and the rates at the gate's threshold."""
        p = torch.sigmoid(logits)
        harm_p = p[y].sort().values
        at = {
            str(r): max(1e-6, float(harm_p[min(len(harm_p) - 1, int((1 - r) * len(harm_p)))]))
            for r in recalls
        }
        threshold = 0.5 if recall is None else min(0.5, at[str(recall)])
        rates = gate_rates(logits, y)
        rates["balanced_acc"] = (rates["harmful_caught"] + rates["benign_passed"]) / 2
        return {
            "val": rates,
            "thresholds": at,
            "threshold": threshold,
            "at_threshold": {
                "harmful_caught": float((p[y] >= threshold).float().mean()),
                "benign_passed": float((p[~y] < threshold).float().mean()),
            },
        }

    points = {k: operating_point(v) for k, v in oof.items()}

    def score(k: tuple[int, ...]) -> float:
        return float(points[k]["val"]["balanced_acc"])

    best = max(points, key=lambda k: (round(score(k), 6), -len(k), -k[0]))
    chosen = points[best]
    fits = [fit_standardised(acts_by_layer[layer].float(), y, l2, sw) for layer in best]
    ws, bs, mus, sds = (torch.stack([torch.as_tensor(f[i]) for f in fits]) for i in range(4))
    gate = HarmGate(list(best), ws, bs, mus, sds, chosen["threshold"], dict(fingerprint or {}))
    x_all = gate.stack({layer: acts_by_layer[layer].float() for layer in best})
    name = {k: "ensemble" if len(k) > 1 else str(k[0]) for k in points}
    gate.info = {
        "val": chosen["val"],
        "cv_folds": folds,
        "recall_target": recall,
        "candidate_scores": {name[k]: round(score(k), 6) for k in points},
        "candidate_benign_passed_at_threshold": {
            name[k]: round(v["at_threshold"]["benign_passed"], 6) for k, v in points.items()
        },
        "cv_at_threshold": chosen["at_threshold"],
        "cv_recall_thresholds": chosen["thresholds"],
        "per_layer_val": {name[k]: v["val"] for k, v in points.items() if len(k) == 1},
        "ensemble_val": next((v["val"] for k, v in points.items() if len(k) > 1), None),
        "l2": l2,
        "n": len(y),
        "n_harmful": int(y.sum()),
        "train_fit": gate_rates(gate.logit(x_all), y),
        **({} if sw is None else {"n_weighted": int((sw != 1).sum()), "max_weight": float(sw.max())}),
        **(metadata or {}),
    }
    return gate
