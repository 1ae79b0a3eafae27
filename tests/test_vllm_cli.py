"""The ``--backend`` option of ``aligntax serve`` and ``aligntax els sweep`` (no vLLM needed): an unknown
backend and options the vLLM server does not take are refused before anything is loaded (usage errors:
exit status 2), and without vLLM installed ``--backend vllm`` says how to get it."""

from __future__ import annotations

import importlib.util

import pytest
from typer.testing import CliRunner

from aligntax.cli import app

runner = CliRunner()


def test_serve_refuses_an_unknown_backend():
    res = runner.invoke(app, ["serve", "--backend", "tgi", "--port", "1"])
    assert res.exit_code == 2
    assert "Unknown backend 'tgi'" in res.output


def test_serve_vllm_refuses_a_device():
    res = runner.invoke(app, ["serve", "--backend", "vllm", "--device", "cuda", "--port", "1"])
    assert res.exit_code == 2
    assert "--device is not used with --backend vllm" in res.output


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_serve_vllm_without_vllm_says_how_to_get_it():
    res = runner.invoke(app, ["serve", "--backend", "vllm", "--port", "1"])
    assert res.exit_code == 2
    assert "./run setup-vllm" in res.output


def test_sweep_refuses_an_unknown_backend(tmp_path):
    res = runner.invoke(app, ["els", "sweep", "--steer", str(tmp_path), "--backend", "tgi"])
    assert res.exit_code != 0
    assert "Unknown backend 'tgi'" in res.output


def test_serve_vllm_refuses_a_latency_target():
    res = runner.invoke(app, ["serve", "--backend", "vllm", "--max-latency-ms", "500", "--port", "1"])
    assert res.exit_code == 2
    assert "not served by the vLLM backend" in res.output
