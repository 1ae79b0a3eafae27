"""lm-evaluation-harness integration (optional extra ``lmeval``): the ``aligntax`` model type
(:mod:`aligntax.lmeval.model`) and ``aligntax lm-eval`` (:mod:`aligntax.cli.lmeval`).

Importing this package does not import lm-eval; :mod:`aligntax.lmeval.model` does, and registers the
model type with it."""
