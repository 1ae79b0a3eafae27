"""Vector-steering baselines behind the same ``Intervention`` interface.

- :class:`ActivationAddition`: add ``coeff * v_l`` to the residual stream entering layer l.
- :class:`DirectionAblation`: project a unit direction out of the residual stream at every layer (input
  of every block and output of the last block) and every position (Arditi et al. 2024). With the
  false-refusal vector (Wang et al. 2024) this is single-vector false-refusal ablation.
- :class:`ConditionalSteering`: CAST-style (Lee et al. 2025): at prefill, the cosine similarity of each
  row's last-prompt-token state at a condition layer with a condition vector decides whether the
  behaviour vector is added (or ablated) for that row's later tokens.

Vector construction: :func:`refusal_direction` (difference in means), :func:`false_refusal_direction`
(pseudo-harmful minus harmless, orthogonalised against the refusal direction), :func:`fit_condition`.
:class:`SteeringVectors` saves/loads vectors as safetensors + a JSON sidecar with the model fingerprint.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from aligntax.activations.compat import TensorArtefact
from aligntax.errors import AligntaxError, DataError
from aligntax.interventions.base import (
    Intervention,
    SteerContext,
    decide_at_prefill,
    hidden_from_args,
    hooks_attached,
    prefill_decisions,
    replace_hidden_in_args,
)
from aligntax.interventions.els import check_positions, positions_slice
from aligntax.models.layers import decoder_layers

Acts = torch.Tensor | dict[int, torch.Tensor]


# ---- vector construction ------------------------------------------------------------------------------
def _per_layer(fn, *args):
    if isinstance(args[0], dict):
        return {int(layer): fn(*(a[layer] if isinstance(a, dict) else a for a in args)) for layer in args[0]}
    return fn(*args)


def mean_difference(acts_a: Acts, acts_b: Acts) -> Acts:
    """mean(a) - mean(b) (float32), per layer when given ``{layer: [n, d]}``."""
    def diff(a, b):
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
    return v - (v @ u) * u


def false_refusal_direction(acts_pseudo_harmful: Acts, acts_harmless: Acts, refusal: Acts) -> Acts:
    """Wang et al. 2024: mean(pseudo-harmful benign) - mean(harmless), orthogonalised against the refusal vector."""
    fr = mean_difference(acts_pseudo_harmful, acts_harmless)
    return _per_layer(orthogonalize, fr, refusal)


def cosine(h: torch.Tensor, v: torch.Tensor, center: torch.Tensor | None = None) -> torch.Tensor:
    h = h.float()
    if center is not None:
        h = h - center.to(h)
    return torch.nn.functional.cosine_similarity(h, v.to(h).expand_as(h), dim=-1)


def fit_condition(acts_pos: torch.Tensor, acts_neg: torch.Tensor, center: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, float, str, float]:
    """A CAST condition from states that should trigger (``pos``) and should not (``neg``).

    Returns (condition vector = unit mean difference, threshold, compare, balanced accuracy): the
    threshold on cos(h - center, c) best separating the two sets; compare is 'greater' (pos above).
    """
    from aligntax.energy.train import best_threshold

    if center is None:
        center = torch.cat([acts_pos, acts_neg]).float().mean(0)
    c = mean_difference(acts_pos, acts_neg)
    c = c / c.norm().clamp_min(1e-12)
    sp, sn = cosine(acts_pos, c, center), cosine(acts_neg, c, center)
    thr = best_threshold(sn, sp)  # "good" side below the threshold: neg
    acc = 0.5 * (float((sp > thr).float().mean()) + float((sn <= thr).float().mean()))
    return c, thr, "greater", acc


# ---- hook helpers ---------------------------------------------------------------------------------------
class _VecCache:
    """Vectors moved to a device once (float32)."""

    def __init__(self):
        self._c: dict = {}

    def get(self, key, v: torch.Tensor, device) -> torch.Tensor:
        k = (key, str(device))
        if k not in self._c:
            self._c[k] = v.detach().to(device=device, dtype=torch.float32)
        return self._c[k]


def _resolve_layers(layers, n: int) -> list[int]:
    if layers is None or layers == "all":
        return list(range(n))
    out = []
    for layer in ([layers] if isinstance(layers, int) else layers):
        idx = int(layer) + n if int(layer) < 0 else int(layer)
        if not 0 <= idx < n:
            raise AligntaxError(f"Layer {layer} does not exist: the model has {n} layers.")
        out.append(idx)
    return sorted(set(out))


def _ablate(x: torch.Tensor, u: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x - scale * (x.u) u, with u a unit vector; x float32 [B, T, d], scale [B, 1, 1]."""
    return x - scale * (x @ u)[..., None] * u


