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
from typing import TYPE_CHECKING, Any

import torch

from aligntax.energy.bank import EnergyBank
from aligntax.energy.front import HarmBasis, RowStrength
from aligntax.energy.gate import HarmGate
from aligntax.energy.model import EnergyModel
from aligntax.errors import AligntaxError
from aligntax.interventions.base import Intervention
from aligntax.interventions.els_kernel import ElsKernel
from aligntax.interventions.kernels import POSITION_MODES, check_positions
from aligntax.interventions.options import need_path, option, register, spec_of

if TYPE_CHECKING:
    from aligntax.models.loader import LoadedModel

__all__ = [
    "POSITION_MODES",
    "DEFAULT_SETTINGS",
    "TUNED_KEYS",
    "VALUE_KEYS",
    "ElsKernel",
    "ElsOptions",
    "EnergySteering",
    "check_positions",
    "resolve_settings",
    "tuned_settings",
]


@dataclass
class ElsOptions:
    """Every ELS option, declared once: its command-line flag, YAML / server key and sweep grid axis
    (:func:`~aligntax.interventions.options.option`), and ``fallback``, the value taken when neither
    the caller nor the folder's sweep gives one (:data:`DEFAULT_SETTINGS`). A field left None is not
    given. The fallbacks are the demo's safe rule (the validation grid of ``aligntax demo`` is built
    around it): the bank's best validated layer, eta 0.35, the harm gate at its saved threshold (when the
    folder has one), the row energy decision at 0 (steer a row only when its last prompt token's energy
    says the model is about to end badly) and only the first 16 generated tokens. Steering every token of
    every row, as a bare energy bank would, pushes answers off the model's manifold."""

    path: str | None = option(
        "energy model folder (implies --intervention els; an `aligntax els distill` folder implies els-lora)",
        flag="--steer",
    )
    eta: float | None = option(
        "ELS step size (x the layer's median norm)",
        parse="float",
        check="positive",
        grid=True,
        grid_default=(0.2, 0.3, 0.5),
        request=True,
        fallback=0.35,
    )
    steps: int | None = option(
        "ELS descent steps",
        parse="int",
        check="count",
        grid=True,
        grid_default=(3,),
        request=True,
        fallback=3,
    )
    layers: list[int] | None = option(
        "comma-separated layer indices, e.g. 17,19",
        parse="layers",
        check="count",
        grid=True,
        grid_default=(),
        request=True,
    )
    top_k: int | None = option(
        "ELS: steer the K best layers of the bank",
        parse="int",
        check="positive_count",
        grid=True,
        grid_default=(1, 2),
        request=True,
        fallback=1,
    )
    threshold: float | str | None = option(
        "ELS: move a position only while its energy is above this ('none': off, even if tuned)",
        flag="--energy-threshold",
        aliases=("--threshold",),
        parse="float_or_none",
        check="finite",
        grid=True,
        grid_default=(None, 0.0),
        request=True,
    )
    gate: float | bool | str | None = option(
        "ELS: hold back rows the bank's harm gate rates p(harmful) >= GATE ('saved': the gate's own "
        "threshold; 'none': off, even if tuned)",
        parse="gate",
        check="probability",
        grid=True,
        optional=True,
        request=True,
        fallback=True,
    )
    horizon: int | str | None = option(
        "ELS: steer only the first N generated tokens ('none': all)",
        parse="int_or_none",
        check="count",
        grid=True,
        optional=True,
        request=True,
        fallback=16,
    )
    row_threshold: float | str | None = option(
        "ELS: steer a row only when its last prompt token's energy is above this ('none': off, even if tuned)",
        parse="float_or_none",
        check="finite",
        grid=True,
        optional=True,
        request=True,
        fallback=0.0,
    )
    gate_ramp: float | str | None = option(
        "ELS: strength falls linearly from 1 at p(harmful) = RAMP to 0 at the gate's threshold ('none': off)",
        parse="float_or_none",
        check="probability",
        grid=True,
        optional=True,
        request=True,
    )
    max_prompt_tokens: int | str | None = option(
        "ELS: hold back rows whose prompt (chat-templated) is longer than N tokens: beyond the energy "
        "models' training prompts, e.g. a long jailbreak set-up ('none': off)",
        parse="int_or_none",
        check="positive_count",
        grid=True,
        optional=True,
        request=True,
        flag="--els-max-prompt-tokens",  # the server's own --max-prompt-tokens limits every request
    )
    max_prompt_surprisal: float | str | None = option(
        "ELS: hold back rows whose user message's mean surprisal under the model (nats per token) is above "
        "this: odd token strings such as optimised jailbreak suffixes, unlike the energy models' training "
        "prompts ('none': off; Hugging Face backend)",
        parse="float_or_none",
        check="positive",
        grid=True,
        optional=True,
        request=True,
    )
    harm_orth: int | str | None = option(
        "ELS: project each step off the first K directions of the folder's harm basis (0 or 'none': off)",
        parse="int_or_none",
        check="count",
        grid=True,
        off=0,
        optional=True,
    )
    row_strength: bool | str | None = option(
        "ELS: the folder's learned per-row strength instead of the gate's and the row energy's cut-offs "
        "('on' or 'off')",
        parse="switch",
        grid=True,
        optional=True,
    )
    positions: str | None = option(
        "last_and_generated, generated or all", cli=False, fallback="last_and_generated"
    )
    scale_by_norm: bool | None = option(
        "step size in units of the layer's median residual norm", cli=False, fallback=True
    )
    grad_method: str | None = option(
        "closed (the energy model's own backward) or autograd", cli=False, fallback="closed"
    )


