"""aligntax: measure and cut the alignment tax of open-weight LLMs.

``aligntax.load_model`` and ``aligntax.load_intervention`` (:mod:`aligntax.api`) load on first use,
so ``import aligntax`` itself stays light."""

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:  # what the lazy table gives, for type checkers
    from aligntax.api import load_intervention, load_model

_LAZY = {"load_model": "aligntax.api", "load_intervention": "aligntax.api"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from aligntax import api

        return getattr(api, name)
    raise AttributeError(f"module 'aligntax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = ["__version__", "load_intervention", "load_model"]
