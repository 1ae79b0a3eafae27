"""Evaluation runs: a run folder with samples.jsonl (appended as produced), results.json and report.md."""

from aligntax.runs.eval import EvalConfig, run_eval
from aligntax.runs.jsonl import append_jsonl, read_jsonl

__all__ = ["EvalConfig", "append_jsonl", "read_jsonl", "run_eval"]
