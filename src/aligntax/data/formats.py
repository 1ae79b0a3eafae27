"""Loaders for the native formats of the refusal benchmarks, plus a generic prompt/label format.

Each ``load_*`` function reads one file and returns :class:`PromptItem` s. :func:`load_file` picks
the format from the file name (the upstream names, e.g. ``xstest_prompts.csv``), else from the
columns, else from an explicit ``fmt``; :data:`FORMATS` lists the format names.

IDs: a benchmark's own id is used where it has one (``xstest:1``,
``harmbench-test:parathion_synthesis_instructions``); otherwise ``{source}:{row}`` with the 0-based
row number in the file, counted before any filtering, so a row keeps its id in every subset.
A generic file's ``id`` column is used verbatim.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from aligntax.data._io import Row, Table, describe_columns, read_table
from aligntax.data.base import Label, PromptItem, label_argument, normalize_label
from aligntax.data.catalog import source_for_filename
from aligntax.errors import DataError

Mapper = Callable[[Table, str, "Label | None"], list[PromptItem]]


@dataclass(frozen=True)
class Format:
    name: str
    description: str
    mapper: Mapper


# --------------------------------------------------------------------------- cell helpers


def _cell_text(table: Table, row: Row, col: str | None, what: str) -> str:
    if col is None:
        return ""
    value = row.values.get(col)
    if value is None:
        return ""
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    raise DataError(
        f"{table.name}, {row.where}: the {what} in column {col!r} is a {type(value).__name__}, not text"
    )


def _prompt(table: Table, row: Row, col: str) -> str:
    text = _cell_text(table, row, col, "prompt")
    if not text:
        raise DataError(f"{table.name}, {row.where}: empty prompt text in column {col!r}")
    return text


def _category(table: Table, row: Row, col: str | None) -> str | None:
    return _cell_text(table, row, col, "category") or None


def _label_cell(table: Table, row: Row, col: str, default: Label | None, expected: str) -> Label:
    raw = row.values.get(col)
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        if default is not None:
            return default
        raise DataError(f"{table.name}, {row.where}: empty label in column {col!r}; expected {expected}")
    label = normalize_label(raw)
    if label is None:
        raise DataError(
            f"{table.name}, {row.where}: unknown label value {raw!r} in column {col!r}; expected {expected}"
        )
    return label


def _need_label(table: Table, fmt: str, label: Label | None) -> Label:
    if label is None:
        raise DataError(
            f"{table.name}: the rows carry no label (no 'label' column; columns: "
            f"{describe_columns(table.columns)}) and the {fmt!r} format does not imply one; "
            f"add a 'label' column with benign/harmful or pass label='benign' or label='harmful'"
        )
    return label


def _finish(table: Table, items: list[tuple[Row, PromptItem]]) -> list[PromptItem]:
    seen: dict[str, str] = {}
    for row, item in items:
        if item.id in seen:
            raise DataError(
                f"{table.name}, {row.where}: duplicate id {item.id!r} (already used at {seen[item.id]})"
            )
        seen[item.id] = row.where
    return [item for _, item in items]


def _row_id(source: str, row: Row, upstream: str = "") -> str:
    return f"{source}:{upstream}" if upstream else f"{source}:{row.num - 1}"


def row_item(
    table: Table,
    row: Row,
    source: str,
    label: Label,
    pcol: str,
    ccol: str | None = None,
    icol: str | None = None,
    *,
    category: str | None = None,
    verbatim_id: bool = False,
) -> PromptItem:
    """One row as a PromptItem: the id from ``icol`` (``{source}:{id}``, or the cell itself with
    ``verbatim_id``; ``{source}:{row}`` where there is none), the prompt from ``pcol``, the category
    from ``ccol`` (or ``category`` when there is no category column)."""
    upstream = _cell_text(table, row, icol, "id")
    item_id = upstream if verbatim_id and upstream else _row_id(source, row, upstream)
    prompt = _prompt(table, row, pcol)
    if ccol is not None:
        category = _category(table, row, ccol)
    return PromptItem(item_id, prompt, label, source, category)


def map_rows(table: Table, make: Callable[[Row], PromptItem | None]) -> list[PromptItem]:
    """``make`` applied to every row (``None``: the row is left out), with ids checked for duplicates."""
    return _finish(table, [(row, item) for row in table.rows if (item := make(row)) is not None])


# --------------------------------------------------------------------------- mappers


def _fixed(
    fmt: str,
    prompt_cols: Sequence[str],
    label: Label | None,
    category_cols: Sequence[str] = ("category",),
    id_cols: Sequence[str] = (),
) -> Mapper:
    """A format whose every row has the same label (``None``: the caller's label)."""

    def mapper(table: Table, source: str, default: Label | None) -> list[PromptItem]:
        lab = label or _need_label(table, fmt, default)
        pcol = table.require_column(prompt_cols, fmt)
        ccol = table.find_column(category_cols) if category_cols else None
        icol = table.find_column(id_cols) if id_cols else None
        return map_rows(table, lambda row: row_item(table, row, source, lab, pcol, ccol, icol))

    return mapper


def _fixed_format(
    name: str,
    description: str,
    prompt_cols: Sequence[str],
    label: Label | None,
    category_cols: Sequence[str] = ("category",),
    id_cols: Sequence[str] = (),
) -> Format:
    """The :class:`Format` ``name`` with a :func:`_fixed` mapper."""
    return Format(name, description, _fixed(name, prompt_cols, label, category_cols, id_cols))


def _map_generic(table: Table, source: str, default: Label | None) -> list[PromptItem]:
    pcol = table.require_column(("prompt", "instruction"), "generic")
    lcol = table.find_column(("label",))
    ccol = table.find_column(("category",))
    icol = table.find_column(("id",))
    if lcol is None:
        default = _need_label(table, "generic", default)

    def make(row: Row) -> PromptItem:
        lab = _label_cell(table, row, lcol, default, "'benign' or 'harmful'") if lcol else default
        return row_item(table, row, source, lab, pcol, ccol, icol, verbatim_id=True)

    return map_rows(table, make)


def _map_xstest(table: Table, source: str, default: Label | None) -> list[PromptItem]:
    pcol = table.require_column(("prompt",), "xstest")
    tcol = table.find_column(("type",))
    lcol = table.find_column(("label",))
    icol = table.find_column(("id",))
    if lcol is None and tcol is None:
        table.require_column(("label", "type"), "xstest")

    def make(row: Row) -> PromptItem:
        kind = _cell_text(table, row, tcol, "type") or None
        if lcol is not None:
            lab = _label_cell(table, row, lcol, None, "'safe' or 'unsafe'")
        elif kind is None:
            raise DataError(f"{table.name}, {row.where}: empty 'type' and no 'label' column")
        else:  # the completions files have no label; unsafe types start with contrast_
            lab = "harmful" if kind.startswith("contrast_") else "benign"
        return row_item(table, row, source, lab, pcol, None, icol, category=kind)

    return map_rows(table, make)


def _harmbench(standard_only: bool) -> Mapper:
    def mapper(table: Table, source: str, default: Label | None) -> list[PromptItem]:
        fmt = "harmbench-standard" if standard_only else "harmbench"
        pcol = table.require_column(("Behavior",), fmt)
        fcol = table.require_column(("FunctionalCategory",), fmt) if standard_only else None
        fcol = fcol or table.find_column(("FunctionalCategory",))
        scol = table.find_column(("SemanticCategory", "category"))
        ctx = table.find_column(("ContextString",))
        icol = table.find_column(("BehaviorID",))

        def make(row: Row) -> PromptItem | None:
            functional = _cell_text(table, row, fcol, "FunctionalCategory")
            if standard_only and functional != "standard":
                return None
            prompt = _prompt(table, row, pcol)
            context = _cell_text(table, row, ctx, "ContextString")
            if context:  # HarmBench's own layout for contextual behaviours
                prompt = f"{context}\n\n---\n\n{prompt}"
            item_id = _row_id(source, row, _cell_text(table, row, icol, "id"))
            category = _category(table, row, scol) or functional or None
            return PromptItem(item_id, prompt, "harmful", source, category)

        return map_rows(table, make)

    return mapper


def _instruction_label(table: Table) -> Label | None:
    name = Path(table.name).name.lower()
    if re.match(r"^(harmful|dan_unsafe|wildguard|or[-_]bench[-_]toxic)", name):
        return "harmful"
    if re.match(r"^(harmless|dan_safe|or[-_]bench[-_]hard)", name):
        return "benign"
    return None


def _map_jbb_artifact(table: Table, source: str, default: Label | None) -> list[PromptItem]:
    """A JailbreakBench artifact (``{"parameters": ..., "jailbreaks": [...]}``): one harmful item per
    behaviour the attack made a prompt for (``prompt`` null: the attack found none; left out), the id
    the behaviour's ``index`` (the same index in every attack's file), the category JBB's."""
    pcol = table.require_column(("prompt",), "jbb-artifact")
    icol = table.require_column(("index",), "jbb-artifact")
    ccol = table.find_column(("category",))

    def make(row: Row) -> PromptItem | None:
        if row.values.get(pcol) is None:
            return None
        return row_item(table, row, source, "harmful", pcol, ccol, icol)

    return map_rows(table, make)


def _map_gsm8k(table: Table, source: str, default: Label | None) -> list[PromptItem]:
    """GSM8K (``question``, ``answer`` ending in ``#### N``): the question as a benign prompt."""
    pcol = table.require_column(("question",), "gsm8k")
    return map_rows(table, lambda row: row_item(table, row, source, "benign", pcol))


def _map_instruction(table: Table, source: str, default: Label | None) -> list[PromptItem]:
    label = default or _instruction_label(table)
    return _fixed("instruction-json", ("instruction",), label)(table, source, label)


def _map_lines(table: Table, source: str, default: Label | None) -> list[PromptItem]:
    return _fixed("lines", ("prompt",), None, ())(table, source, default)


FORMATS: dict[str, Format] = {
    f.name: f
    for f in [
        Format(
            "generic",
            "CSV/TSV/JSON/JSONL with 'prompt' and 'label' (benign/harmful), optional 'id', 'category'",
            _map_generic,
        ),
        _fixed_format(
            "orbench-hard-1k", "OR-Bench-Hard-1K CSV: prompt, category (benign)", ("prompt",), "benign"
        ),
        _fixed_format(
            "orbench-hard-split",
            "or_bench_hard_{train,val,test}.json: instruction, category (benign)",
            ("instruction",),
            "benign",
        ),
        _fixed_format(
            "orbench-toxic",
            "or-bench-toxic-harmful.json: instruction, category (harmful)",
            ("instruction",),
            "harmful",
        ),
        Format(
            "xstest",
            "XSTest CSV: id, prompt, type, label safe/unsafe (or completions CSV: label from type)",
            _map_xstest,
        ),
        _fixed_format("advbench", "AdvBench CSV: goal, target (harmful)", ("goal",), "harmful", ()),
        _fixed_format(
            "jailbreakbench",
            "JBB-Behaviors CSV: Goal, Category, ... (harmful)",
            ("Goal",),
            "harmful",
            ("Category",),
            ("", "Index"),
        ),
        Format(
            "harmbench", "HarmBench behaviours CSV, all functional categories (harmful)", _harmbench(False)
        ),
        Format(
            "harmbench-standard",
            "HarmBench behaviours CSV, FunctionalCategory == 'standard' only",
            _harmbench(True),
        ),
        _fixed_format(
            "strongreject",
            "StrongREJECT CSV: category, source, forbidden_prompt (harmful)",
            ("forbidden_prompt",),
            "harmful",
        ),
        _fixed_format("oktest", "OKTest CSV: prompt (benign)", ("prompt",), "benign", ()),
        _fixed_format(
            "maliciousinstruct",
            "MaliciousInstruct.txt: one prompt a line (harmful)",
            ("prompt",),
            "harmful",
            (),
        ),
        _fixed_format(
            "harmful-json",
            "harmful_{train,val,test}.json: instruction, category (harmful)",
            ("instruction",),
            "harmful",
        ),
        _fixed_format(
            "harmless-json",
            "harmless_{train,val}.json: instruction, category (benign)",
            ("instruction",),
            "benign",
        ),
        _fixed_format(
            "wildguard-adv",
            "wildguard_test_adv.json: instruction, category (harmful)",
            ("instruction",),
            "harmful",
        ),
        _fixed_format(
            "dan-safe", "DAN_safe.json: instruction, category (benign)", ("instruction",), "benign"
        ),
        _fixed_format(
            "dan-unsafe", "DAN_unsafe.json: instruction, category (harmful)", ("instruction",), "harmful"
        ),
        Format(
            "instruction-json",
            "JSON records with instruction, category; label from the file name or the label argument",
            _map_instruction,
        ),
        Format("lines", "plain text, one prompt a line; label from the label argument", _map_lines),
        Format(
            "jbb-artifact",
            "JailbreakBench attack artifact JSON: jailbreaks[] with index, goal, category, prompt (harmful; "
            "rows without a prompt left out)",
            _map_jbb_artifact,
        ),
        Format("gsm8k", "GSM8K JSONL: question, answer (benign)", _map_gsm8k),
    ]
}

# Other names accepted for ``fmt``.
FORMAT_ALIASES = {
    "csv": "generic",
    "tsv": "generic",
    "json": "generic",
    "jsonl": "generic",
    "txt": "lines",
    "orbench": "orbench-hard-1k",
    "jbb": "jailbreakbench",
    "harmful": "harmful-json",
    "harmless": "harmless-json",
    "wildguard": "wildguard-adv",
}

# Upstream file names (lower-case) -> format. Checked in order; the first match wins.
_NAME_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"^or[-_]bench[-_]hard[-_]1k.*\.csv$"), "orbench-hard-1k"),
    (re.compile(r"^or[-_]bench[-_]hard[-_](train|val|validation|test)\.json$"), "orbench-hard-split"),
    (re.compile(r"^or[-_]bench[-_]toxic.*\.json$"), "orbench-toxic"),
    (re.compile(r"^xstest.*\.csv$"), "xstest"),
    (re.compile(r"^(advbench|harmful_behaviors).*\.csv$"), "advbench"),
    (re.compile(r"^(jailbreakbench|jbb).*\.csv$"), "jailbreakbench"),
    (re.compile(r"^harmbench.*\.csv$"), "harmbench"),
    (re.compile(r"^strong_?reject.*\.csv$"), "strongreject"),
    (re.compile(r"^oktest.*\.csv$"), "oktest"),
    (re.compile(r"^maliciousinstruct.*\.txt$"), "maliciousinstruct"),
    (re.compile(r"^harmful_(train|val|test)\.json$"), "harmful-json"),
    (re.compile(r"^harmless_(train|val|test)\.json$"), "harmless-json"),
    (re.compile(r"^wildguard.*\.json$"), "wildguard-adv"),
    (re.compile(r"^dan_safe.*\.json$"), "dan-safe"),
    (re.compile(r"^dan_unsafe.*\.json$"), "dan-unsafe"),
]


