"""Interventions behind one interface: prompting, vector steering, energy steering and adapters."""

from aligntax.interventions.base import Intervention, NoIntervention, SteerContext, hooks_attached, steered_slice
from aligntax.interventions.prompting import (
    HELPFUL_SYSTEM_PROMPT,
    SAFETY_SYSTEM_PROMPT,
    FewShot,
    SystemPrompt,
)

__all__ = [
    "HELPFUL_SYSTEM_PROMPT",
    "SAFETY_SYSTEM_PROMPT",
    "FewShot",
    "Intervention",
    "NoIntervention",
    "SteerContext",
    "SystemPrompt",
    "hooks_attached",
    "steered_slice",
]
