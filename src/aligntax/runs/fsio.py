"""Crash-safe files of run folders: atomic JSON writes and a lock per run folder.

``write_json_atomic(path, obj)`` writes a temporary file in the same folder, fsyncs it and
``os.replace`` s it over ``path`` (then fsyncs the folder), so a reader sees the old file or the new
one, never a torn one, whatever the moment a crash (or a kill) hits.

``run_lock(folder)`` makes one process the only writer of a run folder: it creates ``folder/.aligntax.lock``
exclusively (``O_CREAT | O_EXCL``) holding the owner's pid and host; a second writer is refused with a
:class:`RunLockedError` naming the owner. A lock whose process is no longer alive (same host) is stale:
it is taken over. The lock is removed on leaving the ``with`` block.

A kill between the temp write and the rename leaves a ``.NAME.PID.XXXXXXXX.tmp`` file behind. Such stale
temp files (their writer's process is gone) are removed on the next write to the folder and when the
folder's lock is taken (:func:`clean_stale_temps`); a write in progress in a live process is never
touched.
"""

from __future__ import annotations

import json
import os
import re
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from aligntax.errors import AligntaxError

LOCK_NAME = ".aligntax.lock"
# temp names: ".NAME.PID.XXXXXXXX.tmp" (tempfile.mkstemp with the writer's pid in the prefix); names
# without the pid (".NAME.XXXXXXXX.tmp") come from earlier versions
_TEMP_RE = re.compile(r"^\..+?(?:\.(?P<pid>\d+))?\.[A-Za-z0-9_]{8}\.tmp$")
STALE_TEMP_S = 60.0


class RunLockedError(AligntaxError):
    """Another live process is writing to the run folder."""


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _temp_is_stale(entry: os.DirEntry, now: float, locked: bool) -> bool:
    m = _TEMP_RE.match(entry.name)
    if m is None:
        return False
    if m.group("pid") is not None:  # ours: written by that process, stale once it is gone
        pid = int(m.group("pid"))
        return pid != os.getpid() and not pid_alive(pid)
    # an older name without the writer's pid: only the lock holder, or age, tells
    return locked or now - entry.stat(follow_symlinks=False).st_mtime > STALE_TEMP_S


def clean_stale_temps(folder: str | Path, locked: bool = False) -> list[Path]:
    """Remove the temp files (``.NAME.PID.XXXXXXXX.tmp``) that writes killed before their rename left in
    ``folder``: those of processes no longer running (and, for temp names without a pid, those older
    than ``STALE_TEMP_S``, or all of them when the caller holds the folder's lock, ``locked``).
    Returns the removed paths; errors are ignored (another cleaner may be at work)."""
    removed = []
    now = time.time()
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        try:
            if entry.is_file(follow_symlinks=False) and _temp_is_stale(entry, now, locked):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
        except OSError:
            continue
    return removed


def write_text_atomic(path: str | Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically (temp file in the same folder, fsync, os.replace).
    Stale temp files of earlier killed writes in the folder are removed first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)


def write_json_atomic(
    path: str | Path, obj, *, indent: int | None = 2, default=None, ensure_ascii: bool = True
) -> None:
    """``json.dumps(obj)`` written to ``path`` atomically (see :func:`write_text_atomic`). The JSON is
    built first, so an object that cannot be serialised leaves the old file untouched."""
    write_text_atomic(path, json.dumps(obj, indent=indent, default=default, ensure_ascii=ensure_ascii) + "\n")


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    except OSError:  # pragma: no cover
        return False
    return True


def _read_lock(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # unreadable or half-written


def _stale(info: dict, path: Path) -> bool:
    pid, host = info.get("pid"), info.get("host")
    if not isinstance(pid, int):
        # a lock being written this very moment looks empty: stale only once it is old
        try:
            return time.time() - path.stat().st_mtime > 10
        except FileNotFoundError:
            return True
    if host not in (None, socket.gethostname()):
        return False  # another machine's process: cannot tell, keep it
    return not pid_alive(pid)


@contextmanager
def _guard(folder: Path) -> Iterator[None]:
    """An exclusive flock on ``folder/.aligntax.lock.guard`` (POSIX; elsewhere nothing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover
        yield
        return
    fd = os.open(folder / f"{LOCK_NAME}.guard", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@contextmanager
def run_lock(folder: str | Path) -> Iterator[Path]:
    """Hold the lock of run folder ``folder`` for the ``with`` block (creating the folder).

    Raises :class:`RunLockedError` when another live process (or another ``run_lock`` of this
    process) holds it; a stale lock of a dead process is taken over."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    token = f"{os.getpid()}-{time.time_ns()}"
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "token": token,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    for _ in range(5):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            held = _read_lock(path)
            if held is None:
                continue  # released meanwhile: try again
            if not _stale(held, path):
                who = f"pid {held.get('pid')}" + (f" on {held['host']}" if held.get("host") else "")
                since = f", since {held['started']}" if held.get("started") else ""
                raise RunLockedError(
                    f"{folder} is in use by another aligntax run ({who}{since}). Wait for it to finish or "
                    f"use another --out. If no such process is running, delete {path}."
                ) from None
            # stale: remove it, checking again under a guard so that two takers cannot both win
            with _guard(folder):
                if _read_lock(path) == held:
                    try:
                        path.unlink()
                    except FileNotFoundError:
                        pass
            continue
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(info, fh)
            fh.flush()
            os.fsync(fh.fileno())
        break
    else:  # pragma: no cover - a lock that keeps coming back
        raise RunLockedError(f"Could not take the lock {path}; another process keeps taking it.")
    clean_stale_temps(folder, locked=True)  # the only writer now
    try:
        yield path
    finally:
        held = _read_lock(path)
        if held and held.get("token") == token:
            try:
                path.unlink()
            except FileNotFoundError:  # pragma: no cover
                pass