def normalize_format(fmt: str) -> str:
    key = fmt.strip().lower()
    key = FORMAT_ALIASES.get(key, key)
    if key not in FORMATS:
        known = ", ".join(sorted(FORMATS))
        raise DataError(f"unknown format {fmt!r}; known formats: {known}")
    return key


def detect_format(path: str | Path, table: Table | None = None) -> str:
    """The format of ``path``: from its (upstream) file name, else from its columns."""
    path = Path(path)
    name = path.name.lower()
    for pattern, fmt in _NAME_PATTERNS:
        if pattern.match(name):
            return fmt
    table = table if table is not None else read_table(path)
    if table.kind == "txt":
        return "lines"
    lower = {c.lower() for c in table.columns}
    if {"prompt", "type", "focus"} <= lower:
        return "xstest"
    if "label" in lower and lower & {"prompt", "instruction"}:
        return "generic"
    if {"behavior", "functionalcategory"} <= lower:
        return "harmbench"
    if "goal" in lower:
        return "jailbreakbench" if "category" in lower else "advbench"
    if "forbidden_prompt" in lower:
        return "strongreject"
    if lower & {"prompt", "instruction"}:
        return "generic"
    raise DataError(
        f"{path}: cannot tell the format from the file name or the columns "
        f"({describe_columns(table.columns)}); expected a 'prompt' (and 'label') column, "
        f"or pass fmt= one of {', '.join(sorted(FORMATS))}"
    )


