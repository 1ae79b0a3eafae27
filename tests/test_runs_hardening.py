"""Crash safety of run folders: atomic JSON writes, one writer per folder, JSONL lines split at "\\n" only,
and clear errors for a duplicated CSV header."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from aligntax.errors import AligntaxError, DataError
from aligntax.runs import fsio
from aligntax.runs.fsio import LOCK_NAME, RunLockedError, run_lock, write_json_atomic
from aligntax.runs.jsonl import append_jsonl, read_jsonl

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _python(code: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


# -- atomic writes --------------------------------------------------------------------------------------


def test_write_json_atomic_replaces_and_leaves_no_temp(tmp_path):
    path = tmp_path / "results.json"
    write_json_atomic(path, {"a": 1})
    write_json_atomic(path, {"a": 2, "text": "é"})
    assert json.loads(path.read_text()) == {"a": 2, "text": "é"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


def test_failure_between_temp_write_and_rename_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "results.json"
    write_json_atomic(path, {"version": "old"})

    def crash(src, dst):
        assert json.loads(Path(src).read_text()) == {"version": "new"}  # the temp file was complete
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(fsio.os, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        write_json_atomic(path, {"version": "new"})
    assert json.loads(path.read_text()) == {"version": "old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]  # the temp file was removed
    # an object that cannot be serialised never touches the file
    monkeypatch.undo()
    with pytest.raises(TypeError):
        write_json_atomic(path, {"x": object()})
    assert json.loads(path.read_text()) == {"version": "old"}


def test_process_killed_between_temp_write_and_rename(tmp_path):
    """A real SIGKILL at the worst moment: the old file stays whole and readable."""
    path = tmp_path / "results.json"
    write_json_atomic(path, {"version": "old", "rows": list(range(1000))})
    proc = _python(f"""
        import os, signal
        from aligntax.runs import fsio
        fsio.os.replace = lambda src, dst: os.kill(os.getpid(), signal.SIGKILL)
        fsio.write_json_atomic({str(path)!r}, {{"version": "new", "rows": list(range(100000))}})
    """)
    proc.wait(60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()
    assert json.loads(path.read_text()) == {"version": "old", "rows": list(range(1000))}
    # a later write still works (the orphaned temp file does not get in the way)
    write_json_atomic(path, {"version": "newer"})
    assert json.loads(path.read_text()) == {"version": "newer"}


# -- run folder lock ------------------------------------------------------------------------------------


def test_second_writer_in_the_same_process_is_refused(tmp_path):
    with run_lock(tmp_path / "run") as lock:
        assert lock.is_file() and json.loads(lock.read_text())["pid"] == os.getpid()
        with pytest.raises(RunLockedError, match=f"pid {os.getpid()}.*another --out"):
            with run_lock(tmp_path / "run"):
                pass
    assert not (tmp_path / "run" / LOCK_NAME).exists()
    with run_lock(tmp_path / "run"):  # free again
        pass


def test_two_concurrent_writers_the_second_is_refused_then_a_dead_ones_lock_is_taken_over(tmp_path):
    folder = tmp_path / "run"
    holder = _python(f"""
        import sys, time
        from aligntax.runs.fsio import run_lock
        with run_lock({str(folder)!r}):
            print("locked", flush=True)
            time.sleep(120)
    """)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunLockedError, match=f"pid {holder.pid}") as e:
            with run_lock(folder):
                pass
        assert "in use by another aligntax run" in str(e.value) and LOCK_NAME in str(e.value)
        # a second process is refused too
        other = _python(f"""
            from aligntax.runs.fsio import run_lock, RunLockedError
            try:
                with run_lock({str(folder)!r}):
                    print("got it")
            except RunLockedError as exc:
                print("refused:", exc)
        """)
        out, _ = other.communicate(timeout=60)
        assert out.startswith("refused:"), out
    finally:
        holder.kill()  # SIGKILL: the lock file stays behind, stale
        holder.wait(30)
    assert (folder / LOCK_NAME).is_file()
    with run_lock(folder) as lock:  # its process is dead: taken over
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert not (folder / LOCK_NAME).exists()


def test_run_eval_uses_the_lock(tmp_path):
    from aligntax.runs import EvalConfig, run_eval

    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"id": "a", "prompt": "hi", "label": "benign"}) + "\n")
    out = tmp_path / "r"
    cfg = EvalConfig(data=[str(data)], out=str(out), judge="keyword", max_new_tokens=4, progress=False)
    with run_lock(out):
        with pytest.raises(RunLockedError, match="another --out"):
            run_eval(cfg)
    # an error inside the run releases the lock
    write_json_atomic(out / "config.json", {**asdict(cfg), "max_new_tokens": 5})
    (out / "samples.jsonl").write_text('{"source": "p", "id": "b"}\n')
    with pytest.raises(AligntaxError, match="different settings"):
        run_eval(cfg)
    assert not (out / LOCK_NAME).exists()


# -- JSONL line splitting -------------------------------------------------------------------------------

UNICODE_BREAKS = "a\u2028b\u2029c\x85d\x0be\x0cf\x1cg\x1dh\x1ei\rj"


def test_jsonl_keeps_unicode_line_breaks_inside_lines(tmp_path):
    path = tmp_path / "samples.jsonl"
    rows = [{"id": 1, "response": UNICODE_BREAKS}, {"id": 2, "response": "plain"}]
    append_jsonl(path, rows)
    raw = path.read_bytes()
    assert "\u2028".encode() in raw and raw.count(b"\n") == 2  # written raw (ensure_ascii=False)
    assert read_jsonl(path) == rows
    assert read_jsonl(path, repair=True) == rows and path.read_bytes() == raw

    from aligntax.data._io import read_table

    table = read_table(path)
    assert [r.values["response"] for r in table.rows] == [UNICODE_BREAKS, "plain"]
    txt = tmp_path / "prompts.txt"
    txt.write_text("first\u2028still first\r\nsecond\n", encoding="utf-8")
    assert [r.values["prompt"] for r in read_table(txt).rows] == ["first\u2028still first", "second"]


# -- duplicated CSV header ------------------------------------------------------------------------------


def test_duplicated_csv_header_is_an_error(tmp_path):
    from aligntax.data import load_prompts
    from aligntax.data._io import read_table
    from aligntax.metrics.mc import load_mc

    path = tmp_path / "prompts.csv"
    path.write_text("id,prompt,label,prompt\n1,hello,benign,overwritten\n")
    with pytest.raises(DataError, match=r"names column 'prompt' twice \(columns 2 and 4\)"):
        read_table(path)
    with pytest.raises(DataError, match="twice"):
        load_prompts(str(path))
    tsv = tmp_path / "mc.tsv"
    tsv.write_text('question\tchoices\tanswer\tanswer\nQ?\t["a", "b"]\t0\t1\n')
    with pytest.raises(DataError, match="'answer' twice"):
        load_mc(tsv)
    ok = tmp_path / "ok.csv"  # unnamed trailing columns are fine
    ok.write_text("id,prompt,,\n1,hello,,\n")
    assert read_table(ok).rows[0].values["prompt"] == "hello"


# -- stale temp files of killed writes ------------------------------------------------------------------


def _kill_mid_write(path: Path) -> None:
    proc = _python(f"""
        import os, signal
        from aligntax.runs import fsio
        fsio.os.replace = lambda src, dst: os.kill(os.getpid(), signal.SIGKILL)
        fsio.write_json_atomic({str(path)!r}, {{"version": "new"}})
    """)
    proc.wait(60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()


def _temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_stale_temp_files_are_cleaned_on_the_next_write(tmp_path):
    path = tmp_path / "results.json"
    write_json_atomic(path, {"version": "old"})
    _kill_mid_write(path)
    left = _temps(tmp_path)
    assert len(left) == 1 and left[0].startswith(".results.json.")  # the kill left its temp file
    write_json_atomic(tmp_path / "other.json", {"x": 1})  # any write to the folder cleans it
    assert _temps(tmp_path) == []
    assert json.loads(path.read_text()) == {"version": "old"}


def test_stale_temp_files_are_cleaned_when_the_lock_is_taken(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    _kill_mid_write(folder / "config.json")
    legacy = folder / ".results.json.abcd1234.tmp"  # an older temp name, without the writer's pid
    legacy.write_text("{")
    alive = folder / f".samples.json.{os.getpid()}.zzzz9999.tmp"  # this live process's write in progress
    alive.write_text("{")
    other = folder / "notes.tmp"  # not a temp file of ours
    other.write_text("keep")
    assert len(_temps(folder)) == 4
    with run_lock(folder):
        assert _temps(folder) == [alive.name, other.name]
    # without the lock, a young legacy temp file of a possibly live writer is left alone
    legacy.write_text("{")
    fsio.clean_stale_temps(folder)
    assert legacy.exists()
    old = time.time() - 2 * fsio.STALE_TEMP_S
    os.utime(legacy, (old, old))
    fsio.clean_stale_temps(folder)
    assert not legacy.exists() and alive.exists()


# -- resume checks: model fingerprint, intervention folder, judge -----------------------------------------


class _FakeLM:
    def __init__(self, digest: str = "aaaa"):
        self.fingerprint = {
            "spec": "test:fake",
            "model_type": "qwen2",
            "num_layers": 2,
            "hidden_size": 8,
            "vocab_size": 10,
            "embedding_digest": digest,
        }


def _eval_folder(tmp_path, **cfg_kw):
    from aligntax.runs import EvalConfig

    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"id": "a", "prompt": "hi", "label": "benign"}) + "\n")
    out = tmp_path / "r"
    return EvalConfig(
        data=[str(data)], out=str(out), judge="keyword", max_new_tokens=4, progress=False, **cfg_kw
    ), out


def test_resume_refuses_another_model_fingerprint(tmp_path):
    from aligntax.runs.eval import _check_loaded, _run_eval
    from aligntax.runs.provenance import ProvenanceMismatch, read_provenance

    cfg, out = _eval_folder(tmp_path)
    out.mkdir()
    # a run made before provenance.json: its fingerprint is in results.json only
    write_json_atomic(out / "config.json", asdict(cfg))
    write_json_atomic(out / "results.json", {"model_fingerprint": _FakeLM("aaaa").fingerprint})
    _check_loaded(out, {}, _FakeLM("aaaa"))  # same weights: fine
    with pytest.raises(ProvenanceMismatch, match=r"another model.*embedding_digest: 'aaaa' -> 'bbbb'"):
        _check_loaded(out, {}, _FakeLM("bbbb"))
    # no fingerprint saved anywhere (older runs): not checked
    (out / "results.json").unlink()
    _check_loaded(out, {}, _FakeLM("bbbb"))
    # provenance.json, where recorded, comes first
    with pytest.raises(ProvenanceMismatch, match="another model"):
        _check_loaded(out, {"model_fingerprint": _FakeLM("aaaa").fingerprint}, _FakeLM("bbbb"))
    # a model given to a run whose rows are all done is still checked
    (out / "samples.jsonl").write_text(
        json.dumps(
            {"source": "p", "id": "a", "prompt": "hi", "label": "benign", "response": "x", "refused": False}
        )
        + "\n"
    )
    write_json_atomic(out / "results.json", {"model_fingerprint": _FakeLM("aaaa").fingerprint})
    with pytest.raises(ProvenanceMismatch, match="another model"):
        _run_eval(cfg, out, _FakeLM("bbbb"), None, None, None, None)
    assert read_provenance(out) == {}


def test_resume_refuses_a_changed_intervention_folder(tmp_path, monkeypatch):
    from aligntax.runs import eval as ev
    from aligntax.runs.provenance import ProvenanceMismatch, folder_digest, read_provenance

    art = tmp_path / "els"
    art.mkdir()
    (art / "energy.safetensors").write_bytes(b"tensor bytes")
    (art / "energy.json").write_text('{"layers": [3]}')
    (art / "notes.txt").write_text("not an artefact file")
    cfg, out = _eval_folder(tmp_path, intervention="els", intervention_args={"path": str(art)})
    assert ev._check_resume(out, cfg)["intervention"]["path"] == str(art)  # a new run: nothing to compare
    out.mkdir()
    write_json_atomic(out / "config.json", asdict(cfg))
    (out / "samples.jsonl").write_text('{"source": "p", "id": "a"}\n')  # a run from its first sample on
    ev._save_provenance(out, {}, ev._check_resume(out, cfg))
    saved = read_provenance(out)["intervention"]
    assert set(saved["files"]) == {"energy.json", "energy.safetensors"}
    # unchanged (and cheap: size and mtime match, so no file is read again)
    monkeypatch.setattr("aligntax.runs.provenance._sha256_file", lambda p: pytest.fail(f"re-hashed {p}"))
    assert ev._check_resume(out, cfg)["intervention"]["sha256"] == saved["sha256"]
    monkeypatch.undo()
    (art / "notes.txt").write_text("other notes")  # not part of the artefact
    ev._check_resume(out, cfg)
    (art / "energy.safetensors").write_bytes(b"retrained tensor bytes")
    with pytest.raises(ProvenanceMismatch, match=r"intervention folder .*changed: energy\.safetensors"):
        ev._check_resume(out, cfg)
    (art / "energy.safetensors").write_bytes(b"tensor bytes")
    (art / "gate.safetensors").write_bytes(b"gate")
    with pytest.raises(ProvenanceMismatch, match=r"added: gate\.safetensors"):
        ev._check_resume(out, cfg)
    (art / "gate.safetensors").unlink()
    assert folder_digest(art)["sha256"] == saved["sha256"]
    # a run folder made before this check (no provenance.json) resumes, and records the digest
    (out / "provenance.json").unlink()
    assert ev._check_resume(out, cfg)["intervention"]["sha256"] == saved["sha256"]


def test_resume_refuses_another_judge(tmp_path):
    from aligntax.judges import get_judge
    from aligntax.runs.eval import _check_loaded
    from aligntax.runs.provenance import ProvenanceMismatch, judge_identity

    out = tmp_path / "r"

    class Classifier:  # a classifier judge's identity: the hash of its weights, and its settings
        name = "classifier"
        threshold, short_refusal_floor = 0.5, 0.95

        def __init__(self, sha):
            self.meta = {"weights_sha256": sha}

    saved = {"judge": judge_identity(Classifier("1" * 64))}
    _check_loaded(out, saved, judge=Classifier("1" * 64))
    with pytest.raises(ProvenanceMismatch, match=r"another judge \(weights_sha256: '1+' -> '2+'\)"):
        _check_loaded(out, saved, judge=Classifier("2" * 64))
    kw = {"judge": judge_identity(get_judge("keyword"))}
    _check_loaded(out, kw, judge=get_judge("keyword"))
    with pytest.raises(ProvenanceMismatch, match="another judge"):
        _check_loaded(out, kw, judge=get_judge("keyword", phrases="gcg"))
    _check_loaded(out, {}, judge=Classifier("2" * 64))  # nothing saved: not checked


def test_the_shipped_classifier_is_identified_by_its_weights():
    from aligntax.judges.classifier import RESOURCE_DIR, _sha256, load_classifier
    from aligntax.runs.provenance import judge_identity

    _, meta = load_classifier()

    class Shipped:
        name, threshold, short_refusal_floor = "classifier", 0.5, 0.95

    judge = Shipped()
    judge.meta = meta
    ident = judge_identity(judge)
    assert ident["weights_sha256"] == _sha256(RESOURCE_DIR / meta["weights_file"])


def test_eval_run_records_provenance_and_refuses_a_changed_model_on_resume(tmp_path, tiny_lm):
    from aligntax.judges import get_judge
    from aligntax.runs import run_eval
    from aligntax.runs.provenance import ProvenanceMismatch, read_provenance

    data = tmp_path / "p.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "prompt": f"question {i}", "label": "benign"}) + "\n" for i in range(3)
        )
    )
    from aligntax.runs import EvalConfig

    cfg = EvalConfig(
        data=[str(data)], out=str(tmp_path / "r"), judge="keyword", max_new_tokens=3, progress=False, limit=2
    )
    run_eval(cfg, lm=tiny_lm, judge=get_judge("keyword"))
    prov = read_provenance(tmp_path / "r")
    assert prov["model_fingerprint"] == tiny_lm.fingerprint and prov["judge"]["name"] == "keyword"
    cfg.limit = 3  # one more row to generate, with other weights under the same spec
    other = dict(tiny_lm.fingerprint, embedding_digest="f" * 16)
    tiny_lm.fingerprint = other
    with pytest.raises(ProvenanceMismatch, match="another model"):
        run_eval(cfg, lm=tiny_lm, judge=get_judge("keyword"))
    with pytest.raises(ProvenanceMismatch, match="another judge"):
        tiny_lm.fingerprint = prov["model_fingerprint"]
        run_eval(cfg, lm=tiny_lm, judge=get_judge("keyword", phrases="gcg"))
    assert len(read_jsonl(tmp_path / "r" / "samples.jsonl")) == 2  # nothing was mixed in


# -- input files: same source from two files, duplicate JSON keys ----------------------------------------


def test_two_files_with_the_same_stem_are_refused(tmp_path):
    from aligntax.data import load_prompt_sets
    from aligntax.runs.eval import load_prompt_sets as eval_sets

    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "x.csv").write_text(f"prompt,label\nhello from {sub},benign\n")
    a, b = str(tmp_path / "a" / "x.csv"), str(tmp_path / "b" / "x.csv")
    with pytest.raises(DataError, match=r"a/x\.csv and .*b/x\.csv both give rows the source 'x'"):
        load_prompt_sets([a, b])
    with pytest.raises(DataError, match="source 'x'"):
        eval_sets([a, b])
    (tmp_path / "b" / "y.jsonl").write_text(json.dumps({"prompt": "other", "label": "benign"}) + "\n")
    items = load_prompt_sets([a, str(tmp_path / "b" / "y.jsonl")])
    assert [(it.source, it.id) for it in items] == [("x", "x:0"), ("y", "y:0")]
    assert len(load_prompt_sets([a, a])) == 1  # the same file twice is read once


def test_duplicate_keys_in_json_records_are_an_error(tmp_path):
    from aligntax.data import load_prompts
    from aligntax.data._io import read_table

    jl = tmp_path / "p.jsonl"
    jl.write_text('{"id": "a", "prompt": "ok"}\n{"id": "b", "prompt": "first", "prompt": "second"}\n')
    with pytest.raises(DataError, match=r"p\.jsonl, line 2: a JSON object names the key 'prompt' twice"):
        read_table(jl)
    with pytest.raises(DataError, match="twice"):
        load_prompts(str(jl))
    js = tmp_path / "p.json"
    js.write_text('[{"prompt": "ok"}, {"prompt": "x", "meta": {"k": 1, "k": 2}}]')
    with pytest.raises(DataError, match=r"p\.json, record 2: .*'k' twice"):
        read_table(js)
    top = tmp_path / "top.json"
    top.write_text('{"data": [{"prompt": "a"}], "data": [{"prompt": "b"}]}')
    with pytest.raises(DataError, match="top-level object.*'data' twice"):
        read_table(top)
    fine = tmp_path / "fine.json"
    fine.write_text('[{"prompt": "a", "meta": {"k": 1}}, {"prompt": "b", "meta": {"k": 2}}]')
    assert [r.values["prompt"] for r in read_table(fine).rows] == ["a", "b"]
