"""The batching engine without HTTP: incremental decoding, stop strings, batch limits and grouping,
back-pressure, draining, and independence from the model's own generation_config."""

from __future__ import annotations

import asyncio
import copy
import random

import pytest

from aligntax.serve.engine import BatchEngine
from aligntax.serve.jobs import (
    Delta,
    EngineClosed,
    EngineOverloaded,
    Failed,
    Finished,
    IncrementalDetokenizer,
    Job,
    SamplingParams,
    StopMatcher,
)
from aligntax.serve.settings import ServerSettings
from serve_tiny import AddVector, tiny_lm

GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def lm(one_thread):
    return tiny_lm()


def _ids(lm, text: str) -> list[int]:
    tok = lm.tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tok(prompt, add_special_tokens=False)["input_ids"]


def _run(engine: BatchEngine, jobs: list[Job], pause: bool = False) -> list[tuple[object, str]]:
    """Submit jobs (all queued before the worker may start when ``pause``); return (final event, deltas)."""

    async def go():
        loop = asyncio.get_running_loop()
        if pause:
            engine.pause()
        try:
            for j in jobs:
                j.loop, j.events = loop, asyncio.Queue()
                engine.submit(j)
        finally:
            engine.resume()
        out = []
        for j in jobs:
            deltas = []
            while True:
                ev = await asyncio.wait_for(j.events.get(), 60)
                if isinstance(ev, Delta):
                    deltas.append(ev.text)
                else:
                    out.append((ev, "".join(deltas)))
                    break
        return out

    return asyncio.run(go())


def test_incremental_detokenizer_matches_full_decode(lm):
    tok = lm.tokenizer
    rng = random.Random(0)
    vocab = len(tok)
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 25))]
        detok = IncrementalDetokenizer(tok)
        parts = [detok.push(i) for i in ids]
        assert all(not p.endswith("\ufffd") for p in parts)  # never emits a half character mid-stream
        assert "".join(parts) + detok.flush() == tok.decode(ids, skip_special_tokens=True)
    # a multi-byte character sent one byte token at a time comes out whole
    byte_ids = [tok.convert_tokens_to_ids(c) for c in "ðŁĻĤ"]  # byte-level symbols of the UTF-8 of 🙂
    detok = IncrementalDetokenizer(tok)
    assert [detok.push(i) for i in byte_ids] == ["", "", "", "🙂"]


def test_stop_matcher_holds_back_partial_stops():
    m = StopMatcher(["END", "xy"])
    assert m.feed("abcE") == ("abc", False)
    assert m.feed("N") == ("", False)
    assert m.feed("Dzzz") == ("", True)
    assert m.text == "abc"
    m = StopMatcher(["END"])
    assert m.feed("abE") == ("ab", False)
    assert m.feed("x") == ("Ex", False)
    assert m.feed("E") == ("", False)
    assert m.flush() == "E" and m.text == "abExE"
    m = StopMatcher([])
    assert m.feed("hello") == ("hello", False)


def test_batches_respect_max_size_and_mixing(lm):
    engine = BatchEngine(lm, AddVector(lm.hidden_size), ServerSettings(max_batch_size=4, batch_wait_ms=50))
    jobs = [Job(_ids(lm, f"question {i}"), GREEDY) for i in range(10)]
    res = _run(engine, jobs, pause=True)
    assert dict(engine.metrics.batch_sizes) == {4: 2, 2: 1}
    assert all(isinstance(ev, Finished) and ev.completion_tokens == 12 for ev, _ in res)
    engine.shutdown()

    alone = _run(BatchEngine(lm, AddVector(lm.hidden_size)), [Job(_ids(lm, "hi"), GREEDY)])[0][0].text
    separate = BatchEngine(lm, AddVector(lm.hidden_size), ServerSettings(batch_wait_ms=50, mix_steered=False))
    jobs = [Job(_ids(lm, "hi"), GREEDY, steer=bool(i % 2)) for i in range(6)]
    res = _run(separate, jobs, pause=True)
    assert dict(separate.metrics.batch_sizes) == {3: 2}
    assert separate.metrics.steered_rows == 3
    texts = [ev.text for ev, _ in res]
    assert texts[0::2] == [alone] * 3 and texts[1::2] != [alone] * 3
    separate.shutdown()


def test_streaming_rows_and_plain_rows_agree(lm):
    engine = BatchEngine(lm, None, ServerSettings(batch_wait_ms=50))
    ids = _ids(lm, "Café 🙂 naïve")
    params = SamplingParams(max_tokens=20, temperature=0)
    (plain, _), (streamed, deltas) = _run(
        engine, [Job(ids, params), Job(ids, params, stream=True)], pause=True
    )
    assert plain.text == streamed.text == deltas
    engine.shutdown()


def test_queue_limit_and_closed_engine(lm):
    engine = BatchEngine(lm, None, ServerSettings(max_queue=2))
    engine.start()
    engine.pause()
    submitted = []
    with pytest.raises(EngineOverloaded):
        for _ in range(10):
            submitted.append(engine.submit(Job(_ids(lm, "hi"), GREEDY)))
    assert 2 <= len(submitted) <= 3
    engine.resume()
    engine.shutdown(drain=True, timeout=60)
    assert all(j.done for j in submitted)
    with pytest.raises(EngineClosed):
        engine.submit(Job(_ids(lm, "hi"), GREEDY))


