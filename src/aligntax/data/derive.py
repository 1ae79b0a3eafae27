"""Files made for aligntax from an upstream file, deterministically: the recipes of
:data:`aligntax.data.upstream.DERIVED`.

A recipe reads its source files' bytes and returns the derived file's bytes; the caller checks the
result against the pinned sha256 before storing it, so a recipe that drifted (or a source that
changed) stores nothing.

PHTest's splits are selected by id from the upstream CSV (``ID,Request,Harmfulness``): the ids of each
split are pinned, in order, in ``aligntax/resources/data/phtest_splits.json``. A split is written as
the JSON list the project's results were made with: one object per prompt (``id`` ``phtest:ID``,
``prompt``, ``label``), each key on its own line.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Mapping
from pathlib import Path

from aligntax.data.upstream import PHTEST_CSV
from aligntax.errors import DataError

SPLITS_FILE = Path(__file__).resolve().parent.parent / "resources" / "data" / "phtest_splits.json"


def phtest_split_ids() -> dict[str, list[int]]:
    """The pinned PHTest split: {"train": [ids], "val": [ids]}, in file order of the split."""
    return {k: [int(i) for i in v] for k, v in json.loads(SPLITS_FILE.read_text()).items()}


def json_records(rows: list[dict]) -> bytes:
    """Rows as a JSON list, one key per line (the layout of the project's split files), UTF-8."""
    body = ",\n".join(
        "{\n"
        + ",\n".join(
            f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}"
            for k, v in row.items()
        )
        + "\n}"
        for row in rows
    )
    return f"[\n{body}\n]".encode()


def _phtest_rows(raw: bytes) -> list[dict[str, str]]:
    try:
        rows = list(csv.DictReader(io.StringIO(raw.decode("utf-8"), newline="")))
    except (UnicodeDecodeError, csv.Error) as exc:
        raise DataError(f"{PHTEST_CSV}: not a readable CSV ({exc})") from None
    if not rows or not {"ID", "Request", "Harmfulness"} <= set(rows[0]):
        raise DataError(f"{PHTEST_CSV}: expected the columns ID, Request, Harmfulness")
    return rows


def phtest_split(raw: bytes, split: str) -> bytes:
    """The harmless PHTest prompts of ``split`` (train or val), by pinned id, as benign rows."""
    by_id = {r["ID"]: r for r in _phtest_rows(raw)}
    out = []
    for i in phtest_split_ids()[split]:
        row = by_id.get(str(i))
        if row is None or row["Harmfulness"] != "harmless":
            raise DataError(f"{PHTEST_CSV}: PHTest id {i} of the {split} split is missing or not harmless")
        out.append({"id": f"phtest:{i}", "prompt": row["Request"], "label": "benign"})
    return json_records(out)


def phtest_controversial(raw: bytes) -> bytes:
    """Every prompt PHTest labels controversial, in file order."""
    rows = _phtest_rows(raw)
    out = [
        {"id": f"phtest:{r['ID']}", "prompt": r["Request"], "label": "controversial"}
        for r in rows
        if r["Harmfulness"] == "controversial"
    ]
    return json_records(out)


# recipe -> function of the sources' bytes (in DerivedFile.sources order)
RECIPES: dict[str, Callable[..., bytes]] = {
    "phtest-harmless-train": lambda raw: phtest_split(raw, "train"),
    "phtest-harmless-val": lambda raw: phtest_split(raw, "val"),
    "phtest-controversial": phtest_controversial,
}


def derive(recipe: str, sources: Mapping[str, bytes], order: tuple[str, ...]) -> bytes:
    """Run ``recipe`` on the sources' bytes (``order``: the data-root paths it takes, in order)."""
    fn = RECIPES.get(recipe)
    if fn is None:
        raise DataError(f"unknown recipe {recipe!r}; known: {', '.join(RECIPES)}")
    return fn(*(sources[rel] for rel in order))