def _unit(v: torch.Tensor) -> torch.Tensor:
    v = v.detach().float()
    n = v.norm()
    if not torch.isfinite(n) or n == 0:
        raise AligntaxError("Cannot ablate a zero or non-finite direction.")
    return v / n


def _as_layer_dict(vectors, what: str) -> dict[int, torch.Tensor]:
    if isinstance(vectors, dict):
        return {int(k): v.detach().float() for k, v in vectors.items()}
    raise AligntaxError(f"{what} needs {{layer: vector}}.")


# ---- interventions ---------------------------------------------------------------------------------------
class _VectorIntervention(Intervention):
    """What the vector interventions share: a coefficient, the steered positions (where they have
    them), an optional name over the class's own, and a per-device cache of their vectors."""

    def __init__(self, coeff: float, name: str | None, positions: str | None = None):
        self.coeff = float(coeff)
        if positions is not None:
            self.positions = check_positions(positions)
        if name:
            self.name = name
        self._cache = _VecCache()

    @property
    def prefix_free(self) -> bool:  # steers (and reads) from the last prompt token on, unless "all"
        return getattr(self, "positions", None) != "all"


class ActivationAddition(_VectorIntervention):
    """Add ``coeff * v_l`` (times the row scale) to the states entering each layer l, at ``positions``."""

    name = "activation-addition"

    def __init__(self, vectors_by_layer: dict[int, torch.Tensor], coeff: float = 1.0, positions: str = "all",
                 name: str | None = None):
        self.vectors = _as_layer_dict(vectors_by_layer, "ActivationAddition")
        super().__init__(coeff, name, positions)

    def config(self) -> dict:
        return {"name": self.name, "layers": sorted(self.vectors), "coeff": self.coeff, "positions": self.positions,
                "norms": {layer: float(v.norm()) for layer, v in self.vectors.items()}}

    @contextmanager
    def attach(self, model: nn.Module, ctx: SteerContext) -> Iterator[None]:
        blocks = decoder_layers(model)
        layers = _resolve_layers(list(self.vectors), len(blocks))

        def make_hook(layer: int):
            def hook(module, args, kwargs):
                h = hidden_from_args(args, kwargs)
                sl = positions_slice(h.shape[1], ctx, self.positions)
                if sl.start >= sl.stop or self.coeff == 0:
                    return None
                v = self._cache.get(layer, self.vectors[layer], h.device)
                scale = ctx.row_scale(h.shape[0], h.device, torch.float32)
                new = h.clone()
                new[:, sl] = (h[:, sl].float() + (self.coeff * scale) * v).to(h.dtype)
                return replace_hidden_in_args(args, kwargs, new)
            return hook

        with hooks_attached([(blocks[layer], make_hook(layer), True) for layer in layers]):
            yield