_SETTING_FIELDS = [f for f in dataclasses.fields(ElsOptions) if f.name != "path"]
# The settings: every option of ElsOptions but the folder, at its fallback (used when neither the caller
# nor the folder's sweep gives one; ``layers`` None steers the bank's ``top_k`` best).
DEFAULT_SETTINGS: dict[str, Any] = {f.name: spec_of(f).fallback for f in _SETTING_FIELDS}
# What ``aligntax els sweep`` tunes and ``DIR/sweep/best.json`` holds: the axes of its grid.
TUNED_KEYS = tuple(f.name for f in _SETTING_FIELDS if spec_of(f).grid)
# The options from_dir turns into loaded parts (which layers' energy models, the harm gate, the harm
# basis, the row strength model); every other option is a plain value that EnergySteering keeps in its
# ``settings`` and its kernel reads.
_LOADED = ("layers", "top_k", "gate", "harm_orth", "row_strength")
VALUE_KEYS = tuple(k for k in DEFAULT_SETTINGS if k not in _LOADED)
# Value options that turn something on: off (None) when not given to the constructor. The others (eta,
# steps, positions, ...) take their fallback.
_SWITCHABLE = {
    f.name for f in _SETTING_FIELDS if spec_of(f).parse in ("float_or_none", "int_or_none", "gate", "switch")
}
# config() shows a value option only when it is set, so a run folder made before the option existed
# resumes unchanged; these two it has shown from the start, unset included.
_SHOWN_UNSET = ("threshold", "horizon")
_UNTUNED_NOTED: set[str] = set()


def tuned_settings(directory: str | Path) -> dict[str, Any] | None:
    """The ELS setting selected on validation data by ``aligntax els sweep`` (``DIR/sweep/best.json``)."""
    import json

    path = Path(directory) / "sweep" / "best.json"
    if not path.is_file():
        return None
    args = ((json.loads(path.read_text()) or {}).get("best") or {}).get("args") or {}
    return {k: args[k] for k in TUNED_KEYS if k in args} or None


def _check_known(given: dict[str, Any], what: str) -> None:
    """Refuse keys that are not ELS options."""
    unknown = sorted(set(given) - set(DEFAULT_SETTINGS))
    if unknown:
        raise AligntaxError(
            f"Unknown ELS options for {what}: {', '.join(unknown)} (it takes {', '.join(DEFAULT_SETTINGS)})."
        )


