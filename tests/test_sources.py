"""Generation sources picked from ``--backend`` / ``--ray`` (no model loaded, no vLLM or Ray needed), and
the answer finishing both serve engines share."""

from __future__ import annotations

import pytest

from aligntax.backends.hf import HFSource
from aligntax.backends.vllm.source import VllmSource
from aligntax.errors import AligntaxError
from aligntax.runs.distributed import RayConfig, RaySource
from aligntax.runs.sources import check_source, generation_source
from aligntax.serve.jobs import Delta, Finished, Job, RowText, SamplingParams, finish_events


def test_the_option_picks_the_source():
    assert isinstance(generation_source(None), HFSource) and generation_source("HF").backend == "hf"
    assert isinstance(generation_source("vllm"), VllmSource)
    ray = generation_source("vllm", RayConfig(workers=2))
    assert isinstance(ray, RaySource) and isinstance(ray.local, VllmSource) and ray.backend == "vllm"
    with pytest.raises(AligntaxError, match="Unknown backend 'tgi'"):
        generation_source("tgi")
    with pytest.raises(AligntaxError, match="backend 'vllm'"):
        check_source(HFSource(), "vllm")


def test_each_source_refuses_what_it_cannot_take():
    HFSource().check(
        recorder=True, loaded_intervention=True, loaded_model=True, device_map=True, adapters=True
    )
    with pytest.raises(AligntaxError, match="Hugging Face backend only"):
        VllmSource().check(adapters=True)
    with pytest.raises(AligntaxError, match="Hugging Face backend only"):
        RaySource(RayConfig(), VllmSource()).check(adapters=True)
    with pytest.raises(AligntaxError, match="records no prompt states"):
        VllmSource().check(recorder=True)
    with pytest.raises(AligntaxError, match="no loaded intervention"):
        VllmSource().check(loaded_intervention=True)
    with pytest.raises(AligntaxError, match="places its model itself"):
        VllmSource().check(device_map=True)
    with pytest.raises(AligntaxError, match="loads the model on its replicas"):
        RaySource(RayConfig()).check(loaded_model=True)
    with pytest.raises(AligntaxError, match="records no prompt states"):
        RaySource(RayConfig(), VllmSource()).check(recorder=True)
    with pytest.raises(AligntaxError, match="--device is not used"):
        VllmSource().check_serving(device="cuda")
    with pytest.raises(AligntaxError, match="not served by the vLLM backend"):
        VllmSource().check_serving(max_latency_ms=100.0)


class _Tok:
    """Token i is the letter chr(97 + i); 9 is the end token (no text)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i) for i in ids if i != 9)


def test_an_answer_is_finished_alike_with_and_without_streaming():
    tok = _Tok()
    plain = Job([1, 2], SamplingParams(max_tokens=8))
    events = finish_events(plain, tok, [0, 1, 9], 3, "stop", True, None)
    assert events == [Finished("ab", "stop", 2, 3)]
    streamed = Job([1, 2], SamplingParams(max_tokens=8, stop=("c",)), stream=True)
    row, sent = RowText(tok, ("c",)), []
    assert not row.push(streamed, 0, sent) and not row.push(streamed, 1, sent)
    assert row.push(streamed, 2, sent)  # the stop string: cut before it
    events = finish_events(streamed, tok, [0, 1, 2], 3, "stop", False, row)
    assert "".join(e.text for e in sent if isinstance(e, Delta)) == "ab" and events == [
        Finished("ab", "stop", 2, 3)
    ]
