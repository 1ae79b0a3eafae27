"""The run-folder contract on the ELS pipelines and the demo (``tests/killharness.py``): ``els train``,
``els sweep``, ``els distill`` and ``aligntax demo`` on tiny random models, killed at write points drawn
at random and resumed to the files of an uninterrupted run (1-2 points in the default suite, 20 under
the ``slow`` mark); the sweep refuses a resume with another judge or dtype."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aligntax.runfolder import SettingsChanged, read_jsonl
from killharness import kill_resume

pytestmark = pytest.mark.usefixtures("one_thread")


def _points(default: int):
    return [
        pytest.param(default, id=f"{default}-points"),
        pytest.param(20, id="20-points", marks=pytest.mark.long),
    ]


@pytest.fixture(scope="module")
def lm():
    from tiny import tiny_lm

    return tiny_lm()


def _data(folder: Path, name: str, label: str, n: int) -> str:
    path = folder / f"{name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(
            json.dumps({"id": f"{name}{i}", "prompt": f"{name} request {i} {'x' * (i % 5)}", "label": label})
            + "\n"
            for i in range(n)
        )
    )
    return str(path)


def _train_cfg(tmp_path: Path, out: Path):
    from aligntax.runs.els_train import ELSTrainConfig

    data = tmp_path / "data"
    return ELSTrainConfig(
        out=str(out),
        benign=[_data(data, "b", "benign", 12)],
        harmful=[_data(data, "h", "harmful", 12)],
        harmless=[_data(data, "n", "benign", 6)],
        gate_harmful=[],
        gate_benign=[],
        harm_pairs=[],
        judge="parity",
        max_new_tokens=4,
        batch_size=6,
        dtype="fp32",
        epochs=2,
        energy_folds=2,
        harm_k=2,
        progress=False,
    )


def _train(tmp_path: Path, lm, out: Path):
    from aligntax.runs.els_train import train_els

    cfg = _train_cfg(tmp_path, out)
    return lambda: train_els(cfg, lm=lm)


@pytest.fixture(scope="module")
def els_folder(tmp_path_factory, lm):
    """A trained tiny ELS folder (shared, read only by the tests below)."""
    import aligntax.judges.registry as registry
    from tiny import ParityJudge

    before = registry._JUDGES.get("parity")
    registry._JUDGES["parity"] = (lambda **kw: ParityJudge(), "test")
    try:
        root = tmp_path_factory.mktemp("els")
        _train(root, lm, root / "els")()
    finally:
        if before is None:
            registry._JUDGES.pop("parity", None)
        else:
            registry._JUDGES["parity"] = before
    return root / "els"


def _sweep_cfg(tmp_path: Path, els: Path, out: Path, **over):
    from aligntax.runs.els_sweep import SweepConfig

    data = tmp_path / "sweep-data"
    settings = dict(
        steer=str(els),
        out=str(out),
        benign=[_data(data, "vb", "benign", 6)],
        harmful=[_data(data, "vh", "harmful", 6)],
        jailbreak=[_data(data, "vj", "harmful", 3)],
        knowns=None,
        top_k=[1],
        eta=[0.3],
        threshold=[None, 0.0],
        baselines=False,
        judge="parity",
        max_new_tokens=3,
        batch_size=6,
        dtype="fp32",
        progress=False,
    )
    return SweepConfig(**{**settings, **over})


@pytest.mark.parametrize("points", _points(2))
def test_kill_anywhere_els_train(tmp_path, lm, parity_judge, points):
    run = tmp_path / "run"
    kill_resume(_train(tmp_path, lm, run), run, points, seed=11)
    assert (run / "energy.json").is_file() and (run / "gate.json").is_file()


@pytest.mark.parametrize("points", _points(2))
def test_kill_anywhere_els_sweep(tmp_path, lm, els_folder, parity_judge, points):
    from aligntax.runs.els_sweep import run_sweep

    run = tmp_path / "run"
    cfg = _sweep_cfg(tmp_path, els_folder, run)
    kill_resume(lambda: run_sweep(cfg, lm=lm), run, points, seed=12)
    assert (run / "best.json").is_file() and len(read_jsonl(run / "sweep.jsonl")) >= 3


def test_els_sweep_resume_refuses_another_judge_or_dtype(tmp_path, lm, els_folder, parity_judge):
    """The sweep's rows hold judged answers: a resume with another judge or dtype would mix rows of two
    (the resume key holds both); refused, one line naming the key, before any model is loaded."""
    from aligntax.runs.els_sweep import run_sweep

    out = tmp_path / "sweep"
    run_sweep(_sweep_cfg(tmp_path, els_folder, out), lm=lm)
    rows = read_jsonl(out / "sweep.jsonl")
    for over, named in (
        ({"judge": "keyword"}, "judge: 'parity' -> 'keyword'"),
        ({"dtype": "bf16"}, "dtype: 'fp32' -> 'bf16'"),
    ):
        with pytest.raises(SettingsChanged) as err:
            run_sweep(_sweep_cfg(tmp_path, els_folder, out, **over), lm=None)  # no model: refused first
        assert named in str(err.value) and "\n" not in str(err.value)
    assert read_jsonl(out / "sweep.jsonl") == rows  # nothing scored, nothing mixed
    # more settings in the same folder extend it
    run_sweep(_sweep_cfg(tmp_path, els_folder, out, eta=[0.3, 0.6]), lm=lm)
    assert len(read_jsonl(out / "sweep.jsonl")) > len(rows)


@pytest.mark.parametrize("points", _points(2))
def test_kill_anywhere_els_distill(tmp_path, lm, els_folder, points):
    from aligntax.data import PromptItem
    from aligntax.runs.els_lora import DistillConfig, distill_els_lora

    benign = [
        PromptItem(id=str(i), prompt=f"tell me about item {i}", label="benign", source="b") for i in range(6)
    ]
    harmful = [
        PromptItem(id=str(i), prompt=f"hurt someone {i} times", label="harmful", source="h") for i in range(6)
    ]
    run = tmp_path / "run"
    cfg = DistillConfig(
        steer=str(els_folder),
        out=str(run),
        els={"eta": 0.5, "horizon": 3},
        benign_target="els",
        harmful_target="unsteered",
        epochs=2,
        batch_size=4,
        rank=4,
        answer_tokens=3,
        harmful_answer_tokens=3,
        progress=False,
        dtype="fp32",
        pairs=[],
        retain=[],
    )
    kill_resume(lambda: distill_els_lora(cfg, lm, benign=benign, harmful=harmful), run, points, seed=13)
    assert (run / "els_lora.json").is_file() and (run / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("points", _points(1))
def test_kill_anywhere_demo(tmp_path, lm, data_dir, parity_judge, monkeypatch, points):
    import dataclasses
    import functools

    import aligntax.runs.demo as demo
    from aligntax.runs.demo import DemoConfig, run_demo

    # every stage of the demo, made small: the sweep on 4 prompts of each validation set, the energy
    # models trained briefly, the harm basis from the training prompts (the forked runs see the patches)
    sweep_config = demo.demo_sweep_config
    monkeypatch.setattr(demo, "demo_sweep_config", lambda *a: dataclasses.replace(sweep_config(*a), limit=4))
    monkeypatch.setattr(
        demo,
        "ELSTrainConfig",
        functools.partial(demo.ELSTrainConfig, epochs=2, energy_folds=2, harm_pairs=[], harm_k=2),
    )
    # the parity judge refuses about half of the random model's answers: both classes for every fold
    run = tmp_path / "run"
    cfg = DemoConfig(
        out=str(run),
        test_sets=["orbench-hard-test", "jailbreakbench"],
        limit=4,
        judge="parity",
        max_new_tokens=4,
        limit_benign_train=16,
        limit_harmful_train=16,
        limit_gate_harmful=8,
        limit_gate_benign=8,
        sweep_max_new_tokens=4,
        limit_leak=8,
        sweep_layers=1,
        knowns=None,
        limit_reasoning=4,
        reasoning_max_new_tokens=4,
        test_subsets={},
        progress=False,
    )
    kill_resume(lambda: run_demo(cfg, lm=lm), run, points, seed=14)
    assert (run / "report.md").is_file() and (run / "steered" / "results.json").is_file()


@pytest.mark.parametrize("at", ["safetensors", "append"])
def test_els_train_on_a_full_disk_loses_nothing_written(tmp_path, lm, parity_judge, at):
    """ENOSPC in the middle of ELS training (a tensor file complete but not yet renamed into place, or a
    label row half appended): one line, no temp file or torn row left, every file there whole, and the
    same run resumes, once space is freed, to the files of an uninterrupted run."""
    import errno
    import os

    from safetensors.torch import load_file

    from aligntax import runfolder
    from aligntax.runfolder import WriteError
    from killharness import compare_folders

    run, ref = tmp_path / "run", tmp_path / "ref"
    _train(tmp_path, lm, run)()  # the reference, made at the same path
    run.rename(ref)
    hits = []

    def full_disk(kind, path, phase):
        site = (
            kind == "replace" and phase == "temp" and path.name.endswith(".safetensors")
            if at == "safetensors"
            else kind == "append" and phase == "partial"
        )
        hits.append(site)
        if site and sum(hits) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    runfolder.write_hook = full_disk
    try:
        with pytest.raises(WriteError) as err:
            _train(tmp_path, lm, run)()
    finally:
        runfolder.write_hook = None
    msg = str(err.value)
    assert "\n" not in msg and "no space left on device" in msg
    assert sorted(run.rglob("*.tmp")) == [] and not (run / runfolder.LOCK_NAME).exists()
    for path in run.rglob("*"):  # whatever is there is whole
        if path.suffix == ".json":
            json.loads(path.read_text())
        elif path.suffix == ".jsonl":
            raw = path.read_bytes()
            assert not raw or raw.endswith(b"\n"), path
        elif path.suffix == ".safetensors":
            load_file(path)
    _train(tmp_path, lm, run)()  # space freed: the same command resumes
    assert compare_folders(ref, run) == []


def test_a_last_line_torn_inside_a_utf8_character_is_dropped(tmp_path):
    """A kill mid-append can cut a non-ASCII answer inside a character: the torn line is dropped (and cut
    off with ``repair``), not a decode error."""
    path = tmp_path / "rows.jsonl"
    whole = b'{"a": 1}\n'
    torn = json.dumps({"a": "caf\u00e9"}, ensure_ascii=False).encode()
    path.write_bytes(whole + torn[: torn.index(b"\xc3") + 1])
    assert read_jsonl(path) == [{"a": 1}]
    assert read_jsonl(path, repair=True) == [{"a": 1}] and path.read_bytes() == whole
