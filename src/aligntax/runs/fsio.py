"""Crash-safe files of run folders: the run-folder contract of :mod:`aligntax.runfolder` (atomic writes,
the run lock, stale temp files), under the names the run pipelines have always imported."""

from __future__ import annotations

import os  # noqa: F401 - tests replace fsio.os.replace to crash a write before its rename

from aligntax.runfolder import (  # noqa: F401 - re-exported
    LOCK_NAME,
    STALE_TEMP_S,
    RunLockedError,
    SettingsChanged,
    WriteError,
    atomic_file,
    check_settings,
    check_writable,
    clean_stale_temps,
    pid_alive,
    run_lock,
    write_bytes_atomic,
    write_json_atomic,
    write_jsonl_atomic,
    write_text_atomic,
)
