"""Two refinements of ELS at the over-refusal / safety front: a harm subspace that descent steps are
projected off, and a learned per-row steering strength.

**Harm basis** (``harm_basis.safetensors`` + ``harm_basis.json``). Per block, up to ``k_max`` orthonormal
directions along which harmful prompts differ from benign ones at the last prompt token: the first is
the difference of the class means (harmful minus benign, where benign means every benign-labelled
prompt the folder holds: the over-refusal look-alikes and the harmless instructions, as the harm gate
counts them); the others are the top right singular vectors of the contrast pairs' differences
(harmful minus benign prompt of each pair, sharing a sensitive word), taken orthogonal to the first.
Without pairs, the per-prompt differences (harmful prompt minus the benign mean) take their place. With
``harm_orth = k`` every ELS step is projected off the first ``k`` directions of the steered block, so a
harmful row that the gate leaks is not moved along what makes it harmful (towards compliance), while a
benign row can still move along everything else, the refusal trigger of look-alikes included.

**Row strength** (``row_strength.safetensors`` + ``row_strength.json``). A logistic model over per-row
decision features read at the last prompt token (:data:`STRENGTH_FEATURES`: the harm gate's logit, the
row energy at the first steered block, and the projections of that block's state on the refusal and
harm directions), giving ``s = sigmoid(w . (f - mean) / scale + b)`` in [0, 1], the factor of the row's
step; a row below ``floor`` gets 0 (held back, exactly unsteered). It replaces the two hard cut-offs
(the gate's threshold and the row energy threshold). It is fitted on training prompts to the outcome of
steering (``aligntax els row-strength``): benign prompts are worth steering (1), harmful ones must not
be (0), and the prompts where steering decides (a benign refusal turned into an answer, a harmful
refusal turned into compliance) weigh more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from aligntax.artefacts import TensorArtefact
from aligntax.errors import AligntaxError, DataError

__all__ = [
    "HARM_BASIS_FORMAT",
    "ROW_STRENGTH_FORMAT",
    "STRENGTH_FEATURES",
    "HarmBasis",
    "RowStrength",
    "compute_harm_basis",
    "fit_row_strength",
    "pair_states",
]

HARM_BASIS_FORMAT = "aligntax.harm-basis/1"
ROW_STRENGTH_FORMAT = "aligntax.row-strength/1"
_BASIS = TensorArtefact(HARM_BASIS_FORMAT, "harm_basis.json", "harm_basis.safetensors", what="harm basis")
_STRENGTH = TensorArtefact(
    ROW_STRENGTH_FORMAT, "row_strength.json", "row_strength.safetensors", what="row strength model"
)
STRENGTH_FEATURES = ("gate_logit", "energy", "refusal_proj", "harm_proj")


# ---- harm basis ---------------------------------------------------------------------------------------
@dataclass
class HarmBasis:
    """Orthonormal harm directions per block: ``directions[layer]`` is ``[K, d]`` (rows orthonormal,
    the most important first)."""

    directions: dict[int, torch.Tensor]
    fingerprint: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.directions = {
            int(k): torch.as_tensor(v).detach().float().cpu() for k, v in self.directions.items()
        }
        if not self.directions:
            raise AligntaxError("A harm basis needs at least one layer.")
        dims = {v.shape[-1] for v in self.directions.values()}
        if len(dims) != 1 or any(v.dim() != 2 for v in self.directions.values()):
            raise AligntaxError("Harm basis directions must be [K, d] with one hidden size.")

    @property
    def dim(self) -> int:
        return int(next(iter(self.directions.values())).shape[-1])

    @property
    def k_max(self) -> int:
        return min(int(v.shape[0]) for v in self.directions.values())

    def get(self, layer: int, k: int) -> torch.Tensor:
        """The first ``k`` directions of ``layer``, ``[k, d]``."""
        if int(layer) not in self.directions:
            raise AligntaxError(
                f"The harm basis has no directions for layer {layer} "
                f"(it has layers {sorted(self.directions)})."
            )
        q = self.directions[int(layer)]
        if not 0 < k <= q.shape[0]:
            raise AligntaxError(
                f"harm_orth must be in 1..{q.shape[0]} (the directions saved for layer {layer}); got {k}."
            )
        return q[:k]

    def save(self, directory: str | Path) -> Path:
        return _BASIS.save(
            directory,
            {f"layer.{layer}": q.contiguous() for layer, q in self.directions.items()},
            {
                "fingerprint": self.fingerprint,
                "hidden_size": self.dim,
                "layers": sorted(self.directions),
                "k_max": self.k_max,
                "info": self.info,
            },
        )

    @classmethod
    def load(
        cls,
        directory: str | Path,
        expect_fingerprint: dict[str, Any] | None = None,
        expect_hidden_size: int | None = None,
    ) -> HarmBasis:
        meta, t = _BASIS.load(directory, expect_fingerprint, expect_hidden_size)
        return cls(
            {int(k.split(".", 1)[1]): v for k, v in t.items()}, meta["fingerprint"], meta.get("info") or {}
        )

    @staticmethod
    def exists(directory: str | Path) -> bool:
        return (Path(directory) / _BASIS.sidecar).is_file()


def pair_states(items: Sequence[Any], states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The contrast pairs among ``items`` (prompts sharing a ``category``, one benign and one harmful)
    and their states ``[N, d]`` (one row per item): ``(harmful [P, d], benign [P, d])``, pairs in order."""
    groups: dict[str, dict[str, int]] = {}
    for i, it in enumerate(items):
        if it.category:
            groups.setdefault(it.category, {})[it.label] = i
    pairs = [(g["harmful"], g["benign"]) for g in groups.values() if "harmful" in g and "benign" in g]
    if not pairs:
        return states[:0], states[:0]
    h, b = zip(*pairs, strict=True)
    return states[list(h)], states[list(b)]


