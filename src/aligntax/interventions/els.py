"""Energy Landscape Steering (ELS): gradient descent on per-layer energy models during generation.

On each selected decoder block a forward pre-hook takes the hidden states entering the block and, at
the steered positions (by default the last prompt token and every generated token), runs K steps

    h <- h - eta_l * s_row * g / ||g||,   g = dE_l/dh   (L2-normalised per position)

where ``eta_l = eta * median residual norm of layer l`` when ``scale_by_norm`` (the norm stored in the
energy bank at training time), else ``eta``; ``s_row`` is the context's per-row scale (0 for rows not
steered, or a per-row strength). With a ``threshold``, a position is only moved while its energy is
above it (gating, re-checked at every step). With a ``row_threshold``, a whole row is steered only when
the energy of its last prompt token, entering the first steered block, is above it: the energy models
are trained on exactly those states, so this asks "is the model about to end in a bad state?" (a false
refusal, or compliance with a harmful request) once per row, and leaves a prompt the model will answer
well (an everyday question, a harmful request it will refuse) untouched. The harm gate (a probe of
p(harmful) read before steering) holds back rows with ``p >= gate_threshold``; with ``gate_ramp`` the
strength also falls linearly from 1 at ``p = gate_ramp`` to 0 at the threshold. With a ``horizon`` H only the first H generated tokens
are steered after the last prompt token: refusal is decided in the first few tokens, and steering
every later token of a long answer pushes the model off its manifold (loops). With ``harm_orth`` k
each step's direction ``g / ||g||`` is projected off the first k directions of the folder's harm basis
at the steered block (:class:`aligntax.energy.front.HarmBasis`) before it is applied, so a harmful row
the gate leaks is not moved along what makes it harmful. With a ``row_strength`` model
(:class:`aligntax.energy.front.RowStrength`) the per-row strength is its calibrated probability over
the decision features (gate logit, row energy, projections on the refusal and harm directions) instead
of the gate's and the row energy's hard cut-offs. The energy and its
gradient come from the energy model's closed-form backward in float32, so no autograd graph is built
and nothing flows through the LLM.

The steering is an :class:`ElsKernel` (:mod:`aligntax.interventions.kernels`): the positions follow
:func:`~aligntax.interventions.kernels.edited`, so steering is the same with and without the KV cache,
and independent of left padding (steered positions are the last ones).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path

import torch

from aligntax.energy.bank import EnergyBank
from aligntax.energy.front import STRENGTH_FEATURES, HarmBasis, RowStrength
from aligntax.energy.gate import HarmGate
from aligntax.energy.model import EnergyModel
from aligntax.errors import AligntaxError
from aligntax.interventions.base import Intervention
from aligntax.interventions.kernels import POSITION_MODES, RowKernel, Site, check_positions, merge_stats

__all__ = ["POSITION_MODES", "DEFAULT_SETTINGS", "EnergySteering", "ElsKernel", "check_positions",
           "resolve_settings", "tuned_settings"]
# Settings used when neither the caller nor the folder's sweep (``DIR/sweep/best.json``) gives one: the
# demo's safe rule (the validation grid of ``aligntax demo`` is built around it): the bank's best
# validated layer, eta 0.35, the harm gate at its saved threshold (when the folder has one), the row energy
# decision at 0 (steer a row only when its last prompt token's energy says the model is about to end
# badly) and only the first 16 generated tokens. Steering every token of every row, as a bare energy
# bank would, pushes answers off the model's manifold. ``layers`` (a list) names the steered layers;
# None steers the bank's ``top_k`` best.
DEFAULT_SETTINGS = {"top_k": 1, "layers": None, "eta": 0.35, "steps": 3, "threshold": None, "gate": True,
                    "horizon": 16, "row_threshold": 0.0, "gate_ramp": None, "harm_orth": None,
                    "row_strength": None}
TUNED_KEYS = tuple(DEFAULT_SETTINGS)
_UNTUNED_NOTED: set[str] = set()


def tuned_settings(directory: str | Path) -> dict | None:
    """The ELS setting selected on validation data by ``aligntax els sweep`` (``DIR/sweep/best.json``)."""
    import json

    path = Path(directory) / "sweep" / "best.json"
    if not path.is_file():
        return None
    args = ((json.loads(path.read_text()) or {}).get("best") or {}).get("args") or {}
    return {k: args[k] for k in TUNED_KEYS if k in args} or None


def resolve_settings(directory: str | Path | None, **given) -> tuple[dict, str]:
    """ELS settings: values given (not None) win, then the folder's tuned setting, then the defaults.

    The defaults (:data:`DEFAULT_SETTINGS`, the demo's safe rule) hold the harm gate only where the folder
    has one. Pass ``threshold="none"`` / ``gate="none"`` to turn a tuned gate off. A sweep selects either a
    ``top_k`` or a ``layers`` list; ``top_k`` given (and no ``layers``) replaces tuned ``layers``.
    Returns the settings and a note saying where they came from.
    """
    settings, origin = dict(DEFAULT_SETTINGS), "defaults"
    tuned = tuned_settings(directory) if directory is not None else None
    if tuned:
        settings.update({"threshold": None, "gate": None, **tuned})
        origin = str(Path(directory) / "sweep" / "best.json")
    elif directory is None or not HarmGate.exists(directory):
        settings["gate"] = None  # the default harm gate, where the folder has none (els train --no-gate)
    explicit = {k: v for k, v in given.items() if v is not None}
    if "top_k" in explicit and "layers" not in explicit:
        settings["layers"] = None
    if explicit:
        settings.update({k: (None if isinstance(v, str) and v.lower() == "none" else v) for k, v in explicit.items()})
        origin += " + " + ",".join(sorted(explicit))
    return settings, origin


def _note_untuned(directory: str | Path, settings: dict) -> None:
    """One line, once per folder and process: the settings are the untuned defaults."""
    import logging

    key = str(Path(directory).resolve())
    if key in _UNTUNED_NOTED:
        return
    _UNTUNED_NOTED.add(key)
    gate = {True: "harm gate at its saved threshold", None: "no harm gate (the folder has none)"}.get(
        settings["gate"], f"harm gate at {settings['gate']}")
    logging.getLogger("aligntax").warning(
        "%s is untuned (no sweep/best.json): ELS steers by the safe defaults where not given (%s, row energy "
        "decision %s, first %s generated tokens, eta %s, the best validated layer); `aligntax els sweep "
        "--steer %s` picks tuned settings", directory, gate, DEFAULT_SETTINGS["row_threshold"],
        DEFAULT_SETTINGS["horizon"], DEFAULT_SETTINGS["eta"], directory)


class EnergySteering(Intervention):
    """ELS on a set of layers, each with its own energy model."""

    name = "els"
    cacheable = False  # config() names the bank's folder, not its content

    def __init__(self, models: dict[int, EnergyModel], eta: float = 0.3, steps: int = 3,
                 positions: str = "last_and_generated", scale_by_norm: bool = True,
                 norms: dict[int, float] | None = None, threshold: float | None = None,
                 layer_eta: dict[int, float] | None = None, source: str | None = None,
                 grad_method: str = "closed", gate: HarmGate | None = None,
                 gate_threshold: float | None = None, horizon: int | None = None,
                 row_threshold: float | None = None, gate_ramp: float | None = None,
                 harm_dirs: dict[int, torch.Tensor] | None = None, row_strength: RowStrength | None = None):
        if not models:
            raise AligntaxError("Energy steering needs at least one layer's energy model.")
        if steps < 0:
            raise AligntaxError("steps must be >= 0.")
        if horizon is not None and int(horizon) < 0:
            raise AligntaxError(f"horizon must be >= 0 generated tokens (or None for all); got {horizon}.")
        self.horizon = None if horizon is None else int(horizon)
        self.models = {int(k): m.eval() for k, m in models.items()}
        self.eta = float(eta)
        self.steps = int(steps)
        self.positions = check_positions(positions)
        self.scale_by_norm = bool(scale_by_norm)
        self.norms = {int(k): float(v) for k, v in (norms or {}).items()}
        self.threshold = None if threshold is None else float(threshold)
        self.row_threshold = None if row_threshold is None else float(row_threshold)
        self.layer_eta = {int(k): float(v) for k, v in (layer_eta or {}).items()}
        self.source = source
        if grad_method not in ("closed", "autograd"):
            raise AligntaxError("grad_method must be 'closed' or 'autograd'.")
        self.grad_method = grad_method
        if self.scale_by_norm:
            missing = [layer for layer in self.models if layer not in self.norms and layer not in self.layer_eta]
            if missing:
                raise AligntaxError(f"scale_by_norm needs the median residual norm of layers {missing}; pass "
                                    "norms= (see aligntax.activations.residual_norms) or scale_by_norm=False.")
        self.gate = gate
        self.gate_threshold = (None if gate is None else
                               float(gate.threshold if gate_threshold is None else gate_threshold))
        if gate is not None:
            if not 0.0 < self.gate_threshold < 1.0:
                raise AligntaxError(f"gate_threshold must be in (0, 1); got {self.gate_threshold}.")
            if gate.layer > min(self.models):
                raise AligntaxError(f"The harm gate reads layer {gate.layer}, after the first steered layer "
                                    f"{min(self.models)}; it must decide before steering starts.")
        self.gate_ramp = None if gate_ramp is None else float(gate_ramp)
        if self.gate_ramp is not None and (gate is None or not 0.0 <= self.gate_ramp < self.gate_threshold):
            raise AligntaxError("gate_ramp needs a harm gate and must lie in [0, gate threshold); got "
                                f"{self.gate_ramp} (gate threshold {self.gate_threshold}).")
        self.harm_dirs = {int(k): torch.as_tensor(v).detach().float() for k, v in (harm_dirs or {}).items()}
        missing = sorted(set(self.models) - set(self.harm_dirs)) if self.harm_dirs else []
        if missing:
            raise AligntaxError(f"harm_dirs has no directions for the steered layers {missing}.")
        if len({int(v.shape[0]) for v in self.harm_dirs.values()}) > 1:
            raise AligntaxError("harm_dirs must give the same number of directions at every steered layer.")
        self.row_strength = row_strength
        if row_strength is not None:
            if gate is None:
                raise AligntaxError("A row strength model reads the harm gate's logit: it needs the folder's gate.")
            if row_strength.layer != self.first_layer:
                raise AligntaxError(f"The row strength model was fitted on features of layer {row_strength.layer}, "
                                    f"but steering starts at layer {self.first_layer}; fit one for this layer "
                                    "(aligntax els row-strength --layers ...).")
            if self.gate_ramp is not None or self.row_threshold is not None:
                raise AligntaxError("A row strength model replaces the gate's and the row energy's cut-offs: "
                                    "not with gate_ramp or row_threshold.")
        self._device_models: dict[tuple[int, str], EnergyModel] = {}
        self._device_dirs: dict[tuple[int, str], torch.Tensor] = {}
        self.settings_from: str | None = None

    @property
    def harm_orth(self) -> int:
        """How many harm directions each step is projected off (0: none)."""
        return int(next(iter(self.harm_dirs.values())).shape[0]) if self.harm_dirs else 0

    # ---- construction -------------------------------------------------------------------------------
    @classmethod
    def from_bank(cls, bank: EnergyBank, layers: Sequence[int] | None = None, top_k: int | None = None,
                  **kwargs) -> EnergySteering:
        chosen = [int(x) for x in layers] if layers is not None else bank.layers
        if top_k is not None:
            chosen = [layer for layer in bank.layers if layer in chosen][:top_k]
        missing = [layer for layer in chosen if layer not in bank.models]
        if missing:
            raise AligntaxError(f"The energy bank has no model for layers {missing} (it has {sorted(bank.models)}).")
        norms = {layer: bank.median_norm(layer) for layer in chosen if bank.median_norm(layer) is not None}
        kwargs.setdefault("norms", norms)
        return cls({layer: bank[layer] for layer in chosen}, **kwargs)

    @classmethod
    def from_dir(cls, directory: str | Path, lm=None, layers: Sequence[int] | None = None,
                 eta: float | None = None, steps: int | None = None, top_k: int | None = None,
                 threshold: float | str | None = None, gate: bool | float | str | None = None,
                 horizon: int | str | None = None, row_threshold: float | str | None = None,
                 gate_ramp: float | str | None = None, harm_orth: int | str | None = None,
                 row_strength: bool | str | None = None, **kwargs) -> EnergySteering:
        """Load a saved :class:`EnergyBank` (checked against ``lm.fingerprint``) and steer its best layers.

        Settings not given (None) come from the setting tuned by ``aligntax els sweep`` in
        ``DIR/sweep/best.json`` when there is one, else from ``DEFAULT_SETTINGS`` (see
        :func:`resolve_settings`; ``"none"`` turns a tuned energy or harm gate off). ``gate``: None/False
        steers every row; True holds back rows the folder's harm gate
        (:class:`aligntax.energy.gate.HarmGate`) calls harmful at its saved threshold; a float in (0, 1)
        uses that threshold. ``horizon``: steer only the first N generated tokens (``"none"``: all).
        ``row_threshold``: steer a row only when its last prompt token's energy is above it;
        ``gate_ramp``: graded strength below the gate's threshold (see the module docstring).
        ``layers`` (given, else the tuned setting's) wins over ``top_k``. ``harm_orth`` k > 0: project
        each step off the first k directions of the folder's harm basis (``harm_basis.json``);
        ``row_strength`` True: the folder's learned per-row strength (``row_strength.json``) instead of
        the gate's and the row energy's cut-offs (the gate is loaded for its logit).
        """
        given = dict(eta=eta, steps=steps, threshold=threshold, gate=gate, top_k=top_k, horizon=horizon,
                     layers=layers, row_threshold=row_threshold, gate_ramp=gate_ramp, harm_orth=harm_orth,
                     row_strength=row_strength)
        settings, origin = resolve_settings(directory, **given)
        untuned = tuned_settings(directory) is None
        if untuned and any(given[k] is None for k in ("gate", "horizon", "row_threshold")):
            _note_untuned(directory, settings)
        layers = settings["layers"]
        top_k = settings["top_k"] if layers is None else top_k
        eta, steps, threshold, gate = settings["eta"], settings["steps"], settings["threshold"], settings["gate"]
        kwargs["threshold"] = threshold
        kwargs["horizon"] = settings["horizon"]
        kwargs["row_threshold"] = settings["row_threshold"]
        kwargs["gate_ramp"] = settings["gate_ramp"]
        fp = dict(lm.fingerprint) if lm is not None and getattr(lm, "fingerprint", None) else None
        hs = lm.hidden_size if lm is not None else None
        bank = EnergyBank.load(directory, expect_fingerprint=fp, expect_hidden_size=hs)
        strength = settings["row_strength"] not in (None, False, 0)
        if strength:
            if not RowStrength.exists(directory):
                raise AligntaxError(f"{directory} has no row strength model (row_strength.json); fit one with "
                                    f"`aligntax els row-strength --steer {directory}`.")
            kwargs["row_strength"] = RowStrength.load(directory, expect_fingerprint=fp, expect_hidden_size=hs)
            kwargs["row_threshold"] = kwargs["gate_ramp"] = None  # the learned strength replaces both cut-offs
            gate = True if gate in (None, False) else gate
        if gate is not None and gate is not False:
            if not HarmGate.exists(directory):
                raise AligntaxError(f"{directory} has no harm gate (gate.json); train one with "
                                    "`aligntax els train` (it writes one unless --no-gate).")
            kwargs["gate"] = HarmGate.load(directory, expect_fingerprint=fp, expect_hidden_size=hs)
            if gate is not True:
                kwargs["gate_threshold"] = float(gate)
        if lm is not None:
            n = lm.num_layers
            bad = [layer for layer in bank.models if layer >= n]
            if bad:
                raise AligntaxError(f"Energy bank {directory} has layers {bad} but the model has {n} layers.")
        k = int(settings["harm_orth"] or 0)
        if k < 0:
            raise AligntaxError(f"harm_orth must be >= 0 directions; got {k}.")
        if k:
            if not HarmBasis.exists(directory):
                raise AligntaxError(f"{directory} has no harm basis (harm_basis.json); compute it with "
                                    f"`aligntax els harm-basis --steer {directory}`.")
            basis = HarmBasis.load(directory, expect_fingerprint=fp, expect_hidden_size=hs)
            chosen = [int(x) for x in layers] if layers is not None else bank.layers
            if top_k is not None:
                chosen = [layer for layer in bank.layers if layer in chosen][:top_k]
            kwargs["harm_dirs"] = {layer: basis.get(layer, k) for layer in chosen}
        iv = cls.from_bank(bank, layers=layers, top_k=top_k, eta=eta, steps=steps, source=str(directory), **kwargs)
        iv.settings_from = origin
        return iv

    def config(self) -> dict:
        return {"name": self.name, "layers": sorted(self.models), "eta": self.eta, "steps": self.steps,
                "positions": self.positions, "horizon": self.horizon, "scale_by_norm": self.scale_by_norm, "threshold": self.threshold,
                "eta_by_layer": {layer: self.step_size(layer) for layer in sorted(self.models)},
                "grad_method": self.grad_method, "source": self.source, "settings_from": self.settings_from,
                "gate": None if self.gate is None else self._gate_config(),
                # only when set: a run folder made before these options existed resumes unchanged
                **({"row_threshold": self.row_threshold} if self.row_threshold is not None else {}),
                **({"harm_orth": self.harm_orth} if self.harm_orth else {}),
                **({"row_strength": {"layer": self.row_strength.layer, "floor": self.row_strength.floor}}
                   if self.row_strength is not None else {})}

    def _gate_config(self) -> dict:
        # "layers" only for a gate of several: a one-layer gate's settings read as they always did, so a
        # run folder made before gates of several layers existed still resumes
        extra = {"layers": self.gate.layers} if len(self.gate.layers) > 1 else {}
        if self.gate_ramp is not None:
            extra["ramp"] = self.gate_ramp
        return {"layer": self.gate.layer, "threshold": self.gate_threshold, **extra}

    @property
    def first_layer(self) -> int:
        """The first steered block: the row energy decision reads the state entering it."""
        return min(self.models)

    def gate_scale(self, p: torch.Tensor) -> torch.Tensor:
        """Per-row strength from the harm gate's p(harmful): 0 at or above its threshold, 1 below
        ``gate_ramp`` (or below the threshold, without a ramp), linear in between."""
        t = self.gate_threshold
        if self.gate_ramp is None:
            return (p < t).float()
        return ((t - p) / (t - self.gate_ramp)).clamp(0.0, 1.0).float()

    def harm_p(self, states: dict[int, torch.Tensor]) -> torch.Tensor:
        """The harm gate's p(harmful) ``[N]`` from ``{block: [N, d]}`` at the last prompt token."""
        dev = states[self.gate.layer].device
        return self.gate.prob(self.gate.stack({b: states[b].to(dev) for b in self.gate.layers}))

    def row_features(self, states: dict[int, torch.Tensor], directions: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> torch.Tensor:
        """The row strength model's features ``[N, F]`` (:data:`~aligntax.energy.front.STRENGTH_FEATURES`)
        from ``{block: [N, d]}`` at the last prompt token (the gate's blocks and the first steered one).
        ``directions``: the unit refusal and harm directions at the first steered block (default: the
        row strength model's)."""
        if self.gate is None:
            raise AligntaxError("The row strength features read the harm gate's logit: no gate.")
        last = states[self.first_layer]
        dev = last.device
        gate_logit = self.gate.logit(self.gate.stack({b: states[b].to(dev) for b in self.gate.layers}))
        if directions is None:
            if self.row_strength is None:
                raise AligntaxError("row_features needs the refusal and harm directions (no row strength model).")
            refusal, harm = self.row_strength.projections(last)
        else:
            refusal, harm = (last.float() @ d.to(dev).float() for d in directions)
        cols = {"gate_logit": gate_logit, "energy": self.row_energy(last), "refusal_proj": refusal, "harm_proj": harm}
        return torch.stack([cols[f].float().to(dev) for f in STRENGTH_FEATURES], dim=-1)

    def row_energy(self, last: torch.Tensor) -> torch.Tensor:
        """Energy of the last prompt token's state entering the first steered block, ``[N, d] -> [N]``."""
        with torch.no_grad():
            return self._model_on(self.first_layer, last.device)(last.float(), check=False)

    @property
    def prefix_free(self) -> bool:  # the gate reads the last prompt token; steering starts there unless "all"
        return self.positions != "all"

    def step_size(self, layer: int) -> float:
        if layer in self.layer_eta:
            return self.layer_eta[layer]
        return self.eta * self.norms[layer] if self.scale_by_norm else self.eta

    def _model_on(self, layer: int, device: torch.device) -> EnergyModel:
        """The layer's energy model on ``device`` (a copy, made once, when it lives elsewhere), eval mode."""
        key = (layer, str(device))
        m = self._device_models.get(key)
        if m is None:
            m = self.models[layer]
            if m.in_mean.device != torch.device(device):
                m = copy.deepcopy(m).to(device)
            m.eval()
            self._device_models[key] = m
        return m

    # ---- the steering step ----------------------------------------------------------------------------
    def steer(self, layer: int, x: torch.Tensor, row_scale: torch.Tensor,
              acc: dict | None = None) -> torch.Tensor:
        """K energy-descent steps on ``x`` ``[B, T, d]`` (float32); ``row_scale`` ``[B, 1, 1]``."""
        model = self._model_on(layer, x.device)
        eta = self.step_size(layer)
        q = self._dirs_on(layer, x.device)  # [k, d] orthonormal, or None
        scale = row_scale.to(x.device, torch.float32).view(-1, 1)  # [B, 1]
        rows_on = scale != 0  # [B, 1]
        bad = torch.zeros((), dtype=torch.bool, device=x.device)
        e0 = None
        first_active = None
        for _ in range(self.steps):
            finite = torch.isfinite(x).all(-1)  # [B, T]
            e, g = self._energy_grad(model, torch.where(finite[..., None], x, torch.zeros_like(x)))
            active = rows_on & finite
            if self.threshold is not None:
                active = active & (e > self.threshold)
            bad = bad | (rows_on & ~finite).any()
            if e0 is None:
                e0, first_active = e, active
            norm = g.norm(dim=-1, keepdim=True).clamp_min(1e-12)
            u = g / norm
            if q is not None:  # off the harm subspace: no move along what makes a prompt harmful
                u = u - (u @ q.T) @ q
            step = (eta * scale)[..., None] * u
            x = torch.where(active[..., None], x - step, x)
        if acc is not None and self.steps > 0:
            with torch.no_grad():
                finite = torch.isfinite(x).all(-1)
                e1 = model(torch.where(finite[..., None], x, torch.zeros_like(x)), check=False)
            counted = rows_on.expand_as(e0)
            acc["positions"] = acc.get("positions", 0) + counted.sum()
            acc["steered"] = acc.get("steered", 0) + first_active.sum()
            acc["energy_before"] = acc.get("energy_before", 0) + torch.where(counted, e0, 0).sum()
            acc["energy_after"] = acc.get("energy_after", 0) + torch.where(counted, e1, 0).sum()
            acc["nonfinite"] = acc.get("nonfinite", torch.zeros((), dtype=torch.bool, device=x.device)) | bad
        return x

    def _dirs_on(self, layer: int, device: torch.device) -> torch.Tensor | None:
        """The layer's harm directions ``[k, d]`` on ``device`` (float32), or None without ``harm_orth``."""
        if not self.harm_dirs:
            return None
        key = (layer, str(device))
        q = self._device_dirs.get(key)
        if q is None:
            q = self._device_dirs[key] = self.harm_dirs[layer].to(device=device, dtype=torch.float32)
        return q

    def _energy_grad(self, model: EnergyModel, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.grad_method == "closed":
            return model.energy_and_grad(x, check=False)
        # Autograd on a detached float32 leaf: the graph covers the energy MLP only, never the LLM.
        with torch.enable_grad():
            leaf = x.detach().requires_grad_(True)
            e = model(leaf)
            (g,) = torch.autograd.grad(e.sum(), leaf)
        return e.detach(), g

    def kernel(self, n_layers: int, hidden_size: int | None = None) -> ElsKernel:
        kernel = ElsKernel(self)
        kernel.check(n_layers)
        return kernel


class ElsKernel(RowKernel):
    """ELS as a row kernel: K energy-descent steps on the rows at each steered block; the harm gate
    (p(harmful) at its layers) and the row energy decision (the energy entering the first steered
    block) decide the per-row strength at the last prompt token."""

    def __init__(self, iv: EnergySteering):
        self.iv = iv
        self.sites = [Site(layer) for layer in sorted(iv.models)] if iv.steps > 0 else []
        decision = list(iv.gate.layers) if iv.gate is not None else []
        if iv.row_threshold is not None or iv.row_strength is not None:
            decision.append(iv.first_layer)
        self.decision_layers = sorted(set(decision))
        self.positions = iv.positions
        self.horizon = iv.horizon

    def decision_parts(self, states: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
        iv, parts = self.iv, {}
        if iv.row_strength is not None:  # the learned strength replaces the gate's and the energy's cut-offs
            parts["els_strength"] = iv.row_strength.strength(iv.row_features(states))
            return parts
        if iv.gate is not None:  # the strength the harm gate allows (0: held back)
            parts["els_gate"] = iv.gate_scale(iv.harm_p(states))
        if iv.row_threshold is not None:  # 1 for rows whose last prompt token predicts a bad end
            parts["els_row_energy"] = (iv.row_energy(states[iv.first_layer]) > iv.row_threshold).float()
        return parts

    @property
    def read_layers(self) -> list[int]:
        return sorted({self.iv.first_layer, *self.decision_layers})

    def row_records(self, states: dict[int, torch.Tensor]) -> list[dict]:
        """Per row: ``energy`` (the row energy at the first steered block), ``harm_p`` (with a gate),
        ``steered`` (the gate and the row energy decision pass it) and ``strength``."""
        iv = self.iv
        energy = iv.row_energy(states[iv.first_layer]).cpu()
        rows = [{"energy": round(float(e), 4)} for e in energy]
        if iv.gate is not None:
            for r, p in zip(rows, iv.harm_p(states).cpu(), strict=True):
                r["harm_p"] = round(float(p), 4)
        if iv.row_strength is not None:  # the model's probability, before the floor
            for r, p in zip(rows, iv.row_strength.prob(iv.row_features(states)).cpu(), strict=True):
                r["strength_p"] = round(float(p), 4)
        scale = self.decide(states).cpu() if self.decision_layers else torch.ones(len(rows))
        for r, sc in zip(rows, scale, strict=True):
            r.update(steered=bool(sc > 0 and iv.steps > 0), strength=round(float(sc), 4))
        return rows

    def edit(self, site: Site, rows: torch.Tensor, strength: torch.Tensor, stats: dict | None = None) -> torch.Tensor:
        n, d = rows.shape
        x = self.iv.steer(site.layer, rows.float().view(n, 1, d), strength.view(n, 1, 1), stats)
        return x.view(n, d).to(rows.dtype)

    def finish(self, site_stats: dict[Site, dict], stats: dict) -> None:
        """Per steered layer: positions seen, positions moved, mean energy before and after (one device
        sync per layer); NaN/inf states at steered positions raise."""
        nonfinite = False
        summary = {}
        for site, a in site_stats.items():
            nonfinite = nonfinite or bool(a["nonfinite"])
            count = int(a["positions"])
            summary[site.layer] = {"positions": count, "steered": int(a["steered"]),
                                   "energy_before": float(a["energy_before"]) / count if count else None,
                                   "energy_after": float(a["energy_after"]) / count if count else None,
                                   "eta": self.iv.step_size(site.layer)}
        merge_stats(stats.setdefault("els", {}), summary)
        if nonfinite:
            raise AligntaxError("Energy steering met NaN/inf hidden states at steered positions; the model "
                                "produced non-finite activations (try float32).")
