"""Markdown reports and plots for runs."""

from aligntax.reports.markdown import eval_table, fmt_rate, write_eval_report

__all__ = ["eval_table", "fmt_rate", "write_eval_report"]
