"""Interventions by name, for the CLI, the evaluation runs and the server.

=========================  ====================================================================
name                       what it builds (keyword arguments)
=========================  ====================================================================
none                       no intervention
system-prompt              the safety system prompt (``text=`` to override)
helpful-prompt             the over-refusal-aware helpful system prompt (``text=`` to override)
els                        energy landscape steering from an energy bank folder (``dir=``, ``eta``,
                           ``steps``, ``top_k``, ``layers``, ``threshold``, ``gate``, ``horizon``,
                           ``positions``, ``scale_by_norm``)
refusal-add                add the refusal vector of one layer (``dir=``, ``layer``, ``coeff``, ``positions``;
                           ``layers=[...]`` adds each listed layer's own vector)
refusal-ablation           project the refusal direction (of ``layer``) out at all layers (``dir=``, ``layer``,
                           ``coeff``, ``layers`` to restrict where)
false-refusal-ablation     the same with the false-refusal vector
cast                       conditional steering from the saved CAST condition (``dir=``, ``threshold``,
                           ``mode``, ``coeff``, ``compare``, ``behaviour``)
=========================  ====================================================================

``dir=`` may also be spelt ``path=`` or ``directory=``. Vector folders are made by :func:`aligntax.interventions.vectors.compute_vectors` then ``.save(dir)``;
every artefact is checked against ``lm.fingerprint``.
"""

from __future__ import annotations

from aligntax.errors import AligntaxError
from aligntax.interventions.base import Intervention, NoIntervention
from aligntax.interventions.prompting import HELPFUL_SYSTEM_PROMPT, SAFETY_SYSTEM_PROMPT, SystemPrompt

INTERVENTIONS = ("none", "system-prompt", "helpful-prompt", "els", "refusal-add", "refusal-ablation",
                 "false-refusal-ablation", "cast")


def _fingerprint(lm) -> dict | None:
    fp = getattr(lm, "fingerprint", None) if lm is not None else None
    return dict(fp) if fp else None


def _need_dir(name: str, kwargs: dict):
    d = kwargs.pop("dir", None) or kwargs.pop("directory", None) or kwargs.pop("path", None)
    if not d:
        raise AligntaxError(f"Intervention '{name}' needs dir= (the folder of its saved artefact).")
    return d


def _vectors(name: str, lm, kwargs: dict):
    from aligntax.interventions.vectors import SteeringVectors

    fp = _fingerprint(lm)
    return SteeringVectors.load(_need_dir(name, kwargs), expect_fingerprint=fp,
                                expect_hidden_size=lm.hidden_size if lm is not None else None)


def _reject_unknown(name: str, kwargs: dict) -> None:
    if kwargs:
        raise AligntaxError(f"Unknown options for intervention '{name}': {', '.join(sorted(kwargs))}.")


def make_intervention(name: str, lm=None, **kwargs) -> Intervention:
    """Build the intervention ``name`` for model ``lm`` (None-valued options are ignored)."""
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if name == "none":
        _reject_unknown(name, kwargs)
        return NoIntervention()
    if name == "system-prompt":
        iv = SystemPrompt(kwargs.pop("text", SAFETY_SYSTEM_PROMPT), name="system-prompt")
        _reject_unknown(name, kwargs)
        return iv
    if name == "helpful-prompt":
        iv = SystemPrompt(kwargs.pop("text", HELPFUL_SYSTEM_PROMPT), name="helpful-prompt")
        _reject_unknown(name, kwargs)
        return iv
    if name == "els":
        from aligntax.interventions.els import EnergySteering

        directory = _need_dir(name, kwargs)
        return EnergySteering.from_dir(directory, lm, **kwargs)
    if name in ("refusal-add", "refusal-ablation", "false-refusal-ablation"):
        from aligntax.interventions.vectors import ActivationAddition, DirectionAblation

        vs = _vectors(name, lm, kwargs)
        kind = "false_refusal" if name == "false-refusal-ablation" else "refusal"
        layer = kwargs.pop("layer", None)
        layer = vs.default_layer(kind) if layer is None else int(layer)
        vec = vs.get(kind, layer)
        coeff = float(kwargs.pop("coeff", 1.0))
        if name == "refusal-add":
            add_layers = kwargs.pop("layers", None)  # several layers: each gets its own layer's vector
            vecs = {layer: vec} if add_layers is None else {int(x): vs.get(kind, int(x)) for x in add_layers}
            iv = ActivationAddition(vecs, coeff=coeff, positions=kwargs.pop("positions", "all"), name=name)
        else:
            iv = DirectionAblation(vec, layers=kwargs.pop("layers", "all"), coeff=coeff,
                                   positions=kwargs.pop("positions", "all"), name=name)
        _reject_unknown(name, kwargs)
        return iv
    if name == "cast":
        from aligntax.interventions.vectors import ConditionalSteering

        vs = _vectors(name, lm, kwargs)
        cast = dict(vs.metadata.get("cast") or {})
        if not cast or "condition" not in vs.vectors:
            raise AligntaxError("This vector folder has no CAST condition; compute it with pseudo-harmful prompts.")
        layer = int(cast["condition_layer"])
        behaviour = kwargs.pop("behaviour", cast.get("behaviour", "refusal"))
        beh_layer = kwargs.pop("layer", None)
        vec = vs.get(behaviour, vs.default_layer(behaviour) if beh_layer is None else int(beh_layer))
        center = vs.vectors.get("center", {}).get(layer)
        iv = ConditionalSteering(
            vs.get("condition", layer), layer, float(kwargs.pop("threshold", cast["threshold"])), vec,
            behaviour_layers=kwargs.pop("behaviour_layers", cast.get("behaviour_layers", "all")),
            mode=kwargs.pop("mode", cast.get("mode", "ablate")), coeff=float(kwargs.pop("coeff", 1.0)),
            compare=kwargs.pop("compare", cast.get("compare", "less")), center=center, name="cast")
        _reject_unknown(name, kwargs)
        return iv
    raise AligntaxError(f"Unknown intervention '{name}'; known: {', '.join(INTERVENTIONS)}.")