def compute_harm_basis(
    harmful: dict[int, torch.Tensor],
    benign: dict[int, torch.Tensor],
    pairs: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
    k_max: int = 8,
    fingerprint: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
) -> HarmBasis:
    """Per layer of ``harmful`` ``{layer: [Nh, d]}`` and ``benign`` ``{layer: [Nb, d]}``: the unit
    difference of means, then the top singular directions of the pairs' differences (``pairs[layer]
    = (harmful [P, d], benign [P, d])``; without pairs, each harmful state minus the benign mean) after
    projecting the first direction out; ``k_max`` directions in all, orthonormal."""
    if k_max < 1:
        raise AligntaxError(f"k_max must be >= 1; got {k_max}.")
    directions: dict[int, torch.Tensor] = {}
    info: dict[str, Any] = {"k_max": k_max, "layers": {}}
    for layer in sorted(harmful):
        xh, xb = harmful[layer].float(), benign[layer].float()
        if not len(xh) or not len(xb):
            raise DataError("The harm basis needs harmful and benign prompt states.")
        mean_diff = xh.mean(0) - xb.mean(0)
        q0 = mean_diff / mean_diff.norm().clamp_min(1e-12)
        ph, pb = (pairs or {}).get(layer, (xh[:0], xb[:0]))
        diffs = (ph.float() - pb.float()) if len(ph) else xh - xb.mean(0)
        diffs = diffs - (diffs @ q0)[:, None] * q0[None]
        _, sv, vh = torch.linalg.svd(diffs, full_matrices=False)
        a = torch.cat([q0[None], vh[: k_max - 1]])  # [K, d]
        q, r = torch.linalg.qr(a.T)  # orthonormal columns spanning a's rows, in order
        sign = torch.sign(torch.diagonal(r))
        q = (q * torch.where(sign == 0, torch.ones_like(sign), sign)).T  # q[0] == q0
        directions[layer] = q
        energy = sv.square()
        info["layers"][str(layer)] = {
            "mean_diff_norm": round(float(mean_diff.norm()), 4),
            "pair_diff_share": [
                round(float(v), 4) for v in (energy[: k_max - 1] / energy.sum().clamp_min(1e-12))
            ],
            "n_pairs": int(len(ph)),
        }
    info["n_harmful"] = int(len(next(iter(harmful.values()))))
    info["n_benign"] = int(len(next(iter(benign.values()))))
    info.update(metadata or {})
    return HarmBasis(directions, dict(fingerprint or {}), info)


