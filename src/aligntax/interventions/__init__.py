"""Interventions behind one interface: prompting, vector steering, energy steering and adapters."""

from typing import TYPE_CHECKING, Any

from aligntax.interventions.base import (
    Intervention,
    NoIntervention,
    SteerContext,
    hooks_attached,
    steered_slice,
)
from aligntax.interventions.prompting import (
    HELPFUL_SYSTEM_PROMPT,
    SAFETY_SYSTEM_PROMPT,
    FewShot,
    SystemPrompt,
)

# The steering modules import no module that imports them back (tests/test_layering.py), but importing
# them runs the energy, activations and generation package __init__s, and those reach this package
# again through aligntax.interventions.base: they are loaded on first use so that importing any of
# those packages first works, and so that ``import aligntax.interventions`` stays light.
if TYPE_CHECKING:  # what the lazy table gives, for type checkers
    from aligntax.interventions.els import EnergySteering
    from aligntax.interventions.registry import INTERVENTIONS, make_intervention
    from aligntax.interventions.vectors import (
        ActivationAddition,
        ConditionalSteering,
        DirectionAblation,
        SteeringVectors,
        compute_vectors,
        false_refusal_direction,
        refusal_direction,
    )

_LAZY = {
    "EnergySteering": "aligntax.interventions.els",
    "ActivationAddition": "aligntax.interventions.vectors",
    "ConditionalSteering": "aligntax.interventions.vectors",
    "DirectionAblation": "aligntax.interventions.vectors",
    "SteeringVectors": "aligntax.interventions.vectors",
    "compute_vectors": "aligntax.interventions.vectors",
    "false_refusal_direction": "aligntax.interventions.vectors",
    "refusal_direction": "aligntax.interventions.vectors",
    "INTERVENTIONS": "aligntax.interventions.registry",
    "make_intervention": "aligntax.interventions.registry",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'aligntax.interventions' has no attribute {name!r}")


__all__ = [
    "HELPFUL_SYSTEM_PROMPT",
    "INTERVENTIONS",
    "SAFETY_SYSTEM_PROMPT",
    "ActivationAddition",
    "ConditionalSteering",
    "DirectionAblation",
    "EnergySteering",
    "FewShot",
    "Intervention",
    "NoIntervention",
    "SteerContext",
    "SteeringVectors",
    "SystemPrompt",
    "compute_vectors",
    "false_refusal_direction",
    "hooks_attached",
    "make_intervention",
    "refusal_direction",
    "steered_slice",
]
