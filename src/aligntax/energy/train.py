"""Training per-layer energy models on good (desirable) vs bad (undesirable) states.

Objectives:

- ``infonce`` (the paper): for each good state x+ in a batch, logits ``[-E(x+)/t, -E(x-_1)/t, ...,
  -E(x-_B)/t]`` over the batch's bad states, cross-entropy with target 0, temperature t. This only
  fixes energy differences, so after training the energies are shifted (the output bias) so that the
  threshold best separating good from bad on the *training* split sits at 0; then E(good) < 0 and
  E(bad) > 0 is a meaningful accuracy.
- ``logistic``: binary cross-entropy on ``sigmoid(E)`` with bad = 1.

Validation accuracy is the fraction of validation states with the right energy sign (good < 0,
bad > 0); AUROC (bad as positive, score E) is reported too and breaks ties when ranking layers.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from aligntax.energy.model import EnergyConfig, EnergyModel
from aligntax.errors import AligntaxError, DataError

GOOD_BAD_DOC = "benign+complied and harmful+refused are good; benign+refused and harmful+complied are bad"


def state_labels(labels: Sequence[str | bool | int], refused: Sequence[bool]) -> torch.Tensor:
    """Bad-state labels (1 = undesirable, 0 = desirable) from prompt labels and refusal judgements.

    ``labels`` are ``'benign'``/``'harmful'`` (also accepted: ``'harmless'``, ``'safe'``, ``'unsafe'``,
    or a bool/int meaning harmful). {doc}.
    """
    if len(labels) != len(refused):
        raise DataError(f"{len(labels)} labels but {len(refused)} refusal judgements.")
    out = []
    for lab, ref in zip(labels, refused, strict=True):
        if isinstance(lab, str):
            key = lab.strip().lower()
            if key in ("benign", "harmless", "safe", "pseudo-harmful", "over-refusal", "0", "false"):
                harmful = False
            elif key in ("harmful", "unsafe", "1", "true"):
                harmful = True
            else:
                raise DataError(f"Unknown prompt label '{lab}': use 'benign' or 'harmful'.")
        else:
            harmful = bool(lab)
        out.append(
            int(bool(ref) != harmful)
        )  # bad iff refused a benign prompt or complied with a harmful one
    return torch.tensor(out, dtype=torch.long)


state_labels.__doc__ = (state_labels.__doc__ or "").replace(
    "{doc}", GOOD_BAD_DOC[0].upper() + GOOD_BAD_DOC[1:]
)


def auroc(scores: torch.Tensor, positive: torch.Tensor) -> float:
    """Area under the ROC curve (ties count half); NaN if one class is empty."""
    scores = scores.double().flatten()
    positive = positive.bool().flatten()
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    # Rank-based (Mann-Whitney U) with average ranks for ties.
    order = torch.argsort(scores)
    sorted_scores = scores[order]
    ranks = torch.empty_like(scores)
    i, n = 0, len(scores)
    pos_ranks = torch.arange(1, n + 1, dtype=torch.double)
    uniq, counts = torch.unique_consecutive(sorted_scores, return_counts=True)
    avg = []
    for c in counts.tolist():
        avg.append(pos_ranks[i : i + c].mean().repeat(c))
        i += c
    ranks[order] = torch.cat(avg) if avg else ranks[order]
    u = ranks[positive].sum() - n_pos * (n_pos + 1) / 2
    return float(u / (n_pos * n_neg))


def sign_metrics(e_good: torch.Tensor, e_bad: torch.Tensor) -> dict[str, Any]:
    """Accuracy (good < 0, bad > 0), balanced accuracy, AUROC and mean energies."""
    good_ok = (e_good < 0).float()
    bad_ok = (e_bad > 0).float()
    n = len(e_good) + len(e_bad)
    acc = float((good_ok.sum() + bad_ok.sum()) / n) if n else float("nan")
    bal = 0.5 * (float(good_ok.mean()) + float(bad_ok.mean())) if len(e_good) and len(e_bad) else float("nan")
    scores = torch.cat([e_good, e_bad])
    pos = torch.cat([torch.zeros(len(e_good)), torch.ones(len(e_bad))])
    return {
        "acc": acc,
        "balanced_acc": bal,
        "auroc": auroc(scores, pos),
        "mean_energy_good": float(e_good.mean()) if len(e_good) else float("nan"),
        "mean_energy_bad": float(e_bad.mean()) if len(e_bad) else float("nan"),
        "n_good": len(e_good),
        "n_bad": len(e_bad),
    }


def best_threshold(e_good: torch.Tensor, e_bad: torch.Tensor) -> float:
    """The threshold t maximising balanced accuracy of (good < t, bad > t): midpoint between neighbours."""
    scores = torch.cat([e_good, e_bad]).double()
    is_bad = torch.cat([torch.zeros(len(e_good)), torch.ones(len(e_bad))]).double()
    order = torch.argsort(scores)
    s, b = scores[order], is_bad[order]
    # Threshold after k sorted items: good correct = goods among first k, bad correct = bads after k.
    good_below = torch.cat([torch.zeros(1, dtype=torch.double), torch.cumsum(1 - b, 0)])
    bad_above = b.sum() - torch.cat([torch.zeros(1, dtype=torch.double), torch.cumsum(b, 0)])
    bal = good_below / max(len(e_good), 1) + bad_above / max(len(e_bad), 1)
    # Only cut between distinct values.
    valid = torch.ones(len(s) + 1, dtype=torch.bool)
    if len(s) > 1:
        valid[1:-1] = s[1:] > s[:-1]
    bal = torch.where(valid, bal, torch.full_like(bal, -1.0))
    k = int(torch.argmax(bal))
    if k == 0:
        return float(s[0]) - 1.0
    if k == len(s):
        return float(s[-1]) + 1.0
    return float(0.5 * (s[k - 1] + s[k]))


@dataclass
class TrainResult:
    """A trained energy model with its training history and validation metrics."""

    model: EnergyModel
    metrics: dict[str, Any]  # best-epoch validation metrics: acc, balanced_acc, auroc, mean energies, counts
    train_metrics: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)
    best_epoch: int = 0
    data: dict[str, Any] = field(default_factory=dict)  # sizes of the good/bad train/val sets, offset, norm

    @property
    def val_acc(self) -> float:
        return float(self.metrics.get("acc", float("nan")))

    @property
    def val_auroc(self) -> float:
        return float(self.metrics.get("auroc", float("nan")))


def _split(n: int, frac: float, gen: torch.Generator, fold: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val) indices: the ``fold``-th block of ``frac * n`` of a seeded permutation is held out."""
    perm = torch.randperm(n, generator=gen)
    n_val = max(1, int(round(n * frac))) if n >= 2 else 0
    lo, hi = fold * n_val, min(n, (fold + 1) * n_val)
    return torch.cat([perm[:lo], perm[hi:]]), perm[lo:hi]


