"""The kill harness: run a pipeline, SIGKILL it at write points drawn at random, resume, and compare every
final file with an uninterrupted run.

A pipeline is a function of no arguments that writes one run folder (on the tiny random models of
``tiny.py``, ``vat_tiny.py``). Each run happens in a forked child process (the parent's model is shared,
nothing is imported again), with :data:`aligntax.runfolder.write_hook` counting the write points (every
atomic write: begin, temp half-written, temp complete before the rename; every append: begin, half the
bytes appended; the lock taken). :func:`kill_resume` runs the pipeline once uninterrupted (the
reference; its count of write points is the range of the draw), moves the reference folder away, then
for each of ``points`` write points drawn by ``random.Random(seed)``: runs the pipeline into the same
path, SIGKILLs the child at that point (``os.kill(getpid(), SIGKILL)`` inside the write), reruns it to the
end, and compares the two folders with :func:`compare_folders`.

What may differ (documented in ``docs/architecture.md``, "Run folders"): the JSON keys of
:data:`aligntax.runfolder.VOLATILE_FIELDS` (wall times, what one invocation did, start times, file
modification times, where the folder was), the files of :data:`aligntax.runfolder.VOLATILE_FILES`, the
lines of a markdown report that carry those wall times (:data:`VOLATILE_LINES`). Everything else must
be equal: the same files, the same rows in the same order, the same floats and tensors to the bit (a
resumed run generates each row in the batch an uninterrupted run did; :data:`FLOAT_RTOL` and
:data:`FLOAT_ATOL` are 0 and stay so).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from aligntax import runfolder

FLOAT_RTOL = 0.0
FLOAT_ATOL = 0.0
# Lines of markdown reports that carry wall times or throughput.
VOLATILE_LINES = re.compile(r"(tokens/s|Wall time|wall time|seconds|minutes)", re.IGNORECASE)


class KillPointMissed(AssertionError):
    """The child did not die at its kill point (the pipeline wrote fewer points than drawn)."""


def run_child(fn: Callable[[], object], kill_at: int | None = None) -> tuple[str, int]:
    """Run ``fn`` in a forked child; with ``kill_at``, SIGKILL it at that write point. Returns
    ``("done" | "killed" | "failed", write points seen)``."""
    r, w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(r)
        count = [0]

        def hook(kind, path, phase):
            count[0] += 1
            if kill_at is not None and count[0] >= kill_at:
                os.write(w, f"{count[0]}\n".encode())
                os.kill(os.getpid(), signal.SIGKILL)

        runfolder.write_hook = hook
        code = 0
        try:
            fn()
        except BaseException:  # noqa: BLE001 - reported by the exit code
            traceback.print_exc()
            code = 1
        os.write(w, f"{count[0]}\n".encode())
        os._exit(code)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 4096):
        chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    seen = int(b"".join(chunks).split()[-1]) if b"".join(chunks).split() else 0
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        return "killed", seen
    return ("done" if os.WEXITSTATUS(status) == 0 else "failed"), seen


def _strip(obj):
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k not in runfolder.VOLATILE_FIELDS}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def _diff(a, b, where: str) -> str | None:
    """The first place two JSON values differ (floats within the tolerance are equal)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{where}: keys {sorted(set(a) ^ set(b))} in one only"
        for k in a:
            d = _diff(a[k], b[k], f"{where}.{k}")
            if d:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{where}: {len(a)} vs {len(b)} entries"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            d = _diff(x, y, f"{where}[{i}]")
            if d:
                return d
        return None
    if isinstance(a, float) and isinstance(b, float | int) or isinstance(b, float) and isinstance(a, int):
        if math.isclose(a, b, rel_tol=FLOAT_RTOL, abs_tol=FLOAT_ATOL):
            return None
    if a != b:
        return f"{where}: {a!r} != {b!r}"
    return None


def _files(folder: Path) -> dict[str, Path]:
    return {
        str(p.relative_to(folder)): p
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name not in runfolder.VOLATILE_FILES
    }


def compare_folders(ref: Path, run: Path) -> list[str]:
    """The differences between two run folders outside the documented volatile fields (module
    docstring); ``[]`` when they agree."""
    a, b = _files(ref), _files(run)
    problems = []
    if a.keys() != b.keys():
        problems.append(f"files in one folder only: {sorted(set(a) ^ set(b))}")
    for name in sorted(set(a) & set(b)):
        x, y = a[name], b[name]
        if name.endswith(".json"):
            d = _diff(_strip(json.loads(x.read_text())), _strip(json.loads(y.read_text())), name)
        elif name.endswith(".jsonl"):
            rows_x = [json.loads(line) for line in x.read_text().splitlines() if line.strip()]
            rows_y = [json.loads(line) for line in y.read_text().splitlines() if line.strip()]
            d = _diff(_strip(rows_x), _strip(rows_y), name)
            if d is None and rows_x == rows_y and x.read_bytes() != y.read_bytes():
                d = f"{name}: the same rows written as other bytes"
        elif name.endswith(".md"):
            d = _text_diff(x, y, name)
        else:
            d = None if x.read_bytes() == y.read_bytes() else f"{name}: bytes differ"
        if d:
            problems.append(d)
    return problems


def _text_diff(x: Path, y: Path, name: str) -> str | None:
    lx = [line for line in x.read_text().splitlines() if not VOLATILE_LINES.search(line)]
    ly = [line for line in y.read_text().splitlines() if not VOLATILE_LINES.search(line)]
    if lx == ly:
        return None
    for i, (p, q) in enumerate(zip(lx, ly, strict=False)):
        if p != q:
            return f"{name} line {i + 1}: {p!r} != {q!r}"
    return f"{name}: {len(lx)} vs {len(ly)} lines"


def kill_resume(
    pipeline: Callable[[], object], folder: Path, points: int, seed: int = 0, kills_per_point: int = 1
) -> dict:
    """The harness (module docstring): the reference run into ``folder`` (moved to ``folder.ref``), then
    ``points`` kill points drawn with ``seed`` over its write points, each killed, resumed (killed again
    ``kills_per_point - 1`` times at later points of the resumed runs) and compared. Returns
    ``{"write_points": n, "killed_at": [...]}``; raises AssertionError naming the first difference."""
    folder = Path(folder)
    shutil.rmtree(folder, ignore_errors=True)
    status, total = run_child(pipeline)
    assert status == "done", f"the uninterrupted run {status}"
    ref = folder.with_name(folder.name + ".ref")
    shutil.rmtree(ref, ignore_errors=True)
    folder.rename(ref)
    rng = random.Random(seed)
    drawn = sorted(rng.sample(range(1, total + 1), min(points, total)))
    for k in drawn:
        shutil.rmtree(folder, ignore_errors=True)
        status, seen = run_child(pipeline, kill_at=k)
        if status != "killed":
            raise KillPointMissed(f"write point {k} of {total}: the run {status} after {seen} points")
        for _ in range(kills_per_point - 1):  # kill the resumed run too, at a point of its own
            status, seen = run_child(pipeline, kill_at=rng.randint(1, max(1, total // 2)))
            if status != "killed":
                break
        status, _ = run_child(pipeline)
        assert status == "done", f"the run resumed after a kill at write point {k} of {total} {status}"
        problems = compare_folders(ref, folder)
        assert not problems, f"killed at write point {k} of {total}, resumed: " + "; ".join(problems)
    return {"write_points": total, "killed_at": drawn}
