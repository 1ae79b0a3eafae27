"""The command line, one module per face: ``main`` (the ``aligntax`` app and its pipeline commands),
``options`` (the one error path, option types and the checks run before a model loads), ``serve``,
``vat``, ``bundles`` and ``lmeval`` (sub-commands mounted by ``main``). Nothing below this package
imports it."""

from aligntax.cli.main import app

__all__ = ["app"]
