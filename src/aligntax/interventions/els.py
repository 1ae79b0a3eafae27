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

This module loads and configures ELS (:class:`EnergySteering`: the folder, the settings, their checks);
the math is its :class:`~aligntax.interventions.els_kernel.ElsKernel`, the row kernel both backends run:
the positions follow :func:`~aligntax.interventions.kernels.edited`, so steering is the same with and
without the KV cache, and independent of left padding (steered positions are the last ones).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from aligntax.energy.bank import EnergyBank
from aligntax.energy.front import HarmBasis, RowStrength
from aligntax.energy.gate import HarmGate
from aligntax.energy.model import EnergyModel
from aligntax.errors import AligntaxError
from aligntax.interventions.base import Intervention
from aligntax.interventions.els_kernel import ElsKernel
from aligntax.interventions.kernels import POSITION_MODES, check_positions
from aligntax.interventions.options import need_path, option, register

__all__ = ["POSITION_MODES", "DEFAULT_SETTINGS", "ElsKernel", "ElsOptions", "EnergySteering", "check_positions",
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
            if row_strength.layer != min(self.models):
                raise AligntaxError(f"The row strength model was fitted on features of layer {row_strength.layer}, "
                                    f"but steering starts at layer {min(self.models)}; fit one for this layer "
                                    "(aligntax els row-strength --layers ...).")
            if self.gate_ramp is not None or self.row_threshold is not None:
                raise AligntaxError("A row strength model replaces the gate's and the row energy's cut-offs: "
                                    "not with gate_ramp or row_threshold.")
        self._kernel: ElsKernel | None = None
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
    def prefix_free(self) -> bool:  # the gate reads the last prompt token; steering starts there unless "all"
        return self.positions != "all"

    def step_size(self, layer: int) -> float:
        if layer in self.layer_eta:
            return self.layer_eta[layer]
        return self.eta * self.norms[layer] if self.scale_by_norm else self.eta

    def kernel(self, n_layers: int, hidden_size: int | None = None) -> ElsKernel:
        """The ELS math for these settings (:class:`~aligntax.interventions.els_kernel.ElsKernel`), made
        once: it keeps its energy models' copies on other devices."""
        if self._kernel is None:
            self._kernel = ElsKernel(
                self.models, {layer: self.step_size(layer) for layer in self.models}, self.steps,
                threshold=self.threshold, positions=self.positions, horizon=self.horizon,
                grad_method=self.grad_method, gate=self.gate, gate_threshold=self.gate_threshold,
                gate_ramp=self.gate_ramp, row_threshold=self.row_threshold, harm_dirs=self.harm_dirs,
                row_strength=self.row_strength)
        self._kernel.check(n_layers)
        return self._kernel


@dataclass
class ElsOptions:
    path: str | None = option("energy model folder (implies --intervention els; an `aligntax els distill` "
                              "folder implies els-lora)", flag="--steer")
    eta: float | None = option("ELS step size (x the layer's median norm)", parse="float", check="positive",
                               grid=True, grid_default=(0.2, 0.3, 0.5), request=True)
    steps: int | None = option("ELS descent steps", parse="int", check="count", grid=True, grid_default=(3,),
                               request=True)
    layers: list[int] | None = option("comma-separated layer indices, e.g. 17,19", parse="layers", check="count",
                                      grid=True, grid_default=(), request=True)
    top_k: int | None = option("ELS: steer the K best layers of the bank", parse="int", check="positive_count",
                                grid=True, grid_default=(1, 2), request=True)
    threshold: float | str | None = option(
        "ELS: move a position only while its energy is above this ('none': off, even if tuned)",
        flag="--energy-threshold", aliases=("--threshold",), parse="float_or_none", check="finite", grid=True,
        grid_default=(None, 0.0), request=True)
    gate: float | bool | str | None = option(
        "ELS: hold back rows the bank's harm gate rates p(harmful) >= GATE ('saved': the gate's own "
        "threshold; 'none': off, even if tuned)", parse="gate", check="probability", grid=True, request=True)
    horizon: int | str | None = option("ELS: steer only the first N generated tokens ('none': all)",
                                       parse="int_or_none", check="count", grid=True, request=True)
    row_threshold: float | str | None = option(
        "ELS: steer a row only when its last prompt token's energy is above this ('none': off, even if tuned)",
        parse="float_or_none", check="finite", grid=True, request=True)
    gate_ramp: float | str | None = option(
        "ELS: strength falls linearly from 1 at p(harmful) = RAMP to 0 at the gate's threshold ('none': off)",
        parse="float_or_none", check="probability", grid=True, request=True)
    harm_orth: int | str | None = option(
        "ELS: project each step off the first K directions of the folder's harm basis (0 or 'none': off)",
        parse="int_or_none", check="count", grid=True, off=0)
    row_strength: bool | str | None = option(
        "ELS: the folder's learned per-row strength instead of the gate's and the row energy's cut-offs "
        "('on' or 'off')", parse="switch", grid=True)
    positions: str | None = option("last_and_generated, generated or all", cli=False)
    scale_by_norm: bool | None = option("step size in units of the layer's median residual norm", cli=False)
    grad_method: str | None = option("closed (the energy model's own backward) or autograd", cli=False)


@register("els", ElsOptions, "energy landscape steering from an energy bank folder")
def _els(lm, o: ElsOptions) -> EnergySteering:
    path = need_path("els", o.path)
    kwargs = {f.name: getattr(o, f.name) for f in dataclasses.fields(o) if f.name != "path"}
    return EnergySteering.from_dir(path, lm, **{k: v for k, v in kwargs.items() if v is not None})
