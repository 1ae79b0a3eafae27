"""``aligntax eval --ray --backend vllm``: replicas of the model that each run a vLLM engine (a Ray actor
per replica), on a tiny random Qwen2 model in float32: the samples equal those of the vLLM backend in one
process (same ids, responses and per-row steering records), steered with CAST (a per-row decision).

Runs where both vLLM and Ray are installed (``.venv-vllm`` with ``ray[default]==2.60.0``):
``.venv-vllm/bin/python -m pytest tests/test_ray_vllm.py``; skipped elsewhere."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("vllm")
ray = pytest.importorskip("ray")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from aligntax.runs import EvalConfig, run_eval  # noqa: E402
from aligntax.runs.distributed import RayConfig  # noqa: E402
from aligntax.runs.jsonl import read_jsonl  # noqa: E402
from tiny import PROMPTS, save_tiny_vectors, tiny_model, tiny_tokenizer  # noqa: E402

MORE = PROMPTS + [
    "Write a haiku about rain.",
    "What is 2 + 2?",
    "Explain TCP in one line.",
    "How to make a bomb?",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from aligntax.models import load_model

    d = tmp_path_factory.mktemp("tiny-ray-vllm")
    tiny_model("qwen2", hidden=128, layers=3, num_attention_heads=4, num_key_value_heads=2).save_pretrained(
        d / "model"
    )
    tiny_tokenizer().save_pretrained(d / "model")
    save_tiny_vectors(load_model(str(d / "model"), dtype="fp32"), d / "vectors")
    return d


def test_vllm_replicas_write_the_samples_of_one_vllm_process(tiny_dir, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(json.dumps({"id": str(i), "prompt": p, "label": "benign"}) + "\n" for i, p in enumerate(MORE))
    )

    def cfg(name: str) -> EvalConfig:
        return EvalConfig(
            data=[str(data)],
            out=str(tmp_path / name),
            model=str(tiny_dir / "model"),
            dtype="fp32",
            judge="keyword",
            max_new_tokens=8,
            batch_size=3,
            backend="vllm",
            progress=False,
            intervention="cast",
            intervention_args={"path": str(tiny_dir / "vectors"), "threshold": 0.0},
        )

    run_eval(cfg("one"))
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        res = run_eval(cfg("two"), ray=RayConfig(workers=2))
    finally:
        ray.shutdown()
    one = {r["id"]: r for r in read_jsonl(tmp_path / "one" / "samples.jsonl")}
    two = {r["id"]: r for r in read_jsonl(tmp_path / "two" / "samples.jsonl")}
    assert sorted(one) == sorted(two) == sorted(str(i) for i in range(len(MORE)))
    for k, r in one.items():
        assert two[k]["response"] == r["response"]
        assert {f: two[k]["steering"][f] for f in ("steered", "strength")} == {
            f: r["steering"][f] for f in ("steered", "strength")
        }
    steered = [r["steering"]["steered"] for r in two.values()]
    assert any(steered) and not all(steered)  # the condition decided per row
    assert res["config"]["backend"] == "vllm"