class DirectionAblation(_VectorIntervention):
    """Project a direction out of the residual stream at every (selected) layer and position.

    ``direction`` is one vector (used at every layer) or ``{layer: vector}``. The direction is removed
    from the input of every selected block and, when the last block is selected, from its output (so
    the final norm and the LM head never see it). ``coeff`` < 1 removes only part of the component.
    """

    name = "direction-ablation"

    def __init__(self, direction: torch.Tensor | dict[int, torch.Tensor], layers: str | Sequence[int] = "all",
                 coeff: float = 1.0, positions: str = "all", name: str | None = None):
        self.direction = ({int(k): _unit(v) for k, v in direction.items()} if isinstance(direction, dict)
                          else _unit(direction))
        self.layers = layers
        super().__init__(coeff, name, positions)

    def config(self) -> dict:
        layers = self.layers if isinstance(self.layers, str) else list(self.layers)
        return {"name": self.name, "layers": layers, "coeff": self.coeff, "positions": self.positions,
                "per_layer": isinstance(self.direction, dict)}

    def _dir(self, layer: int) -> torch.Tensor | None:
        if isinstance(self.direction, dict):
            return self.direction.get(layer)
        return self.direction

    def _apply(self, h: torch.Tensor, layer: int, ctx: SteerContext) -> torch.Tensor | None:
        d = self._dir(layer)
        if d is None or self.coeff == 0:
            return None
        sl = positions_slice(h.shape[1], ctx, self.positions)
        if sl.start >= sl.stop:
            return None
        u = self._cache.get(layer, d, h.device)
        scale = self.coeff * ctx.row_scale(h.shape[0], h.device, torch.float32)
        new = h.clone()
        new[:, sl] = _ablate(h[:, sl].float(), u, scale).to(h.dtype)
        return new

    @contextmanager
    def attach(self, model: nn.Module, ctx: SteerContext) -> Iterator[None]:
        blocks = decoder_layers(model)
        n = len(blocks)
        if isinstance(self.direction, dict) and self.layers == "all":
            layers = _resolve_layers(list(self.direction), n)
        else:
            layers = _resolve_layers(self.layers, n)
        for d in ([self.direction] if not isinstance(self.direction, dict) else self.direction.values()):
            if d.shape[-1] != (dim := _model_dim(model)):
                raise AligntaxError(f"Direction has size {d.shape[-1]}, the model's hidden size is {dim}.")

        def make_pre(layer: int):
            def hook(module, args, kwargs):
                new = self._apply(hidden_from_args(args, kwargs), layer, ctx)
                return None if new is None else replace_hidden_in_args(args, kwargs, new)
            return hook

        def post_hook(module, args, kwargs, output):
            h = output[0] if isinstance(output, tuple) else output
            new = self._apply(h, n - 1, ctx)
            if new is None:
                return None
            return (new, *output[1:]) if isinstance(output, tuple) else new

        regs = [(blocks[layer], make_pre(layer), True) for layer in layers]
        if n - 1 in layers:
            regs.append((blocks[n - 1], post_hook, False))
        with hooks_attached(regs):
            yield


