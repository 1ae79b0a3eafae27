"""Crash-safe JSONL: appended line by line, and read back tolerating a torn last line."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from aligntax.errors import DataError


def read_jsonl(path: str | Path, repair: bool = False) -> list[dict]:
    """Read a JSONL file. A torn last line (a crash mid-write) is dropped, and with ``repair`` the file is
    truncated to its last complete line; a bad line elsewhere is an error naming the line."""
    path = Path(path)
    if not path.exists():
        return []
    raw = path.read_bytes()
    complete, _, tail = raw.rpartition(b"\n")
    rows = []
    for i, line in enumerate(complete.split(b"\n") if complete else [], start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}: line {i} is not valid JSON ({exc.msg})") from exc
    if tail.strip():
        try:  # a last line without newline: keep it if whole, drop it if torn
            rows.append(json.loads(tail))
            if repair:
                with open(path, "ab") as fh:
                    fh.write(b"\n")
        except json.JSONDecodeError:
            if repair:
                with open(path, "r+b") as fh:
                    fh.truncate(len(complete) + (1 if complete else 0))
    return rows


def append_jsonl(path: str | Path, rows: Iterable[dict]) -> None:
    """Append rows and flush them to disk before returning."""
    with open(path, "a", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