def rank_key(key: dict[str, Any]) -> tuple[Any, ...]:
    """Ranking key (higher is better): validation accuracy, then AUROC, then lower validation loss."""
    acc = key.get("acc", float("nan"))
    au = key.get("auroc", float("nan"))
    loss = key.get("loss")
    loss = float("inf") if loss is None or math.isnan(loss) else loss
    return (-1.0 if math.isnan(acc) else acc, -1.0 if math.isnan(au) else au, -loss)


class EnergyTrainer:
    """Train one energy model from good and bad states (``[n, d]`` each)."""

    def __init__(self, config: EnergyConfig | None = None):
        self.config = config or EnergyConfig()

    def train(
        self, good: torch.Tensor, bad: torch.Tensor, progress: bool = False, fold: int = 0
    ) -> TrainResult:
        """Train on all but the ``fold``-th validation block (see ``EnergyConfig.folds``)."""
        cfg = self.config
        if not 0 <= fold < cfg.folds:
            raise AligntaxError(f"fold must be in [0, {cfg.folds}); got {fold}.")
        good, bad = good.detach().float().cpu(), bad.detach().float().cpu()
        if good.ndim != 2 or bad.ndim != 2 or good.shape[1] != bad.shape[1]:
            raise DataError(
                f"good and bad must be [n, d] with the same d; got {tuple(good.shape)} and {tuple(bad.shape)}."
            )
        if len(good) < 2 or len(bad) < 2:
            raise DataError(
                f"Need at least 2 good and 2 bad states to train; got {len(good)} good, {len(bad)} bad."
            )
        if not (torch.isfinite(good).all() and torch.isfinite(bad).all()):
            raise AligntaxError("Training states contain NaN or inf.")
        gen = torch.Generator().manual_seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        g_tr, g_val = _split(len(good), cfg.val_fraction, gen, fold)
        b_tr, b_val = _split(len(bad), cfg.val_fraction, gen, fold)
        if len(g_val) == 0 or len(b_val) == 0:
            raise DataError(
                f"Fold {fold} of {cfg.folds} holds out no good or no bad state ({len(good)} good, "
                f"{len(bad)} bad); use fewer folds."
            )
        if cfg.balance == "truncate":
            m = min(len(g_tr), len(b_tr))
            g_tr, b_tr = g_tr[:m], b_tr[:m]
        xg, xb = good[g_tr], bad[b_tr]
        vg, vb = good[g_val], bad[b_val]
        d = good.shape[1]
        device = torch.device(cfg.device or "cpu")
        model = EnergyModel.from_config(d, cfg)
        both = torch.cat([xg, xb])
        if cfg.normalize == "standard":
            mean, scale = both.mean(0), both.std(0).clamp_min(1e-6)
        elif cfg.normalize == "norm":
            mean, scale = torch.zeros(d), both.norm(dim=-1).median().clamp_min(1e-6).repeat(d)
        else:
            mean, scale = torch.zeros(d), torch.ones(d)
        model.set_normalization(mean, scale)
        model.to(device)
        opt = (
            torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=True)
            if cfg.weight_decay
            else torch.optim.Adam(model.parameters(), lr=cfg.lr, foreach=True)
        )
        xg_d, xb_d = xg.to(device), xb.to(device)
        pos_weight = torch.tensor(len(xg) / len(xb), device=device) if cfg.balance == "weight" else None

        best_state, best_key, best_epoch, best_offset = None, None, -1, 0.0
        history: list[dict[str, Any]] = []
        bad_epochs = 0
        for epoch in range(cfg.epochs):
            model.train()
            losses = []
            if cfg.objective == "infonce":
                perm_g = torch.randperm(len(xg_d), generator=gen)
                perm_b = torch.randperm(len(xb_d), generator=gen)
                n_b = len(perm_b)
                for k, start in enumerate(range(0, len(perm_g), cfg.batch_size)):
                    gi = perm_g[start : start + cfg.batch_size]
                    bi = perm_b[torch.arange(k * cfg.batch_size, k * cfg.batch_size + cfg.batch_size) % n_b]
                    e_pos = model(xg_d[gi])
                    e_neg = model(xb_d[bi])
                    logits = torch.cat([-e_pos[:, None], (-e_neg)[None, :].expand(len(gi), -1)], 1)
                    loss = F.cross_entropy(
                        logits / cfg.temperature, torch.zeros(len(gi), dtype=torch.long, device=device)
                    )
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    losses.append(loss.item())
            else:
                x = torch.cat([xg_d, xb_d])
                y = torch.cat([torch.zeros(len(xg_d)), torch.ones(len(xb_d))]).to(device)
                perm = torch.randperm(len(x), generator=gen)
                for start in range(0, len(perm), cfg.batch_size):
                    idx = perm[start : start + cfg.batch_size]
                    loss = F.binary_cross_entropy_with_logits(model(x[idx]), y[idx], pos_weight=pos_weight)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    losses.append(loss.item())
            model.eval()
            offset = self._offset(model, xg_d, xb_d)
            e_vg, e_vb = (self._energies(model, v.to(device)) - offset for v in (vg, vb))
            val = sign_metrics(e_vg, e_vb)
            val["loss"] = self._loss(e_vg, e_vb)
            history.append(
                {
                    "epoch": epoch,
                    "loss": sum(losses) / max(len(losses), 1),
                    "val_loss": val["loss"],
                    "val_acc": val["acc"],
                    "val_auroc": val["auroc"],
                }
            )
            key = rank_key(val)
            if best_key is None or key > best_key:
                best_key, best_epoch, best_offset = key, epoch, offset
                best_state = copy.deepcopy(model.state_dict())
                bad_epochs = 0
            else:
                bad_epochs += 1
                if cfg.patience is not None and bad_epochs >= cfg.patience:
                    break
            if progress:
                print(
                    f"epoch {epoch}: loss {history[-1]['loss']:.4f} val acc {val['acc']:.3f} auroc {val['auroc']:.3f}"
                )
        if best_state is not None:
            model.load_state_dict(best_state)
        with torch.no_grad():
            model.out.bias.sub_(best_offset)
        model.eval()
        e_vg, e_vb = self._energies(model, vg.to(device)), self._energies(model, vb.to(device))
        e_tg, e_tb = self._energies(model, xg_d), self._energies(model, xb_d)
        model.cpu()
        metrics = sign_metrics(e_vg, e_vb)
        metrics["loss"] = self._loss(e_vg, e_vb)
        data = {
            "n_good": len(good),
            "n_bad": len(bad),
            "n_train_good": len(xg),
            "n_train_bad": len(xb),
            "n_val_good": len(vg),
            "n_val_bad": len(vb),
            "offset": best_offset,
            "median_norm": float(torch.cat([good, bad]).norm(dim=-1).median()),
        }
        return TrainResult(model, metrics, sign_metrics(e_tg, e_tb), history, best_epoch, data)

    def _loss(self, e_good: torch.Tensor, e_bad: torch.Tensor) -> float:
        """The objective on held-out energies (InfoNCE against all held-out bad states, or BCE)."""
        if len(e_good) == 0 or len(e_bad) == 0:
            return float("nan")
        if self.config.objective == "infonce":
            logits = torch.cat([-e_good[:, None], (-e_bad)[None, :].expand(len(e_good), -1)], 1)
            return float(
                F.cross_entropy(logits / self.config.temperature, torch.zeros(len(e_good), dtype=torch.long))
            )
        y = torch.cat([torch.zeros(len(e_good)), torch.ones(len(e_bad))])
        return float(F.binary_cross_entropy_with_logits(torch.cat([e_good, e_bad]), y))

    def _offset(self, model: EnergyModel, xg: torch.Tensor, xb: torch.Tensor) -> float:
        if not (self.config.calibrate or self.config.objective == "infonce"):
            return 0.0
        return best_threshold(self._energies(model, xg), self._energies(model, xb))

    @staticmethod
    @torch.no_grad()
    def _energies(model: EnergyModel, x: torch.Tensor) -> torch.Tensor:
        if len(x) == 0:
            return torch.empty(0)
        return torch.cat([model(x[i : i + 4096]) for i in range(0, len(x), 4096)]).cpu()
