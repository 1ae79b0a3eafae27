"""Interventions by name, for the library, the CLI, the evaluation runs and the server.

Each method is registered once with :func:`aligntax.interventions.options.register`, beside its class
(``base``, ``prompting``, ``els``, ``lora``, ``vectors``): its name, its typed options dataclass (every
field declared with its help, flag and parsing) and a builder. Importing this module imports those
modules, so every method is registered, in the order of :data:`_MODULES`. The
command-line options, the YAML ``intervention_args`` keys, the sweep's grid axes and the server's
per-request options (the fields declared ``request=True``) are read from those dataclasses.
``python -c "from aligntax.interventions.registry import describe; print(describe())"`` lists them.

Other packages add methods through the entry-point group ``aligntax.interventions``
(:data:`ENTRY_POINT_GROUP`): each entry point names a module (or an object in one) whose import registers
its methods with :func:`~aligntax.interventions.options.register`, as the modules here do. They are
loaded after the built-in methods and listed after them; a plugin that fails to import or takes a name
already registered is left out with a warning naming its entry point. In a package's
``pyproject.toml``::

    [project.entry-points."aligntax.interventions"]
    my-method = "my_package.steering"

``dir=`` may also be spelt ``path=`` or ``directory=``. Vector folders are made by
:func:`aligntax.interventions.vectors.compute_vectors` then ``.save(dir)``; every artefact is checked
against ``lm.fingerprint``.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from aligntax.models.loader import LoadedModel

# The options dataclasses, cli_options, grid_fields, grid_values and intervention_args are re-exported:
# importing them from here guarantees that every method is registered first.
__all__ = [
    "ENTRY_POINT_GROUP",
    "INTERVENTIONS",
    "PLUGINS",
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
    "load_plugins",
    "make_intervention",
]

# The modules that register methods, in the order the methods are listed (names, command-line options),
# whichever of them was imported first.
_MODULES = (base, prompting, els, lora, compose, vectors)
_ORDER = [m.__name__ for m in _MODULES]
_registered = sorted(METHODS.items(), key=lambda kv: _ORDER.index(kv[1].build.__module__))
METHODS.clear()
METHODS.update(_registered)

ENTRY_POINT_GROUP = "aligntax.interventions"


def load_plugins(group: str = ENTRY_POINT_GROUP) -> list[str]:
    """Import every entry point of ``group`` (installed packages' intervention modules), which registers
    their methods; returns the names of the methods they added, in order. A plugin that fails to import
    or registers a name already taken is left out with a warning naming it, so one broken package does
    not stop the others or aligntax itself."""
    added: list[str] = []
    for ep in sorted(entry_points(group=group), key=lambda e: e.name):
        before = dict(METHODS)
        try:
            ep.load()
        except Exception as exc:  # noqa: BLE001 - any failure of another package's import
            METHODS.clear()
            METHODS.update(before)  # nothing half-registered stays
            warnings.warn(
                f"aligntax: intervention plugin '{ep.name}' ({ep.value}) was not loaded: "
                f"{type(exc).__name__}: {exc}",
                RuntimeWarning,
                stacklevel=2,
            )
            continue
        added += [name for name in METHODS if name not in before]
    return added


PLUGINS = tuple(load_plugins())

INTERVENTIONS = tuple(METHODS)


def make_intervention(name: str, lm: LoadedModel | None = None, **kwargs: Any) -> Intervention:
    """Build the intervention ``name`` for model ``lm`` from keyword options (None values are ignored;
    an option the method does not declare is refused)."""
    if name not in METHODS:
        raise AligntaxError(f"Unknown intervention '{name}'; known: {', '.join(METHODS)}.")
    iv: Intervention = METHODS[name].make(lm, **kwargs)
    return iv


def describe(methods: Mapping[str, Method] | None = None) -> str:
    """A table of the registered methods (or of ``methods``) and their options."""
    lines = []
    for m in (METHODS if methods is None else methods).values():
        lines.append(f"{m.name}: {m.help}")
        for f in dataclasses.fields(m.options):
            lines.append(f"    {f.name}: {spec_of(f).help}")
    return "\n".join(lines)
