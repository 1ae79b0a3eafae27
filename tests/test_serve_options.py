"""Per-request steering options (``{"aligntax": {"options": {...}}}``), end to end: a real loopback
server steering the tiny fp32 model with ELS from a tiny energy bank, greedy decoding."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from aligntax.serve import ServerSettings, create_app
from aligntax.serve.background import BackgroundServer
from aligntax.serve.options import InterventionCache, RequestField, options_key, request_fields
from serve_tiny import tiny_lm
from tiny import save_tiny_bank

NAME = "tiny"
STEERED = "tiny+els"
HELLO = [{"role": "user", "content": "Hello there, how are you?"}]
STRONG = {"eta": 3.0}  # changes the tiny model's greedy tokens (asserted below)


@pytest.fixture(scope="module")
def lm(one_thread):
    return tiny_lm()


@pytest.fixture(scope="module")
def live(lm, tmp_path_factory):
    bank = save_tiny_bank(lm, tmp_path_factory.mktemp("bank"))
    app = create_app(
        lm,
        None,
        ServerSettings(
            model_name=NAME,
            max_batch_size=8,
            batch_wait_ms=20,
            max_prompt_tokens=200,
            max_tokens_limit=64,
            default_max_tokens=16,
            options_cache_size=4,
        ),
        steer_method="els",
        steer_options={"path": str(bank)},
    )
    srv = BackgroundServer(app).start()
    yield srv
    srv.stop()


def _body(model=STEERED, options=None, **kw) -> dict:
    body = {"model": model, "messages": HELLO, "temperature": 0, "max_tokens": 12, **kw}
    if options is not None:
        body["aligntax"] = {"options": options}
    return body


def _post(live, body: dict) -> httpx.Response:
    return httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60)


def _text(live, **kw) -> str:
    r = _post(live, _body(**kw))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _steering(live):
    return live.app.state.handler.steering


def test_models_list_the_registry_fields(live):
    data = httpx.get(live.url + "/v1/models").json()["data"]
    cards = {m["id"]: m for m in data}
    assert "aligntax" not in cards[NAME]
    ext = cards[STEERED]["aligntax"]
    assert ext["method"] == "els"
    expected = request_fields("els")
    assert [o["name"] for o in ext["options"]] == [f.name for f in expected]
    assert {"eta", "steps", "horizon", "threshold", "row_threshold", "gate"} <= {f.name for f in expected}
    assert "path" not in {f.name for f in expected}  # folders are never set per request
    eta = next(o for o in ext["options"] if o["name"] == "eta")
    assert eta["type"] == "number" and "step size" in eta["help"]
    horizon = next(o for o in ext["options"] if o["name"] == "horizon")
    assert horizon["type"] == 'integer | "none"'
    one = httpx.get(live.url + f"/v1/models/{STEERED}").json()
    assert one["aligntax"] == ext


def test_vector_methods_take_coeff_and_layer_not_the_folder():
    names = [f.name for f in request_fields("refusal-add")]
    assert "coeff" in names and "layer" in names and "path" not in names
    assert request_fields("system-prompt") == []  # its text is never set per request
    assert request_fields(None) == [] and request_fields("nope") == []


def test_an_option_changes_the_tokens_and_the_default_is_unchanged(live):
    builds = _steering(live).cache.builds
    plain = _text(live, model=NAME)
    default = _text(live)
    assert _steering(live).cache.builds == builds  # no options: the server's own intervention
    assert _text(live, options={}) == default
    strong = _text(live, options=STRONG)
    assert strong != default
    assert default != plain  # the default steering does act on this model
    # the options given explicitly at their default values steer exactly as the default does
    assert _text(live, options={"eta": 0.35, "steps": 3}) == default
    # horizon 0: only the last prompt token is steered, not the generated ones
    assert _text(live, options={"horizon": 0}) not in (default, plain)
    # the response echoes the options
    r = _post(live, _body(options=STRONG)).json()
    assert r["aligntax"] == {"steered": True, "strength": 1.0, "options": STRONG}


def test_interventions_are_cached_per_option_set(live):
    steering = _steering(live)
    _text(live, options={"eta": 0.7})
    builds = steering.cache.builds
    _text(live, options={"eta": 0.7})
    assert steering.cache.builds == builds
    for i in range(6):
        _text(live, options={"eta": 1.0 + i / 10})
    assert len(steering.cache) == 4  # options_cache_size


@pytest.mark.parametrize(
    ("options", "param", "code"),
    [
        ({"etaa": 0.2}, "aligntax.options.etaa", "unknown_parameter"),
        ({"path": "/etc"}, "aligntax.options.path", "unknown_parameter"),  # folders never per request
        ({"eta": "0.2"}, "aligntax.options.eta", "invalid_type"),
        ({"eta": True}, "aligntax.options.eta", "invalid_type"),
        ({"steps": 2.5}, "aligntax.options.steps", "invalid_type"),
        ({"steps": -1}, "aligntax.options.steps", "invalid_type"),
        ({"steps": 10**9}, "aligntax.options.steps", "invalid_type"),
        ({"horizon": "all"}, "aligntax.options.horizon", "invalid_type"),
        ({"layers": ["1"]}, "aligntax.options.layers", "invalid_type"),
        ({"gate": 1.5}, "aligntax.options.gate", "invalid_type"),
    ],
)
def test_bad_options_are_400_naming_the_key(live, options, param, code):
    r = _post(live, _body(options=options))
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["code"] == code
    assert param in err["message"]


def test_options_the_builder_refuses_and_options_for_the_plain_model_are_400(live):
    r = _post(live, _body(options={"layers": [9]}))  # the bank has layers 0 and 1
    assert r.status_code == 400 and r.json()["error"]["param"] == "aligntax.options"
    assert "layers [9]" in r.json()["error"]["message"]
    r = _post(live, _body(model=NAME, options={"eta": 0.2}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "aligntax.options"
    r = _post(live, {**_body(), "aligntax": {"options": [1]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "aligntax.options"
    # the server still answers normally afterwards
    assert _post(live, _body()).status_code == 200


def test_different_options_in_flight_at_once_get_their_own_tokens(live):
    requests = [
        _body(model=NAME),
        _body(),
        _body(options=STRONG),
        _body(options={"horizon": 0}),
        _body(options=STRONG, stream=True),
        _body(options={"eta": 0.35, "steps": 3}),
    ]
    alone = [_text(live, **{k: v for k, v in _body_kwargs(b).items()}) for b in requests]
    result: dict = {}

    async def go():
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(
                *[c.post(live.url + "/v1/chat/completions", json=b) for b in requests]
            )

    engine = live.app.state.engine
    batches = live.app.state.metrics.snapshot()["batches_total"]
    engine.pause()
    try:
        t = threading.Thread(target=lambda: result.setdefault("out", asyncio.run(go())))
        t.start()
        deadline = time.monotonic() + 20
        while engine.queue_depth < len(requests):
            assert time.monotonic() < deadline, "requests did not reach the queue"
            time.sleep(0.005)
    finally:
        engine.resume()
    t.join(60)
    texts = []
    for b, r in zip(requests, result["out"], strict=True):
        assert r.status_code == 200, r.text
        texts.append(_sse_text(r.text) if b.get("stream") else r.json()["choices"][0]["message"]["content"])
    assert texts == alone
    # three interventions (default, eta=3, horizon=0; the explicit defaults are a fourth): not one batch
    assert live.app.state.metrics.snapshot()["batches_total"] - batches >= 3


def _body_kwargs(body: dict) -> dict:
    kw = {"model": body["model"]}
    if "aligntax" in body:
        kw["options"] = body["aligntax"]["options"]
    return kw


def _sse_text(text: str) -> str:
    import json

    out = ""
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            obj = json.loads(line[6:])
            for ch in obj.get("choices", []):
                out += ch["delta"].get("content") or ""
    return out


def test_field_checks_and_the_lru_cache_unit():
    f = RequestField("gate", "gate", "")
    assert f.check("saved") is True and f.check("none") == "none" and f.check(0.4) == 0.4
    assert f.check(0) is None and f.check("off") is None
    assert RequestField("eta", "float", "").check(float("nan")) is None
    assert RequestField("layers", "layers", "").check([]) is None
    assert options_key({"layers": [1, 2], "eta": 1.0}) == (("eta", 1.0), ("layers", (1, 2)))
    built = []
    cache = InterventionCache(lambda o: built.append(o) or object(), maxsize=2)
    a = cache.get({"eta": 1.0})
    assert cache.get({"eta": 1.0}) is a and len(built) == 1
    cache.get({"eta": 2.0})
    cache.get({"eta": 1.0})  # most recent: eta=2 is the oldest now
    cache.get({"eta": 3.0})
    assert len(cache) == 2 and cache.get({"eta": 1.0}) is a and len(built) == 3
    cache.get({"eta": 2.0})
    assert len(built) == 4  # evicted, so built again
