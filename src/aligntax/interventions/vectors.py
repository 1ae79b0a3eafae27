"""Vector-steering baselines behind the same ``Intervention`` interface.

- :class:`ActivationAddition`: add ``coeff * v_l`` to the residual stream entering layer l.
- :class:`DirectionAblation`: project a unit direction out of the residual stream at every layer (input
  of every block, its attention output, and the output of the last block) and every position (Arditi
  et al. 2024). With the false-refusal vector (Wang et al. 2024) this is single-vector false-refusal
  ablation.
- :class:`ConditionalSteering`: CAST-style (Lee et al. 2025): at prefill, the cosine similarity of each
  row's last-prompt-token state at a condition layer with a condition vector decides whether the
  behaviour vector is added (or ablated) for that row's later tokens.

Vector construction: :func:`refusal_direction` (difference in means), :func:`false_refusal_direction`
(pseudo-harmful minus harmless, orthogonalised against the refusal direction), :func:`fit_condition`.
:class:`SteeringVectors` saves/loads vectors as safetensors + a JSON sidecar with the model fingerprint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from aligntax.artefacts import TensorArtefact
from aligntax.errors import AligntaxError, DataError
from aligntax.interventions.base import Intervention
from aligntax.interventions.kernels import RowKernel, Site, check_positions
from aligntax.interventions.options import need_path, option, register
from aligntax.models.layers import resolve_layers

if TYPE_CHECKING:
    from aligntax.models.loader import LoadedModel

Acts = torch.Tensor | dict[int, torch.Tensor]


# ---- vector construction ------------------------------------------------------------------------------
def _per_layer(fn: Callable[..., torch.Tensor], *args: Acts) -> Acts:
    if isinstance(args[0], dict):
        return {int(layer): fn(*(a[layer] if isinstance(a, dict) else a for a in args)) for layer in args[0]}
    return fn(*args)


def mean_difference(acts_a: Acts, acts_b: Acts) -> Acts:
    """mean(a) - mean(b) (float32), per layer when given ``{layer: [n, d]}``."""

    def diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if len(a) == 0 or len(b) == 0:
            raise DataError("Difference in means needs at least one state on each side.")
        return a.float().mean(0) - b.float().mean(0)

    return _per_layer(diff, acts_a, acts_b)


def refusal_direction(acts_harmful: Acts, acts_harmless: Acts) -> Acts:
    """The refusal direction (Arditi et al.): mean(harmful) - mean(harmless), not normalised."""
    return mean_difference(acts_harmful, acts_harmless)


def orthogonalize(v: torch.Tensor, against: torch.Tensor) -> torch.Tensor:
    """``v`` minus its component along ``against``."""
    u = against.float() / against.float().norm().clamp_min(1e-12)
    v = v.float()
    out: torch.Tensor = v - (v @ u) * u
    return out


def false_refusal_direction(acts_pseudo_harmful: Acts, acts_harmless: Acts, refusal: Acts) -> Acts:
    """Wang et al. 2024: mean(pseudo-harmful benign) - mean(harmless), orthogonalised against the refusal vector."""
    fr = mean_difference(acts_pseudo_harmful, acts_harmless)
    return _per_layer(orthogonalize, fr, refusal)


def cosine(h: torch.Tensor, v: torch.Tensor, center: torch.Tensor | None = None) -> torch.Tensor:
    h = h.float()
    if center is not None:
        h = h - center.to(h)
    return torch.nn.functional.cosine_similarity(h, v.to(h).expand_as(h), dim=-1)


def fit_condition(
    acts_pos: torch.Tensor, acts_neg: torch.Tensor, center: torch.Tensor | None = None
) -> tuple[torch.Tensor, float, str, float]:
    """A CAST condition from states that should trigger (``pos``) and should not (``neg``).

    Returns (condition vector = unit mean difference, threshold, compare, balanced accuracy): the
    threshold on cos(h - center, c) best separating the two sets; compare is 'greater' (pos above).
    """
    from aligntax.energy.train import best_threshold

    if center is None:
        center = torch.cat([acts_pos, acts_neg]).float().mean(0)
    c = cast(torch.Tensor, mean_difference(acts_pos, acts_neg))  # tensors in, a tensor out
    c = c / c.norm().clamp_min(1e-12)
    sp, sn = cosine(acts_pos, c, center), cosine(acts_neg, c, center)
    thr = best_threshold(sn, sp)  # "good" side below the threshold: neg
    acc = 0.5 * (float((sp > thr).float().mean()) + float((sn <= thr).float().mean()))
    return c, thr, "greater", acc


# ---- hook helpers ---------------------------------------------------------------------------------------
class _VecCache:
    """Vectors moved to a device once (float32)."""

    def __init__(self) -> None:
        self._c: dict[tuple[int | str, str], torch.Tensor] = {}

    def get(self, key: int | str, v: torch.Tensor, device: torch.device) -> torch.Tensor:
        k = (key, str(device))
        if k not in self._c:
            self._c[k] = v.detach().to(device=device, dtype=torch.float32)
        return self._c[k]


def _resolve_layers(layers: str | int | Sequence[int] | None, n: int) -> list[int]:
    return sorted(resolve_layers(layers, n))


def _ablate(x: torch.Tensor, u: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x - scale * (x.u) u, with u a unit vector; x float32 [B, T, d], scale [B, 1, 1]."""
    return x - scale * (x @ u)[..., None] * u