def resolve_settings(directory: str | Path | None, **given: Any) -> tuple[dict[str, Any], str]:
    """ELS settings: values given (not None) win, then the folder's tuned setting, then the fallbacks.

    The fallbacks (:data:`DEFAULT_SETTINGS`, the demo's safe rule) hold the harm gate only where the
    folder has one. Pass ``threshold="none"`` / ``gate="none"`` to turn a tuned gate off. A sweep selects
    either a ``top_k`` or a ``layers`` list; ``top_k`` given (and no ``layers``) replaces tuned ``layers``.
    ``given`` takes the fields of :class:`ElsOptions` (but the folder). Returns every setting and a note
    saying where they came from.
    """
    _check_known(given, "resolve_settings")
    settings, origin = dict(DEFAULT_SETTINGS), "defaults"
    tuned = tuned_settings(directory) if directory is not None else None
    if tuned:
        settings.update({"threshold": None, "gate": None, **tuned})
        assert directory is not None  # tuned settings are read from a folder
        origin = str(Path(directory) / "sweep" / "best.json")
    elif directory is None or not HarmGate.exists(directory):
        settings["gate"] = None  # the default harm gate, where the folder has none (els train --no-gate)
    explicit = {k: v for k, v in given.items() if v is not None}
    if "top_k" in explicit and "layers" not in explicit:
        settings["layers"] = None
    if explicit:
        settings.update(
            {k: (None if isinstance(v, str) and v.lower() == "none" else v) for k, v in explicit.items()}
        )
        origin += " + " + ",".join(sorted(explicit))
    return settings, origin


def _note_untuned(directory: str | Path, settings: dict[str, Any]) -> None:
    """One line, once per folder and process: the settings are the untuned defaults."""
    import logging

    key = str(Path(directory).resolve())
    if key in _UNTUNED_NOTED:
        return
    _UNTUNED_NOTED.add(key)
    gate = {True: "harm gate at its saved threshold", None: "no harm gate (the folder has none)"}.get(
        settings["gate"], f"harm gate at {settings['gate']}"
    )
    logging.getLogger("aligntax").warning(
        "%s is untuned (no sweep/best.json): ELS steers by the safe defaults where not given (%s, row energy "
        "decision %s, first %s generated tokens, eta %s, the best validated layer); `aligntax els sweep "
        "--steer %s` picks tuned settings",
        directory,
        gate,
        DEFAULT_SETTINGS["row_threshold"],
        DEFAULT_SETTINGS["horizon"],
        DEFAULT_SETTINGS["eta"],
        directory,
    )


