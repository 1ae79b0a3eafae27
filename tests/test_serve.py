"""The OpenAI-compatible server, end to end: a real uvicorn server on a free loopback port, in a
background thread, serving a tiny random Qwen2 model, queried with the official ``openai`` client
(and raw ``httpx`` for malformed requests)."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest

from aligntax.serve import ServerSettings, create_app
from aligntax.serve.background import BackgroundServer
from serve_tiny import AddVector, tiny_lm

KEY = "sk-test-key"
NAME = "tiny"
STEERED = "tiny+addvec"
FAIL_STRENGTH = 13.0
HELLO = [{"role": "user", "content": "Hello there, how are you?"}]


@pytest.fixture(scope="module")
def lm(one_thread):
    return tiny_lm()


@pytest.fixture(scope="module")
def live(lm):
    app = create_app(
        lm,
        AddVector(lm.hidden_size, fail_strength=FAIL_STRENGTH),
        ServerSettings(
            model_name=NAME,
            api_key=KEY,
            max_batch_size=32,
            batch_wait_ms=20,
            max_prompt_tokens=200,
            max_tokens_limit=64,
            default_max_tokens=16,
        ),
    )
    srv = BackgroundServer(app).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _aclient(live) -> openai.AsyncOpenAI:
    """A fresh async client per event loop (its connection pool belongs to the loop)."""
    return openai.AsyncOpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _engine(live):
    return live.app.state.engine


def _metrics(live) -> dict:
    r = httpx.get(live.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200
    return r.json()


def _chat(client, model=NAME, messages=HELLO, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 12)
    return client.chat.completions.create(model=model, messages=messages, **kw)


def _one_batch(live, requests: list[dict]) -> list:
    """Send the requests concurrently while the engine is paused, so they run as one batch."""
    result: dict = {}

    async def go():
        aclient = _aclient(live)
        return await asyncio.gather(
            *[
                aclient.chat.completions.create(
                    **{"messages": HELLO, "temperature": 0, "max_tokens": 12, **r}
                )
                for r in requests
            ],
            return_exceptions=True,
        )

    engine = _engine(live)
    engine.pause()
    try:
        t = threading.Thread(target=lambda: result.setdefault("out", asyncio.run(go())))
        t.start()
        _wait_queue(live, len(requests))
    finally:
        engine.resume()
    t.join(60)
    return result["out"]


def _wait_queue(live, n: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while _engine(live).queue_depth < n:
        assert time.monotonic() < deadline, "requests did not reach the queue"
        time.sleep(0.005)


def test_models_lists_plain_and_steered(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [NAME, STEERED]
    assert client.models.retrieve(STEERED).id == STEERED
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_plain_and_streamed_completion(client, lm):
    resp = _chat(client)
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and resp.model == NAME
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    prompt = lm.tokenizer.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=False)
    n_prompt = len(lm.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert resp.usage.prompt_tokens == n_prompt
    assert 1 <= resp.usage.completion_tokens <= 12
    assert resp.usage.total_tokens == n_prompt + resp.usage.completion_tokens
    if choice.finish_reason == "length":
        assert resp.usage.completion_tokens == 12

    chunks = list(_chat(client, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content_chunks = [c for c in chunks if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert text == choice.message.content
    assert content_chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert all(c.choices[0].finish_reason is None for c in content_chunks[:-1])
    assert chunks[-1].usage.completion_tokens == resp.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == n_prompt
    assert len(content_chunks) > 3  # really streamed, token by token


def test_max_completion_tokens_stop_and_length(client):
    full = _chat(client, max_tokens=None, max_completion_tokens=20).choices[0]
    assert full.finish_reason == "length" and full.message.content
    short = _chat(client, max_tokens=3)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"
    text = full.message.content
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    expected = text[: text.find(stop)]
    for stream in (False, True):
        if stream:
            chunks = list(_chat(client, max_tokens=20, stop=[stop, "zzzz-never"], stream=True))
            got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = chunks[-1].choices[0].finish_reason
        else:
            r = _chat(client, max_tokens=20, stop=stop).choices[0]
            got, reason = r.message.content, r.finish_reason
        assert got == expected and reason == "stop"


def test_seeded_sampling_is_reproducible(client):
    a = _chat(client, temperature=1.2, top_p=0.9, seed=7, max_tokens=10).choices[0].message.content
    b = _chat(client, temperature=1.2, top_p=0.9, seed=7, max_tokens=10).choices[0].message.content
    assert a == b


def test_steering_per_request_and_mixed_batch(client, live):
    plain = _chat(client).choices[0].message.content
    steered = _chat(client, model=STEERED)
    assert steered.model == STEERED
    assert steered.choices[0].message.content != plain
    zero = _chat(client, model=STEERED, extra_body={"aligntax": {"strength": 0.0}})
    assert zero.choices[0].message.content == plain

    before = _metrics(live)["batch_size_histogram"].get("3", 0)
    s_mixed, p_mixed, half = _one_batch(
        live,
        [
            dict(model=STEERED),
            dict(model=NAME),
            dict(model=STEERED, extra_body={"aligntax": {"strength": 0.5}}),
        ],
    )
    assert _metrics(live)["batch_size_histogram"].get("3", 0) == before + 1  # one mixed batch
    assert p_mixed.choices[0].message.content == plain
    assert s_mixed.choices[0].message.content == steered.choices[0].message.content
    assert half.choices[0].message.content != plain


def test_concurrent_requests_are_batched_and_faster(client, live):
    prompts = [
        [{"role": "user", "content": f"Question {i}: how do I kill a Python process?"}] for i in range(32)
    ]
    t0 = time.perf_counter()
    seq = [_chat(client, messages=p, max_tokens=16) for p in prompts]
    t_seq = time.perf_counter() - t0

    async def fire():
        aclient = _aclient(live)
        return await asyncio.gather(
            *[
                aclient.chat.completions.create(
                    model=NAME if i % 2 else STEERED, messages=p, temperature=0, max_tokens=16
                )
                for i, p in enumerate(prompts)
            ]
        )

    t0 = time.perf_counter()
    conc = asyncio.run(fire())
    t_conc = time.perf_counter() - t0
    assert len(conc) == 32 and all(r.choices[0].message.content is not None for r in conc)
    for i in range(1, 32, 2):  # unsteered rows of the big mixed batches match the one-by-one answers
        assert conc[i].choices[0].message.content == seq[i].choices[0].message.content
    print(f"32 sequential: {t_seq:.2f}s, 32 concurrent: {t_conc:.2f}s")
    assert t_conc < t_seq, (t_conc, t_seq)
    m = _metrics(live)
    assert m["batch_size_max"] > 1 and m["batch_size_mean"] > 1
    assert m["requests_by_status"]["200"] >= 64
    assert m["completion_tokens_total"] >= 32 * 16 and m["latency_mean_s"] > 0


def _assert_openai_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None):
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == "invalid_request_error"
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err


BAD_BODIES = [
    # (body, status, code, param)
    ({"messages": HELLO}, 400, "missing_required_parameter", "model"),
    ({"model": NAME}, 400, "missing_required_parameter", "messages"),
    ({"model": NAME, "messages": []}, 400, None, "messages"),
    ({"model": NAME, "messages": "hi"}, 400, "invalid_type", "messages"),
    ({"model": NAME, "messages": [{"content": "hi"}]}, 400, None, "messages[0].role"),
    ({"model": NAME, "messages": [{"role": "robot", "content": "hi"}]}, 400, None, "messages[0].role"),
    ({"model": NAME, "messages": [{"role": "user"}]}, 400, None, "messages[0].content"),
    (
        {"model": NAME, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "unsupported_value",
        None,
    ),
    ({"model": "gpt-17", "messages": HELLO}, 404, "model_not_found", "model"),
    ({"model": NAME, "messages": HELLO, "max_tokens": 100000}, 400, None, "max_tokens"),
    ({"model": NAME, "messages": HELLO, "max_completion_tokens": 65}, 400, None, "max_completion_tokens"),
    ({"model": NAME, "messages": HELLO, "max_tokens": 0}, 400, None, "max_tokens"),
    ({"model": NAME, "messages": HELLO, "max_tokens": "5"}, 400, "invalid_type", "max_tokens"),
    ({"model": NAME, "messages": HELLO, "max_tokens": 2.5}, 400, "invalid_type", "max_tokens"),
    ({"model": NAME, "messages": HELLO, "temperature": -0.1}, 400, None, "temperature"),
    ({"model": NAME, "messages": HELLO, "temperature": 2.5}, 400, None, "temperature"),
    ({"model": NAME, "messages": HELLO, "temperature": "hot"}, 400, "invalid_type", "temperature"),
    ({"model": NAME, "messages": HELLO, "top_p": 0}, 400, None, "top_p"),
    ({"model": NAME, "messages": HELLO, "top_p": 1.5}, 400, None, "top_p"),
    ({"model": NAME, "messages": HELLO, "n": 2}, 400, None, "n"),
    ({"model": NAME, "messages": HELLO, "n": 0}, 400, None, "n"),
    ({"model": NAME, "messages": HELLO, "stream": "yes"}, 400, "invalid_type", "stream"),
    ({"model": NAME, "messages": HELLO, "stop": 5}, 400, None, "stop"),
    ({"model": NAME, "messages": HELLO, "seed": "x"}, 400, "invalid_type", "seed"),
    ({"model": NAME, "messages": HELLO, "logprobs": True}, 400, "unsupported_value", "logprobs"),
    (
        {"model": NAME, "messages": [{"role": "user", "content": "word " * 400}]},
        400,
        "context_length_exceeded",
        "messages",
    ),
    ({"model": NAME, "messages": HELLO, "aligntax": {"strength": 0.5}}, 400, None, "aligntax.strength"),
    (
        {"model": STEERED, "messages": HELLO, "aligntax": {"strength": "max"}},
        400,
        "invalid_type",
        "aligntax.strength",
    ),
    (
        {"model": STEERED, "messages": HELLO, "aligntax": {"strenght": 1}},
        400,
        "unknown_parameter",
        "aligntax.strenght",
    ),
]


def test_malformed_requests_get_openai_errors(live, client):
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=live.url, headers=headers, timeout=30) as http:
        url = "/v1/chat/completions"
        for raw in (b'{"model": "tiny", "messages": [', b"not json at all", b""):
            r = http.post(url, content=raw, headers={"Content-Type": "application/json"})
            _assert_openai_error(r, 400)
        _assert_openai_error(http.post(url, json=[1, 2]), 400)
        for body, status, code, param in BAD_BODIES:
            _assert_openai_error(http.post(url, json=body), status, code, param)
        _assert_openai_error(http.get(url), 405)
        _assert_openai_error(http.get("/v1/nowhere"), 404)
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, max_tokens=1000)
    assert e.value.status_code == 400 and e.value.param == "max_tokens"
    with pytest.raises(openai.NotFoundError) as e:
        _chat(client, model="missing")
    assert e.value.code == "model_not_found"
    assert _chat(client).choices[0].message.content is not None  # still serving


def test_failing_request_does_not_affect_others(live, client):
    bad, good = _one_batch(
        live,
        [
            dict(model=STEERED, max_tokens=8, extra_body={"aligntax": {"strength": FAIL_STRENGTH}}),
            dict(model=NAME, max_tokens=8),
        ],
    )
    assert isinstance(bad, openai.InternalServerError) and "test intervention failure" in str(bad)
    assert good.choices[0].message.content == _chat(client, max_tokens=8).choices[0].message.content
    with pytest.raises(openai.APIError, match="test intervention failure"):
        list(_chat(client, model=STEERED, stream=True, extra_body={"aligntax": {"strength": FAIL_STRENGTH}}))
    assert _engine(live).alive
    assert _chat(client, model=STEERED).choices[0].message.content


def test_api_key_required(live):
    with httpx.Client(base_url=live.url, timeout=30) as http:
        body = {"model": NAME, "messages": HELLO, "max_tokens": 2}
        r = http.post("/v1/chat/completions", json=body)
        _assert_openai_error(r, 401, "invalid_api_key")
        r = http.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer wrong"})
        _assert_openai_error(r, 401, "invalid_api_key")
        _assert_openai_error(http.get("/v1/models"), 401, "invalid_api_key")
        _assert_openai_error(http.get("/metrics"), 401, "invalid_api_key")
        assert http.get("/health").json()["status"] == "ok"
    bad = openai.OpenAI(base_url=live.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_health_and_metrics(live):
    h = httpx.get(live.url + "/health").json()
    assert h["status"] == "ok" and h["models"] == [NAME, STEERED]
    m = _metrics(live)
    for key in (
        "requests_total",
        "requests_by_status",
        "prompt_tokens_total",
        "completion_tokens_total",
        "queue_depth",
        "batch_size_histogram",
        "batch_size_mean",
        "latency_mean_s",
    ):
        assert key in m
    assert m["requests_total"] >= m["requests_by_status"].get("200", 0) > 0


def test_shutdown_drains_queued_requests(lm):
    srv = BackgroundServer(create_app(lm, None, ServerSettings(model_name="drain", batch_wait_ms=5))).start()
    engine = srv.app.state.engine
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
    results: list = []

    def call():
        try:
            results.append(_chat(c, model="drain", max_tokens=8))
        except Exception as exc:  # pragma: no cover - reported by the assert below
            results.append(exc)

    engine.pause()
    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while engine.queue_depth < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    srv.server.should_exit = True  # shutdown begins while all three wait in the queue
    time.sleep(0.3)
    engine.resume()
    for t in threads:
        t.join(30)
    srv.thread.join(30)
    assert not srv.thread.is_alive()
    assert len(results) == 3 and all(isinstance(r, openai.types.chat.ChatCompletion) for r in results), (
        results
    )
    assert engine.closed and not engine.alive
    with pytest.raises(httpx.TransportError):
        httpx.get(srv.url + "/health", timeout=2)


def test_client_disconnect_cancels_stream(live):
    engine = _engine(live)
    epoch = engine.cancel_epoch
    body = {"model": NAME, "messages": HELLO, "max_tokens": 64, "temperature": 0, "stream": True}
    engine.pause()
    try:
        with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as http:
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                assert next(r.iter_lines()).startswith("data: ")  # the role chunk, sent before generation
    finally:
        engine.resume()
    deadline = time.monotonic() + 10
    while engine.cancel_epoch == epoch:
        assert time.monotonic() < deadline, "the server did not notice the client going away"
        time.sleep(0.01)


def test_serve_takes_every_steering_option_of_the_registry(tmp_path, monkeypatch):
    """``aligntax serve --steer DIR --gate none --horizon 4 --eta 0.7`` builds the steered variant with
    those settings (the same options as every steering command); an option of another method is a clear
    error before anything is loaded."""
    from typer.testing import CliRunner

    import aligntax.serve.app as serve_app
    from aligntax.cli import app
    from tiny import save_tiny_bank, tiny_lm

    lm = tiny_lm("qwen2", hidden=32, layers=3)
    bank = save_tiny_bank(lm, tmp_path / "bank")
    seen = {}
    monkeypatch.setattr("aligntax.models.loader.load_model", lambda *a, **k: lm)
    # the bank names its random model 'tiny-qwen2', which no loader resolves: its layer count is given here
    monkeypatch.setattr("aligntax.cli.options.model_num_layers", lambda spec: 3)
    monkeypatch.setattr(serve_app, "serve", lambda app, **kw: seen.setdefault("app", app))
    res = CliRunner().invoke(
        app,
        ["serve", "--steer", str(bank), "--layers", "1", "--eta", "0.7", "--horizon", "4", "--gate", "none"],
    )
    assert res.exit_code == 0, res.output
    cfg = seen["app"].state.engine.intervention.config()
    assert cfg["name"] == "els" and cfg["eta"] == 0.7 and cfg["horizon"] == 4 and cfg["layers"] == [1]
    res = CliRunner().invoke(app, ["serve", "--intervention", "refusal-ablation", "--eta", "0.3"])
    assert res.exit_code == 2 and "--eta is an option of els" in res.output
