"""Interventions by name, for the library, the CLI, the evaluation runs and the server.

Each method is registered once with :func:`aligntax.interventions.options.register`, beside its class
(``base``, ``prompting``, ``els``, ``lora``, ``vectors``): its name, its typed options dataclass (every
field declared with its help, flag and parsing) and a builder. Importing this module imports those
modules, so every method is registered, in the order of :data:`_MODULES`. The
command-line options, the YAML ``intervention_args`` keys, the sweep's grid axes and the server's
per-request options (the fields declared ``request=True``) are read from those dataclasses.
``python -c "from aligntax.interventions.registry import describe; print(describe())"`` lists them.

``dir=`` may also be spelt ``path=`` or ``directory=``. Vector folders are made by
:func:`aligntax.interventions.vectors.compute_vectors` then ``.save(dir)``; every artefact is checked
against ``lm.fingerprint``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from aligntax.errors import AligntaxError
from aligntax.interventions import base, compose, els, lora, prompting, vectors
from aligntax.interventions.base import Intervention, NoOptions
from aligntax.interventions.els import ElsOptions
from aligntax.interventions.lora import ElsLoraOptions
from aligntax.interventions.options import (
    METHODS,
    Method,
    cli_options,
    grid_fields,
    grid_values,
    intervention_args,
    spec_of,
)
from aligntax.interventions.prompting import PromptOptions
from aligntax.interventions.vectors import CastOptions, VectorOptions

# The options dataclasses, cli_options, grid_fields, grid_values and intervention_args are re-exported:
# importing them from here guarantees that every method is registered first.
__all__ = [
    "INTERVENTIONS",
    "CastOptions",
    "ElsLoraOptions",
    "ElsOptions",
    "NoOptions",
    "PromptOptions",
    "VectorOptions",
    "cli_options",
    "describe",
    "grid_fields",
    "grid_values",
    "intervention_args",
    "make_intervention",
]

# The modules that register methods, in the order the methods are listed (names, command-line options),
# whichever of them was imported first.
_MODULES = (base, prompting, els, lora, compose, vectors)
_ORDER = [m.__name__ for m in _MODULES]
_registered = sorted(METHODS.items(), key=lambda kv: _ORDER.index(kv[1].build.__module__))
METHODS.clear()
METHODS.update(_registered)

INTERVENTIONS = tuple(METHODS)


def make_intervention(name: str, lm=None, **kwargs) -> Intervention:
    """Build the intervention ``name`` for model ``lm`` from keyword options (None values are ignored;
    an option the method does not declare is refused)."""
    if name not in METHODS:
        raise AligntaxError(f"Unknown intervention '{name}'; known: {', '.join(METHODS)}.")
    return METHODS[name].make(lm, **kwargs)


def describe(methods: Mapping[str, Method] | None = None) -> str:
    """A table of the registered methods (or of ``methods``) and their options."""
    lines = []
    for m in (METHODS if methods is None else methods).values():
        lines.append(f"{m.name}: {m.help}")
        for f in dataclasses.fields(m.options):
            lines.append(f"    {f.name}: {spec_of(f).help}")
    return "\n".join(lines)
