"""``load_prompts``: one entry point for a file, a named dataset or a Hub dataset."""

from __future__ import annotations

import difflib
from collections import Counter
from pathlib import Path

from aligntax.data.base import PromptItem, label_argument
from aligntax.data.formats import load_file
from aligntax.data.hub import HUB_PREFIX, load_hub, looks_like_hub_id
from aligntax.data.registry import DATASETS, find_dataset, load_named
from aligntax.errors import DataError

_HUB_FORMATS = ("hf", "hub")


def load_prompts(
    spec: str | Path,
    limit: int | None = None,
    label: str | None = None,
    fmt: str | None = None,
    default_label: str | None = None,
) -> list[PromptItem]:
    """Load prompts from ``spec``, tried in this order:

    1. ``hf:ORG/NAME[:split]`` (or ``fmt="hf"``): a Hub dataset, see :func:`load_hub`;
    2. a named dataset (:func:`list_datasets`), e.g. ``orbench-hard-test`` (``fmt`` must be unset);
    3. an existing file; its format from the file name or columns, or ``fmt``
       (a key of ``FORMATS``, or csv/jsonl/json/txt for the generic format);
    4. a bare ``ORG/NAME`` that is no local path: a Hub dataset.

    ``label`` ("benign"/"harmful"): rows that carry no label get it (generic files without a
    ``label`` column, text files, Hub datasets); where the source labels its rows, only rows with
    this label are kept (``load_prompts("xstest", label="benign")`` = xstest-safe), and a source
    without any such row is an error. ``limit`` keeps the first ``limit`` rows, in file order,
    after that filter. ``default_label``: the label of a file's rows that carry none, with nothing
    filtered (for a caller that does not use labels, such as generation). Problems raise
    :class:`aligntax.errors.DataError`.
    """
    want = label_argument(label)
    fill = want or label_argument(default_label)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise DataError(f"limit must be a whole number >= 0, got {limit!r}")
    text = str(spec).strip()
    if not text:
        raise DataError("empty dataset spec: give a file path, a named dataset or a Hub id")
    fmt_key = fmt.strip().lower() if fmt else None

    if fmt_key in _HUB_FORMATS or text.startswith(HUB_PREFIX):
        items = load_hub(text, label=want)
    elif isinstance(spec, str) and find_dataset(text) is not None:
        if fmt_key is not None:
            raise DataError(f"{text!r} is a named dataset; its format is fixed, so leave fmt unset")
        items = load_named(text)
    elif Path(text).expanduser().exists():
        items = load_file(Path(text).expanduser(), fmt, fill)
    elif fmt_key is None and looks_like_hub_id(text):
        items = load_hub(text, label=want)
    else:
        raise DataError(not_found_message(text))

    if want is not None:
        kept = [item for item in items if item.label == want]
        if items and not kept:
            counts = Counter(item.label for item in items)
            have = ", ".join(f"{n} {lab}" for lab, n in sorted(counts.items()))
            raise DataError(f"{text}: no rows labelled {want!r} (it has {have})")
        items = kept
    if limit is not None:
        items = items[:limit]
    return items


def _origin(spec: str, fmt: str | None = None) -> tuple[str, str]:
    """(kind, what) a spec reads: ("file", resolved path), ("named", the dataset's file) or ("hub", id)."""
    text = str(spec).strip()
    fmt_key = fmt.strip().lower() if fmt else None
    if fmt_key in _HUB_FORMATS or text.startswith(HUB_PREFIX):
        return "hub", text
    named = find_dataset(text)
    if named is not None:
        return "named", named.package or ("resources/" if named.bundled else "") + named.path
    if Path(text).expanduser().exists():
        return "file", str(Path(text).expanduser().resolve())
    return "hub", text


def load_prompt_sets(
    specs: list[str], limit: int | None = None, label: str | None = None
) -> list[PromptItem]:
    """The items of several datasets (files, names or Hub ids), in order; ``limit`` applies to each.

    Rows are keyed by ``(source, id)`` downstream (resume, reports per dataset), and a file's source is
    its stem, so two different inputs that give the same source would silently merge (or, with equal
    ids, drop each other's rows): that is a :class:`DataError` naming both. Subsets of one named
    dataset (``xstest-safe`` and ``xstest-unsafe``) share their source by design and are fine; the same
    spec given twice is read once."""
    items: list[PromptItem] = []
    by_source: dict[str, tuple[str, tuple[str, str]]] = {}  # source -> (first spec, its origin)
    keys: dict[tuple[str, str], tuple[str, tuple[str, str]]] = {}  # (source, id) -> (spec, origin)
    seen_specs: set[tuple[str, str]] = set()
    for spec in specs:
        origin = _origin(spec)
        if origin in seen_specs and origin[0] != "named":
            continue  # the same file given twice
        seen_specs.add(origin)
        loaded = load_prompts(spec, limit=limit, label=label)
        for source in dict.fromkeys(it.source for it in loaded):
            first = by_source.get(source)
            if first is None:
                by_source[source] = (str(spec), origin)
                continue
            other, other_origin = first
            if other_origin == origin or (other_origin[0] == "named" and origin[0] == "named"):
                continue  # subsets of one dataset, or named datasets that share a source by design
            raise DataError(
                f"{other} and {spec} both give rows the source {source!r} (a file's source is its name without "
                "the extension), so their rows would be mixed in the results and rows with equal ids "
                "dropped as duplicates. Rename one of the files, or merge them into one."
            )
        for it in loaded:
            key = (it.source, it.id)
            if key in keys and keys[key][1] != origin:  # the same row of one file (two subsets) is fine
                raise DataError(
                    f"{keys[key][0]} and {spec} both hold the row {it.source}/{it.id}; only one of "
                    "them would be used. Give each input distinct ids or sources."
                )
            keys.setdefault(key, (str(spec), origin))
        items.extend(loaded)
    return items


def not_found_message(text: str) -> str:
    path_like = any(sep in text for sep in ("/", "\\")) or Path(text).suffix != ""
    if path_like:
        return f"{text}: file not found"
    close = difflib.get_close_matches(text.lower(), list(DATASETS), n=3, cutoff=0.6)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    return (
        f"unknown dataset {text!r}: no such file, named dataset or Hub id (hf:ORG/NAME).{hint} "
        f"Named datasets: {', '.join(DATASETS)}"
    )
