"""Interventions by name, for the library, the CLI, the evaluation runs and the server.

Each method is registered once with :func:`aligntax.interventions.options.register`: its name, its
typed options dataclass (every field declared with its help, flag and parsing) and a builder. The
command-line options, the YAML ``intervention_args`` keys, the sweep's grid axes and the server's
per-request options (the fields declared ``request=True``) are read from those dataclasses.
``python -c "from aligntax.interventions.registry import describe; print(describe())"`` lists them.

``dir=`` may also be spelt ``path=`` or ``directory=``. Vector folders are made by
:func:`aligntax.interventions.vectors.compute_vectors` then ``.save(dir)``; every artefact is checked
against ``lm.fingerprint``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aligntax.errors import AligntaxError
from aligntax.interventions.options import (
    METHODS,
    cli_options,
    grid_fields,
    grid_values,
    intervention_args,
    option,
    register,
    spec_of,
)

if TYPE_CHECKING:  # the builders import what they build: reading the options stays free of torch
    from aligntax.interventions.base import Intervention

# cli_options, grid_fields, grid_values and intervention_args are re-exported: importing them from here guarantees
# that every method above is registered first.
__all__ = ["INTERVENTIONS", "CastOptions", "ElsLoraOptions", "ElsOptions", "NoOptions", "PromptOptions",
           "VectorOptions",
           "cli_options", "describe", "grid_fields", "grid_values", "intervention_args", "make_intervention"]


# ---- options, one dataclass per kind of method ----------------------------------------------------------
@dataclass
class NoOptions:
    """No options."""


@dataclass
class PromptOptions:
    text: str | None = option("the system prompt's text (default: the method's own)", cli=False)


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


@dataclass
class ElsLoraOptions:
    path: str | None = option("energy model folder (implies --intervention els), or an els-lora adapter folder "
                              "(aligntax els distill)", flag="--steer")
    scale: float | None = option("els-lora: multiplier of the adapter's update (0: the unsteered model; default 1)",
                                 flag="--lora-scale", parse="float", check="finite")


@dataclass
class _SavedVectorOptions:
    """What every method reading a vector folder takes."""

    path: str | None = option("vector folder for the vector baselines", flag="--vectors")
    coeff: float | None = option("vector baselines: strength", parse="float", check="finite", request=True)
    layer: int | None = option("vector baselines: the layer whose vector is used (default: the folder's)",
                               parse="int", check="count", request=True)


@dataclass
class VectorOptions(_SavedVectorOptions):
    layers: list[int] | None = option("comma-separated layer indices, e.g. 17,19", parse="layers", check="count",
                                      request=True)
    positions: str | None = option("last_and_generated, generated or all (default all)", cli=False)


@dataclass
class CastOptions(_SavedVectorOptions):
    threshold: float | None = option("CAST: the condition's cosine threshold (default: the fitted one)",
                                      parse="float", check="finite", cli=False,
                                      request=True)
    mode: str | None = option("CAST: add or ablate the behaviour vector", cli=False)
    compare: str | None = option("CAST: steer when the similarity is greater or less than the threshold",
                                 cli=False)
    behaviour: str | None = option("CAST: the saved vector to use (refusal, false_refusal)", cli=False)
    behaviour_layers: str | list[int] | None = option("CAST: the layers it acts on (default all)", cli=False)


def _need_dir(name: str, path: str | None) -> str:
    if not path:
        raise AligntaxError(f"Intervention '{name}' needs dir= (the folder of its saved artefact).")
    return path


def _fingerprint(lm) -> dict | None:
    fp = getattr(lm, "fingerprint", None) if lm is not None else None
    return dict(fp) if fp else None


def _vectors(name: str, lm, path: str | None):
    from aligntax.interventions.vectors import SteeringVectors

    return SteeringVectors.load(_need_dir(name, path), expect_fingerprint=_fingerprint(lm),
                                expect_hidden_size=lm.hidden_size if lm is not None else None)


# ---- the methods ----------------------------------------------------------------------------------------
@register("none", NoOptions, "no intervention")
def _none(lm, o: NoOptions) -> Intervention:
    from aligntax.interventions.base import NoIntervention

    return NoIntervention()


@register("system-prompt", PromptOptions, "the safety system prompt")
def _system_prompt(lm, o: PromptOptions) -> Intervention:
    from aligntax.interventions.prompting import SAFETY_SYSTEM_PROMPT, SystemPrompt

    return SystemPrompt(o.text or SAFETY_SYSTEM_PROMPT, name="system-prompt")


@register("helpful-prompt", PromptOptions, "the over-refusal-aware helpful system prompt")
def _helpful_prompt(lm, o: PromptOptions) -> Intervention:
    from aligntax.interventions.prompting import HELPFUL_SYSTEM_PROMPT, SystemPrompt

    return SystemPrompt(o.text or HELPFUL_SYSTEM_PROMPT, name="helpful-prompt")


@register("els", ElsOptions, "energy landscape steering from an energy bank folder")
def _els(lm, o: ElsOptions) -> Intervention:
    from aligntax.interventions.els import EnergySteering

    path = _need_dir("els", o.path)
    kwargs = {f.name: getattr(o, f.name) for f in dataclasses.fields(o) if f.name != "path"}
    return EnergySteering.from_dir(path, lm, **{k: v for k, v in kwargs.items() if v is not None})


@register("els-lora", ElsLoraOptions, "ELS distilled into a LoRA adapter (aligntax els distill), applied by hooks")
def _els_lora(lm, o: ElsLoraOptions) -> Intervention:
    from aligntax.interventions.lora import ElsLora

    return ElsLora.load(_need_dir("els-lora", o.path), lm, scale=o.scale)


def _vector_method(name: str, lm, o: VectorOptions) -> Intervention:
    from aligntax.interventions.vectors import ActivationAddition, DirectionAblation

    vs = _vectors(name, lm, o.path)
    kind = "false_refusal" if name == "false-refusal-ablation" else "refusal"
    layer = vs.default_layer(kind) if o.layer is None else int(o.layer)
    vec = vs.get(kind, layer)
    coeff = 1.0 if o.coeff is None else float(o.coeff)
    if name == "refusal-add":  # several layers: each gets its own layer's vector
        vecs = {layer: vec} if o.layers is None else {int(x): vs.get(kind, int(x)) for x in o.layers}
        return ActivationAddition(vecs, coeff=coeff, positions=o.positions or "all", name=name)
    return DirectionAblation(vec, layers="all" if o.layers is None else o.layers, coeff=coeff,
                             positions=o.positions or "all", name=name)


@register("refusal-add", VectorOptions, "add the refusal vector of one layer (--layers: each listed layer's own)")
def _refusal_add(lm, o: VectorOptions) -> Intervention:
    return _vector_method("refusal-add", lm, o)


@register("refusal-ablation", VectorOptions, "project the refusal direction (of --layer) out at every layer")
def _refusal_ablation(lm, o: VectorOptions) -> Intervention:
    return _vector_method("refusal-ablation", lm, o)


@register("false-refusal-ablation", VectorOptions, "project the false-refusal direction out at every layer")
def _false_refusal_ablation(lm, o: VectorOptions) -> Intervention:
    return _vector_method("false-refusal-ablation", lm, o)


@register("cast", CastOptions, "conditional steering from the saved CAST condition")
def _cast(lm, o: CastOptions) -> Intervention:
    from aligntax.interventions.vectors import ConditionalSteering

    vs = _vectors("cast", lm, o.path)
    cast = dict(vs.metadata.get("cast") or {})
    if not cast or "condition" not in vs.vectors:
        raise AligntaxError("This vector folder has no CAST condition; compute it with pseudo-harmful prompts.")
    layer = int(cast["condition_layer"])
    behaviour = o.behaviour or cast.get("behaviour", "refusal")
    vec = vs.get(behaviour, vs.default_layer(behaviour) if o.layer is None else int(o.layer))
    return ConditionalSteering(
        vs.get("condition", layer), layer, float(cast["threshold"] if o.threshold is None else o.threshold), vec,
        behaviour_layers=o.behaviour_layers or cast.get("behaviour_layers", "all"),
        mode=o.mode or cast.get("mode", "ablate"), coeff=1.0 if o.coeff is None else float(o.coeff),
        compare=o.compare or cast.get("compare", "less"), center=vs.vectors.get("center", {}).get(layer),
        name="cast")


INTERVENTIONS = tuple(METHODS)


def make_intervention(name: str, lm=None, **kwargs) -> Intervention:
    """Build the intervention ``name`` for model ``lm`` from keyword options (None values are ignored;
    an option the method does not declare is refused)."""
    if name not in METHODS:
        raise AligntaxError(f"Unknown intervention '{name}'; known: {', '.join(METHODS)}.")
    return METHODS[name].make(lm, **kwargs)


def describe() -> str:
    """A table of the registered methods and their options."""
    lines = []
    for m in METHODS.values():
        lines.append(f"{m.name}: {m.help}")
        for f in dataclasses.fields(m.options):
            lines.append(f"    {f.name}: {spec_of(f).help}")
    return "\n".join(lines)
