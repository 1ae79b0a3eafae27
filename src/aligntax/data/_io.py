"""Read a prompt file (CSV/TSV, JSON, JSONL, plain text) into rows, with errors that name the file.

Every loader goes through :func:`read_table`, so the checks for a missing or empty file, text that
is not UTF-8 and malformed JSON live here once.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aligntax.errors import DataError

KINDS = ("csv", "tsv", "json", "jsonl", "txt")
_EXT_KIND = {
    ".csv": "csv",
    ".tsv": "tsv",
    ".json": "json",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".txt": "txt",
}
# Keys under which a JSON object may hold its list of records.
_JSON_LIST_KEYS = ("data", "rows", "records", "examples", "items", "instances", "prompts", "jailbreaks")

# Long jailbreak prompts can exceed csv's default field limit (128 KiB).
if csv.field_size_limit() < 16 * 1024 * 1024:
    csv.field_size_limit(16 * 1024 * 1024)


@dataclass
class Row:
    num: int  # 1-based data row number (header and blank lines not counted)
    where: str  # "row 3 (line 4)", "line 7", "record 2": for messages
    values: dict[str, Any]


@dataclass
class Table:
    name: str  # the file path (or Hub id) as shown in messages
    kind: str
    columns: list[str]
    rows: list[Row] = field(default_factory=list)

    def find_column(self, candidates: Iterable[str]) -> str | None:
        """The first candidate present: exact spelling first, then ignoring case."""
        candidates = list(candidates)
        for cand in candidates:
            if cand in self.columns:
                return cand
        lower = {c.lower(): c for c in self.columns}
        for cand in candidates:
            if cand.lower() in lower:
                return lower[cand.lower()]
        return None

    def require_column(self, candidates: Sequence[str], fmt: str) -> str:
        col = self.find_column(candidates)
        if col is None:
            expected = " or ".join(repr(c) for c in candidates)
            raise DataError(
                f"{self.name}: missing column {expected} (expected for the {fmt!r} format); "
                f"the file has columns: {describe_columns(self.columns)}"
            )
        return col


def describe_columns(columns: Sequence[str]) -> str:
    return ", ".join(repr(c) for c in columns) if columns else "(none)"


def kind_for(path: Path) -> str | None:
    return _EXT_KIND.get(path.suffix.lower())


def read_text(path: Path) -> str:
    """The file's text, decoded as UTF-8 (a BOM is allowed); DataError if missing, empty or undecodable."""
    if not path.exists():
        raise DataError(f"{path}: file not found")
    if path.is_dir():
        raise DataError(f"{path}: is a folder, not a file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"{path}: cannot read the file: {exc}") from exc
    if not data.strip():
        raise DataError(f"{path}: file is empty")
    skip = 3 if data.startswith(b"\xef\xbb\xbf") else 0
    try:
        text = data[skip:].decode("utf-8")
    except UnicodeDecodeError as exc:
        offset = exc.start + skip
        line = data[:offset].count(b"\n") + 1
        hint = ""
        if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
            hint = " (it looks like UTF-16)"
        raise DataError(
            f"{path}: not valid UTF-8 text{hint}: byte 0x{data[offset]:02x} at byte offset {offset} "
            f"(line {line}) cannot be decoded; re-save the file as UTF-8"
        ) from None
    if not text.strip():
        raise DataError(f"{path}: file is empty")
    return text


def read_table(path: str | Path, kind: str | None = None) -> Table:
    """Parse ``path`` into a :class:`Table`. ``kind`` (csv/tsv/json/jsonl/txt) defaults from the extension."""
    path = Path(path)
    text = read_text(path)
    kind = kind or kind_for(path) or _sniff_kind(text)
    if kind not in KINDS:
        raise DataError(f"{path}: unknown file kind {kind!r}; expected one of {', '.join(KINDS)}")
    if kind in ("csv", "tsv"):
        table = _parse_csv(path, text, "\t" if kind == "tsv" else ",")
    elif kind == "json":
        table = _parse_json(path, text)
    elif kind == "jsonl":
        table = _parse_jsonl(path, text)
    else:
        table = _parse_txt(path, text)
    if not table.rows:
        raise DataError(f"{path}: file is empty (no data rows)")
    return table


def _sniff_kind(text: str) -> str:
    head = text.lstrip()
    if head.startswith("["):
        return "json"
    if head.startswith("{"):
        first = head.splitlines()[0].strip()
        return "jsonl" if first.endswith("}") else "json"
    return "csv"


def _check_header(path: Path, line: int, header: list[str]) -> None:
    """A column named twice would silently overwrite the first: refuse it, naming both positions."""
    first: dict[str, int] = {}
    for i, name in enumerate(header):
        if not name:
            continue  # unnamed columns (e.g. a trailing delimiter) are never read by name
        if name in first:
            raise DataError(
                f"{path}, line {line}: the header names column '{name}' twice (columns {first[name] + 1} and "
                f"{i + 1}); rename one of them so that neither is silently overwritten"
            )
        first[name] = i


def _parse_csv(path: Path, text: str, delimiter: str) -> Table:
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
    header: list[str] | None = None
    rows: list[Row] = []
    prev_line = 0
    try:
        for cells in reader:
            start = prev_line + 1
            prev_line = reader.line_num
            if not cells or all(not c.strip() for c in cells):
                continue
            if header is None:
                header = [c.strip() for c in cells]
                _check_header(path, start, header)
                continue
            if len(cells) > len(header) and any(c.strip() for c in cells[len(header) :]):
                raise DataError(
                    f"{path}, line {start}: {len(cells)} fields but the header has {len(header)} "
                    f"(an unquoted delimiter in the text?)"
                )
            values = {col: (cells[i] if i < len(cells) else "") for i, col in enumerate(header)}
            num = len(rows) + 1
            rows.append(Row(num, f"row {num} (line {start})", values))
    except csv.Error as exc:
        raise DataError(f"{path}, line {reader.line_num}: malformed CSV: {exc}") from None
    return Table(str(path), "tsv" if delimiter == "\t" else "csv", header or [], rows)


class _Dup(dict):
    """A JSON object that named a key twice (``dup`` is the key); only the last value was kept."""

    dup: str = ""


def _mark_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    """``json`` object hook: a key given twice would silently keep only its last value; mark it."""
    out: dict = {}
    dup = None
    for key, value in pairs:
        if key in out and dup is None:
            dup = key
        out[key] = value
    if dup is None:
        return out
    marked = _Dup(out)
    marked.dup = dup
    return marked


def _loads(text: str) -> Any:
    return json.loads(text, object_pairs_hook=_mark_duplicates)


def _duplicate_key(value: Any) -> str | None:
    """The first key named twice in any object of ``value`` (depth first), or None."""
    if isinstance(value, _Dup):
        return value.dup
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    for child in children:
        key = _duplicate_key(child)
        if key is not None:
            return key
    return None


def _check_duplicates(path: Path, where: str, value: Any) -> None:
    key = _duplicate_key(value)
    if key is not None:
        raise DataError(
            f"{path}, {where}: a JSON object names the key {key!r} twice; only the last value "
            "would be kept, so remove or rename one of them"
        )


def _records_to_table(path: Path, kind: str, records: list[tuple[str, Any]]) -> Table:
    columns: dict[str, None] = {}
    rows: list[Row] = []
    for where, rec in records:
        if isinstance(rec, str):
            rec = {"prompt": rec}
        if not isinstance(rec, dict):
            raise DataError(
                f"{path}, {where}: expected a JSON object (or a string), got {type(rec).__name__}"
            )
        _check_duplicates(path, where, rec)
        for key in rec:
            columns.setdefault(str(key), None)
        rows.append(Row(len(rows) + 1, where, {str(k): v for k, v in rec.items()}))
    return Table(str(path), kind, list(columns), rows)


def _parse_json(path: Path, text: str) -> Table:
    try:
        data = _loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data" and text.lstrip().startswith("{"):
            return _parse_jsonl(path, text)  # JSON Lines saved as .json
        raise DataError(
            f"{path}: malformed JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
        ) from None
    if isinstance(data, _Dup):
        _check_duplicates(path, "the top-level object", data)
    if isinstance(data, dict):
        lists = [k for k in _JSON_LIST_KEYS if isinstance(data.get(k), list)]
        if not lists:
            raise DataError(
                f"{path}: expected a JSON array of records (or an object with one of the keys "
                f"{', '.join(_JSON_LIST_KEYS)}); found an object with keys {describe_columns(list(data))}"
            )
        data = data[lists[0]]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON array of records, found {type(data).__name__}")
    return _records_to_table(path, "json", [(f"record {i + 1}", rec) for i, rec in enumerate(data)])


def _lines(text: str) -> list[str]:
    """Lines split at "\n" only (a "\r" before it dropped): unlike ``str.splitlines`` this keeps
    U+2028, U+2029, U+0085 and other Unicode line breaks, which JSON written with ``ensure_ascii=False``
    holds raw inside strings, within their line."""
    return [line[:-1] if line.endswith("\r") else line for line in text.split("\n")]


def _parse_jsonl(path: Path, text: str) -> Table:
    records: list[tuple[str, Any]] = []
    for lineno, line in enumerate(_lines(text), start=1):
        if not line.strip():
            continue
        try:
            records.append((f"line {lineno}", _loads(line)))
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{path}, line {lineno}: malformed JSON (column {exc.colno}): {exc.msg}"
            ) from None
    return _records_to_table(path, "jsonl", records)


def _parse_txt(path: Path, text: str) -> Table:
    rows: list[Row] = []
    for lineno, line in enumerate(_lines(text), start=1):
        if line.strip():
            rows.append(Row(len(rows) + 1, f"line {lineno}", {"prompt": line}))
    return Table(str(path), "txt", ["prompt"], rows)
