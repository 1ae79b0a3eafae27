"""``aligntax serve --backend vllm``: the OpenAI-compatible server answering from vLLM's AsyncLLM, on a tiny
random Qwen2 model saved as a model folder (float32).

A real server on a loopback port (uvicorn in a background thread, the app of ``aligntax.serve.app`` with
the vLLM engine) answers plain and steered (``NAME+els``) chat completions, streaming and not, with the
official ``openai`` client; the steered greedy answers equal ``aligntax generate --backend vllm`` with the
same intervention (run as a command) and the Hugging Face backend's; strength 0 is plain; requests sent
together (continuous batching) get their own answers; stop strings, ``max_tokens`` and bad strengths
are handled as the HF server handles them; the command itself (``aligntax serve --backend vllm``) serves
and, on SIGTERM, stops together with its engine's process.

Per-request steering options (``aligntax.options``): each option set's answers equal the HF backend's
with the intervention built for those options; several sets in flight together get their one-at-a-time
answers; bad keys and types get 400; more sets than the bound (3 here) are evicted and registered
again; a registration the workers refuse fails only its request.

Runs in ``.venv-vllm`` (``./run setup-vllm``); skipped where vLLM is not installed."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import httpx  # noqa: E402
import openai  # noqa: E402
import psutil  # noqa: E402

from aligntax.generation import GenerationConfig, generate  # noqa: E402
from aligntax.serve.settings import ServerSettings  # noqa: E402
from tiny import PROMPTS, save_tiny_bank, tiny_model, tiny_tokenizer  # noqa: E402

NAME = "tiny"
STEERED = "tiny+els"
ELS = {"eta": 2.0, "steps": 2, "horizon": 3, "layers": [1, 2], "gate": "none", "row_threshold": "none"}
ELS_FLAGS = [
    "--eta",
    "2.0",
    "--steps",
    "2",
    "--horizon",
    "3",
    "--layers",
    "1,2",
    "--gate",
    "none",
    "--row-threshold",
    "none",
]
MAX_NEW = 8
OPTIONS_BOUND = 3
# option sets that change the steered answers of this tiny model (checked in the tests)
OPTION_SETS = [
    {"eta": 0.5},
    {"horizon": 1},
    {"steps": 1, "layers": [2]},
    {"eta": 1.0, "horizon": 5},
    {"horizon": 6},
]
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from aligntax.models import load_model

    d = tmp_path_factory.mktemp("tiny-vllm-serve")
    model = tiny_model("qwen2", hidden=128, layers=3, num_attention_heads=4, num_key_value_heads=2)
    model.save_pretrained(d / "model")
    tiny_tokenizer().save_pretrained(d / "model")
    save_tiny_bank(load_model(str(d / "model"), dtype="fp32"), d / "els")
    return d


@pytest.fixture(scope="module")
def lm(tiny_dir):
    from aligntax.models import load_model

    return load_model(str(tiny_dir / "model"), dtype="fp32")


@pytest.fixture(scope="module")
def vm(tiny_dir):
    from aligntax.backends.vllm.async_engine import AsyncVllm
    from aligntax.backends.vllm.engine import VllmOptions

    engine = AsyncVllm(
        str(tiny_dir / "model"), "fp32", VllmOptions(max_model_len=256, max_num_seqs=4, kv_cache_gib=1)
    )
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def live(vm, tiny_dir):
    from aligntax.backends.vllm.engine import prepare
    from aligntax.backends.vllm.serving import PRESET, create_vllm_app
    from aligntax.interventions.registry import make_intervention
    from aligntax.serve.background import BackgroundServer

    args = {"path": str(tiny_dir / "els"), **ELS}
    preset, rewriting = prepare(vm, "els", args, preset=PRESET)
    assert preset == PRESET and rewriting is None
    iv = make_intervention("els", vm.facts, **args)
    app = create_vllm_app(
        vm,
        iv,
        preset,
        ServerSettings(
            model_name=NAME,
            max_batch_size=4,
            max_tokens_limit=64,
            default_max_tokens=16,
            options_cache_size=OPTIONS_BOUND,
        ),
        steer_method="els",
        steer_options=args,
    )
    srv = BackgroundServer(app).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _msgs(p: str) -> list[dict]:
    return [{"role": "user", "content": p}]


def _chat(client, prompt: str, model: str = NAME, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", MAX_NEW)
    return client.chat.completions.create(model=model, messages=_msgs(prompt), **kw)


def _stream_text(client, prompt: str, model: str, **kw) -> tuple[str, str]:
    text, finish = "", None
    for chunk in client.chat.completions.create(
        model=model, messages=_msgs(prompt), temperature=0, max_tokens=MAX_NEW, stream=True, **kw
    ):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def _hf(lm, iv=None, prompts=PROMPTS):
    cfg = GenerationConfig(max_new_tokens=MAX_NEW, batch_size=8, drop_finished=False)
    return [(g.response, g.finish_reason) for g in generate(lm, prompts, cfg, iv, progress=False)]


def _hf_options(lm, tiny_dir, options: dict, prompts=PROMPTS):
    """The HF backend's greedy answers with the intervention built for the server's options updated with
    ``options`` (what the HF server's per-request options steer with)."""
    from aligntax.api import load_intervention

    return _hf(lm, load_intervention(str(tiny_dir / "els"), lm, **{**ELS, **options}), prompts)


def _opt(options: dict) -> dict:
    return {"extra_body": {"aligntax": {"options": options}}}


def _answer(r) -> tuple[str, str]:
    return r.choices[0].message.content.strip(), r.choices[0].finish_reason


def test_models_listed(client):
    assert sorted(m.id for m in client.models.list().data) == [NAME, STEERED]


def test_plain_and_steered_equal_hf(client, lm, tiny_dir):
    from aligntax.api import load_intervention

    plain = [_chat(client, p) for p in PROMPTS]
    steered = [_chat(client, p, STEERED) for p in PROMPTS]
    got_plain = [(r.choices[0].message.content.strip(), r.choices[0].finish_reason) for r in plain]
    got_steered = [(r.choices[0].message.content.strip(), r.choices[0].finish_reason) for r in steered]
    assert got_plain == _hf(lm)
    assert got_steered == _hf(lm, load_intervention(str(tiny_dir / "els"), lm, **ELS))
    assert got_steered != got_plain  # steering changes the answers, so the equality is not vacuous
    assert all(r.model_extra["aligntax"] == {"steered": True, "strength": 1.0} for r in steered)
    assert all(r.usage.completion_tokens <= MAX_NEW for r in plain + steered)


def test_steered_equals_generate_command(client, tiny_dir):
    """The server's steered greedy answers are `aligntax generate --backend vllm`'s with the same setting."""
    cmd = [
        str(BIN / "aligntax"),
        "generate",
        *PROMPTS,
        "--backend",
        "vllm",
        "--model",
        str(tiny_dir / "model"),
        "--dtype",
        "fp32",
        "--max-new-tokens",
        str(MAX_NEW),
        "--steer",
        str(tiny_dir / "els"),
        *ELS_FLAGS,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(PROMPTS)
    served = [_chat(client, p, STEERED).choices[0] for p in PROMPTS]
    assert [(c.message.content.strip(), c.finish_reason) for c in served] == [
        (r["response"], r["finish_reason"]) for r in rows
    ]


def test_streaming_equals_non_streaming(client):
    for model in (NAME, STEERED):
        for p in PROMPTS[:3]:
            whole = _chat(client, p, model).choices[0]
            text, finish = _stream_text(client, p, model)
            assert (text, finish) == (whole.message.content, whole.finish_reason)


def test_strength_zero_is_plain_and_bad_strength_refused(client):
    for p in PROMPTS[:3]:
        zero = (
            _chat(client, p, STEERED, extra_body={"aligntax": {"strength": 0.0}}).choices[0].message.content
        )
        assert zero == _chat(client, p).choices[0].message.content
    with pytest.raises(openai.BadRequestError, match=r"must lie in \[0, 10\]"):
        _chat(client, PROMPTS[0], STEERED, extra_body={"aligntax": {"strength": 11.0}})
    with pytest.raises(openai.BadRequestError, match="only applies"):
        _chat(client, PROMPTS[0], NAME, extra_body={"aligntax": {"strength": 0.5}})
    with pytest.raises(openai.NotFoundError):
        _chat(client, PROMPTS[0], "other")


def test_concurrent_mixed_requests(live, client):
    """Plain and steered requests in flight together (continuous batching) get their one-at-a-time answers."""
    want = {(p, m): _chat(client, p, m).choices[0].message.content for p in PROMPTS for m in (NAME, STEERED)}

    async def go():
        aclient = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=120)
        keys = list(want) * 2
        outs = await asyncio.gather(
            *[
                aclient.chat.completions.create(model=m, messages=_msgs(p), temperature=0, max_tokens=MAX_NEW)
                for p, m in keys
            ]
        )
        return keys, outs

    keys, outs = asyncio.run(go())
    assert [o.choices[0].message.content for o in outs] == [want[k] for k in keys]
    metrics = httpx.get(live.url + "/metrics").json()
    assert metrics["in_flight"] == 0 and metrics["queue_depth"] == 0


def test_stop_strings_and_length(client):
    """A stop string cuts the answer before it (finish "stop"), streamed or not; max_tokens ends with
    "length" after exactly that many tokens."""
    full = _chat(client, PROMPTS[1], max_tokens=16).choices[0]
    text = full.message.content
    assert len(text) >= 4
    stop = text[2:4]
    cut = _chat(client, PROMPTS[1], max_tokens=16, stop=[stop]).choices[0]
    assert cut.message.content == text[: text.index(stop)]
    assert cut.finish_reason == "stop"
    assert _stream_text(client, PROMPTS[1], NAME, stop=[stop]) == (cut.message.content, "stop")
    short = _chat(client, PROMPTS[1], max_tokens=3)
    if short.choices[0].finish_reason == "length":
        assert short.usage.completion_tokens == 3


def test_sampling_is_seeded(client):
    a = _chat(client, PROMPTS[0], temperature=1.0, seed=7).choices[0].message.content
    b = _chat(client, PROMPTS[0], temperature=1.0, seed=7).choices[0].message.content
    assert a == b


def test_serve_command(tiny_dir, lm):
    """`aligntax serve --backend vllm` itself: it starts, lists NAME and NAME+els and answers both, and the
    steered model takes per-request steering options."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    cmd = [
        str(BIN / "aligntax"),
        "serve",
        "--backend",
        "vllm",
        "--model",
        str(tiny_dir / "model"),
        "--dtype",
        "fp32",
        "--port",
        str(port),
        "--model-name",
        NAME,
        "--max-batch-size",
        "4",
        "--steer",
        str(tiny_dir / "els"),
        *ELS_FLAGS,
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    engine_procs: list = []
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(1)
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        assert sorted(m.id for m in c.models.list().data) == [NAME, STEERED]
        plain = _chat(c, PROMPTS[0]).choices[0].message.content
        steered = _chat(c, PROMPTS[0], STEERED).choices[0].message.content
        assert plain != steered
        card = httpx.get(url + "/v1/models").json()["data"][1]
        assert card["id"] == STEERED and "eta" in [o["name"] for o in card["aligntax"]["options"]]
        options = _answer(_chat(c, PROMPTS[0], STEERED, **_opt(OPTION_SETS[0])))
        assert [options] == _hf_options(lm, tiny_dir, OPTION_SETS[0], PROMPTS[:1])
        engine_procs = psutil.Process(proc.pid).children(recursive=True)
        assert engine_procs  # vLLM's engine core runs in a process of its own
    finally:
        proc.terminate()  # SIGTERM: a graceful stop that shuts the engine down too
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    _, alive = psutil.wait_procs(engine_procs, timeout=30)
    assert not alive, [p.name() for p in alive]


# ---- per-request steering options -------------------------------------------------------------------


def test_models_list_options(live):
    from aligntax.serve.options import request_fields

    cards = {m["id"]: m for m in httpx.get(live.url + "/v1/models").json()["data"]}
    listed = cards[STEERED]["aligntax"]
    assert listed["method"] == "els"
    assert listed["options"] == [f.card() for f in request_fields("els")]
    assert [o["name"] for o in listed["options"]][:3] == ["eta", "steps", "layers"]
    assert "aligntax" not in cards[NAME]


def test_options_equal_hf(client, lm, tiny_dir):
    """Each option set's greedy answers are the HF backend's with the intervention built for those options,
    and differ from the server's own steering (so the options reach the engine)."""
    base = [_answer(_chat(client, p, STEERED)) for p in PROMPTS]
    for options in OPTION_SETS[:3]:
        got = [_chat(client, p, STEERED, **_opt(options)) for p in PROMPTS]
        assert [_answer(r) for r in got] == _hf_options(lm, tiny_dir, options), options
        assert [_answer(r) for r in got] != base, options
        assert all(r.model_extra["aligntax"]["options"] == options for r in got)
    # strength multiplies the option set's steering as it does the server's; 0 is plain
    zero = _chat(
        client, PROMPTS[0], STEERED, extra_body={"aligntax": {"strength": 0.0, "options": OPTION_SETS[0]}}
    )
    assert zero.choices[0].message.content == _chat(client, PROMPTS[0]).choices[0].message.content


def test_options_streaming_equals_non_streaming(client):
    for p in PROMPTS[:2]:
        whole = _chat(client, p, STEERED, **_opt(OPTION_SETS[1])).choices[0]
        assert _stream_text(client, p, STEERED, **_opt(OPTION_SETS[1])) == (
            whole.message.content,
            whole.finish_reason,
        )


def test_concurrent_option_sets(live, client):
    """Requests of several option sets (and plain and the server's steering) in flight together get their
    one-at-a-time answers; concurrent requests with one new set register it once."""
    engine = live.app.state.engine
    sets = [None, {}, *OPTION_SETS[:3]]
    want = {}
    for p in PROMPTS:
        for k, options in enumerate(sets):
            model = NAME if options is None else STEERED
            want[(p, k)] = (
                _chat(client, p, model, **(_opt(options) if options else {})).choices[0].message.content
            )

    async def go(keys):
        aclient = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=120)
        outs = await asyncio.gather(
            *[
                aclient.chat.completions.create(
                    model=NAME if sets[k] is None else STEERED,
                    messages=_msgs(p),
                    temperature=0,
                    max_tokens=MAX_NEW,
                    **(_opt(sets[k]) if sets[k] else {}),
                )
                for p, k in keys
            ]
        )
        return [o.choices[0].message.content for o in outs]

    keys = list(want) * 2
    assert asyncio.run(go(keys)) == [want[k] for k in keys]
    # a set not seen before, sent by several requests at once, is registered once
    fresh = {"eta": 0.75}
    before = engine.option_registrations
    sets.append(fresh)
    outs = asyncio.run(go([(p, len(sets) - 1) for p in PROMPTS]))
    assert engine.option_registrations == before + 1
    assert outs == [_chat(client, p, STEERED, **_opt(fresh)).choices[0].message.content for p in PROMPTS]
    metrics = httpx.get(live.url + "/metrics").json()
    assert metrics["in_flight"] == 0 and metrics["queue_depth"] == 0