def _unit(v: torch.Tensor) -> torch.Tensor:
    v = v.detach().float()
    n = v.norm()
    if not torch.isfinite(n) or n == 0:
        raise AligntaxError("Cannot ablate a zero or non-finite direction.")
    unit: torch.Tensor = v / n
    return unit


def _as_layer_dict(vectors: Acts, what: str) -> dict[int, torch.Tensor]:
    if isinstance(vectors, dict):
        return {int(k): v.detach().float() for k, v in vectors.items()}
    raise AligntaxError(f"{what} needs {{layer: vector}}.")


# ---- interventions ---------------------------------------------------------------------------------------
class _VectorIntervention(Intervention):
    """What the vector interventions share: a coefficient, the steered positions (where they have
    them), an optional name over the class's own, and a per-device cache of their vectors."""

    cacheable = False  # config() gives the vectors' layers and norms, not the vectors

    def __init__(self, coeff: float, name: str | None, positions: str | None = None):
        self.coeff = float(coeff)
        if positions is not None:
            self.positions = check_positions(positions)
        if name:
            self.name = name
        self._cache = _VecCache()

    @property
    def prefix_free(self) -> bool:  # type: ignore[override]  # a class attribute of Intervention
        # steers (and reads) from the last prompt token on, unless "all"
        return getattr(self, "positions", None) != "all"


class ActivationAddition(_VectorIntervention):
    """Add ``coeff * v_l`` (times the row scale) to the states entering each layer l, at ``positions``."""

    name = "activation-addition"

    def __init__(
        self,
        vectors_by_layer: dict[int, torch.Tensor],
        coeff: float = 1.0,
        positions: str = "all",
        name: str | None = None,
    ):
        self.vectors = _as_layer_dict(vectors_by_layer, "ActivationAddition")
        super().__init__(coeff, name, positions)

    def config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "layers": sorted(self.vectors),
            "coeff": self.coeff,
            "positions": self.positions,
            "norms": {layer: float(v.norm()) for layer, v in self.vectors.items()},
        }

    def kernel(self, n_layers: int, hidden_size: int | None = None) -> RowKernel:
        layers = _resolve_layers(list(self.vectors), n_layers)
        _check_dim(self.vectors.values(), hidden_size)
        return _VectorKernel(
            self,
            {layer: self.vectors[layer if layer in self.vectors else layer - n_layers] for layer in layers},
            "add",
            self.positions,
        )


