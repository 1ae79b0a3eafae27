"""``aligntax eval --backend vllm`` on the embedded model: the same run folder as the Hugging Face
backend (samples with the same fields and per-row steering records, results, report, resume), and
refusal/compliance rates whose paired difference from the Hugging Face backend's is within its 95%
interval, unsteered and steered with ELS.

Slow, and only where vLLM is installed: ``.venv-vllm/bin/python -m pytest -m slow tests/test_vllm_eval.py``.
The steered check needs a trained ELS folder (the one ``./run demo`` trains):
``ALIGNTAX_VLLM_TEST_ELS=runs/demo/els``; it is skipped without it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("vllm")
os.environ.setdefault(
    "VLLM_ENABLE_V1_MULTIPROCESSING", "0"
)  # the engine in this process: one start per module
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

from aligntax.errors import AligntaxError  # noqa: E402
from aligntax.metrics.rates import paired_interval  # noqa: E402
from aligntax.runs import EvalConfig, run_eval  # noqa: E402
from aligntax.runs.jsonl import read_jsonl  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

MODEL = "embedded:qwen2.5-coder-0.5b-instruct"
DATA = "orbench-hard-test"
N, TOKENS = 48, 32
ELS_ENV = "ALIGNTAX_VLLM_TEST_ELS"


def _judge_name() -> str:
    """The classifier judge where its embedding model is installed, else the keyword judge."""
    from aligntax.judges import get_judge

    try:
        get_judge("classifier")
    except AligntaxError:
        return "keyword"
    return "classifier"


@pytest.fixture(scope="module")
def setup(data_dir, qwen_tokenizer):
    from aligntax.backends.vllm.engine import VllmModel, VllmOptions
    from aligntax.models import load_model

    hf = load_model(MODEL, dtype="bf16")
    vm = VllmModel(MODEL, dtype="bf16", options=VllmOptions(max_model_len=1024, max_num_seqs=16))
    return hf, vm, _judge_name()


def _cfg(out: Path, backend: str, judge: str, **kw) -> EvalConfig:
    return EvalConfig(
        data=[DATA],
        out=str(out),
        model=MODEL,
        judge=judge,
        max_new_tokens=TOKENS,
        limit=N,
        batch_size=16,
        dtype="bf16",
        backend=backend,
        progress=False,
        **kw,
    )


def _compare(tmp: Path, setup, tag: str, **iv) -> dict:
    """The HF run, then the vLLM run compared with it; returns the vLLM results."""
    hf, vm, judge = setup
    run_eval(_cfg(tmp / f"hf-{tag}", "hf", judge, **iv), lm=hf)
    res = run_eval(_cfg(tmp / f"vllm-{tag}", "vllm", judge, compare_to=str(tmp / f"hf-{tag}"), **iv), lm=vm)
    change = res["paired"]["datasets"][DATA]["benign"]
    lo, hi = paired_interval(change["gained"], change["lost"], change["n"])
    hf_rows = _by_key(tmp / f"hf-{tag}")
    same = sum(r["response"] == hf_rows[k]["response"] for k, r in _by_key(tmp / f"vllm-{tag}").items())
    print(
        f"{tag}: judge {judge}; compliance hf {change['before']:.3f} vllm {change['after']:.3f} "
        f"(+{change['gained']} -{change['lost']}, 95% paired interval [{lo:+.3f}, {hi:+.3f}], "
        f"p {change['p_value']:.3f}); identical responses {same}/{N}"
    )
    assert change["n"] == N and res["paired"]["unmatched"] == 0
    assert lo <= 0.0 <= hi
    return res


def _by_key(run: Path) -> dict:
    return {(r["source"], r["id"]): r for r in read_jsonl(run / "samples.jsonl")}


def _same_fields(a: Path, b: Path) -> None:
    ra, rb = _by_key(a), _by_key(b)
    assert sorted(ra) == sorted(rb) and len(ra) == N
    for key, x in ra.items():
        y = rb[key]
        assert set(x) == set(y)
        if "steering" in x:
            assert set(y["steering"]) - set(x["steering"]) == {"engine_strength"}
    for name in ("results.json", "report.md", "config.json", "provenance.json"):
        assert (b / name).is_file()


def test_unsteered_rates_agree_and_resume(tmp_path, setup):
    hf, vm, judge = setup
    res = _compare(tmp_path, setup, "plain")
    _same_fields(tmp_path / "hf-plain", tmp_path / "vllm-plain")
    assert res["config"]["backend"] == "vllm"
    assert res["timing"]["new_samples"] == N and res["timing"]["tokens_per_second"] > 0
    prov_hf = json.loads((tmp_path / "hf-plain" / "provenance.json").read_text())
    prov_vl = json.loads((tmp_path / "vllm-plain" / "provenance.json").read_text())
    assert prov_vl["model_fingerprint"] == prov_hf["model_fingerprint"]  # the same weights as HF loads them

    # a rerun resumes: nothing generated again, nothing duplicated
    again = run_eval(
        _cfg(tmp_path / "vllm-plain", "vllm", judge, compare_to=str(tmp_path / "hf-plain")), lm=vm
    )
    assert again["timing"]["new_samples"] == 0 and again["timing"]["resumed_samples"] == N
    assert len(read_jsonl(tmp_path / "vllm-plain" / "samples.jsonl")) == N
    # a run folder never mixes the backends' samples
    with pytest.raises(AligntaxError, match="backend: 'vllm' -> 'hf'"):
        run_eval(_cfg(tmp_path / "vllm-plain", "hf", judge), lm=hf)


def test_els_rates_agree(tmp_path, setup):
    folder = os.environ.get(ELS_ENV)
    if not folder:
        pytest.skip(f"set {ELS_ENV} to a trained ELS folder (e.g. runs/demo/els, which ./run demo trains)")
    if not (Path(folder) / "energy.json").is_file():
        pytest.skip(f"{ELS_ENV}={folder} is not an ELS folder (no energy.json)")
    iv = {"intervention": "els", "intervention_args": {"path": folder}}
    res = _compare(tmp_path, setup, "els", **iv)
    _same_fields(tmp_path / "hf-els", tmp_path / "vllm-els")
    rows = list(_by_key(tmp_path / "vllm-els").values())
    hf_rows = _by_key(tmp_path / "hf-els")
    # the records before generating are the HF backend's (one HF prefill decides in both runs)
    assert [r["steering"]["steered"] for r in rows] == [
        hf_rows[(r["source"], r["id"])]["steering"]["steered"] for r in rows
    ]
    steered = [r["steering"]["steered"] for r in rows]
    engine = [r["steering"]["engine_strength"] > 0 for r in rows]
    agree = sum(a == b for a, b in zip(steered, engine, strict=True))
    print(
        f"els: {sum(steered)} rows steered by the HF decision, {sum(engine)} by the engine's; agree {agree}/{N}"
    )
    assert sum(steered) > 0  # the comparison is not vacuous
    assert agree >= N - 3  # bf16 numerics of two engines may flip a borderline decision, no more
    stats = res["steering_stats"]
    assert stats["els_gate"]["rows"] == N and stats["els"]  # the engine's statistics reach results.json
