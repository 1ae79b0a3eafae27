"""Rates with confidence intervals and the over-refusal / safety summary of an evaluation."""

from aligntax.metrics.rates import Rate, rate, summarize_refusals, wilson_interval

__all__ = ["Rate", "rate", "summarize_refusals", "wilson_interval"]