class DirectionAblation(_VectorIntervention):
    """Project a direction out of the residual stream at every (selected) layer and position.

    ``direction`` is one vector (used at every layer) or ``{layer: vector}``. The direction is removed
    from the input of every selected block, from what its attention writes into the stream (so the
    MLP never reads it either) and, when the last block is selected, from its output (so the final
    norm and the LM head never see it): with ``coeff`` 1 on every layer the stream never holds a
    component along it, which is what the weight export (``aligntax export``) bakes in. ``coeff`` < 1
    removes only part of the component at each of those sites.
    """

    name = "direction-ablation"

    def __init__(
        self,
        direction: torch.Tensor | dict[int, torch.Tensor],
        layers: str | Sequence[int] = "all",
        coeff: float = 1.0,
        positions: str = "all",
        name: str | None = None,
    ):
        self.direction = (
            {int(k): _unit(v) for k, v in direction.items()}
            if isinstance(direction, dict)
            else _unit(direction)
        )
        self.layers = layers
        super().__init__(coeff, name, positions)

    def config(self) -> dict[str, Any]:
        layers = self.layers if isinstance(self.layers, str) else list(self.layers)
        return {
            "name": self.name,
            "layers": layers,
            "coeff": self.coeff,
            "positions": self.positions,
            "per_layer": isinstance(self.direction, dict),
        }

    def _dir(self, layer: int) -> torch.Tensor | None:
        if isinstance(self.direction, dict):
            return self.direction.get(layer)
        return self.direction

    def kernel(self, n_layers: int, hidden_size: int | None = None) -> RowKernel:
        if isinstance(self.direction, dict) and self.layers == "all":
            layers = _resolve_layers(list(self.direction), n_layers)
        else:
            layers = _resolve_layers(self.layers, n_layers)
        _check_dim(
            [self.direction] if not isinstance(self.direction, dict) else self.direction.values(), hidden_size
        )
        units = {layer: d for layer in layers if (d := self._dir(layer)) is not None}
        sites = [Site(layer, where) for layer in units for where in ("pre", "attn")]
        if n_layers - 1 in layers and n_layers - 1 in units:  # the last block's output too
            sites.append(Site(n_layers - 1, "post"))
        return _VectorKernel(self, units, "ablate", self.positions, sites=sites)


def _check_dim(vectors: Iterable[torch.Tensor], hidden_size: int | None) -> None:
    for v in vectors:
        if hidden_size is not None and v.shape[-1] != hidden_size:
            raise AligntaxError(f"Vector has size {v.shape[-1]}, the model's hidden size is {hidden_size}.")


