"""The run-folder contract: what every pipeline that writes a folder keeps, in one implementation.

A run folder (``aligntax eval --out``, ``knowns``, ``mc``, ``els train`` / ``sweep`` / ``distill``,
``vat run`` / ``matrix`` / ``sweep``, the demo) can be killed at any moment (``kill -9``, a full disk, a
power cut) and rerun with the same command to the same final files. Five rules make it so:

1. **One writer.** :func:`run_lock` creates ``FOLDER/.aligntax.lock`` exclusively (pid, host, start
   time); a second writer is refused with a :class:`RunLockedError` naming the owner, and the lock of a
   process that is gone (same host) is taken over.
2. **A settings header**, written at the start (:func:`check_settings`: ``config.json``, ``run.json``,
   ...), and diffed on a resume: a setting that changes a result refuses the resume with one
   :class:`SettingsChanged` line naming every key that differs (``key: old -> new``). Paths that moved
   with the folder (a run folder copied or moved elsewhere, its sibling folders with it) are the same
   setting (:func:`settings_diffs`).
3. **A resume key** that holds everything a result depends on: the model's fingerprint, the dtype, the
   judge and its version (weights hash, settings), the intervention's configuration (and its folder's
   content), the decoding settings and a digest of the data (:func:`digest`). Part of it is known only
   after loading (the fingerprint, the judge): that part is checked when it is known, before anything
   is written with it.
4. **Atomic writes**: every file but an append-only one is written to a temp file in the same folder,
   fsynced, and renamed over the old one (:func:`write_text_atomic`, :func:`write_json_atomic`,
   :func:`write_jsonl_atomic`, and :func:`atomic_file` for libraries that write a path themselves:
   safetensors, matplotlib). A reader sees the old file or the new one, never a torn one.
5. **Append-only samples**: rows are appended and fsynced batch by batch (:func:`append_jsonl`); a torn
   last line (the kill hit mid-append) is dropped on read (:func:`read_jsonl`), and truncated away by the
   writer that resumes.

A write that fails for lack of space (ENOSPC, EDQUOT) or on a read-only or forbidden folder raises a
:class:`WriteError`, one line naming the file and what to do; nothing half-written stays behind (the
temp file is removed, a partial append is cut back), so the same command resumes once space is freed.
:func:`check_writable` refuses a read-only ``--out`` before any model loads.

Every write passes through :func:`_point` (a no-op unless a test sets :data:`write_hook`): the kill
harness of the tests (``tests/killharness.py``) kills the process at write points drawn at random.
A resumed run's files equal an uninterrupted run's except for :data:`VOLATILE_FIELDS` (JSON keys of wall
times, counts of what this invocation did, start times, file modification times) and
:data:`VOLATILE_FILES`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import socket
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from aligntax.errors import AligntaxError, DataError

LOCK_NAME = ".aligntax.lock"
# temp names: ".NAME.PID.XXXXXXXX.tmp" (tempfile.mkstemp with the writer's pid in the prefix); names
# without the pid (".NAME.XXXXXXXX.tmp") come from earlier versions
_TEMP_RE = re.compile(r"^\..+?(?:\.(?P<pid>\d+))?\.[A-Za-z0-9_]{8}\.tmp$")
STALE_TEMP_S = 60.0
# The hidden file in which a run folder records where it was when its header was last written (to
# recognise paths that moved with it); hidden, so bundles and folder digests leave it out.
WHERE_NAME = ".aligntax-where.json"

# JSON keys whose values may differ between a run that was killed and resumed and one that was not:
# wall times and throughput, what one invocation did (new / resumed / reused counts), start times, file
# modification times in folder digests, where the folder was. Anything else must be equal.
VOLATILE_FIELDS = frozenset(
    {
        "timing",  # eval / knowns / vat: wall and generation seconds, new vs resumed samples
        "seconds",  # mc, vat sweep rows, ELS sweep rows: wall seconds
        "wall_seconds",
        "minutes",  # the demo's stage clock
        "estimates",
        "calibration_seconds",
        "started",  # settings headers and locks: when a run started
        "mtime_ns",  # folder digests: modification times of the files
        "step_seconds",  # ELS training: wall seconds per step
        "phase_seconds",  # ELS distillation: wall seconds per phase
    }
)
# Files that may differ: the flock file that guards a stale lock's takeover (left by a resumed run only),
# where the folder was, and the demo's stage clock (wall minutes per stage, its estimates).
VOLATILE_FILES = frozenset({f"{LOCK_NAME}.guard", WHERE_NAME, "timing.json"})


class RunLockedError(AligntaxError):
    """Another live process is writing to the run folder."""


class SettingsChanged(AligntaxError):
    """A resume with settings (or a resume key) other than those the folder's results were made with."""