# ---- learned row strength -----------------------------------------------------------------------------
@dataclass
class RowStrength:
    """``s = sigmoid(w . (f - mean) / scale + b)`` over :data:`STRENGTH_FEATURES` read at block
    ``layer`` (the first steered block; the gate logit at the gate's own layers), 0 below ``floor``.
    ``refusal_dir`` and ``harm_dir``: the unit directions the projection features read."""

    layer: int
    weight: torch.Tensor  # [F]
    bias: float
    mean: torch.Tensor  # [F]
    scale: torch.Tensor  # [F]
    refusal_dir: torch.Tensor  # [d]
    harm_dir: torch.Tensor  # [d]
    floor: float = 0.1
    fingerprint: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.layer = int(self.layer)
        f = len(STRENGTH_FEATURES)
        self.weight, self.mean = (
            torch.as_tensor(t).detach().float().cpu().reshape(f) for t in (self.weight, self.mean)
        )
        self.scale = torch.as_tensor(self.scale).detach().float().cpu().reshape(f).clamp_min(1e-6)
        self.refusal_dir, self.harm_dir = (
            _unit(torch.as_tensor(t).detach().float().cpu().flatten())
            for t in (self.refusal_dir, self.harm_dir)
        )
        self.bias = float(self.bias)
        if not 0.0 <= self.floor < 1.0:
            raise AligntaxError(f"The row strength floor must be in [0, 1); got {self.floor}.")
        self._on: dict[str, tuple[torch.Tensor, ...]] = {}

    @property
    def dim(self) -> int:
        return int(self.refusal_dir.shape[0])

    def projections(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The projections of states ``[N, d]`` (block ``layer``) on the refusal and the harm direction."""
        key = str(h.device)
        if key not in self._on:
            self._on[key] = tuple(
                t.to(h.device) for t in (self.weight, self.mean, self.scale, self.refusal_dir, self.harm_dir)
            )
        *_, r, hd = self._on[key]
        return h.float() @ r, h.float() @ hd

    def prob(self, features: torch.Tensor) -> torch.Tensor:
        """The calibrated probability that steering the row is worth it, ``[N, F] -> [N]``."""
        w, mu, sc = (t.to(features.device) for t in (self.weight, self.mean, self.scale))
        return torch.sigmoid(((features.float() - mu) / sc) @ w + self.bias)

    def strength(self, features: torch.Tensor) -> torch.Tensor:
        """The step factor ``[N]`` in [0, 1]: :meth:`prob`, or 0 below ``floor``."""
        p = self.prob(features)
        return torch.where(p >= self.floor, p, torch.zeros_like(p))

    def save(self, directory: str | Path) -> Path:
        return _STRENGTH.save(
            directory,
            {
                "weight": self.weight,
                "mean": self.mean,
                "scale": self.scale,
                "refusal_dir": self.refusal_dir,
                "harm_dir": self.harm_dir,
            },
            {
                "fingerprint": self.fingerprint,
                "hidden_size": self.dim,
                "layer": self.layer,
                "bias": self.bias,
                "floor": self.floor,
                "features": list(STRENGTH_FEATURES),
                "info": self.info,
            },
        )

    @classmethod
    def load(
        cls,
        directory: str | Path,
        expect_fingerprint: dict[str, Any] | None = None,
        expect_hidden_size: int | None = None,
    ) -> RowStrength:
        meta, t = _STRENGTH.load(directory, expect_fingerprint, expect_hidden_size)
        if list(meta.get("features") or []) != list(STRENGTH_FEATURES):
            raise DataError(
                f"{directory}: the row strength model reads features {meta.get('features')}, "
                f"not {list(STRENGTH_FEATURES)}."
            )
        return cls(
            meta["layer"],
            t["weight"],
            meta["bias"],
            t["mean"],
            t["scale"],
            t["refusal_dir"],
            t["harm_dir"],
            float(meta.get("floor", 0.1)),
            meta["fingerprint"],
            meta.get("info") or {},
        )

    @staticmethod
    def exists(directory: str | Path) -> bool:
        return (Path(directory) / _STRENGTH.sidecar).is_file()


def _unit(v: torch.Tensor) -> torch.Tensor:
    unit: torch.Tensor = v / v.norm().clamp_min(1e-12)
    return unit


def fit_row_strength(
    features: torch.Tensor,
    worth: torch.Tensor,
    layer: int,
    refusal_dir: torch.Tensor,
    harm_dir: torch.Tensor,
    weight: torch.Tensor | None = None,
    l2: float = 1e-2,
    floor: float = 0.1,
    fingerprint: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
) -> RowStrength:
    """A :class:`RowStrength` fitted by L2-regularised logistic regression (classes weighted equally,
    ``weight`` per row within its class) on ``features`` ``[N, F]`` and ``worth`` (1: worth steering)."""
    from aligntax.energy.gate import fit_standardised, gate_rates

    y = torch.as_tensor(worth).bool().flatten()
    x = torch.as_tensor(features).float()
    if x.shape != (len(y), len(STRENGTH_FEATURES)):
        raise DataError(f"Row strength features must be [N, {len(STRENGTH_FEATURES)}]; got {tuple(x.shape)}.")
    if y.all() or not y.any():
        raise DataError("The row strength model needs rows worth steering and rows that must not be.")
    if not torch.isfinite(x).all():
        raise DataError("Row strength features contain NaN or inf.")
    w, b, mu, sd = fit_standardised(x, y, l2, weight)
    model = RowStrength(layer, w, b, mu, sd, refusal_dir, harm_dir, floor, dict(fingerprint or {}))
    p = model.prob(x)
    s = model.strength(x)
    model.info = {
        "l2": l2,
        "n": len(y),
        "n_worth": int(y.sum()),
        "train_fit": gate_rates(torch.logit(p.clamp(1e-6, 1 - 1e-6)), y),
        "mean_strength": {"worth": float(s[y].mean()), "not_worth": float(s[~y].mean())},
        "held_at_floor": {
            "worth": float((s[y] == 0).float().mean()),
            "not_worth": float((s[~y] == 0).float().mean()),
        },
        "weights": dict(zip(STRENGTH_FEATURES, [round(float(v), 4) for v in w], strict=True)),
        **(metadata or {}),
    }
    return model