def default_source(path: str | Path) -> str:
    """The ``source`` for a file: the dataset name for an upstream file name, else the file stem."""
    path = Path(path)
    known = source_for_filename(path.name)
    if known:
        return known
    return re.sub(r"[^a-z0-9]+", "-", path.stem.lower()).strip("-") or "file"


def load_file(
    path: str | Path,
    fmt: str | None = None,
    label: str | None = None,
    *,
    source: str | None = None,
    split: str | None = None,
) -> list[PromptItem]:
    """Load every row of ``path``. ``label`` labels rows that carry none (generic without a label
    column, plain text, unknown instruction JSON); it does not relabel rows that have one. ``split``
    keeps only the rows whose ``split`` column holds it (rows keep the ids they have in the whole file)."""
    path = Path(path)
    default = label_argument(label)
    key = normalize_format(fmt) if fmt else None
    table = read_table(path)
    key = key or detect_format(path, table)
    if split is not None:
        col = table.find_column(("split",))
        if col is None:
            raise DataError(
                f"{table.name}: no 'split' column (columns: {describe_columns(table.columns)}), "
                f"so the split {split!r} cannot be selected"
            )
        table.rows = [row for row in table.rows if _cell_text(table, row, col, "split") == split]
    return FORMATS[key].mapper(table, source or default_source(path), default)