class WriteError(AligntaxError):
    """A write failed for lack of space or permission; nothing half-written was kept."""


# ----------------------------------------------------------------------------------- write points
# A test-only hook called at every write point as ``hook(kind, path, phase)``: kind "replace" (an atomic
# write; phases "begin", "partial" = the temp file half-written, "temp" = the temp file complete and
# fsynced, before the rename), "append" (phases "begin", "partial" = half of the bytes appended) or "lock"
# (phase "held": the lock file written). The kill harness kills the process in it; fault tests raise.
write_hook: Callable[[str, Path, str], None] | None = None


def _point(kind: str, path: Path, phase: str) -> None:
    if write_hook is not None:
        write_hook(kind, Path(path), phase)


_NO_SPACE = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
_NO_WRITE = {errno.EROFS, errno.EACCES, errno.EPERM}


def write_error(path: str | Path, exc: OSError) -> WriteError | None:
    """The one-line :class:`WriteError` for an OSError of a write to ``path`` (no space, read-only
    file system, no permission); None for any other error."""
    if exc.errno in _NO_SPACE:
        return WriteError(
            f"Cannot write {path}: no space left on device. Nothing half-written was kept; free some space "
            "and rerun the same command to resume."
        )
    if exc.errno in _NO_WRITE:
        why = "the file system is read-only" if exc.errno == errno.EROFS else "permission denied"
        return WriteError(
            f"Cannot write {path}: {why}. Give an output folder that can be written, or fix its permissions."
        )
    return None


@contextlib.contextmanager
def _translated(path: Path) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        err = write_error(path, exc)
        if err is None:
            raise
        raise err from exc


# ----------------------------------------------------------------------------------- atomic writes
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


def _temp_is_stale(entry: os.DirEntry, now: float, locked: bool) -> bool:
    m = _TEMP_RE.match(entry.name)
    if m is None:
        return False
    if m.group("pid") is not None:  # ours: written by that process, stale once it is gone
        pid = int(m.group("pid"))
        return pid != os.getpid() and not pid_alive(pid)
    # an older name without the writer's pid: only the lock holder, or age, tells
    return locked or now - entry.stat(follow_symlinks=False).st_mtime > STALE_TEMP_S


def is_temp(name: str) -> bool:
    """Whether ``name`` is the temp file of an atomic write (``.NAME.PID.XXXXXXXX.tmp``)."""
    return _TEMP_RE.match(name) is not None


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


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """A temp path beside ``path`` for a writer that opens the path itself (``save_file``, ``savefig``):
    on leaving the block the temp file is fsynced and renamed over ``path``; on an error it is removed
    (a full disk or a read-only folder raise :class:`WriteError`). Stale temp files of earlier killed
    writes in the folder are removed first."""
    path = Path(path)
    with _translated(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        clean_stale_temps(path.parent)
        _point("replace", path, "begin")
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        tmp = Path(name)
        try:
            yield tmp
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            _point("replace", path, "temp")
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        _fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_files(folder: str | Path) -> Iterator[Path]:
    """A temp folder inside ``folder`` for a writer that saves several files at once
    (``save_pretrained``): on leaving the block each file is fsynced and renamed into ``folder`` (a
    reader sees each file old or new, never torn), and the temp folder removed; on an error it is
    removed. Temp folders of earlier killed saves (``.save.PID.*`` of processes no longer running) are
    removed first."""
    import shutil

    folder = Path(folder)
    with _translated(folder):
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob(".save.*"):
            pid = old.name.split(".")[2] if old.name.count(".") >= 3 else ""
            if old.is_dir() and pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
                shutil.rmtree(old, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".save.{os.getpid()}.", dir=folder))
        try:
            yield tmp
            for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                target = folder / path.relative_to(tmp)
                target.parent.mkdir(parents=True, exist_ok=True)
                _point("replace", target, "temp")
                os.replace(path, target)
            _fsync_dir(folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (temp file in the same folder, fsync, rename)."""
    path = Path(path)
    with atomic_file(path) as tmp, open(tmp, "wb") as fh:
        if write_hook is not None and len(data) > 1:  # a write point with the temp file half-written
            half = len(data) // 2
            fh.write(data[:half])
            fh.flush()
            _point("replace", path, "partial")
            data = data[half:]
        fh.write(data)
        fh.flush()


def write_text_atomic(path: str | Path, text: str) -> None:
    """Replace ``path`` with ``text`` (UTF-8) atomically: see :func:`write_bytes_atomic`."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(
    path: str | Path, obj, *, indent: int | None = 2, default=None, ensure_ascii: bool = True
) -> None:
    """``json.dumps(obj)`` written to ``path`` atomically (see :func:`write_bytes_atomic`). The JSON is
    built first, so an object that cannot be serialised leaves the old file untouched."""
    write_text_atomic(path, json.dumps(obj, indent=indent, default=default, ensure_ascii=ensure_ascii) + "\n")


