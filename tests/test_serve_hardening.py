"""Hardening of the OpenAI-compatible server, against a real uvicorn server on loopback with a tiny model.

Every case checks three things: the right status (and OpenAI error body), that the server answers a
normal request afterwards, and that its log holds no unhandled exception.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import torch
from typer.testing import CliRunner

from aligntax.interventions.base import Intervention, hidden_from_args, hooks_attached, replace_hidden_in_args
from aligntax.models.layers import decoder_layers
from aligntax.serve import ServerSettings, create_app
from aligntax.serve.background import BackgroundServer
from aligntax.serve.engine import BatchEngine
from aligntax.serve.jobs import Failed, Finished, Job, SamplingParams
from aligntax.serve.metrics import ServeMetrics
from aligntax.serve.security import MAX_BODY_BYTES, InsecureBindError, RequestGuard, check_bind
from serve_tiny import tiny_lm

KEY = "sk-hardening"
NAME = "tiny"
STEERED = "tiny+trouble"
NAN_STRENGTH = 7.0  # rows steered at this strength turn NaN
SLOW_STRENGTH = 5.0  # batches holding a row of this strength take 0.2 s per forward pass
HELLO = [{"role": "user", "content": "Hello there, how are you?"}]
AUTH = {"Authorization": f"Bearer {KEY}"}
URL = "/v1/chat/completions"
TIMEOUT_S = 3.0


class Trouble(Intervention):
    """Per row: NaN hidden states at NAN_STRENGTH; slow forward passes at SLOW_STRENGTH; else a shift."""

    name = "trouble"

    def __init__(self, hidden: int):
        self.vector = torch.randn(hidden, generator=torch.Generator().manual_seed(3)) * 30

    @contextmanager
    def attach(self, model, ctx):
        layer = decoder_layers(model)[-1]

        def hook(module, args, kwargs):
            h = hidden_from_args(args, kwargs)
            scale = ctx.row_scale(h.shape[0], h.device, h.dtype)
            if bool((scale == SLOW_STRENGTH).any()):
                time.sleep(0.2)
            h = h + scale * self.vector.to(h.device, h.dtype)
            h = torch.where(scale == NAN_STRENGTH, torch.full_like(h, float("nan")), h)
            return replace_hidden_in_args(args, kwargs, h)

        with hooks_attached([(layer, hook, True)]):
            yield


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def unhandled(self) -> list[str]:
        bad = []
        for r in self.records:
            msg = r.getMessage()
            if (
                r.exc_info
                or "Exception in ASGI application" in msg
                or "unhandled error" in msg
                or "Traceback" in msg
                or "never retrieved" in msg
            ):
                bad.append(f"{r.name}: {msg}")
        return bad


_LOGGERS = ("uvicorn", "uvicorn.error", "aligntax", "aligntax.serve", "asyncio")


@pytest.fixture(scope="module")
def logs():
    handler = _Records()
    for name in _LOGGERS:
        logging.getLogger(name).addHandler(handler)
    yield handler
    for name in _LOGGERS:
        logging.getLogger(name).removeHandler(handler)


@pytest.fixture(scope="module")
def lm(one_thread):
    return tiny_lm()


@pytest.fixture(scope="module")
def live(lm, logs):
    app = create_app(
        lm,
        Trouble(lm.hidden_size),
        ServerSettings(
            model_name=NAME,
            api_key=KEY,
            max_batch_size=16,
            batch_wait_ms=20,
            max_prompt_tokens=200,
            max_tokens_limit=64,
            default_max_tokens=16,
            max_queue=3,
            request_timeout=TIMEOUT_S,
        ),
    )
    srv = BackgroundServer(app).start()
    # uvicorn configures its loggers at start: attach (again) afterwards
    for name in _LOGGERS:
        if logs not in logging.getLogger(name).handlers:
            logging.getLogger(name).addHandler(logs)
    yield srv
    srv.stop()


@pytest.fixture
def http(live):
    with httpx.Client(base_url=live.url, headers=AUTH, timeout=30) as c:
        yield c


def _engine(live):
    return live.app.state.engine


def _body(**kw) -> dict:
    return {"model": NAME, "messages": HELLO, "max_tokens": 6, "temperature": 0, **kw}


def _err(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error") or status == 429
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def _healthy(live, logs) -> None:
    """The server answers normally and its log holds no unhandled exception."""
    r = httpx.post(live.url + URL, json=_body(), headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] is not None
    assert _engine(live).alive
    assert not logs.unhandled(), logs.unhandled()


def _wait(pred, timeout: float = 10, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@contextmanager
def _paused(engine):
    engine.pause()
    try:
        yield
    finally:
        engine.resume()


# -- body size ------------------------------------------------------------------------------------------


def test_guard_answers_413_to_endless_chunked_body_without_reading_it():
    """ASGI level: a body that never ends is cut off just past the limit."""
    calls, sent = [0], []
    chunk = b"x" * (1 << 20)

    async def receive():
        calls[0] += 1
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message):
        sent.append(message)

    async def app(scope, receive, send):  # pragma: no cover - must not be reached
        raise AssertionError("the app was called")

    guard = RequestGuard(app, None, ServeMetrics())
    scope = {"type": "http", "method": "POST", "path": URL, "headers": [(b"transfer-encoding", b"chunked")]}
    asyncio.run(guard(scope, receive, send))
    assert sent[0]["status"] == 413
    assert calls[0] == MAX_BODY_BYTES // len(chunk) + 1
    assert json.loads(sent[1]["body"])["error"]["code"] == "request_too_large"


def test_chunked_body_over_limit_gets_413(live, http, logs):
    sock = socket.create_connection(("127.0.0.1", live.port), timeout=30)
    got = bytearray()

    def reader():
        try:
            while b"\r\n\r\n" not in got:
                data = sock.recv(65536)
                if not data:
                    return
                got.extend(data)
        except OSError:
            pass

    t = threading.Thread(target=reader)
    t.start()
    head = (
        f"POST {URL} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
        "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()
    try:
        sock.sendall(head)
        piece = b"x" * (1 << 20)
        for _ in range(MAX_BODY_BYTES // len(piece) + 1):  # just over the limit, and never a last chunk
            sock.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
    except OSError:
        pass  # the server may close while we still send: it answered already
    t.join(30)
    sock.close()
    assert got.startswith(b"HTTP/1.1 413"), bytes(got[:200])
    # a small chunked body is fine
    payload = json.dumps(_body()).encode()
    r = http.post(
        URL, content=iter([payload[:10], payload[10:]]), headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 200, r.text
    _healthy(live, logs)


# -- invalid Unicode ------------------------------------------------------------------------------------


def test_lone_surrogates_are_400(live, http, logs):
    hi = '[{"role": "user", "content": "hi"}]'
    raw = [
        b'{"model": "tiny", "messages": [{"role": "user", "content": "hi \\ud800"}]}',
        b'{"model": "\\ud800", "messages": ' + hi.encode() + b"}",
        b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
        b'{"model": "tiny", "messages": ' + hi.encode() + b', "stop": ["\\ud800"]}',
        b'{"model": "tiny", "messages": ' + hi.encode() + b', "\\ud800": 1}',
        b'{"model": "tiny", "messages": [{"role": "user", "content": "raw \xed\xa0\x80"}]}',  # CESU surrogate
        b'{"model": "tiny", "messages": [{"role": "user", "content": "bad \xff byte"}]}',
    ]
    for body in raw:
        r = http.post(URL, content=body, headers={"Content-Type": "application/json"})
        _err(r, 400)
    err = _err(http.post(URL, content=raw[1], headers={"Content-Type": "application/json"}), 400)
    assert err["param"] == "model" and "Unicode" in err["message"]
    _healthy(live, logs)


# -- unknown fields -------------------------------------------------------------------------------------


def test_unknown_fields_are_400(live, http, logs, lm):
    _err(http.post(URL, json={**_body(), "max_toknes": 5}), 400, "unknown_parameter", "max_toknes")
    bad_msg = [{"role": "user", "content": "hi", "nmae": "x"}]
    _err(http.post(URL, json=_body(messages=bad_msg)), 400, "unknown_parameter", "messages[0].nmae")
    _err(
        http.post(URL, json=_body(stream=True, stream_options={"include_usage": True, "x": 1})),
        400,
        "unknown_parameter",
        "stream_options.x",
    )
    _err(http.post(URL, json=_body(functions=[{"name": "f"}])), 400, "unsupported_value", "functions")
    # known OpenAI fields that are harmless are accepted; an echoed assistant message too
    echo = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "refusal": None, "tool_calls": None, "annotations": []},
        {"role": "user", "content": "and?"},
    ]
    r = http.post(URL, json=_body(messages=echo, store=False, metadata={"a": "b"}, modalities=["text"]))
    assert r.status_code == 200, r.text
    _healthy(live, logs)

    lenient = BackgroundServer(
        create_app(
            lm, None, ServerSettings(model_name="lenient", allow_unknown_fields=True, max_tokens_limit=8)
        )
    ).start()
    try:
        r = httpx.post(
            lenient.url + URL, json={**_body(model="lenient"), "max_toknes": 5, "foo": {"x": 1}}, timeout=30
        )
        assert r.status_code == 200, r.text
    finally:
        lenient.stop()


# -- non-loopback host ----------------------------------------------------------------------------------


def test_non_loopback_host_needs_key_or_insecure():
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.5"):
        check_bind(host, None)
    check_bind("0.0.0.0", "key")
    check_bind("0.0.0.0", None, insecure=True)
    for host in ("0.0.0.0", "::", "192.168.1.10", "example.com"):
        with pytest.raises(InsecureBindError, match="--insecure"):
            check_bind(host, None)

    from aligntax.cli import app

    res = CliRunner().invoke(
        app, ["serve", "--host", "0.0.0.0", "--model", "no/such-model"], env={"ALIGNTAX_API_KEY": ""}
    )
    assert res.exit_code == 2, res.output
    assert "without an API key" in res.output and "--insecure" in res.output
    res = CliRunner().invoke(app, ["serve", "--host", "0.0.0.0", "--insecure", "--model", "/no/such/model"])
    assert "without an API key" not in res.output  # got past the check (and failed loading the model)


# -- deadline and disconnects ---------------------------------------------------------------------------


def test_request_timeout_cancels_and_answers_504(live, http, logs):
    engine = _engine(live)
    epoch = engine.cancel_epoch
    with _paused(engine):
        t0 = time.monotonic()
        r = http.post(URL, json=_body())
        took = time.monotonic() - t0
        _err(r, 504, "request_timeout")
        assert TIMEOUT_S - 0.1 <= took < TIMEOUT_S + 5
        assert engine.cancel_epoch > epoch
        # streaming: the role chunk, then an error event
        with http.stream("POST", URL, json=_body(stream=True)) as s:
            lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    assert json.loads(lines[-2][6:])["error"]["code"] == "request_timeout"
    assert lines[-1] == "data: [DONE]"
    _wait(lambda: engine.queue_depth == 0, what="the queue to empty")
    _healthy(live, logs)


def test_client_disconnect_cancels_non_streaming(live, logs):
    engine = _engine(live)
    epoch, batches = engine.cancel_epoch, engine.metrics.batches
    with _paused(engine):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(live.url + URL, json=_body(max_tokens=64), headers=AUTH, timeout=0.5)
        _wait(lambda: engine.cancel_epoch > epoch, what="the server to notice the client going away")
    _wait(lambda: engine.queue_depth == 0, what="the queue to empty")
    time.sleep(0.1)
    assert engine.metrics.batches == batches  # the cancelled request never ran
    _healthy(live, logs)


def test_disconnect_mid_generation_takes_rows_out_of_the_batch(live, logs):
    engine = _engine(live)
    epoch = engine.cancel_epoch
    body = _body(model=STEERED, max_tokens=64, aligntax={"strength": SLOW_STRENGTH})
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.url + URL, json=body, headers=AUTH, timeout=1.0)
    _wait(lambda: engine.cancel_epoch > epoch, what="the cancel")
    _wait(lambda: engine.in_flight == 0, timeout=5, what="the batch to end early")  # 64 steps would take 13 s
    _healthy(live, logs)


# -- queue bound ----------------------------------------------------------------------------------------


def test_full_queue_answers_429_with_retry_after(live, logs):
    engine = _engine(live)
    results: list = []

    def call():
        results.append(httpx.post(live.url + URL, json=_body(), headers=AUTH, timeout=30))

    with _paused(engine):
        threads = [threading.Thread(target=call) for _ in range(4)]  # 1 taken by the worker + 3 queued
        for t in threads:
            t.start()
            time.sleep(0.05)
        _wait(lambda: engine.queue_depth == 4, what="a full queue")
        r = httpx.post(live.url + URL, json=_body(), headers=AUTH, timeout=30)
        _err(r, 429, "queue_full")
        assert r.headers["Retry-After"] == "1"
    for t in threads:
        t.join(30)
    assert [x.status_code for x in results] == [200] * 4
    _healthy(live, logs)


# -- admission: counted from arrival, bounded by the expected wait --------------------------------------


def test_requests_being_tokenised_count_against_the_queue_bound(live, logs):
    """max_queue=3: three requests stuck in tokenisation fill the queue; a fourth gets 429 at once."""
    server, engine = live.app.state.handler, _engine(live)
    release = threading.Event()
    encode = server.encode

    def slow_encode(*a, **kw):
        assert release.wait(30)
        return encode(*a, **kw)

    results: list = []

    def call():
        results.append(httpx.post(live.url + URL, json=_body(), headers=AUTH, timeout=30))

    server.encode = slow_encode
    try:
        threads = [threading.Thread(target=call) for _ in range(3)]
        for t in threads:
            t.start()
        _wait(lambda: engine.waiting == 3, what="three requests in tokenisation")
        assert engine.queue_depth == 0  # none reached the engine's queue yet: the old bound saw nothing
        r = httpx.post(live.url + URL, json=_body(), headers=AUTH, timeout=30)
        _err(r, 429, "queue_full")
        assert r.headers["Retry-After"] == "1"
    finally:
        release.set()
        del server.encode
    for t in threads:
        t.join(30)
    assert [x.status_code for x in results] == [200] * 3
    assert engine.waiting == 0
    _healthy(live, logs)


def test_requests_refused_after_admission_are_withdrawn(live, http, logs):
    engine = _engine(live)
    _err(http.post(URL, json=_body(model="nope")), 404, "model_not_found")
    _err(
        http.post(URL, json=_body(messages=[{"role": "user", "content": "x" * 5000}])),
        400,
        "context_length_exceeded",
    )
    _err(http.post(URL, json=_body(max_tokens=10_000)), 400)
    assert engine.waiting == 0 and engine._arriving == 0
    _healthy(live, logs)


def test_engine_admission_counts_and_expected_wait(lm):
    from aligntax.serve.jobs import EngineOverloaded

    engine = BatchEngine(lm, None, ServerSettings(max_batch_size=2, max_queue=3, max_queue_wait_ms=100))
    try:
        for _ in range(3):
            engine.admit()
        with pytest.raises(EngineOverloaded) as e:
            engine.admit()
        assert (e.value.status, e.value.code, e.value.retry_after) == (429, "queue_full", 1)
        engine.withdraw()
        engine.admit()
        for _ in range(3):
            engine.withdraw()
        assert engine.waiting == 0
        # a measured batch of 0.5 s, one running since now: a request with one waiting ahead waits ~0.5 s
        engine.batch_seconds = 0.5
        engine._batch_started = time.perf_counter()
        # (wall-clock time passes between these lines: on a loaded machine a thread may wait its turn)
        assert engine.expected_wait(0) == pytest.approx(0.5, abs=0.2)
        assert engine.expected_wait(2) == pytest.approx(1.0, abs=0.2)  # a full batch of 2 ahead, then ours
        engine.admit()  # nothing waiting: always admitted (it starts the next batch)
        with pytest.raises(EngineOverloaded) as e:
            engine.admit()
        assert (e.value.status, e.value.code, e.value.retry_after) == (503, "overloaded", 1)
        assert "target 0.10 s" in str(e.value)
        engine._batch_started = None  # the batch ended: nothing ahead of the next one but the queue
        engine.admit()
        assert engine.waiting == 2
        engine.withdraw()
        engine.withdraw()
        engine.batch_seconds = 3.2
        engine._batch_started = time.perf_counter()
        engine.admit()
        with pytest.raises(EngineOverloaded) as e:
            engine.admit()
        assert e.value.retry_after == 4  # about when the work ahead has drained
    finally:  # a failed check must not leave the engine's thread running into the next tests
        engine.shutdown()


def test_expected_wait_over_the_target_answers_503_with_retry_after(lm, logs):
    app = create_app(
        lm,
        None,
        ServerSettings(
            model_name="w", max_batch_size=4, max_queue=50, max_queue_wait_ms=50, max_tokens_limit=64
        ),
    )
    assert app.state.engine.max_queue_wait == pytest.approx(0.05)
    with BackgroundServer(app) as srv:
        engine = app.state.engine
        body = {"model": "w", "messages": HELLO, "max_tokens": 4, "temperature": 0}
        results: list = []

        def call():
            results.append(httpx.post(srv.url + URL, json=body, timeout=30))

        with _paused(engine):
            engine.batch_seconds = 0.5  # as if batches took 0.5 s and one had just started
            engine._batch_started = time.perf_counter()
            first = threading.Thread(target=call)
            first.start()  # taken by the worker, which is paused: it starts the next batch
            _wait(lambda: engine.queue_depth == 1, what="the first request")
            second = threading.Thread(target=call)
            second.start()  # nothing waiting ahead: admitted
            _wait(lambda: engine.waiting == 1, what="the second request")
            r = httpx.post(srv.url + URL, json=body, timeout=30)
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert err["code"] == "overloaded" and err["type"] == "server_error" and "retry" in err["message"]
            assert int(r.headers["Retry-After"]) >= 1
            engine._batch_started = None
        for t in (first, second):
            t.join(30)
        assert [x.status_code for x in results] == [200, 200]
        assert httpx.post(srv.url + URL, json=body, timeout=30).status_code == 200
        assert engine.waiting == 0
    assert not logs.unhandled(), logs.unhandled()


def test_a_latency_target_stops_batches_from_waiting_for_requests_that_may_not_come(lm):
    engine = BatchEngine(
        lm,
        None,
        ServerSettings(max_batch_size=8, batch_wait_ms=400, max_batch_wait_ms=400, max_queue_wait_ms=100),
    )

    async def go():
        job = Job(
            _ids(lm, "hi"), SamplingParams(2, 0), loop=asyncio.get_running_loop(), events=asyncio.Queue()
        )
        t0 = time.perf_counter()
        engine.submit(job)
        ev = await asyncio.wait_for(job.events.get(), 30)
        return ev, time.perf_counter() - t0

    ev, took = asyncio.run(go())
    assert isinstance(ev, Finished) and took < 0.35, took  # did not wait the 400 ms batch window
    _wait(lambda: engine.batch_seconds is not None, what="the batch's duration")  # recorded after the answer
    assert engine.batch_seconds > 0
    engine.shutdown()


def test_serve_cli_has_the_queue_wait_target():
    from aligntax.cli import app

    res = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert res.exit_code == 0 and "--max-queue-wait-ms" in res.output


# -- batch budget, tokenisation, stop strings -----------------------------------------------------------


def _ids(lm, text: str) -> list[int]:
    tok = lm.tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tok(prompt, add_special_tokens=False)["input_ids"]


def test_padded_token_budget_keeps_a_long_prompt_apart(lm):
    short = [_ids(lm, f"hi {i}") for i in range(4)]
    long = _ids(lm, "The quick brown fox jumps over the lazy dog. " * 6)
    budget = max(len(long), 4 * max(map(len, short)))
    assert len(long) * 2 > budget
    engine = BatchEngine(
        lm, None, ServerSettings(max_batch_size=8, batch_wait_ms=50, max_batch_tokens=budget)
    )
    jobs = [Job(short[0], SamplingParams(4, 0)), Job(long, SamplingParams(4, 0))] + [
        Job(ids, SamplingParams(4, 0)) for ids in short[1:]
    ]

    async def go():
        loop = asyncio.get_running_loop()
        engine.pause()
        for j in jobs:
            j.loop, j.events = loop, asyncio.Queue()
            engine.submit(j)
        engine.resume()
        return [await asyncio.wait_for(j.events.get(), 60) for j in jobs]

    res = asyncio.run(go())
    assert all(isinstance(ev, Finished) for ev in res)
    assert dict(engine.metrics.batch_sizes) == {4: 1, 1: 1}  # four short ones together, the long one alone
    engine.shutdown()


def test_decoding_does_not_wait_on_prompt_tokenisation(live):
    server = live.app.state.handler
    engine = _engine(live)
    assert server.encode_tokenizer is not engine.tokenizer and server.encode_lock is not engine.tokenizer_lock
    done = threading.Event()
    with engine.tokenizer_lock:  # as during a decoding step
        t = threading.Thread(target=lambda: (server.encode(HELLO, False), done.set()))
        t.start()
        assert done.wait(10), "tokenising a request waited for the decoding lock"
    t.join()


def test_stop_string_limits(live, http, logs):
    _err(http.post(URL, json=_body(stop=["a", "b", "c", "d", "e"])), 400, None, "stop")
    _err(http.post(URL, json=_body(stop="x" * 257)), 400, None, "stop")
    r = http.post(URL, json=_body(stop=["q" * 256, "b", "c", "zz"]))
    assert r.status_code == 200, r.text
    _healthy(live, logs)


# -- NaN in one row -------------------------------------------------------------------------------------


def test_nan_row_fails_alone(live, http, logs):
    engine = _engine(live)
    plain = http.post(URL, json=_body(max_tokens=8)).json()["choices"][0]["message"]["content"]
    half = http.post(URL, json=_body(model=STEERED, max_tokens=8, aligntax={"strength": 0.5})).json()
    half = half["choices"][0]["message"]["content"]
    reqs = [
        _body(model=STEERED, max_tokens=8, aligntax={"strength": NAN_STRENGTH}),
        _body(max_tokens=8),
        _body(model=STEERED, max_tokens=8, aligntax={"strength": 0.5}),
        _body(model=STEERED, max_tokens=8, stream=True, aligntax={"strength": NAN_STRENGTH}),
    ]
    out: dict = {}

    def call(i, body):
        if body.get("stream"):
            with httpx.stream("POST", live.url + URL, json=body, headers=AUTH, timeout=30) as s:
                out[i] = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
        else:
            out[i] = httpx.post(live.url + URL, json=body, headers=AUTH, timeout=30)

    batches = engine.metrics.batches
    with _paused(engine):
        threads = [threading.Thread(target=call, args=(i, b)) for i, b in enumerate(reqs)]
        for t in threads:
            t.start()
        _wait(lambda: engine.queue_depth == len(reqs), timeout=30, what="all requests queued")
    for t in threads:
        t.join(30)
    assert engine.metrics.batches == batches + 1  # one batch
    err = _err(out[0], 400, "non_finite_output")
    assert "strength" in err["message"]
    assert out[1].json()["choices"][0]["message"]["content"] == plain
    assert out[2].json()["choices"][0]["message"]["content"] == half
    assert json.loads(out[3][-2][6:])["error"]["code"] == "non_finite_output"
    _healthy(live, logs)


def test_nan_row_engine_level(lm):
    engine = BatchEngine(lm, Trouble(lm.hidden_size), ServerSettings(batch_wait_ms=50))
    jobs = [
        Job(_ids(lm, "hi"), SamplingParams(6, 0), steer=True, strength=NAN_STRENGTH),
        Job(_ids(lm, "hi"), SamplingParams(6, 1.0, seed=1)),
        Job(_ids(lm, "hi"), SamplingParams(6, 0)),
    ]

    async def go():
        loop = asyncio.get_running_loop()
        engine.pause()
        for j in jobs:
            j.loop, j.events = loop, asyncio.Queue()
            engine.submit(j)
        engine.resume()
        return [await asyncio.wait_for(j.events.get(), 60) for j in jobs]

    bad, sampled, greedy = asyncio.run(go())
    assert isinstance(bad, Failed) and bad.status == 400
    assert isinstance(sampled, Finished) and isinstance(greedy, Finished)
    assert dict(engine.metrics.batch_sizes) == {3: 1}
    engine.shutdown()


# -- graceful shutdown ----------------------------------------------------------------------------------


def test_shutdown_timeout_bounds_a_graceful_shutdown(lm, logs):
    srv = BackgroundServer(
        create_app(
            lm,
            Trouble(lm.hidden_size),
            ServerSettings(model_name="slow", shutdown_timeout=1, max_tokens_limit=64),
        )
    ).start()
    engine = srv.app.state.engine
    assert srv.server.config.timeout_graceful_shutdown == 1
    result: list = []

    def call():
        body = _body(model="slow+trouble", max_tokens=64, aligntax={"strength": SLOW_STRENGTH})
        try:
            result.append(httpx.post(srv.url + URL, json=body, timeout=60))
        except httpx.HTTPError as exc:
            result.append(exc)

    t = threading.Thread(target=call)
    t.start()
    _wait(lambda: engine.in_flight == 1, what="generation to start")
    t0 = time.monotonic()
    srv.server.should_exit = True
    srv.thread.join(20)
    took = time.monotonic() - t0
    t.join(20)
    assert not srv.thread.is_alive() and took < 8, took  # 64 slow steps would take ~13 s
    assert not engine.alive
    assert result and not (isinstance(result[0], httpx.Response) and result[0].status_code == 200)
    assert not logs.unhandled(), logs.unhandled()


def test_step_time_model_fits_a_per_row_cost():
    from aligntax.serve.batch import StepTimeModel

    model = StepTimeModel()
    assert model.step_seconds(1) is None
    model.observe(1, 0.2, 10)  # 0.02 s per step for one row
    assert model.step_seconds(8) == pytest.approx(0.02)  # one size seen: no slope yet
    model.observe(3, 0.4, 10)  # 0.04 s per step for three rows
    a, b = model.coefficients()
    assert a == pytest.approx(0.01) and b == pytest.approx(0.01)
    assert model.step_seconds(5) > model.step_seconds(3) > model.step_seconds(1)
    # predictions carry 2x the mean error of past predictions (0.04 observed, 0.02 predicted)
    assert model.dev == pytest.approx(0.25 * 0.02)
    assert model.step_seconds(1) == pytest.approx(0.02 + 2 * model.dev)
    assert model.step_seconds(1, margin=0) == pytest.approx(0.02)
    assert model.batch_seconds(2, 10) == pytest.approx(10 * (a + 2 * b + 2 * model.dev))
    model.observe(2, 0.0, 10)  # ignored: no time
    model.observe(2, 1.0, 0)  # ignored: no step
    assert model.coefficients() == (a, b)


def _latency_engine(lm, target_ms: float) -> BatchEngine:
    """An engine whose step time is 0.01 + 0.01 * rows s (measured on two batches), not started."""
    engine = BatchEngine(
        lm, None, ServerSettings(max_batch_size=2, batch_wait_ms=0, max_latency_ms=target_ms)
    )
    engine.step_model.observe(1, 0.2, 10)
    engine.step_model.observe(3, 0.4, 10)
    engine.step_model.margin = 0  # the plain fit: the arithmetic below is exact
    return engine


def _queued(lm, max_tokens: int, arrived_s_ago: float) -> Job:
    return Job(_ids(lm, "hi"), SamplingParams(max_tokens, 0), arrived_at=time.perf_counter() - arrived_s_ago)


def test_predicted_latency_counts_the_running_batch_the_batches_ahead_and_its_own(lm):
    engine = _latency_engine(lm, 1000)
    step = engine.step_model.step_seconds
    assert step(1) == pytest.approx(0.02) and step(2) == pytest.approx(0.03)
    now = time.perf_counter()
    assert engine.predicted_latency(10, now=now) == pytest.approx(10 * step(1))  # idle: its own batch only
    engine._batch_started, engine._batch_expected_end = now, now + 0.5  # a batch running for 0.5 s more
    assert engine.predicted_latency(10, now=now) == pytest.approx(0.5 + 10 * step(1))
    # one request waiting (20 tokens, arrived 0.3 s ago): the new one joins its batch of 2 rows that
    # decodes 20 steps, and the oldest of that batch will have waited 0.3 s longer
    engine._q.put_nowait(_queued(lm, 20, 0.3))
    assert engine.predicted_latency(10, now=now) == pytest.approx(0.5 + 20 * step(2) + 0.3, abs=0.01)
    # two waiting: a full batch of 2 ahead (20 steps), then its own batch of one row (10 steps)
    engine._q.put_nowait(_queued(lm, 5, 0.1))
    assert engine.predicted_latency(10, now=now) == pytest.approx(0.5 + 20 * step(2) + 10 * step(1), abs=0.01)
    engine.shutdown()


def test_admission_refuses_a_request_predicted_over_the_latency_target(lm):
    from aligntax.serve.jobs import EngineOverloaded

    engine = _latency_engine(lm, 1300)
    engine.admit(max_tokens=10**6)  # idle: always admitted, whatever the prediction
    engine.withdraw()
    now = time.perf_counter()
    engine._batch_started, engine._batch_expected_end = now, now + 0.5
    engine.admit(max_tokens=10)  # 0.5 + 0.2 s: within 1.3 s
    engine.withdraw()
    engine._q.put_nowait(_queued(lm, 20, 0.3))
    # its own latency (0.5 + 0.6 s) is within the target, but it would make the oldest request of its
    # batch finish 1.4 s after that one arrived: refused
    with pytest.raises(EngineOverloaded) as e:
        engine.admit(max_tokens=10)
    assert (e.value.status, e.value.code) == (503, "overloaded")
    assert "target 1.30 s" in str(e.value) and "complete" in str(e.value)
    engine.admit()  # without max_tokens the latency target is not checked
    assert engine.waiting == 2
    engine.max_latency = None
    engine.admit(max_tokens=10)  # no target: admitted
    engine.shutdown(drain=False)


def test_latency_target_answers_503_through_the_server(lm, logs):
    app = create_app(
        lm,
        None,
        ServerSettings(
            model_name="w", max_batch_size=4, max_queue=50, max_latency_ms=300, max_tokens_limit=64
        ),
    )
    assert app.state.engine.max_latency == pytest.approx(0.3)
    with BackgroundServer(app) as srv:
        engine = app.state.engine
        body = {"model": "w", "messages": HELLO, "max_tokens": 4, "temperature": 0}
        results: list = []
        first = threading.Thread(
            target=lambda: results.append(httpx.post(srv.url + URL, json=body, timeout=30))
        )
        with _paused(engine):
            first.start()  # idle engine: admitted; the paused worker holds it
            _wait(lambda: engine.queue_depth == 1, what="the first request")
            engine.step_model.observe(1, 0.4, 4)  # 0.1 s per step
            now = time.perf_counter()
            engine._batch_started, engine._batch_expected_end = now, now + 0.5  # as if a batch were running
            r = httpx.post(srv.url + URL, json=body, timeout=30)  # 0.5 + 4 x 0.1 s > 0.3 s
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert err["code"] == "overloaded" and "complete" in err["message"]
            assert int(r.headers["Retry-After"]) >= 1
            engine._batch_started = engine._batch_expected_end = None
        first.join(30)
        assert [x.status_code for x in results] == [200]
        assert httpx.post(srv.url + URL, json=body, timeout=30).status_code == 200
        assert engine.waiting == 0
    assert not logs.unhandled(), logs.unhandled()


def test_serve_cli_has_the_latency_target():
    from aligntax.cli import app

    res = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert res.exit_code == 0 and "--max-latency-ms" in res.output
