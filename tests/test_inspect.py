"""inspect_ai (extra ``inspect``) against ``aligntax serve``: a real server subprocess serving a tiny random
model and its ``+els`` variant (``--steer`` a tiny energy bank), and an inspect eval over a local JSONL
dataset with the ``includes`` scorer through inspect's ``openai-api`` provider (base URL and key from
``ALIGNTAX_BASE_URL`` / ``ALIGNTAX_API_KEY``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("inspect_ai")

import httpx  # noqa: E402
import openai  # noqa: E402

import aligntax  # noqa: E402
from tiny import save_tiny_bank, tiny_lm  # noqa: E402

KEY = "sk-inspect-test"
MAX_TOKENS = 8
ITEMS = [
    {"input": "Say red.", "target": "red"},
    {"input": "Name a colour.", "target": "blue"},
    {"input": "What is 2 + 2?", "target": "4"},
    {"input": "Repeat: stone", "target": "stone"},
]

pytestmark = pytest.mark.usefixtures("one_thread")


def _wait_for_port(proc: subprocess.Popen, log_path: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"aligntax serve exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        m = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", log_path.read_text())
        if m and httpx.get(m.group(1) + "/health", timeout=5).json()["status"] == "ok":
            return m.group(1)
        time.sleep(0.2)
    pytest.fail(f"aligntax serve did not come up in {timeout} s:\n{log_path.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``aligntax serve --model DIR --steer BANK --model-name tiny`` in a subprocess: ``tiny`` and
    ``tiny+els``; yields the base URL."""
    root = tmp_path_factory.mktemp("inspect")
    lm = tiny_lm("qwen2", hidden=32, layers=3)
    lm.model.save_pretrained(root / "model")
    lm.tokenizer.save_pretrained(root / "model")
    bank = save_tiny_bank(
        aligntax.load_model(str(root / "model"), dtype="fp32", device="cpu"), root / "bank", n=16, epochs=2
    )
    log_path = root / "serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "ALIGNTAX_API_KEY": KEY}
    cmd = [
        sys.executable,
        "-m",
        "aligntax",
        "serve",
        "--model",
        str(root / "model"),
        "--steer",
        str(bank),
        "--model-name",
        "tiny",
        "--dtype",
        "fp32",
        "--device",
        "cpu",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--threads",
        "1",
        "--max-tokens-limit",
        "64",
        "--top-k",
        "2",
        "--eta",
        "0.3",
        "--horizon",
        "none",
        "--row-threshold",
        "none",
    ]  # every row steered
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        yield _wait_for_port(proc, log_path, timeout=120)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_inspect_eval_against_aligntax_serve(served, tmp_path, monkeypatch):
    from inspect_ai import Task, eval
    from inspect_ai.dataset import json_dataset
    from inspect_ai.model import GenerateConfig
    from inspect_ai.scorer import includes
    from inspect_ai.solver import generate

    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in ITEMS), encoding="utf-8")
    monkeypatch.setenv("ALIGNTAX_BASE_URL", served + "/v1")
    monkeypatch.setenv("ALIGNTAX_API_KEY", KEY)
    task = Task(
        dataset=json_dataset(str(data)),
        solver=generate(),
        scorer=includes(),
        config=GenerateConfig(temperature=0.0, max_tokens=MAX_TOKENS),
    )
    names = ["tiny", "tiny+els"]
    logs = eval(
        task,
        model=[f"openai-api/aligntax/{n}" for n in names],
        log_dir=str(tmp_path / "logs"),
        display="none",
        max_connections=4,
    )
    assert len(logs) == 2
    client = openai.OpenAI(base_url=served + "/v1", api_key=KEY, max_retries=0, timeout=60)
    completions = {}
    for log in logs:
        assert log.status == "success", log.error
        name = log.eval.model.split("/")[-1]
        samples = sorted(log.samples, key=lambda s: s.id)
        assert len(samples) == len(ITEMS)
        completions[name] = []
        for sample, item in zip(samples, ITEMS, strict=True):
            text = sample.output.completion
            completions[name].append(text)
            # inspect's scorer saw the server's answer: includes = target in the answer (case-insensitive)
            value = next(iter(sample.scores.values())).value
            assert value == ("C" if item["target"].lower() in text.lower() else "I")
            # and that answer is the server's greedy answer to the same request
            direct = client.chat.completions.create(
                model=name,
                messages=[{"role": "user", "content": item["input"]}],
                temperature=0,
                max_tokens=MAX_TOKENS,
            )
            assert text == direct.choices[0].message.content
        assert any(completions[name])
    assert sorted(completions) == names
    assert completions["tiny"] != completions["tiny+els"]  # the +els name is steered