def _model_dim(model: nn.Module) -> int:
    from aligntax.models.layers import hidden_size

    return hidden_size(model)


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

    def __init__(self, condition: torch.Tensor, condition_layer: int, threshold: float,
                 behaviour: torch.Tensor | dict[int, torch.Tensor], behaviour_layers: str | Sequence[int] = "all",
                 mode: str = "add", coeff: float = 1.0, compare: str = "greater",
                 center: torch.Tensor | None = None, name: str | None = None):
        if mode not in ("add", "ablate"):
            raise AligntaxError("CAST mode must be 'add' or 'ablate'.")
        if compare not in ("greater", "less"):
            raise AligntaxError("CAST compare must be 'greater' or 'less'.")
        self.condition = _unit(condition)
        self.condition_layer = int(condition_layer)
        self.threshold = float(threshold)
        self.behaviour = ({int(k): v.detach().float() for k, v in behaviour.items()} if isinstance(behaviour, dict)
                          else behaviour.detach().float())
        self.behaviour_layers = behaviour_layers
        self.mode = mode
        super().__init__(coeff, name)
        self.compare = compare
        self.center = None if center is None else center.detach().float()

    def config(self) -> dict:
        bl = self.behaviour_layers if isinstance(self.behaviour_layers, str) else list(self.behaviour_layers)
        return {"name": self.name, "condition_layer": self.condition_layer, "threshold": self.threshold,
                "compare": self.compare, "mode": self.mode, "coeff": self.coeff, "behaviour_layers": bl}

    def _vec(self, layer: int) -> torch.Tensor | None:
        return self.behaviour.get(layer) if isinstance(self.behaviour, dict) else self.behaviour

    def unsteered_rows(self, lm, prompts, system: str | None = None, batch_size: int = 32) -> list[bool] | None:
        """The rows whose prompt does not meet the condition (never steered)."""
        block = self._condition_block(lm.num_layers)
        return prefill_decisions(lm, prompts, [block], lambda states: ~self.decide(states[block]), self, system,
                                 batch_size)

    def _condition_block(self, n_layers: int) -> int:
        return _resolve_layers(self.condition_layer, n_layers)[0]

    def decide(self, h_last: torch.Tensor) -> torch.Tensor:
        """Rows (bool ``[B]``) whose last-prompt-token state meets the condition."""
        c = self._cache.get("condition", self.condition, h_last.device)
        center = None if self.center is None else self._cache.get("center", self.center, h_last.device)
        sim = cosine(h_last, c, center)
        return sim > self.threshold if self.compare == "greater" else sim < self.threshold

    @contextmanager
    def attach(self, model: nn.Module, ctx: SteerContext) -> Iterator[None]:
        blocks = decoder_layers(model)
        n = len(blocks)
        cl = self._condition_block(n)
        if isinstance(self.behaviour, dict) and self.behaviour_layers == "all":
            layers = _resolve_layers(list(self.behaviour), n)
        else:
            layers = _resolve_layers(self.behaviour_layers, n)
        key = (id(self), "condition")  # ctx.row_state[key]: rows that meet the condition

        def cond_hook(module, args, kwargs):
            decide_at_prefill(hidden_from_args(args, kwargs), ctx, key, self.decide, "CAST")
            return None

        def make_hook(layer: int):
            def hook(module, args, kwargs):
                decision = ctx.row_state.get(key)
                if decision is None:
                    return None  # prefill, before the condition layer has run
                h = hidden_from_args(args, kwargs)
                seq = h.shape[1]
                if seq == 1:  # a cached decode step (or the prefill of a 1-token prompt, after the decision)
                    sl = slice(0, 1)
                else:
                    start = ctx.prompt_len - 1 if layer > cl else ctx.prompt_len
                    sl = slice(min(start, seq), seq)
                if sl.start >= sl.stop:
                    return None
                scale = ctx.row_scale(h.shape[0], h.device, torch.float32) * decision.view(-1, 1, 1).float()
                v = self._cache.get(layer, self._vec(layer), h.device)
                x = h[:, sl].float()
                if self.mode == "add":
                    x = x + (self.coeff * scale) * v
                else:
                    x = _ablate(x, v / v.norm().clamp_min(1e-12), self.coeff * scale)
                new = h.clone()
                new[:, sl] = x.to(h.dtype)
                return replace_hidden_in_args(args, kwargs, new)
            return hook

        regs = [(blocks[cl], cond_hook, True)]
        regs += [(blocks[layer], make_hook(layer), True) for layer in layers if self._vec(layer) is not None]
        with hooks_attached(regs):
            yield
        if key in ctx.decisions:
            d = ctx.decisions[key].cpu()
            ctx.stats.setdefault("cast", {"rows": 0, "triggered": 0})
            ctx.stats["cast"]["rows"] += len(d)
            ctx.stats["cast"]["triggered"] += int(d.sum())