class EnergySteering(Intervention):
    """ELS on a set of layers, each with its own energy model.

    ``options``: the plain value options of :class:`ElsOptions` (:data:`VALUE_KEYS`: ``threshold``,
    ``horizon``, ``row_threshold``, ``gate_ramp``, ``positions``, ``scale_by_norm``, ``grad_method``,
    ...); one not given is off, or at its fallback where it cannot be off. They are kept in ``settings``
    (also readable as attributes: ``st.horizon``), which the kernel reads. The loaded parts are explicit:
    ``gate`` (a :class:`HarmGate`) with ``gate_threshold``, ``harm_dirs`` (layer -> ``[k, d]``),
    ``row_strength`` (a :class:`RowStrength`), ``norms`` / ``layer_eta`` (the step size per layer)."""

    name = "els"
    cacheable = False  # config() names the bank's folder, not its content

    def __init__(
        self,
        models: dict[int, EnergyModel],
        eta: float = 0.3,
        steps: int = 3,
        *,
        norms: dict[int, float] | None = None,
        layer_eta: dict[int, float] | None = None,
        source: str | None = None,
        gate: HarmGate | None = None,
        gate_threshold: float | None = None,
        harm_dirs: dict[int, torch.Tensor] | None = None,
        row_strength: RowStrength | None = None,
        surprisal_span: tuple[int, int] | None = None,
        **options: Any,
    ):
        unknown = sorted(set(options) - set(VALUE_KEYS))
        if unknown:
            raise AligntaxError(
                f"EnergySteering takes no option {', '.join(unknown)} (its options: "
                f"{', '.join(VALUE_KEYS)}; the loaded parts gate, harm_dirs, row_strength)."
            )
        if not models:
            raise AligntaxError("Energy steering needs at least one layer's energy model.")
        s: dict[str, Any] = {
            k: options.get(k) if k in _SWITCHABLE or options.get(k) is not None else DEFAULT_SETTINGS[k]
            for k in VALUE_KEYS
        }
        s["eta"], s["steps"] = float(eta), int(steps)
        if s["steps"] < 0:
            raise AligntaxError("steps must be >= 0.")
        for key, kind in (
            ("threshold", float),
            ("row_threshold", float),
            ("gate_ramp", float),
            ("horizon", int),
            ("max_prompt_tokens", int),
            ("max_prompt_surprisal", float),
        ):
            s[key] = None if s[key] is None else kind(s[key])
        if s["horizon"] is not None and s["horizon"] < 0:
            raise AligntaxError(
                f"horizon must be >= 0 generated tokens (or None for all); got {s['horizon']}."
            )
        s["positions"] = check_positions(s["positions"])
        s["scale_by_norm"] = bool(s["scale_by_norm"])
        if s["grad_method"] not in ("closed", "autograd"):
            raise AligntaxError("grad_method must be 'closed' or 'autograd'.")
        self.settings: dict[str, Any] = s
        self.models = {int(k): m.eval() for k, m in models.items()}
        self.norms = {int(k): float(v) for k, v in (norms or {}).items()}
        self.layer_eta = {int(k): float(v) for k, v in (layer_eta or {}).items()}
        self.source = source
        if self.scale_by_norm:
            missing = [
                layer for layer in self.models if layer not in self.norms and layer not in self.layer_eta
            ]
            if missing:
                raise AligntaxError(
                    f"scale_by_norm needs the median residual norm of layers {missing}; pass "
                    "norms= (see aligntax.activations.residual_norms) or scale_by_norm=False."
                )
        self.gate = gate
        self.gate_threshold = (
            None if gate is None else float(gate.threshold if gate_threshold is None else gate_threshold)
        )
        if gate is not None:
            assert self.gate_threshold is not None  # set with the gate
            if not 0.0 < self.gate_threshold < 1.0:
                raise AligntaxError(f"gate_threshold must be in (0, 1); got {self.gate_threshold}.")
            if gate.layer > min(self.models):
                raise AligntaxError(
                    f"The harm gate reads layer {gate.layer}, after the first steered layer "
                    f"{min(self.models)}; it must decide before steering starts."
                )
        if self.gate_ramp is not None and (gate is None or not 0.0 <= self.gate_ramp < self.gate_threshold):
            raise AligntaxError(
                "gate_ramp needs a harm gate and must lie in [0, gate threshold); got "
                f"{self.gate_ramp} (gate threshold {self.gate_threshold})."
            )
        self.harm_dirs = {int(k): torch.as_tensor(v).detach().float() for k, v in (harm_dirs or {}).items()}
        missing = sorted(set(self.models) - set(self.harm_dirs)) if self.harm_dirs else []
        if missing:
            raise AligntaxError(f"harm_dirs has no directions for the steered layers {missing}.")
        if len({int(v.shape[0]) for v in self.harm_dirs.values()}) > 1:
            raise AligntaxError("harm_dirs must give the same number of directions at every steered layer.")
        self.row_strength = row_strength
        self.surprisal_span = (
            None if surprisal_span is None else (int(surprisal_span[0]), int(surprisal_span[1]))
        )
        if row_strength is not None:
            if gate is None:
                raise AligntaxError(
                    "A row strength model reads the harm gate's logit: it needs the folder's gate."
                )
            if row_strength.layer != min(self.models):
                raise AligntaxError(
                    f"The row strength model was fitted on features of layer {row_strength.layer}, "
                    f"but steering starts at layer {min(self.models)}; fit one for this layer "
                    "(aligntax els row-strength --layers ...)."
                )
            if self.gate_ramp is not None or self.row_threshold is not None:
                raise AligntaxError(
                    "A row strength model replaces the gate's and the row energy's cut-offs: "
                    "not with gate_ramp or row_threshold."
                )
        self._kernel: ElsKernel | None = None
        self.settings_from: str | None = None

    def __getattr__(self, name: str) -> Any:
        """A value option read as an attribute (``st.eta``, ``st.horizon``): its entry in ``settings``."""
        settings = self.__dict__.get("settings") or {}
        if name in settings:
            return settings[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def harm_orth(self) -> int:
        """How many harm directions each step is projected off (0: none)."""
        return int(next(iter(self.harm_dirs.values())).shape[0]) if self.harm_dirs else 0

    # ---- construction -------------------------------------------------------------------------------
    @classmethod
    def from_bank(
        cls,
        bank: EnergyBank,
        layers: Sequence[int] | None = None,
        top_k: int | None = None,
        **kwargs: Any,
    ) -> EnergySteering:
        chosen = [int(x) for x in layers] if layers is not None else bank.layers
        if top_k is not None:
            chosen = [layer for layer in bank.layers if layer in chosen][:top_k]
        missing = [layer for layer in chosen if layer not in bank.models]
        if missing:
            raise AligntaxError(
                f"The energy bank has no model for layers {missing} (it has {sorted(bank.models)})."
            )
        norms = {layer: bank.median_norm(layer) for layer in chosen if bank.median_norm(layer) is not None}
        kwargs.setdefault("norms", norms)
        return cls({layer: bank[layer] for layer in chosen}, **kwargs)

    @classmethod
    def from_dir(cls, directory: str | Path, lm: LoadedModel | None = None, **options: Any) -> EnergySteering:
        """Load a saved :class:`EnergyBank` (checked against ``lm.fingerprint``) and steer its best layers.

        ``options``: the fields of :class:`ElsOptions` but the folder (any other key is refused). Those
        not given (None) come from the setting tuned by ``aligntax els sweep`` in ``DIR/sweep/best.json``
        when there is one, else from ``DEFAULT_SETTINGS`` (see :func:`resolve_settings`; ``"none"`` turns
        a tuned energy or harm gate off). ``gate``: None/False steers every row; True holds back rows the
        folder's harm gate (:class:`aligntax.energy.gate.HarmGate`) calls harmful at its saved threshold;
        a float in (0, 1) uses that threshold. ``layers`` (given, else the tuned setting's) wins over
        ``top_k``. ``harm_orth`` k > 0: project each step off the first k directions of the folder's harm
        basis (``harm_basis.json``); ``row_strength`` True: the folder's learned per-row strength
        (``row_strength.json``) instead of the gate's and the row energy's cut-offs (the gate is loaded
        for its logit). The other options are plain values (see the module docstring).
        """
        _check_known(options, "from_dir")
        settings, origin = resolve_settings(directory, **options)
        untuned = tuned_settings(directory) is None
        if untuned and any(options.get(k) is None for k in ("gate", "horizon", "row_threshold")):
            _note_untuned(directory, settings)
        layers = settings["layers"]
        top_k = settings["top_k"] if layers is None else options.get("top_k")
        gate = settings["gate"]
        values = {k: settings[k] for k in VALUE_KEYS}
        loaded: dict[str, Any] = {}
        fp = dict(lm.fingerprint) if lm is not None and getattr(lm, "fingerprint", None) else None
        hs = lm.hidden_size if lm is not None else None
        bank = EnergyBank.load(directory, expect_fingerprint=fp, expect_hidden_size=hs)
        if settings["row_strength"] not in (None, False, 0):
            if not RowStrength.exists(directory):
                raise AligntaxError(
                    f"{directory} has no row strength model (row_strength.json); fit one with "
                    f"`aligntax els row-strength --steer {directory}`."
                )
            loaded["row_strength"] = RowStrength.load(directory, expect_fingerprint=fp, expect_hidden_size=hs)
            values["row_threshold"] = values["gate_ramp"] = (
                None  # the learned strength replaces both cut-offs
            )
            gate = True if gate in (None, False) else gate
        if gate is not None and gate is not False:
            if not HarmGate.exists(directory):
                raise AligntaxError(
                    f"{directory} has no harm gate (gate.json); train one with "
                    "`aligntax els train` (it writes one unless --no-gate)."
                )
            loaded["gate"] = HarmGate.load(directory, expect_fingerprint=fp, expect_hidden_size=hs)
            if gate is not True:
                loaded["gate_threshold"] = float(gate)
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
                raise AligntaxError(
                    f"{directory} has no harm basis (harm_basis.json); compute it with "
                    f"`aligntax els harm-basis --steer {directory}`."
                )
            basis = HarmBasis.load(directory, expect_fingerprint=fp, expect_hidden_size=hs)
            chosen = [int(x) for x in layers] if layers is not None else bank.layers
            if top_k is not None:
                chosen = [layer for layer in bank.layers if layer in chosen][:top_k]
            loaded["harm_dirs"] = {layer: basis.get(layer, k) for layer in chosen}
        if values.get("max_prompt_surprisal") is not None and lm is not None:
            from aligntax.surprisal import template_span

            loaded["surprisal_span"] = template_span(lm.tokenizer)
        iv = cls.from_bank(bank, layers=layers, top_k=top_k, source=str(directory), **loaded, **values)
        iv.settings_from = origin
        return iv

    def config(self) -> dict[str, Any]:
        """The resolved setting: the value options (each only when set, but ``threshold`` and ``horizon``,
        so a run folder made before an option existed resumes unchanged; ``gate_ramp`` inside ``gate``),
        the steered layers and their step sizes, the gate, harm basis and row strength model."""
        values = {
            k: v
            for k, v in self.settings.items()
            if k != "gate_ramp" and (v is not None or k in _SHOWN_UNSET)
        }
        return {
            "name": self.name,
            "layers": sorted(self.models),
            **values,
            "eta_by_layer": {layer: self.step_size(layer) for layer in sorted(self.models)},
            "source": self.source,
            "settings_from": self.settings_from,
            "gate": None if self.gate is None else self._gate_config(),
            **({"harm_orth": self.harm_orth} if self.harm_orth else {}),
            **(
                {"row_strength": {"layer": self.row_strength.layer, "floor": self.row_strength.floor}}
                if self.row_strength is not None
                else {}
            ),
        }

    def _gate_config(self) -> dict[str, Any]:
        # "layers" only for a gate of several: a one-layer gate's settings read as they always did, so a
        # run folder made before gates of several layers existed still resumes
        assert self.gate is not None  # config() asks only with a gate
        extra: dict[str, Any] = {"layers": self.gate.layers} if len(self.gate.layers) > 1 else {}
        if self.gate_ramp is not None:
            extra["ramp"] = self.gate_ramp
        return {"layer": self.gate.layer, "threshold": self.gate_threshold, **extra}

    @property
    def prefix_free(self) -> bool:  # type: ignore[override]  # a class attribute of Intervention
        # the gate reads the last prompt token and steering starts there unless "all"; the surprisal
        # domain scores the whole prompt inside the forward that holds it
        return self.positions != "all" and self.max_prompt_surprisal is None

    def step_size(self, layer: int) -> float:
        if layer in self.layer_eta:
            return self.layer_eta[layer]
        step: float = self.eta * self.norms[layer] if self.scale_by_norm else self.eta
        return step

    def kernel(self, n_layers: int, hidden_size: int | None = None) -> ElsKernel:
        """The ELS math for these settings (:class:`~aligntax.interventions.els_kernel.ElsKernel`), made
        once: it keeps its energy models' copies on other devices."""
        if self._kernel is None:
            self._kernel = ElsKernel(
                self.models,
                {layer: self.step_size(layer) for layer in self.models},
                self.settings,
                gate=self.gate,
                gate_threshold=self.gate_threshold,
                harm_dirs=self.harm_dirs,
                row_strength=self.row_strength,
                surprisal_span=self.surprisal_span,
            )
        self._kernel.check(n_layers)
        return self._kernel


@register("els", ElsOptions, "energy landscape steering from an energy bank folder")
def _els(lm: LoadedModel | None, o: ElsOptions) -> EnergySteering:
    path = need_path("els", o.path)
    kwargs = {f.name: getattr(o, f.name) for f in _SETTING_FIELDS}
    return EnergySteering.from_dir(path, lm, **{k: v for k, v in kwargs.items() if v is not None})
