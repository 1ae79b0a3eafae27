"""``aligntax demo --backend vllm``: the main job with every generation of its evaluations, sweep and
known-answer check on one vLLM engine writes the same run folders as the Hugging Face demo, on a tiny
random Qwen2 model (float32, where both backends decode the same tokens) with the real Qwen tokenizer and
the benchmark files: the same answers in the baseline, steered, known-answer and baseline-method runs,
the same sweep rows and the same selected setting. A judge that reads the answers' exact text (parity
of its code points) makes every score a function of the answers, so equal sweep rows mean equal steered
answers (the gated ELS setting holds every row of the tiny model back; the sweep's ungated settings and
CAST steer).

Runs in ``.venv-vllm`` (``./run setup-vllm``); skipped where vLLM or the data folder is missing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from aligntax.runs.jsonl import read_jsonl  # noqa: E402
from tiny import make_tiny_lm  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

RUNS = (
    "baseline",
    "steered",
    "knowns-baseline",
    "knowns-steered",
    "test-baselines/system-prompt",
    "test-baselines/refusal-ablation",
    "test-baselines/cast",
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, qwen_tokenizer):
    d = tmp_path_factory.mktemp("tiny-vllm-demo") / "model"
    # untied output weights: a tied random model repeats the last prompt token ("\n"), an empty answer
    lm = make_tiny_lm(qwen_tokenizer, hidden=128, layers=3, tie_word_embeddings=False)
    lm.model.save_pretrained(d)
    qwen_tokenizer.save_pretrained(d)
    return d


def _cfg(model_dir: Path, out: Path, backend: str):
    from aligntax.runs.demo import DemoConfig

    return DemoConfig(
        out=str(out),
        model=str(model_dir),
        dtype="fp32",
        backend=backend,
        test_sets=["orbench-hard-test", "jailbreakbench"],
        limit=6,
        judge="parity",
        max_new_tokens=6,
        batch_size=8,
        limit_benign_train=24,
        limit_harmful_train=16,
        limit_gate_harmful=16,
        limit_gate_benign=16,
        sweep_max_new_tokens=6,
        limit_leak=40,
        progress=False,
        test_baselines=["system-prompt", "refusal-ablation", "cast"],
    )


def _answers(run: Path) -> dict:
    return {(r.get("source"), r["id"]): r["response"] for r in read_jsonl(run / "samples.jsonl")}


def test_vllm_demo_equals_hf_demo(model_dir, tmp_path, data_dir, parity_judge):
    from aligntax.runs.demo import run_demo

    hf = run_demo(_cfg(model_dir, tmp_path / "hf", "hf"))
    vl = run_demo(_cfg(model_dir, tmp_path / "vllm", "vllm"))
    assert vl["best"] is not None and hf["best"] is not None
    drop = ("seconds", "key")
    assert {k: v for k, v in vl["best"].items() if k not in drop} == {
        k: v for k, v in hf["best"].items() if k not in drop
    }
    for run in RUNS:
        a, b = _answers(tmp_path / "hf" / run), _answers(tmp_path / "vllm" / run)
        assert len(a) >= 6 and a == b, run
        assert json.loads((tmp_path / "vllm" / run / "config.json").read_text())["backend"] == "vllm", run
    hf_rows = {
        json.dumps([r["name"], r["args"]], sort_keys=True): (
            r["benign_compliance"],
            r["harmful_refusal"],
            r.get("known_accuracy"),
        )
        for r in read_jsonl(tmp_path / "hf" / "els" / "sweep" / "sweep.jsonl")
    }
    vl_rows = {
        json.dumps([r["name"], r["args"]], sort_keys=True): (
            r["benign_compliance"],
            r["harmful_refusal"],
            r.get("known_accuracy"),
        )
        for r in read_jsonl(tmp_path / "vllm" / "els" / "sweep" / "sweep.jsonl")
    }
    assert vl_rows == hf_rows and len(hf_rows) >= 5
    # the judge reads the answers' exact text: the ungated (paper-style) setting, which steers every row,
    # scores apart from the unsteered one, so its equal rows mean equal steered answers
    paper = next(v for k, v in hf_rows.items() if '"els"' in k and '"threshold": 0.0' in k)
    assert paper != hf_rows['["none", {}]']
    # a per-row method ran steered through the engine (CAST: its own decision per row), with equal answers
    cast = read_jsonl(tmp_path / "vllm" / "test-baselines" / "cast" / "samples.jsonl")
    assert sum((r.get("steering") or {}).get("engine_strength", 0) > 0 for r in cast) >= 1
    assert "generated with vLLM" in (tmp_path / "vllm" / "report.md").read_text()