def test_engine_ignores_model_generation_config_sampling_options(lm):
    ids = _ids(lm, "Hello there")
    engine = BatchEngine(lm, None)
    before = _run(engine, [Job(ids, GREEDY)])[0][0].text
    engine.shutdown()
    saved = copy.deepcopy(lm.model.generation_config)
    try:
        gc = lm.model.generation_config
        gc.repetition_penalty, gc.no_repeat_ngram_size, gc.min_new_tokens = 5.0, 1, 8
        gc.do_sample, gc.temperature, gc.top_k = True, 0.3, 3
        engine = BatchEngine(lm, None)
        after = _run(engine, [Job(ids, GREEDY)])[0][0].text
        engine.shutdown()
    finally:
        lm.model.generation_config = saved
    assert after == before


def test_failed_batch_is_retried_per_request(lm):
    engine = BatchEngine(lm, AddVector(lm.hidden_size, fail_strength=13.0), ServerSettings(batch_wait_ms=50))
    jobs = [
        Job(_ids(lm, "hi"), GREEDY, steer=True, strength=13.0),
        Job(_ids(lm, "hi"), GREEDY),
        Job(_ids(lm, "hi"), GREEDY, steer=True, strength=1.0),
    ]
    res = _run(engine, jobs, pause=True)
    assert isinstance(res[0][0], Failed) and "test intervention failure" in res[0][0].message
    assert isinstance(res[1][0], Finished) and isinstance(res[2][0], Finished)
    assert engine.alive
    engine.shutdown()


def test_finished_requests_leave_the_batch(lm):
    """A request that ends leaves the batch: later forwards run on the rows still answering, and
    the others' answers are those they get alone."""
    ids = _ids(lm, "Tell me a story")
    short, long = SamplingParams(max_tokens=2, temperature=0), SamplingParams(max_tokens=9, temperature=0)
    alone_engine = BatchEngine(lm, None)
    alone = _run(alone_engine, [Job(ids, long)])[0][0].text
    alone_engine.shutdown()
    rows: list[int] = []
    handle = lm.model.register_forward_pre_hook(
        lambda mod, args, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        engine = BatchEngine(lm, None, ServerSettings(batch_wait_ms=50))
        res = _run(engine, [Job(ids, short), Job(ids, long), Job(ids, short)], pause=True)
        engine.shutdown()
    finally:
        handle.remove()
    assert [ev.completion_tokens for ev, _ in res] == [2, 9, 2]
    assert res[1][0].text == alone
    # the shared prefix (one row), the prefill and the second step with three rows, then one row
    assert rows == [1, 3, 3] + [1] * 7


def test_a_burst_arriving_one_by_one_forms_one_batch(lm):
    """Requests that come a few milliseconds apart join the batch as long as each comes within
    batch_wait of the one before; max_batch_wait caps the wait in all."""
    import threading
    import time

    def burst(engine: BatchEngine, n: int, gap_s: float) -> dict:
        async def go():
            loop = asyncio.get_running_loop()
            jobs = [Job(_ids(lm, f"q{i}"), SamplingParams(max_tokens=2, temperature=0)) for i in range(n)]
            for j in jobs:
                j.loop, j.events = loop, asyncio.Queue()

            def send():
                for j in jobs:
                    engine.submit(j)
                    time.sleep(gap_s)

            t = threading.Thread(target=send)
            t.start()
            for j in jobs:
                while not isinstance(await asyncio.wait_for(j.events.get(), 60), Finished):
                    pass
            t.join()

        asyncio.run(go())
        engine.shutdown()
        return dict(engine.metrics.batch_sizes)

    # 8 requests 10 ms apart, each within batch_wait (60 ms) of the one before: one batch, though the
    # burst lasts longer than batch_wait
    assert burst(
        BatchEngine(lm, None, ServerSettings(batch_wait_ms=60, max_batch_wait_ms=5000)), 8, 0.01
    ) == {8: 1}
    # the same burst with the whole wait capped at 60 ms: split
    assert 8 not in burst(
        BatchEngine(lm, None, ServerSettings(batch_wait_ms=60, max_batch_wait_ms=60)), 8, 0.01
    )


def _rss_mb() -> float:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) / 1024 for line in fh if line.startswith("VmRSS"))


def test_trim_allocator_returns_scattered_free_memory():
    """Small tensors freed between kept ones leave holes no heap top can return; the trim hands those
    pages back (glibc; skipped elsewhere)."""
    import gc

    import torch

    from aligntax.serve.engine import trim_allocator

    if not trim_allocator():
        pytest.skip("no glibc malloc_trim here")
    keep, drop = [], []
    for i in range(3000):  # 64 KB each, below the allocator's mmap threshold: from the heap
        (keep if i % 8 == 0 else drop).append(torch.ones(16 * 1024))
    drop.clear()
    gc.collect()
    freed = 3000 * 7 / 8 * 64 / 1024  # MB freed, scattered between the kept tensors
    before = _rss_mb()
    trim_allocator()
    assert before - _rss_mb() > 0.5 * freed
    assert len(keep) == 375


def test_the_worker_trims_after_each_batch(lm, monkeypatch):
    import aligntax.serve.engine as eng

    calls = []
    monkeypatch.setattr(eng, "trim_allocator", lambda: calls.append(1) or True)
    engine = BatchEngine(lm, None, ServerSettings(max_batch_size=2, batch_wait_ms=50))
    jobs = [Job(_ids(lm, f"question {i}"), GREEDY) for i in range(5)]
    _run(engine, jobs, pause=True)
    engine.shutdown()
    assert len(calls) == sum(engine.metrics.batch_sizes.values()) == 3


def test_the_kernel_cache_is_capped_unless_the_user_set_it(monkeypatch):
    import os

    from aligntax.serve.engine import ONEDNN_CACHE, bound_kernel_cache

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    bound_kernel_cache()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(ONEDNN_CACHE)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
    bound_kernel_cache()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64"