def save_figure(fig, path: str | Path, **kwargs) -> None:
    """``fig.savefig`` to ``path`` atomically (the format from the path's suffix)."""
    path = Path(path)
    with atomic_file(path) as tmp:
        fig.savefig(tmp, format=path.suffix.lstrip(".") or "png", **kwargs)


def _jsonl_bytes(rows: Iterable[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")


def write_jsonl_atomic(path: str | Path, rows: Iterable[dict]) -> None:
    """Replace a JSONL file with ``rows`` atomically (a rewrite in a new order, or with fixed rows)."""
    write_bytes_atomic(path, _jsonl_bytes(rows))


# ----------------------------------------------------------------------------------- append-only JSONL
def read_jsonl(path: str | Path, repair: bool = False) -> list[dict]:
    """Read a JSONL file (``[]`` when absent). A torn last line (a crash mid-append) is dropped, and
    with ``repair`` the file is cut back to its last complete line; a bad line elsewhere is a
    :class:`~aligntax.errors.DataError` naming the line."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    complete, _, tail = raw.rpartition(b"\n")
    rows = []
    for i, line in enumerate(complete.split(b"\n") if complete else [], start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError as exc:  # not JSON, or not UTF-8
            raise DataError(f"{path}: line {i} is not valid JSON ({getattr(exc, 'msg', exc)})") from exc
    if tail.strip():
        try:  # a last line without newline: keep it if whole, drop it if torn
            rows.append(json.loads(tail))
            if repair:
                with _translated(path), open(path, "ab") as fh:
                    fh.write(b"\n")
        except ValueError:  # torn: not JSON, or cut inside a UTF-8 character
            if repair:
                with _translated(path), open(path, "r+b") as fh:
                    fh.truncate(len(complete) + (1 if complete else 0))
    return rows


def _mend_tail(path: Path) -> None:
    """Before an append: a file not ending in a newline (a crash mid-append) is cut back to its last
    complete line, or given its newline when the last line is whole, so that new rows never join it."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            if fh.tell() == 0:
                return
            fh.seek(-1, os.SEEK_END)
            if fh.read(1) == b"\n":
                return
    except FileNotFoundError:
        return
    read_jsonl(path, repair=True)


def append_jsonl(path: str | Path, rows: Iterable[dict]) -> None:
    """Append rows (one JSON object a line) and fsync them before returning. A failed append (a full
    disk) is cut back to the file's earlier end, so no torn line is left for a reader to drop, and
    raises a :class:`WriteError`."""
    path = Path(path)
    data = _jsonl_bytes(rows)
    if not data:
        return
    _point("append", path, "begin")
    with _translated(path):
        _mend_tail(path)
    with _translated(path), open(path, "ab") as fh:
        start = fh.tell()
        try:
            if write_hook is not None and len(data) > 1:  # a write point with half the bytes appended
                half = len(data) // 2
                fh.write(data[:half])
                fh.flush()
                _point("append", path, "partial")
                data = data[half:]
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        except OSError:
            with contextlib.suppress(OSError):  # the bytes that did reach the file: cut back
                fh.truncate(start)
            raise


# ----------------------------------------------------------------------------------- the lock
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
    if isinstance(info.get("folder"), str) and info["folder"] != str(path.parent.resolve()):
        return True  # the folder was moved or copied here: its writer writes to the old place
    if not isinstance(pid, int):
        # a lock being written this very moment looks empty: stale only once it is old
        try:
            return time.time() - path.stat().st_mtime > 10
        except FileNotFoundError:
            return True
    if host not in (None, socket.gethostname()):
        return False  # another machine's process: cannot tell, keep it
    return not pid_alive(pid)


@contextlib.contextmanager
def _guard(folder: Path) -> Iterator[None]:
    """An exclusive flock on ``folder/.aligntax.lock.guard`` (POSIX; elsewhere nothing)."""
    with file_lock(folder / f"{LOCK_NAME}.guard"):
        yield


@contextlib.contextmanager
def file_lock(path: str | Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if needed) for the block, waiting for another
    holder (a process or this one) to leave it: for caches that several processes fill, where the
    second one should wait and find the work done rather than be refused. POSIX; elsewhere nothing."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover
        yield
        return
    path = Path(path)
    with _translated(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def run_lock(folder: str | Path, flag: str = "--out") -> Iterator[Path]:
    """Hold the lock of run folder ``folder`` for the ``with`` block (creating the folder).

    Raises :class:`RunLockedError` when another live process (or another ``run_lock`` of this
    process) holds it; a stale lock of a dead process is taken over (and the stale temp files of its
    killed writes are removed)."""
    folder = Path(folder)
    path = folder / LOCK_NAME
    with _translated(folder):
        folder.mkdir(parents=True, exist_ok=True)
    token = f"{os.getpid()}-{time.time_ns()}"
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "folder": str(folder.resolve()),
        "token": token,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    for _ in range(5):
        try:
            with _translated(path):
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
                    f"use another {flag}. If no such process is running, delete {path}."
                ) from None
            # stale: remove it, checking again under a guard so that two takers cannot both win
            with _guard(folder):
                if _read_lock(path) == held:
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
            continue
        try:
            with _translated(path), os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(info, fh)
                fh.flush()
                os.fsync(fh.fileno())
        except BaseException:
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        _point("lock", path, "held")
        break
    else:  # pragma: no cover - a lock that keeps coming back
        raise RunLockedError(f"Could not take the lock {path}; another process keeps taking it.")
    clean_stale_temps(folder, locked=True)  # the only writer now
    try:
        yield path
    finally:
        held = _read_lock(path)
        if held and held.get("token") == token:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def check_writable(out: str | Path, flag: str = "--out") -> None:
    """Refuse (one :class:`WriteError` line) an output folder that cannot be written: the folder, or
    the nearest folder above it that exists, takes a probe file (created and removed at once). Meant to
    run before anything is loaded."""
    path = Path(out).expanduser()
    probe_in = next((p for p in (path, *path.parents) if p.exists()), None)
    if probe_in is None or not probe_in.is_dir():
        return
    try:
        fd, name = tempfile.mkstemp(prefix=".aligntax-probe.", dir=probe_in)
    except OSError as exc:
        err = write_error(probe_in, exc)
        if err is None:
            raise
        raise WriteError(f"{flag} {out}: {str(err).removeprefix('Cannot write ')}") from exc
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(name)


# ----------------------------------------------------------------------------------- settings header
def digest(obj) -> str:
    """The sha256 of ``obj`` as canonical JSON (sorted keys): a data digest or a resume key's hash."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def where(folder: str | Path) -> dict:
    """Where a run folder is: its absolute path and the working folder its relative paths start from."""
    return {"folder": str(Path(folder).resolve()), "cwd": os.getcwd()}


def read_where(folder: str | Path) -> dict | None:
    """Where the folder was when its header was last written (:data:`WHERE_NAME`; None if unknown)."""
    return read_header(folder, WHERE_NAME)


def _same_place(old: str, new: str, was: dict | None, folder: Path | None) -> bool:
    """Two path strings name the same file: equal once made absolute (each from its own working
    folder), or, when the run folder moved, the same place relative to the folder's parent (a sibling
    folder that moved with it: the demo's ``els/`` beside ``steered/``)."""
    if not was or folder is None:
        return False
    try:
        old_abs = Path(was.get("cwd") or os.getcwd(), old).resolve()
        new_abs = Path(new).resolve()
        if old_abs == new_abs:
            return True
        old_anchor = Path(was["folder"]).parent
        new_anchor = Path(folder).resolve().parent
        return old_abs.relative_to(old_anchor) == new_abs.relative_to(new_anchor)
    except (KeyError, OSError, ValueError, TypeError):
        return False


def _equal(old, new, was: dict | None, folder: Path | None) -> bool:
    if isinstance(old, dict) and isinstance(new, dict):
        return old.keys() == new.keys() and all(_equal(old[k], new[k], was, folder) for k in old)
    if isinstance(old, list | tuple) and isinstance(new, list | tuple):
        return len(old) == len(new) and all(_equal(a, b, was, folder) for a, b in zip(old, new, strict=True))
    if old == new:
        return True
    return isinstance(old, str) and isinstance(new, str) and _same_place(old, new, was, folder)


def settings_diffs(
    old: dict,
    new: dict,
    keys: Sequence[str],
    folder: str | Path | None = None,
    defaults: dict | None = None,
    was: dict | None = None,
) -> list[str]:
    """``"key: old -> new"`` for each of ``keys`` whose value differs between a header ``old`` and the
    settings ``new``. ``defaults``: the value of a key that an older header lacks. Path strings count as
    equal when they name the same place (:func:`_same_place`; ``folder`` is where the run folder is now,
    ``was`` where it was when ``old`` was written: by default the folder's :data:`WHERE_NAME`)."""
    if was is None and folder is not None:
        was = read_where(folder)
    old = {**(defaults or {}), **old}
    here = Path(folder) if folder is not None else None
    return [
        f"{k}: {old.get(k)!r} -> {new.get(k)!r}"
        for k in keys
        if not _equal(_plain(old.get(k)), _plain(new.get(k)), was, here)
    ]


def _plain(value):
    """A value as it reads back from JSON (tuples as lists)."""
    return json.loads(json.dumps(value, default=str))


def read_header(folder: str | Path, name: str) -> dict | None:
    """A folder's settings header (``None`` when absent or unreadable)."""
    try:
        data = json.loads((Path(folder) / name).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_header(folder: str | Path, name: str, settings: dict) -> None:
    """Write ``settings`` as the folder's header ``name`` (atomically), and where the folder is
    (:data:`WHERE_NAME`)."""
    folder = Path(folder)
    write_json_atomic(folder / name, _plain(settings))
    if read_where(folder) != where(folder):
        write_json_atomic(folder / WHERE_NAME, where(folder))


def check_settings(
    folder: str | Path,
    name: str,
    settings: dict,
    keys: Sequence[str],
    bound: bool,
    what: str = "run",
    flag: str = "--out",
    defaults: dict | None = None,
    write: bool = True,
) -> dict | None:
    """The settings header rule: when the folder already holds results (``bound``), refuse (one
    :class:`SettingsChanged` line naming every differing key) a header ``folder/name`` whose ``keys``
    differ from ``settings``; then write ``settings`` as the header (:func:`write_header`) unless
    ``write`` is false. A folder that holds no result yet (a run that failed
    while loading) binds nothing: a new run may start there whatever it records. Returns the old
    header (None if there was none)."""
    folder = Path(folder)
    old = read_header(folder, name)
    if bound and old is not None:
        diffs = settings_diffs(old, settings, keys, folder, defaults)
        if diffs:
            raise SettingsChanged(
                f"{folder} holds a {what} with different settings ({'; '.join(diffs)}). Use another {flag}, "
                "or delete the folder to start again."
            )
    if write:
        write_header(folder, name, settings)
    return old


def check_key(
    folder: str | Path, saved: dict | None, current: dict, what: str = "run", flag: str = "--out"
) -> dict:
    """The resume key rule for the parts known after loading (``{"model": fingerprint, "judge":
    identity, ...}``): each part present in both ``saved`` and ``current`` must be equal, else one
    :class:`SettingsChanged` line names the parts that differ. Returns the merged key."""
    saved = dict(saved or {})
    diffs = [
        k
        for k, v in current.items()
        if v is not None and saved.get(k) is not None and _plain(saved[k]) != _plain(v)
    ]
    if diffs:
        raise SettingsChanged(
            f"{folder} holds a {what} made with another {', '.join(diffs)} (its resume key differs in "
            f"{', '.join(diffs)}). Use another {flag}, or delete the folder to start again."
        )
    return {**saved, **{k: _plain(v) for k, v in current.items() if v is not None}}