# ---- storage ---------------------------------------------------------------------------------------------
FORMAT = "aligntax.vectors/1"
SIDECAR = "vectors.json"
WEIGHTS = "vectors.safetensors"
_FILES = TensorArtefact(FORMAT, SIDECAR, WEIGHTS, what="vector set", missing="steering vectors", kind="vector file")


@dataclass
class SteeringVectors:
    """Named per-layer vectors (e.g. ``refusal``, ``false_refusal``, ``condition``) for one model."""

    vectors: dict[str, dict[int, torch.Tensor]]
    fingerprint: dict = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.vectors = {str(k): {int(layer): v.detach().float().cpu() for layer, v in d.items()}
                        for k, d in self.vectors.items()}
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
            raise DataError(f"No '{name}' vector for layer {layer} (have layers {sorted(self.vectors[name])}).")
        return self.vectors[name][layer]

    def default_layer(self, name: str = "refusal") -> int:
        layers = sorted(self.vectors[name])
        chosen = self.metadata.get("layer")
        if chosen is not None and int(chosen) in self.vectors[name]:
            return int(chosen)
        return layers[len(layers) // 2]

    def save(self, directory: str | Path) -> Path:
        tensors = {f"{name}.{layer}": v.contiguous() for name, d in self.vectors.items() for layer, v in d.items()}
        return _FILES.save(directory, tensors, {"fingerprint": self.fingerprint, "hidden_size": self.hidden_size,
                                                "vectors": {n: sorted(d) for n, d in self.vectors.items()},
                                                "metadata": self.metadata})

    @classmethod
    def load(cls, directory: str | Path, expect_fingerprint: dict | None = None,
             expect_hidden_size: int | None = None) -> SteeringVectors:
        meta, tensors = _FILES.load(directory, expect_fingerprint, expect_hidden_size)
        vectors: dict[str, dict[int, torch.Tensor]] = {}
        for key, v in tensors.items():
            name, layer = key.rsplit(".", 1)
            vectors.setdefault(name, {})[int(layer)] = v
        return cls(vectors, meta["fingerprint"], meta.get("metadata") or {})


def compute_vectors(acts_harmful: dict[int, torch.Tensor], acts_harmless: dict[int, torch.Tensor],
                    acts_pseudo_harmful: dict[int, torch.Tensor] | None = None, fingerprint: dict | None = None,
                    layer: int | None = None, metadata: dict | None = None) -> SteeringVectors:
    """Refusal vectors per layer, plus false-refusal vectors and a CAST condition when pseudo-harmful
    (benign but risky-looking) prompts are given.

    The CAST condition (at ``layer``) separates harmful from pseudo-harmful states; its metadata
    (threshold, compare, layer, center) is stored under ``metadata['cast']``.
    """
    refusal = refusal_direction(acts_harmful, acts_harmless)
    vectors: dict[str, dict[int, torch.Tensor]] = {"refusal": refusal}
    meta = dict(metadata or {})
    layers = sorted(refusal)
    layer = int(layer) if layer is not None else layers[len(layers) // 2]
    meta["layer"] = layer
    if acts_pseudo_harmful is not None:
        vectors["false_refusal"] = false_refusal_direction(acts_pseudo_harmful, acts_harmless, refusal)
        center = torch.cat([acts_harmful[layer], acts_pseudo_harmful[layer]]).float().mean(0)
        c, thr, compare, acc = fit_condition(acts_harmful[layer], acts_pseudo_harmful[layer], center)
        vectors["condition"] = {layer: c}
        vectors["center"] = {layer: center}
        # Over-refusal use: ablate refusal for rows that do not look harmful (sim below the threshold).
        meta["cast"] = {"condition_layer": layer, "threshold": thr, "compare": "less", "mode": "ablate",
                        "behaviour": "refusal", "behaviour_layers": "all", "fit_balanced_acc": acc}
    return SteeringVectors(vectors, dict(fingerprint or {}), meta)