# --------------------------------------------------------------------------- per-format loaders


def load_generic(
    path: str | Path, label: str | None = None, *, source: str | None = None
) -> list[PromptItem]:
    """CSV/TSV/JSON/JSONL with ``prompt`` and ``label`` (benign/harmful; also safe/unsafe) columns,
    optional ``id`` and ``category``. ``label`` fills rows (or files) without one."""
    return load_file(path, "generic", label, source=source)


def load_orbench(path: str | Path, *, source: str | None = None) -> list[PromptItem]:
    """OR-Bench-Hard (benign): the 1k CSV (prompt, category) or a split JSON (instruction, category)."""
    fmt = "orbench-hard-split" if Path(path).suffix.lower() == ".json" else "orbench-hard-1k"
    return load_file(path, fmt, source=source)


class FileLoader(Protocol):
    """A ``load_*`` function of one fixed format."""

    def __call__(self, path: str | Path, *, source: str | None = None) -> list[PromptItem]: ...


def _loader(fmt: str, doc: str) -> FileLoader:
    """``load_<fmt>(path, *, source=None)``: :func:`load_file` with the format fixed to ``fmt``."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}")

    def load(path: str | Path, *, source: str | None = None) -> list[PromptItem]:
        return load_file(path, fmt, source=source)

    load.__name__ = load.__qualname__ = "load_" + fmt.replace("-", "_")
    load.__doc__ = doc
    return load


load_orbench_toxic = _loader("orbench-toxic", "OR-Bench toxic prompts (harmful): instruction, category.")
load_xstest = _loader("xstest", "XSTest prompts: safe -> benign, unsafe -> harmful; category = ``type``.")
load_advbench = _loader("advbench", "AdvBench harmful behaviours (``goal``).")
load_jailbreakbench = _loader("jailbreakbench", "JBB-Behaviors (``Goal``, ``Category``), harmful.")
load_strongreject = _loader("strongreject", "StrongREJECT (``forbidden_prompt``, ``category``), harmful.")
load_oktest = _loader("oktest", "OKTest (``prompt``), benign.")
load_maliciousinstruct = _loader("maliciousinstruct", "MaliciousInstruct: one harmful prompt a line.")


def load_harmbench(
    path: str | Path, *, standard_only: bool = False, source: str | None = None
) -> list[PromptItem]:
    """HarmBench text behaviours, harmful; category = SemanticCategory. ``standard_only`` keeps
    FunctionalCategory == "standard". Contextual behaviours get their context in front."""
    return load_file(path, "harmbench-standard" if standard_only else "harmbench", source=source)


def load_instruction_json(
    path: str | Path, label: str | None = None, *, source: str | None = None
) -> list[PromptItem]:
    """JSON records with ``instruction`` and ``category`` (harmful_*/harmless_*, wildguard_test_adv,
    DAN_safe/DAN_unsafe, the OR-Bench splits). The label comes from ``label`` or else the upstream
    file name (harmful_*, DAN_unsafe, wildguard*, or-bench-toxic: harmful; harmless_*, DAN_safe,
    or_bench_hard*: benign)."""
    return load_file(path, "instruction-json", label, source=source)