class _VectorKernel(RowKernel):
    """A vector method as a row kernel: per site, add ``coeff * strength * v`` (``"add"``) or remove
    ``coeff * strength`` of the component along ``v / |v|`` (``"ablate"``); an optional CAST-style
    condition (``condition``: the intervention's ``decide`` at ``condition_layer``) decides per row."""

    def __init__(
        self,
        iv: _VectorIntervention,
        vectors: dict[int, torch.Tensor],
        mode: str,
        positions: str,
        sites: list[Site] | None = None,
        condition_layer: int | None = None,
        normalise: bool = False,
    ):
        self.iv, self.vectors, self.mode, self.normalise = iv, vectors, mode, normalise
        self.positions = positions
        self.sites = sites if sites is not None else [Site(layer) for layer in sorted(vectors)]
        if iv.coeff == 0:
            self.sites = []
        self.condition_layer = condition_layer
        self.decision_layers = [] if condition_layer is None else [condition_layer]

    def decision_parts(self, states: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.condition_layer is None:
            return {}
        iv = cast(ConditionalSteering, self.iv)  # the one vector method with a condition
        return {"cast": iv.decide(states[self.condition_layer]).float()}

    def record_decisions(self, parts: dict[str, torch.Tensor], stats: dict[str, Any]) -> None:
        if "cast" in parts:
            d = parts["cast"].detach().cpu() != 0
            s = stats.setdefault("cast", {"rows": 0, "triggered": 0})
            s["rows"] += len(d)
            s["triggered"] += int(d.sum())

    def edits_last_prompt(self, site: Site) -> bool:
        # a conditional edit starts at the last prompt token only in the blocks after the decision
        return self.condition_layer is None or site.layer > self.condition_layer

    def edit(
        self, site: Site, rows: torch.Tensor, strength: torch.Tensor, stats: dict[str, Any] | None = None
    ) -> torch.Tensor:
        v = self.iv._cache.get(site.layer, self.vectors[site.layer], rows.device)
        x = rows.float()
        scale = (self.iv.coeff * strength.to(rows.device))[:, None]
        if self.mode == "add":
            x = x + scale * v
        else:
            x = _ablate(x, v / v.norm().clamp_min(1e-12) if self.normalise else v, scale)
        return x.to(rows.dtype)


class ConditionalSteering(_VectorIntervention):
    """CAST-style conditional steering.

    At the forward that holds the prompt, the state entering ``condition_layer`` at the last prompt
    token gives ``sim = cos(h - center, condition)`` per row; a row is steered when ``sim > threshold``
    (``compare='greater'``) or ``sim < threshold`` (``'less'``), combined with the context's own row
    mask and strength. Steered rows then get the behaviour vector added (``mode='add'``, ``coeff * v``)
    or projected out (``mode='ablate'``) at ``behaviour_layers``: at every generated token, and also
    at the last prompt token in the layers after the condition layer (the ones that run after the
    decision). Rows decided in the prefill keep their decision for the rest of the generation; the
    same decision is reached when the KV cache is off (the prompt is re-fed unchanged).
    """

    name = "cast"

    def __init__(
        self,
        condition: torch.Tensor,
        condition_layer: int,
        threshold: float,
        behaviour: torch.Tensor | dict[int, torch.Tensor],
        behaviour_layers: str | Sequence[int] = "all",
        mode: str = "add",
        coeff: float = 1.0,
        compare: str = "greater",
        center: torch.Tensor | None = None,
        name: str | None = None,
    ):
        if mode not in ("add", "ablate"):
            raise AligntaxError("CAST mode must be 'add' or 'ablate'.")
        if compare not in ("greater", "less"):
            raise AligntaxError("CAST compare must be 'greater' or 'less'.")
        self.condition = _unit(condition)
        self.condition_layer = int(condition_layer)
        self.threshold = float(threshold)
        self.behaviour = (
            {int(k): v.detach().float() for k, v in behaviour.items()}
            if isinstance(behaviour, dict)
            else behaviour.detach().float()
        )
        self.behaviour_layers = behaviour_layers
        self.mode = mode
        super().__init__(coeff, name)
        self.compare = compare
        self.center = None if center is None else center.detach().float()

    def config(self) -> dict[str, Any]:
        bl = self.behaviour_layers if isinstance(self.behaviour_layers, str) else list(self.behaviour_layers)
        return {
            "name": self.name,
            "condition_layer": self.condition_layer,
            "threshold": self.threshold,
            "compare": self.compare,
            "mode": self.mode,
            "coeff": self.coeff,
            "behaviour_layers": bl,
        }

    def _vec(self, layer: int) -> torch.Tensor | None:
        return self.behaviour.get(layer) if isinstance(self.behaviour, dict) else self.behaviour

    def _condition_block(self, n_layers: int) -> int:
        return _resolve_layers(self.condition_layer, n_layers)[0]

    def decide(self, h_last: torch.Tensor) -> torch.Tensor:
        """Rows (bool ``[B]``) whose last-prompt-token state meets the condition."""
        c = self._cache.get("condition", self.condition, h_last.device)
        center = None if self.center is None else self._cache.get("center", self.center, h_last.device)
        sim = cosine(h_last, c, center)
        return sim > self.threshold if self.compare == "greater" else sim < self.threshold

    def kernel(self, n_layers: int, hidden_size: int | None = None) -> RowKernel:
        cl = self._condition_block(n_layers)
        if isinstance(self.behaviour, dict) and self.behaviour_layers == "all":
            layers = _resolve_layers(list(self.behaviour), n_layers)
        else:
            layers = _resolve_layers(self.behaviour_layers, n_layers)
        vectors = {layer: v for layer in layers if (v := self._vec(layer)) is not None}
        _check_dim([self.condition, *vectors.values()], hidden_size)
        return _VectorKernel(
            self, vectors, self.mode, "last_and_generated", condition_layer=cl, normalise=True
        )


# ---- storage ---------------------------------------------------------------------------------------------
@dataclass
class _SavedVectorOptions:
    """What every method reading a vector folder takes."""

    path: str | None = option("vector folder for the vector baselines", flag="--vectors")
    coeff: float | None = option("vector baselines: strength", parse="float", check="finite", request=True)
    layer: int | None = option(
        "vector baselines: the layer whose vector is used (default: the folder's)",
        parse="int",
        check="count",
        request=True,
    )


@dataclass
class VectorOptions(_SavedVectorOptions):
    layers: list[int] | None = option(
        "comma-separated layer indices, e.g. 17,19", parse="layers", check="count", request=True
    )
    positions: str | None = option("last_and_generated, generated or all (default all)", cli=False)


@dataclass
class CastOptions(_SavedVectorOptions):
    threshold: float | None = option(
        "CAST: the condition's cosine threshold (default: the fitted one)",
        parse="float",
        check="finite",
        cli=False,
        request=True,
    )
    mode: str | None = option("CAST: add or ablate the behaviour vector", cli=False)
    compare: str | None = option(
        "CAST: steer when the similarity is greater or less than the threshold", cli=False
    )
    behaviour: str | None = option("CAST: the saved vector to use (refusal, false_refusal)", cli=False)
    behaviour_layers: str | list[int] | None = option("CAST: the layers it acts on (default all)", cli=False)


def _fingerprint(lm: LoadedModel | None) -> dict[str, Any] | None:
    fp = getattr(lm, "fingerprint", None) if lm is not None else None
    return dict(fp) if fp else None


def _vectors(name: str, lm: LoadedModel | None, path: str | None) -> SteeringVectors:
    return SteeringVectors.load(
        need_path(name, path),
        expect_fingerprint=_fingerprint(lm),
        expect_hidden_size=lm.hidden_size if lm is not None else None,
    )


def _vector_method(name: str, lm: LoadedModel | None, o: VectorOptions) -> _VectorIntervention:
    vs = _vectors(name, lm, o.path)
    kind = "false_refusal" if name == "false-refusal-ablation" else "refusal"
    layer = vs.default_layer(kind) if o.layer is None else int(o.layer)
    vec = vs.get(kind, layer)
    coeff = 1.0 if o.coeff is None else float(o.coeff)
    if name == "refusal-add":  # several layers: each gets its own layer's vector
        vecs = {layer: vec} if o.layers is None else {int(x): vs.get(kind, int(x)) for x in o.layers}
        return ActivationAddition(vecs, coeff=coeff, positions=o.positions or "all", name=name)
    return DirectionAblation(
        vec,
        layers="all" if o.layers is None else o.layers,
        coeff=coeff,
        positions=o.positions or "all",
        name=name,
    )


@register(
    "refusal-add", VectorOptions, "add the refusal vector of one layer (--layers: each listed layer's own)"
)
def _refusal_add(lm: LoadedModel | None, o: VectorOptions) -> _VectorIntervention:
    return _vector_method("refusal-add", lm, o)


@register("refusal-ablation", VectorOptions, "project the refusal direction (of --layer) out at every layer")
def _refusal_ablation(lm: LoadedModel | None, o: VectorOptions) -> _VectorIntervention:
    return _vector_method("refusal-ablation", lm, o)


@register("false-refusal-ablation", VectorOptions, "project the false-refusal direction out at every layer")
def _false_refusal_ablation(lm: LoadedModel | None, o: VectorOptions) -> _VectorIntervention:
    return _vector_method("false-refusal-ablation", lm, o)


@register("cast", CastOptions, "conditional steering from the saved CAST condition")
def _cast(lm: LoadedModel | None, o: CastOptions) -> _VectorIntervention:
    vs = _vectors("cast", lm, o.path)
    cast = dict(vs.metadata.get("cast") or {})
    if not cast or "condition" not in vs.vectors:
        raise AligntaxError(
            "This vector folder has no CAST condition; compute it with pseudo-harmful prompts."
        )
    layer = int(cast["condition_layer"])
    behaviour = o.behaviour or cast.get("behaviour", "refusal")
    vec = vs.get(behaviour, vs.default_layer(behaviour) if o.layer is None else int(o.layer))
    return ConditionalSteering(
        vs.get("condition", layer),
        layer,
        float(cast["threshold"] if o.threshold is None else o.threshold),
        vec,
        behaviour_layers=o.behaviour_layers or cast.get("behaviour_layers", "all"),
        mode=o.mode or cast.get("mode", "ablate"),
        coeff=1.0 if o.coeff is None else float(o.coeff),
        compare=o.compare or cast.get("compare", "less"),
        center=vs.vectors.get("center", {}).get(layer),
        name="cast",
    )


FORMAT = "aligntax.vectors/1"
SIDECAR = "vectors.json"
WEIGHTS = "vectors.safetensors"
_FILES = TensorArtefact(
    FORMAT, SIDECAR, WEIGHTS, what="vector set", missing="steering vectors", kind="vector file"
)


@dataclass
class SteeringVectors:
    """Named per-layer vectors (e.g. ``refusal``, ``false_refusal``, ``condition``) for one model."""

    vectors: dict[str, dict[int, torch.Tensor]]
    fingerprint: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.vectors = {
            str(k): {int(layer): v.detach().float().cpu() for layer, v in d.items()}
            for k, d in self.vectors.items()
        }
        dims = {v.shape[-1] for d in self.vectors.values() for v in d.values()}
        if len(dims) > 1:
            raise DataError(f"Vectors of one set must share the hidden size; got {sorted(dims)}.")

    @property
    def hidden_size(self) -> int:
        for d in self.vectors.values():
            for v in d.values():
                return int(v.shape[-1])
        return 0

    def get(self, name: str, layer: int | None = None) -> torch.Tensor:
        if name not in self.vectors:
            raise DataError(f"No '{name}' vectors saved (have {sorted(self.vectors)}).")
        layer = self.default_layer(name) if layer is None else int(layer)
        if layer not in self.vectors[name]:
            raise DataError(
                f"No '{name}' vector for layer {layer} (have layers {sorted(self.vectors[name])})."
            )
        return self.vectors[name][layer]

    def default_layer(self, name: str = "refusal") -> int:
        layers = sorted(self.vectors[name])
        chosen = self.metadata.get("layer")
        if chosen is not None and int(chosen) in self.vectors[name]:
            return int(chosen)
        return layers[len(layers) // 2]

    def save(self, directory: str | Path) -> Path:
        tensors = {
            f"{name}.{layer}": v.contiguous() for name, d in self.vectors.items() for layer, v in d.items()
        }
        return _FILES.save(
            directory,
            tensors,
            {
                "fingerprint": self.fingerprint,
                "hidden_size": self.hidden_size,
                "vectors": {n: sorted(d) for n, d in self.vectors.items()},
                "metadata": self.metadata,
            },
        )

    @classmethod
    def load(
        cls,
        directory: str | Path,
        expect_fingerprint: dict[str, Any] | None = None,
        expect_hidden_size: int | None = None,
    ) -> SteeringVectors:
        meta, tensors = _FILES.load(directory, expect_fingerprint, expect_hidden_size)
        vectors: dict[str, dict[int, torch.Tensor]] = {}
        for key, v in tensors.items():
            name, layer = key.rsplit(".", 1)
            vectors.setdefault(name, {})[int(layer)] = v
        return cls(vectors, meta["fingerprint"], meta.get("metadata") or {})


def compute_vectors(
    acts_harmful: dict[int, torch.Tensor],
    acts_harmless: dict[int, torch.Tensor],
    acts_pseudo_harmful: dict[int, torch.Tensor] | None = None,
    fingerprint: dict[str, Any] | None = None,
    layer: int | None = None,
    metadata: dict[str, Any] | None = None,
) -> SteeringVectors:
    """Refusal vectors per layer, plus false-refusal vectors and a CAST condition when pseudo-harmful
    (benign but risky-looking) prompts are given.

    The CAST condition (at ``layer``) separates harmful from pseudo-harmful states; its metadata
    (threshold, compare, layer, center) is stored under ``metadata['cast']``.
    """
    # per-layer states in, per-layer vectors out
    refusal = cast(dict[int, torch.Tensor], refusal_direction(acts_harmful, acts_harmless))
    vectors: dict[str, dict[int, torch.Tensor]] = {"refusal": refusal}
    meta = dict(metadata or {})
    layers = sorted(refusal)
    layer = int(layer) if layer is not None else layers[len(layers) // 2]
    meta["layer"] = layer
    if acts_pseudo_harmful is not None:
        vectors["false_refusal"] = cast(
            dict[int, torch.Tensor], false_refusal_direction(acts_pseudo_harmful, acts_harmless, refusal)
        )
        center = torch.cat([acts_harmful[layer], acts_pseudo_harmful[layer]]).float().mean(0)
        c, thr, compare, acc = fit_condition(acts_harmful[layer], acts_pseudo_harmful[layer], center)
        vectors["condition"] = {layer: c}
        vectors["center"] = {layer: center}
        # Over-refusal use: ablate refusal for rows that do not look harmful (sim below the threshold).
        meta["cast"] = {
            "condition_layer": layer,
            "threshold": thr,
            "compare": "less",
            "mode": "ablate",
            "behaviour": "refusal",
            "behaviour_layers": "all",
            "fit_balanced_acc": acc,
        }
    return SteeringVectors(vectors, dict(fingerprint or {}), meta)
