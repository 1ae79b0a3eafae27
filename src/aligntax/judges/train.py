"""Training the classifier judge's head: logistic regression or a one-hidden-layer MLP, in torch.

Features are standardised with the training set's mean and std (stored with the weights); the
loss is binary cross-entropy (optionally weighted per row, e.g. to count the truncated copies of a
completion less than the completion itself) plus an L2 penalty on the weights (not biases).
Training is full-batch and seeded, so the same data gives the same weights.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass
class HeadConfig:
    kind: str = "logreg"  # "logreg" or "mlp"
    hidden: int = 64  # MLP width
    l2: float = 1e-2  # penalty on weights, scaled by 1/2 * l2 * ||W||^2
    epochs: int = 300  # Adam steps (MLP) / LBFGS max iterations (logreg)
    lr: float = 1e-2
    dropout: float = 0.0
    seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


class Head(torch.nn.Module):
    """Standardise, then a linear layer (logreg) or Linear-GELU-Linear (mlp); outputs a logit."""

    def __init__(self, n_features: int, kind: str = "logreg", hidden: int = 64, dropout: float = 0.0):
        super().__init__()
        self.kind = kind
        self.register_buffer("mean", torch.zeros(n_features))
        self.register_buffer("std", torch.ones(n_features))
        if kind == "logreg":
            self.net = torch.nn.Sequential(torch.nn.Linear(n_features, 1))
        elif kind == "mlp":
            self.net = torch.nn.Sequential(
                torch.nn.Linear(n_features, hidden),
                torch.nn.GELU(),
                torch.nn.Dropout(dropout),
                torch.nn.Linear(hidden, 1),
            )
        else:
            raise ValueError(f"unknown head kind '{kind}'")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net((x - self.mean) / self.std).squeeze(-1)

    def weight_params(self) -> list[torch.Tensor]:
        return [m.weight for m in self.net if isinstance(m, torch.nn.Linear)]


def fit_head(
    x: torch.Tensor, y: torch.Tensor, cfg: HeadConfig, sample_weight: torch.Tensor | None = None
) -> Head:
    """Fit a head on features ``x`` [N, F] and 0/1 labels ``y`` [N]; ``sample_weight`` [N] weights each
    row's loss (the weighted mean is used, so the L2 strength means the same with or without it).
    The standardisation statistics are the unweighted ones."""
    g = torch.Generator().manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    x = x.float()
    y = y.float()
    head = Head(x.shape[1], cfg.kind, cfg.hidden, cfg.dropout)
    head.mean.copy_(x.mean(0))
    head.std.copy_(x.std(0).clamp(min=1e-4))
    for m in head.net:
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.normal_(m.weight, std=(1.0 / m.in_features) ** 0.5, generator=g)
            torch.nn.init.zeros_(m.bias)
    if sample_weight is None:
        bce = torch.nn.BCEWithLogitsLoss()
    else:
        sw = torch.as_tensor(sample_weight, dtype=torch.float32).reshape(-1)
        if sw.numel() != y.numel() or bool((sw < 0).any()) or float(sw.sum()) <= 0:
            raise ValueError("sample_weight must be [N], non-negative, with a positive sum")

        def bce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            losses = torch.nn.functional.binary_cross_entropy_with_logits(logits, target, reduction="none")
            return (losses * sw).sum() / sw.sum()

    def loss_fn() -> torch.Tensor:
        penalty = sum((w**2).sum() for w in head.weight_params())
        return bce(head(x), y) + 0.5 * cfg.l2 * penalty

    head.train()
    if cfg.kind == "logreg":
        opt = torch.optim.LBFGS(
            head.parameters(),
            lr=1.0,
            max_iter=cfg.epochs,
            tolerance_grad=1e-7,
            tolerance_change=1e-10,
            history_size=20,
            line_search_fn="strong_wolfe",
        )

        def closure():
            opt.zero_grad()
            loss = loss_fn()
            loss.backward()
            return loss

        opt.step(closure)
    else:
        opt = torch.optim.Adam(head.parameters(), lr=cfg.lr)
        for _ in range(cfg.epochs):
            opt.zero_grad()
            loss = loss_fn()
            loss.backward()
            opt.step()
    head.eval()
    return head


@torch.no_grad()
def predict_proba(head: Head, x: torch.Tensor) -> torch.Tensor:
    head.eval()
    return torch.sigmoid(head(x.float()))


def binary_metrics(pred: torch.Tensor | list[bool], gold: torch.Tensor | list[bool]) -> dict:
    """Accuracy, precision, recall and F1 (refusal = positive class)."""
    p = torch.as_tensor(pred).bool()
    t = torch.as_tensor(gold).bool()
    tp = int((p & t).sum())
    fp = int((p & ~t).sum())
    fn = int((~p & t).sum())
    n = int(t.numel())
    acc = float((p == t).float().mean()) if n else 0.0
    prec = tp / (tp + fp) if tp + fp else 0.0
    rec = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * prec * rec / (prec + rec) if prec + rec else 0.0
    return {"n": n, "accuracy": acc, "precision": prec, "recall": rec, "f1": f1}
