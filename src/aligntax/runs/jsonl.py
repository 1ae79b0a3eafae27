"""Crash-safe JSONL: appended line by line, and read back tolerating a torn last line
(:mod:`aligntax.runfolder`)."""

from __future__ import annotations

from aligntax.runfolder import append_jsonl, read_jsonl, write_jsonl_atomic  # noqa: F401 - re-exported
