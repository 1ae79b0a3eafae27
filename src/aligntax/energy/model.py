"""Per-layer energy models: a small MLP mapping a residual-stream state to a scalar energy.

Low energy = desirable state (benign+complied, harmful+refused); high energy = undesirable state
(false refusal, jailbreak). The paper's default network is Linear -> LayerNorm -> SiLU -> Dropout(0.15)
blocks of widths [2048, 1024, 1024, 512] followed by Linear(., 1).

The input is normalised inside the model (``(h - in_mean) / in_scale``; buffers saved with it), so
callers pass raw hidden states of the LLM. :meth:`EnergyModel.energy_and_grad` computes the energy and
its gradient with respect to the raw state in closed form (no autograd graph), which is what steering
calls at every step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, cast, get_args

import torch
import torch.nn.functional as F
from torch import nn

from aligntax.errors import AligntaxError

Objective = Literal["infonce", "logistic"]
Normalization = Literal["standard", "norm", "none"]
Balance = Literal["truncate", "weight", "none"]
GradMethod = Literal["closed", "autograd"]
OBJECTIVES: tuple[Objective, ...] = get_args(Objective)
NORMALIZATIONS: tuple[Normalization, ...] = get_args(Normalization)
BALANCES: tuple[Balance, ...] = get_args(Balance)


@dataclass
class EnergyConfig:
    """Architecture and training hyper-parameters of the per-layer energy models.

    Defaults follow the ELS paper's code (widths [2048, 1024, 1024, 512] with LayerNorm and dropout
    0.15, InfoNCE at temperature 0.1, Adam lr 5e-5, batch 64, 120 epochs, equal-size good/bad sets,
    80/20 split). Additions: weight decay, early stopping on validation accuracy (then AUROC), input
    normalisation, and for InfoNCE (which only fixes energy *differences*) a calibrated offset so
    that E < 0 means "good" and the sign-based accuracy is meaningful.
    """

    widths: list[int] = field(default_factory=lambda: [2048, 1024, 1024, 512])
    layernorm: bool = True
    dropout: float = 0.15
    objective: Objective = "infonce"
    temperature: float = 0.1
    lr: float = 5e-5
    batch_size: int = 64
    epochs: int = 120
    weight_decay: float = 0.0
    val_fraction: float = 0.2
    # >1: train each layer once per fold (fold i holds out the i-th val_fraction of the data) and rank
    # layers by the mean validation metrics over folds; the model of fold 0 is the one kept. One split
    # of a few hundred states moves a layer's accuracy by a validation sample or two, enough to reorder
    # nearly tied layers.
    folds: int = 1
    patience: int | None = 20  # epochs without val improvement before stopping (None: never stop early)
    normalize: Normalization = "standard"  # per-feature mean/std | divide by the median norm | none
    balance: Balance = "truncate"  # paper: equal-size good/bad | weight (logistic only) | none
    calibrate: bool = True  # shift E so that the best train threshold sits at 0 (always on for InfoNCE)
    seed: int = 0
    device: str | None = None  # None: CPU

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise AligntaxError(f"Unknown energy objective '{self.objective}'; use one of {OBJECTIVES}.")
        if self.normalize not in NORMALIZATIONS:
            raise AligntaxError(f"Unknown normalisation '{self.normalize}'; use one of {NORMALIZATIONS}.")
        if self.balance not in BALANCES:
            raise AligntaxError(f"Unknown balance '{self.balance}'; use one of {BALANCES}.")
        if not 0.0 < self.val_fraction < 1.0:
            raise AligntaxError("val_fraction must be between 0 and 1.")
        if self.folds < 1 or self.folds * self.val_fraction > 1 + 1e-9:
            raise AligntaxError(
                f"folds must be at least 1 and folds * val_fraction at most 1; got folds {self.folds} "
                f"with val_fraction {self.val_fraction}."
            )
        self.widths = [int(w) for w in self.widths]

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> EnergyConfig:
        """``paper`` (the default) or ``small`` (Linear(d,512)-SiLU-Linear(512,256)-SiLU-Linear(256,1))."""
        if name == "paper":
            base: dict[str, Any] = {}
        elif name == "small":
            base = dict(
                widths=[512, 256], layernorm=False, dropout=0.0, lr=1e-3, epochs=60, weight_decay=1e-4
            )
        else:
            raise AligntaxError(f"Unknown energy preset '{name}'; use 'paper' or 'small'.")
        return cls(**{**base, **overrides})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EnergyConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class EnergyModel(nn.Module):
    """Scalar energy of a hidden state. ``energy(h)`` accepts any leading dims: ``[..., d] -> [...]``."""

    in_mean: torch.Tensor  # buffers: the input normalisation
    in_scale: torch.Tensor

    def __init__(
        self,
        dim: int,
        widths: list[int] | tuple[int, ...] = (2048, 1024, 1024, 512),
        layernorm: bool = True,
        dropout: float = 0.15,
    ):
        super().__init__()
        self.dim = int(dim)
        self.widths = [int(w) for w in widths]
        self.use_layernorm = bool(layernorm)
        self.dropout_p = float(dropout)
        self.linears = nn.ModuleList()
        self.norms = nn.ModuleList()
        prev = self.dim
        for w in self.widths:
            self.linears.append(nn.Linear(prev, w))
            if self.use_layernorm:
                self.norms.append(nn.LayerNorm(w))
            prev = w
        self.out = nn.Linear(prev, 1)
        self.drop = nn.Dropout(self.dropout_p)
        self.register_buffer("in_mean", torch.zeros(self.dim))
        self.register_buffer("in_scale", torch.ones(self.dim))
        self.eval()  # inference by default (no dropout); the trainer switches to train mode itself

    # ---- construction helpers -------------------------------------------------------------------
    @classmethod
    def from_config(cls, dim: int, cfg: EnergyConfig) -> EnergyModel:
        return cls(dim, cfg.widths, cfg.layernorm, cfg.dropout)

    def arch(self) -> dict[str, Any]:
        return {
            "dim": self.dim,
            "widths": self.widths,
            "layernorm": self.use_layernorm,
            "dropout": self.dropout_p,
        }

    def set_normalization(self, mean: torch.Tensor, scale: torch.Tensor) -> None:
        self.in_mean.copy_(mean.to(self.in_mean))
        self.in_scale.copy_(scale.to(self.in_scale).clamp_min(1e-6))

    def _linear(self, i: int) -> nn.Linear:
        return cast(nn.Linear, self.linears[i])

    def _norm(self, i: int) -> nn.LayerNorm:
        return cast(nn.LayerNorm, self.norms[i])

    # ---- forward ----------------------------------------------------------------------------------
    def _check(self, h: torch.Tensor) -> torch.Tensor:
        if h.shape[-1] != self.dim:
            raise AligntaxError(
                f"Energy model expects hidden size {self.dim}, got states of shape {tuple(h.shape)}."
            )
        h = h.to(dtype=torch.float32, device=self.in_mean.device)
        if not torch.isfinite(h).all():
            raise AligntaxError(
                "Hidden states contain NaN or inf; the energy is undefined. Check the model "
                "dtype/precision and the activations."
            )
        return h

    def forward(self, h: torch.Tensor, check: bool = True) -> torch.Tensor:
        x = ((self._check(h) if check else h.float()) - self.in_mean) / self.in_scale
        for i, lin in enumerate(self.linears):
            x = lin(x)
            if self.use_layernorm:
                x = self.norms[i](x)
            x = self.drop(F.silu(x))
        out: torch.Tensor = self.out(x).squeeze(-1)
        return out

    def energy(self, h: torch.Tensor) -> torch.Tensor:
        """Energy (float32) of states ``[..., d]``; uses the module's current train/eval mode."""
        e: torch.Tensor = self(h)
        return e

    @torch.no_grad()
    def energy_and_grad(self, h: torch.Tensor, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Energy ``[...]`` and its gradient ``dE/dh`` ``[..., d]`` in closed form (eval mode: no dropout).

        Costs about two small matmuls per hidden layer and builds no autograd graph.
        """
        x = self._check(h) if check else h.float()
        shape = x.shape
        x = ((x - self.in_mean) / self.in_scale).reshape(-1, self.dim)
        cache: list[tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]] = []
        for i in range(len(self.linears)):
            lin = self._linear(i)
            z = F.linear(x, lin.weight, lin.bias)
            if self.use_layernorm:
                ln = self._norm(i)
                mu = z.mean(-1, keepdim=True)
                zc = z - mu
                rstd = torch.rsqrt(zc.pow(2).mean(-1, keepdim=True) + ln.eps)
                u = zc * rstd
                y = u * ln.weight + ln.bias if ln.weight is not None else u
                cache.append((u, rstd, y))
            else:
                y = z
                cache.append((None, None, y))
            x = F.silu(y)
        e = F.linear(x, self.out.weight, self.out.bias).squeeze(-1)
        g = self.out.weight.expand(x.shape[0], -1)  # dE/da of the last activation
        for i in range(len(self.linears) - 1, -1, -1):
            un, rs, y = cache[i]
            s = torch.sigmoid(y)
            gy = g * (s * (1 + y * (1 - s)))
            if self.use_layernorm:
                assert un is not None and rs is not None  # kept for every layer with a LayerNorm
                ln = self._norm(i)
                gu = gy * ln.weight if ln.weight is not None else gy
                gz = rs * (gu - gu.mean(-1, keepdim=True) - un * (gu * un).mean(-1, keepdim=True))
            else:
                gz = gy
            g = gz @ self._linear(i).weight
        g = g / self.in_scale
        return e.reshape(shape[:-1]), g.reshape(shape)

    def grad(self, h: torch.Tensor, method: GradMethod = "closed") -> torch.Tensor:
        """``dE/dh`` (float32, same shape as ``h``), closed form or via autograd; never through the LLM."""
        if method == "closed":
            return self.energy_and_grad(h)[1]
        if method != "autograd":
            raise AligntaxError("grad method must be 'closed' or 'autograd'.")
        with torch.enable_grad():
            x = self._check(h).detach().requires_grad_(True)
            (g,) = torch.autograd.grad(self(x).sum(), x)
        return g
