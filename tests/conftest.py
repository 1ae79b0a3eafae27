"""Shared fixtures: tiny randomly initialised chat models built from a config, one intra-op thread,
and data paths."""

from __future__ import annotations

import pytest
import torch

from aligntax.models.embedded import converted_dir, is_fetched
from aligntax.paths import shared_data_dir
from tiny import make_tiny_lm

QWEN = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture(scope="session")
def qwen_tokenizer():
    """The real Qwen2.5 tokenizer (with its chat template), from the embedded model cache."""
    from transformers import AutoTokenizer

    from aligntax.models.loader import prepare_tokenizer

    if not is_fetched(QWEN):
        pytest.skip("embedded model not fetched (run ./run setup)")
    tok = AutoTokenizer.from_pretrained(converted_dir(QWEN))
    prepare_tokenizer(tok)
    return tok


@pytest.fixture()
def tiny_lm(qwen_tokenizer):
    return make_tiny_lm(qwen_tokenizer)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``): on a
    small shared machine, OpenMP barriers across busy cores make every step of a tiny model wait for a
    descheduled thread (10x slower, and noisy timings)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def data_dir():
    d = shared_data_dir()
    if d is None:
        pytest.skip("benchmark data folder not found (set ALIGNTAX_DATA)")
    return d


@pytest.fixture()
def parity_judge(monkeypatch):
    """The judge ``"parity"`` (:class:`tiny.ParityJudge`: a function of the answer's exact text) in the
    judge registry for one test."""
    from aligntax.judges import registry
    from tiny import ParityJudge

    monkeypatch.setitem(registry._JUDGES, "parity", (lambda **kw: ParityJudge(), "test"))
