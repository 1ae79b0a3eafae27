"""Prompt sets from the Hugging Face Hub (``hf:ORG/NAME[:split]`` or ``hf:ORG/NAME:config:split``)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from aligntax.data._io import Row, Table, describe_columns
from aligntax.data.base import Label, PromptItem, label_argument, normalize_label
from aligntax.data.formats import map_rows, row_item
from aligntax.errors import DataError

HUB_PREFIX = "hf:"

# Column names tried, in order, for the prompt text, category, id and label.
PROMPT_COLUMNS: tuple[str, ...] = (
    "prompt",
    "instruction",
    "goal",  # AdvBench
    "Goal",  # JBB (which also has "Behavior", a short name: "Goal" must come first)
    "Behavior",  # HarmBench
    "forbidden_prompt",  # StrongREJECT
    "question",
    "query",
    "text",
)
CATEGORY_COLUMNS: tuple[str, ...] = ("category", "SemanticCategory", "type")
ID_COLUMNS: tuple[str, ...] = ("id", "BehaviorID", "Index")
LABEL_COLUMNS: tuple[str, ...] = ("label",)

_REPO = r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*"
_HUB_ID = re.compile(rf"^(?P<repo>{_REPO})(?::(?P<a>[\w.-]+))?(?::(?P<b>[\w.-]+))?$")
_FILE_EXTS = (".csv", ".tsv", ".json", ".jsonl", ".ndjson", ".txt", ".parquet")


def parse_hub_id(spec: str) -> tuple[str, str | None, str | None]:
    """``hf:ORG/NAME[:split]`` or ``hf:ORG/NAME:config:split`` -> (repo, config, split)."""
    text = spec.strip()
    if text.startswith(HUB_PREFIX):
        text = text[len(HUB_PREFIX) :]
    m = _HUB_ID.match(text)
    if m is None:
        raise DataError(
            f"bad Hub dataset id {spec!r}; expected hf:ORG/NAME, hf:ORG/NAME:split or hf:ORG/NAME:config:split"
        )
    a, b = m.group("a"), m.group("b")
    if b is not None:
        return m.group("repo"), a, b
    return m.group("repo"), None, a


def looks_like_hub_id(spec: str) -> bool:
    """True for ``hf:...`` and for a bare ``ORG/NAME[:split]`` that is not shaped like a file path."""
    text = spec.strip()
    if text.startswith(HUB_PREFIX):
        return True
    if text.startswith((".", "/", "~")) or text.lower().endswith(_FILE_EXTS):
        return False
    return _HUB_ID.match(text) is not None


def load_hub(
    dataset_id: str,
    *,
    split: str | None = None,
    config: str | None = None,
    label: str | None = None,
    prompt_column: str | None = None,
    category_column: str | None = None,
    id_column: str | None = None,
    source: str | None = None,
) -> list[PromptItem]:
    """Load a Hub dataset with ``datasets.load_dataset`` and map its columns to PromptItems.

    ``dataset_id`` is ``ORG/NAME`` (with or without ``hf:``, optionally ``:split`` or
    ``:config:split``). The prompt column is ``prompt_column`` or the first of
    :data:`PROMPT_COLUMNS` present. Rows are labelled by a ``label`` column when it holds
    benign/harmful (or safe/unsafe); otherwise every row gets ``label``, which is then required.
    With several splits and none named, the error lists them.
    """
    repo, cfg, spl = parse_hub_id(dataset_id)
    config = config or cfg
    split = split or spl
    default = label_argument(label)
    shown = HUB_PREFIX + repo + (f":{config}" if config else "")
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - datasets is a dependency
        raise DataError(
            f"cannot load {shown}: the 'datasets' package is not installed; "
            "pass a local file or a named dataset instead"
        ) from exc
    try:
        ds = datasets.load_dataset(repo, config, split=split)
    except Exception as exc:
        from aligntax.data.registry import DATASETS

        raise DataError(
            f"could not load Hub dataset {shown}{f' split {split!r}' if split else ''}: "
            f"{type(exc).__name__}: {exc}. If you are offline or the id is wrong, pass a local file "
            f"(CSV/JSONL with 'prompt' and 'label' columns) or a named dataset "
            f"({', '.join(DATASETS)})"
        ) from exc
    if not hasattr(ds, "column_names") or isinstance(ds.column_names, dict):  # a DatasetDict
        splits = list(ds)
        if len(splits) != 1:
            raise DataError(f"{shown} has splits {', '.join(splits)}; name one, e.g. {shown}:{splits[0]}")
        split = splits[0]
        ds = ds[split]
    name = shown + (f":{split}" if split else "")
    columns = list(ds.column_names)
    rows = [Row(i + 1, f"row {i + 1}", dict(rec)) for i, rec in enumerate(ds)]
    if not rows:
        raise DataError(f"{name}: the dataset has no rows")
    table = Table(name, "hub", columns, rows)
    return map_records(
        table,
        source or name,
        default,
        prompt_columns=(prompt_column,) if prompt_column else PROMPT_COLUMNS,
        category_columns=(category_column,) if category_column else CATEGORY_COLUMNS,
        id_columns=(id_column,) if id_column else ID_COLUMNS,
    )


def map_records(
    table: Table,
    source: str,
    default: Label | None,
    *,
    prompt_columns: Sequence[str] = PROMPT_COLUMNS,
    category_columns: Sequence[str] = CATEGORY_COLUMNS,
    id_columns: Sequence[str] = ID_COLUMNS,
) -> list[PromptItem]:
    """Map loosely shaped records (Hub rows) to PromptItems; see :func:`load_hub`."""
    pcol = table.find_column(prompt_columns)
    if pcol is None:
        raise DataError(
            f"{table.name}: no prompt column; looked for {', '.join(repr(c) for c in prompt_columns)}, "
            f"the dataset has columns: {describe_columns(table.columns)}; pass prompt_column="
        )
    ccol = table.find_column(category_columns)
    icol = table.find_column(id_columns)
    lcol = table.find_column(LABEL_COLUMNS)
    if lcol is not None and not all(normalize_label(r.values.get(lcol)) for r in table.rows):
        lcol = None  # e.g. integer class ids: meaning unknown, so use the label argument
    if lcol is None and default is None:
        raise DataError(
            f"{table.name}: the rows carry no benign/harmful label (columns: "
            f"{describe_columns(table.columns)}); pass label='benign' or label='harmful'"
        )

    def make(row: Row) -> PromptItem:
        lab = normalize_label(row.values.get(lcol)) if lcol else default
        return row_item(table, row, source, lab, pcol, ccol, icol)

    return map_rows(table, make)
