"""Rates with confidence intervals and the over-refusal / safety summary of an evaluation."""

from aligntax.metrics.rates import (
    Rate,
    mcnemar_exact,
    paired_change,
    paired_changes,
    rate,
    summarize_refusals,
    wilson_interval,
)

__all__ = [
    "Rate",
    "mcnemar_exact",
    "paired_change",
    "paired_changes",
    "rate",
    "summarize_refusals",
    "wilson_interval",
]