@pytest.mark.parametrize(
    ("options", "param", "code"),
    [
        ({"etaa": 0.2}, "aligntax.options.etaa", "unknown_parameter"),
        ({"path": "/etc"}, "aligntax.options.path", "unknown_parameter"),  # folders never per request
        ({"horizon": "soon"}, "aligntax.options.horizon", "invalid_type"),
        ({"layers": [1, True]}, "aligntax.options.layers", "invalid_type"),
        ({"eta": 0.5}, "aligntax.options", None),  # on the plain model
        ({"layers": [9]}, "aligntax.options", None),  # refused by the builder: the model has 3 layers
        ({"max_prompt_surprisal": 5.0}, "aligntax.options", None),  # the server does not score prompts
    ],
)
def test_bad_options_refused(live, options, param, code):
    engine = live.app.state.engine
    n = engine.option_registrations
    model = NAME if param == "aligntax.options" and "eta" in options else STEERED
    r = httpx.post(
        live.url + "/v1/chat/completions",
        timeout=60,
        json={
            "model": model,
            "messages": _msgs(PROMPTS[0]),
            "temperature": 0,
            "max_tokens": MAX_NEW,
            "aligntax": {"options": options},
        },
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    if code is not None:
        assert err["code"] == code and param in err["message"]
    assert engine.option_registrations == n  # refused before reaching the engine


def _settled(engine, timeout: float = 30.0) -> None:
    """Wait until the finished requests released their presets and the evicted ones are unregistered."""
    deadline = time.monotonic() + timeout
    while (
        engine._unregistering or len(engine.option_presets) > OPTIONS_BOUND
    ) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine._unregistering and len(engine.option_presets) <= OPTIONS_BOUND


def test_option_presets_evicted_and_registered_again(live, client, vm, lm, tiny_dir):
    """More option sets than the bound: the least recently used presets are unregistered from the workers,
    every set still gets its own answers, and an evicted set is registered again when asked for again."""
    engine = live.app.state.engine
    prompts = PROMPTS[:2]
    want = {i: _hf_options(lm, tiny_dir, options, prompts) for i, options in enumerate(OPTION_SETS)}
    regs, unregs = engine.option_registrations, engine.option_unregistrations
    for i, options in enumerate(OPTION_SETS):
        got = [_answer(_chat(client, p, STEERED, **_opt(options))) for p in prompts]
        assert got == want[i], options
    _settled(engine)
    assert engine.option_unregistrations > unregs
    names = [engine.option_preset_name(o) for o in OPTION_SETS[-OPTIONS_BOUND:]]
    assert engine.option_presets == names  # the most recent ones, least recently used first
    registered = set(vm.summary()["presets"])
    assert set(names) <= registered
    assert engine.option_preset_name(OPTION_SETS[0]) not in registered  # evicted from the workers too
    # asked for again: registered again, same answers
    n = engine.option_registrations
    assert [_answer(_chat(client, p, STEERED, **_opt(OPTION_SETS[0]))) for p in prompts] == want[0]
    assert engine.option_registrations == n + 1 > regs
    _settled(engine)
    assert len([p for p in vm.summary()["presets"] if p.startswith("req-")]) <= OPTIONS_BOUND


def test_option_registration_failure_fails_that_request_only(live, client, tiny_dir):
    """A preset the workers refuse to build (here: its folder is gone) fails that request with a 500 naming
    the options; other requests, and the same options once they can be built, are answered."""
    import dataclasses

    engine = live.app.state.engine
    good = engine.option_steering
    options = {"eta": 0.3}
    try:
        engine.option_steering = dataclasses.replace(good, source=str(tiny_dir / "missing"))
        with pytest.raises(openai.InternalServerError, match=r"could not be set up.*\"eta\": 0.3"):
            _chat(client, PROMPTS[0], STEERED, **_opt(options))
        assert engine.option_preset_name(options) not in engine.option_presets
    finally:
        engine.option_steering = good
    assert _chat(client, PROMPTS[0]).choices[0].finish_reason in ("stop", "length")
    steered = _chat(client, PROMPTS[0], STEERED, **_opt(options)).choices[0].message.content
    assert steered != _chat(client, PROMPTS[0]).choices[0].message.content


def test_app_registers_its_method_and_drops_its_presets(vm, live, lm, tiny_dir):
    """``create_vllm_app`` with ``steer_method`` and no preset registers the method itself; a server that
    stops unregisters its option presets from the engine it shares (the other server's stay)."""
    from aligntax.backends.vllm.serving import create_vllm_app
    from aligntax.serve.background import BackgroundServer

    args = {"path": str(tiny_dir / "els"), **ELS}
    app = create_vllm_app(
        vm,
        None,
        None,
        ServerSettings(model_name=NAME, max_tokens_limit=64, options_cache_size=1),
        steer_method="els",
        steer_options=args,
    )
    srv = BackgroundServer(app).start()
    engine = app.state.engine
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        assert [_answer(_chat(c, PROMPTS[0], STEERED))] == _hf_options(lm, tiny_dir, {}, PROMPTS[:1])
        for options in OPTION_SETS[:2]:
            assert [_answer(_chat(c, PROMPTS[0], STEERED, **_opt(options)))] == _hf_options(
                lm, tiny_dir, options, PROMPTS[:1]
            )
        deadline = time.monotonic() + 30
        while (engine._unregistering or len(engine.option_presets) > 1) and time.monotonic() < deadline:
            time.sleep(0.05)
        mine = engine.option_presets
        assert mine == [engine.option_preset_name(OPTION_SETS[1])]
        assert set(mine) <= set(vm.summary()["presets"])
    finally:
        srv.stop()
    others = live.app.state.engine.option_presets
    registered = set(vm.summary()["presets"])
    assert not set(mine) & registered
    assert set(others) <= registered
