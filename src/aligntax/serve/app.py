"""The OpenAI-compatible HTTP layer: ``create_app`` builds the FastAPI app, ``serve`` runs it.

Endpoints: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/chat/completions`` (plain and
``stream: true`` server-sent events), ``GET /health`` and ``GET /metrics``. The model is served under
``model_name`` (unsteered) and, when an intervention is given, ``model_name+suffix`` (steered, suffix
defaulting to the intervention's name). A request picks steering with the model name and may set its
strength with the extension field ``{"aligntax": {"strength": 0.5}}``. When the server knows the
registered method it steers with (``steer_method``), a request to the steered model may also set that
method's per-request options, ``{"aligntax": {"options": {"eta": 0.2, "horizon": 8}}}``: the keys and
types come from the registry and are listed in ``GET /v1/models`` (:mod:`aligntax.serve.options`).

Every error is answered as ``{"error": {"message", "type", "param", "code"}}``; FastAPI's 422
validation errors become 400s. With ``api_key`` set, ``/v1/*`` and ``/metrics`` need
``Authorization: Bearer <key>``.

Hardening: bodies over 16 MiB get 413, chunked ones too (without reading the rest); invalid Unicode
(lone surrogates) and unknown fields (unless ``allow_unknown_fields``) get 400; at most 4 stop strings
of at most 256 characters; a full queue gets 429 and an expected wait over ``max_queue_wait_ms`` (or
a predicted completion latency over ``max_latency_ms``) 503, both with ``Retry-After`` (requests count from their arrival, tokenisation included); ``request_timeout_s`` bounds a
request's time (504 ``request_timeout``, its generation cancelled), and a non-streaming client that
disconnects has its generation cancelled too; prompts are tokenised with a private copy of the
tokenizer, so the per-step decoding of running batches never waits on a long prompt's tokenisation.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import ipaddress
import json
import logging
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from aligntax.errors import AligntaxError
from aligntax.generation.chat import build_messages, render_chat
from aligntax.interventions.base import Intervention
from aligntax.models.loader import prepare_tokenizer
from aligntax.serve.base import EngineFactory, ServeEngine
from aligntax.serve.engine import BatchEngine
from aligntax.serve.jobs import (
    Delta,
    EngineClosed,
    EngineOverloaded,
    Failed,
    Finished,
    Job,
    SamplingParams,
)
from aligntax.serve.metrics import ServeMetrics
from aligntax.serve.options import RequestSteering
from aligntax.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    error_body,
    invalid,
    unknown_field,
    validation_error,
)

log = logging.getLogger("aligntax.serve")

MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256
RETRY_AFTER_S = 1


class InsecureBindError(AligntaxError):
    """A non-loopback host without an API key (and without ``insecure``)."""


def is_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: str | None, insecure: bool = False) -> None:
    """Refuse to listen on a non-loopback interface without an API key unless ``insecure``."""
    if api_key or insecure or is_loopback(host):
        return
    raise InsecureBindError(
        f"Refusing to serve on {host} without an API key: anyone who can reach this address could use the "
        "model. Set --api-key (or ALIGNTAX_API_KEY), listen on 127.0.0.1, or pass --insecure to serve "
        "without a key anyway."
    )


class SafeJSONResponse(JSONResponse):
    """JSON that cannot fail to encode: text that is not valid UTF-8 (a lone surrogate echoed back in an
    error message) is written as a JSON escape instead of raising."""

    def render(self, content) -> bytes:
        text = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        try:
            return text.encode("utf-8")
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


def default_model_name(lm) -> str:
    spec = str(getattr(lm, "spec", "") or "model")
    if spec.startswith("embedded:"):
        return spec.split(":", 1)[1]
    if "/" in spec and Path(spec).expanduser().exists():
        return Path(spec).name.removesuffix(".gguf")
    return spec


def context_window(lm) -> int | None:
    cfg = lm.model.config
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


@dataclass
class ServeSettings:
    model_name: str
    steered_name: str | None
    api_key: str | None
    max_prompt_tokens: int
    max_new_tokens_limit: int
    default_max_tokens: int
    context_window: int | None
    default_strength: float
    created: int
    allow_unknown_fields: bool = False
    request_timeout_s: float | None = None
    max_latency_ms: float | None = None


@dataclass
class RequestPlan:
    """What :meth:`_Server.check_model` decided for a request: steered or not, and its own steering
    options (empty: the server's)."""

    steer: bool
    options: dict


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


class _RequestGuard:
    """Pure ASGI middleware: API key check, body size limit, and per-request metrics."""

    def __init__(self, app, api_key: str | None, metrics: ServeMetrics):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        counted = path.startswith("/v1/chat/completions")
        start = time.perf_counter()
        status = [500]

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            error = self._check(scope, path)
            if error is None:
                # Read the body here, up to the limit (chunked bodies have no Content-Length to check).
                chunks, size = [], 0
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > MAX_BODY_BYTES:
                        error = self._too_large()
                        break
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
            if error is not None:
                headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else {}
                if error.status == 413:
                    headers["Connection"] = "close"  # the rest of the body is never read
                response = SafeJSONResponse(error.body(), status_code=error.status, headers=headers or None)
                return await response(scope, receive, send_wrapper)
            body = b"".join(chunks)
            replayed = False

            async def replay():
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            return await self.app(scope, replay, send_wrapper)
        finally:
            if counted:
                self.metrics.record_request(status[0], time.perf_counter() - start)

    def _check(self, scope, path: str) -> APIError | None:
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and (path.startswith("/v1") or path == "/metrics"):
            auth = headers.get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if not auth:
                return APIError(
                    401,
                    "You didn't provide an API key. Send it in the Authorization header "
                    "(Authorization: Bearer YOUR_KEY).",
                    "invalid_request_error",
                    None,
                    "invalid_api_key",
                )
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                return APIError(
                    401, "Incorrect API key provided.", "invalid_request_error", None, "invalid_api_key"
                )
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            return self._too_large()
        return None

    @staticmethod
    def _too_large() -> APIError:
        return APIError(
            413,
            f"Request body too large (over {MAX_BODY_BYTES} bytes).",
            "invalid_request_error",
            None,
            "request_too_large",
        )


class _Server:
    """Request handling shared by the routes: validation, prompt building and answering."""

    def __init__(
        self,
        lm,
        intervention: Intervention | None,
        engine: ServeEngine,
        settings: ServeSettings,
        steering: RequestSteering | None = None,
    ):
        self.lm = lm
        self.intervention = intervention
        self.steering = steering  # the per-request options of the steered model (None: it takes none)
        self.engine = engine
        self.s = settings
        digest = (getattr(lm, "fingerprint", None) or {}).get("embedding_digest")
        self.fingerprint = f"fp_{digest[:10]}" if digest else None
        # Requests are tokenised with a private copy of the tokenizer under their own lock, so that the
        # worker's per-step decoding (under engine.tokenizer_lock) never waits on a long prompt.
        try:
            self.encode_tokenizer = copy.deepcopy(lm.tokenizer)
            self.encode_lock = threading.Lock()
        except Exception:  # pragma: no cover - a tokenizer that cannot be copied: share the engine's lock
            self.encode_tokenizer, self.encode_lock = lm.tokenizer, engine.tokenizer_lock

    # -- models -------------------------------------------------------------------------------------
    def model_names(self) -> list[str]:
        return [self.s.model_name] + ([self.s.steered_name] if self.s.steered_name else [])

    def model_card(self, name: str) -> dict:
        card = {"id": name, "object": "model", "created": self.s.created, "owned_by": "aligntax"}
        if name == self.s.steered_name:
            card["aligntax"] = {
                "method": self.steering.method if self.steering else getattr(self.intervention, "name", None),
                "strength": {
                    "type": "number",
                    "default": self.s.default_strength,
                    "help": "steering strength (0: unsteered)",
                },
                "options": [f.card() for f in self.steering.fields] if self.steering else [],
            }
        return card

    # -- validation and prompt building -------------------------------------------------------------
    def check_model(self, body: ChatCompletionRequest) -> RequestPlan:
        """Whether the request is for the steered model, and its steering options (checked against the
        served method's per-request fields); 404 for an unknown model, 400 for a bad option."""
        if body.model == self.s.model_name:
            steer = False
        elif self.s.steered_name is not None and body.model == self.s.steered_name:
            steer = True
        else:
            raise APIError(
                404,
                f"The model '{body.model}' does not exist. Available models: "
                + ", ".join(self.model_names())
                + ".",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        ext = body.aligntax
        if ext is not None and ext.strength is not None and not steer:
            where = (
                f"the steered model '{self.s.steered_name}'"
                if self.s.steered_name
                else "a steered model, and this server has none (start it with an intervention)"
            )
            raise invalid(f"'aligntax.strength' only applies to {where}.", "aligntax.strength")
        raw = ext.options if ext is not None else None
        if not raw:
            return RequestPlan(steer, {})
        if not steer:
            where = (
                f"the steered model '{self.s.steered_name}'"
                if self.s.steered_name
                else "a steered model, and this server has none (start it with an intervention)"
            )
            raise invalid(f"'aligntax.options' only applies to {where}.", "aligntax.options")
        if self.steering is None or not self.steering.fields:
            raise invalid(
                f"The model '{body.model}' takes no per-request steering options.",
                "aligntax.options",
                "unknown_parameter",
            )
        return RequestPlan(steer, self.steering.parse(raw, body.model))

    def check_fields(self, body: ChatCompletionRequest) -> None:
        err = unknown_field(body, self.s.allow_unknown_fields)
        if err is not None:
            raise err

    def check_params(self, body: ChatCompletionRequest) -> None:
        if body.n is not None and body.n > 1:
            raise invalid("Only n=1 is supported.", "n", "unsupported_value")
        if body.logprobs:
            raise invalid("logprobs are not supported by this server.", "logprobs", "unsupported_value")
        if body.top_logprobs:
            raise invalid(
                "top_logprobs are not supported by this server.", "top_logprobs", "unsupported_value"
            )
        if body.logit_bias:
            raise invalid("logit_bias is not supported by this server.", "logit_bias", "unsupported_value")
        if body.tools:
            raise invalid("Tool calling is not supported by this server.", "tools", "unsupported_value")
        if body.tool_choice not in (None, "none"):
            raise invalid("Tool calling is not supported by this server.", "tool_choice", "unsupported_value")
        if body.response_format and body.response_format.get("type", "text") != "text":
            raise invalid(
                "Only response_format {'type': 'text'} is supported.", "response_format", "unsupported_value"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(body, name):
                raise invalid(f"{name} is not supported by this server (only 0).", name, "unsupported_value")

    def stops(self, body: ChatCompletionRequest) -> tuple[str, ...]:
        stop = body.stop
        if stop is None:
            return ()
        stops = [stop] if isinstance(stop, str) else list(stop)
        if len(stops) > MAX_STOP_SEQUENCES:
            raise invalid(
                f"At most {MAX_STOP_SEQUENCES} stop sequences are allowed; got {len(stops)}.", "stop"
            )
        for s in stops:
            if len(s) > MAX_STOP_CHARS:
                raise invalid(
                    f"Each stop sequence may have at most {MAX_STOP_CHARS} characters; one has {len(s)}.",
                    "stop",
                )
        return tuple(s for s in stops if s)

    @staticmethod
    def messages(body: ChatCompletionRequest) -> list[dict]:
        out = []
        for i, m in enumerate(body.messages):
            content = m.content
            if isinstance(content, list):
                texts = []
                for k, part in enumerate(content):
                    if part.type != "text" or part.text is None:
                        raise invalid(
                            f"Only text content parts are supported; messages[{i}].content[{k}] "
                            f"has type '{part.type}'.",
                            f"messages[{i}].content[{k}].type",
                            "unsupported_value",
                        )
                    texts.append(part.text)
                content = "\n".join(texts)
            if content is None:
                if m.role != "assistant":
                    raise invalid(
                        f"messages[{i}].content is required for role '{m.role}'.",
                        f"messages[{i}].content",
                        "missing_required_parameter",
                    )
                content = ""
            msg = {"role": "system" if m.role == "developer" else m.role, "content": content}
            if m.name:
                msg["name"] = m.name
            out.append(msg)
        return out

    def encode(
        self, messages: list[dict], steer: bool, intervention: Intervention | None = None
    ) -> list[int]:
        """Chat template + tokenisation (runs in a thread pool); ``intervention``: the steered request's own."""
        tok = self.encode_tokenizer
        msgs = build_messages(messages, None, (intervention or self.intervention) if steer else None)
        with self.encode_lock:
            try:
                text = render_chat(tok, msgs)
            except Exception as exc:  # jinja errors: e.g. roles the template does not accept
                raise invalid(f"The chat template rejected these messages: {exc}", "messages") from exc
            return list(tok(text, add_special_tokens=False)["input_ids"])

    def requested_tokens(self, body: ChatCompletionRequest) -> int:
        """The completion limit a request asks for (before its prompt is known), as admission reads it."""
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if requested is None:
            requested = self.s.default_max_tokens
        return max(1, min(int(requested), self.s.max_new_tokens_limit))

    def max_tokens(self, body: ChatCompletionRequest, n_prompt: int) -> int:
        s = self.s
        if n_prompt > s.max_prompt_tokens:
            raise invalid(
                f"This model's maximum prompt length is {s.max_prompt_tokens} tokens. However, "
                f"your messages resulted in {n_prompt} tokens. Please reduce the length of the "
                "messages.",
                "messages",
                "context_length_exceeded",
            )
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        room = s.context_window - n_prompt if s.context_window else None
        if requested is not None:
            if requested > s.max_new_tokens_limit:
                raise invalid(
                    f"{param} is too large: {requested}. This server allows at most "
                    f"{s.max_new_tokens_limit} completion tokens.",
                    param,
                )
            if room is not None and requested > room:
                raise invalid(
                    f"This model's maximum context length is {s.context_window} tokens. However, "
                    f"you requested {n_prompt + requested} tokens ({n_prompt} in the messages, "
                    f"{requested} in the completion). Please reduce the length of the messages "
                    "or completion.",
                    "messages",
                    "context_length_exceeded",
                )
            return requested
        limit = min(s.default_max_tokens, s.max_new_tokens_limit)
        if room is not None:
            if room < 1:
                raise invalid(
                    f"This model's maximum context length is {s.context_window} tokens, and your "
                    f"messages resulted in {n_prompt} tokens, leaving no room for a completion.",
                    "messages",
                    "context_length_exceeded",
                )
            limit = min(limit, room)
        return limit

    async def prepare(self, body: ChatCompletionRequest) -> Job:
        self.check_fields(body)
        plan = self.check_model(body)
        steer = plan.steer
        self.check_params(body)
        stops = self.stops(body)
        messages = self.messages(body)
        iv = await run_in_threadpool(self.steering.intervention, plan.options) if plan.options else None
        prompt_ids = await run_in_threadpool(self.encode, messages, steer, iv)
        params = SamplingParams(
            max_tokens=self.max_tokens(body, len(prompt_ids)),
            temperature=1.0 if body.temperature is None else float(body.temperature),
            top_p=1.0 if body.top_p is None else float(body.top_p),
            seed=body.seed,
            stop=stops,
        )
        strength = self.s.default_strength
        if body.aligntax is not None and body.aligntax.strength is not None:
            strength = float(body.aligntax.strength)
        return Job(
            prompt_ids=prompt_ids,
            params=params,
            steer=steer,
            strength=strength,
            intervention=iv,
            options=dict(plan.options) if plan.options else None,
            stream=bool(body.stream),
            loop=asyncio.get_running_loop(),
            events=asyncio.Queue(),
        )

    def admit(self, body: ChatCompletionRequest | None = None) -> None:
        """Count the request against the engine's bounds from its arrival (before tokenisation), or
        answer 429 (queue full) / 503 (expected wait or predicted latency over the target) with
        Retry-After. With a latency target the engine is told the request's completion limit."""
        try:
            if self.s.max_latency_ms is not None and body is not None:
                self.engine.admit(max_tokens=self.requested_tokens(body))
            else:
                self.engine.admit()
        except EngineClosed as exc:
            raise APIError(503, str(exc), "server_error", None, "server_shutting_down") from None
        except EngineOverloaded as exc:
            raise _overloaded(exc) from None

    def submit(self, job: Job, admitted: bool = False) -> None:
        try:
            self.engine.submit(job, admitted=admitted)
        except EngineClosed as exc:
            raise APIError(503, str(exc), "server_error", None, "server_shutting_down") from None
        except EngineOverloaded as exc:
            raise _overloaded(exc) from None

    # -- answering ----------------------------------------------------------------------------------
    def _base(self, cid: str, created: int, model: str, obj: str) -> dict:
        out = {"id": cid, "object": obj, "created": created, "model": model}
        if self.fingerprint:
            out["system_fingerprint"] = self.fingerprint
        return out

    @staticmethod
    def _usage(ev: Finished) -> dict:
        return {
            "prompt_tokens": ev.prompt_tokens,
            "completion_tokens": ev.completion_tokens,
            "total_tokens": ev.prompt_tokens + ev.completion_tokens,
        }

    async def complete(self, body: ChatCompletionRequest, job: Job) -> dict:
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        try:
            while True:
                ev = await job.events.get()
                if isinstance(ev, Finished):
                    break
                if isinstance(ev, Failed):
                    raise APIError(ev.status, ev.message, _error_type(ev.status), None, ev.code)
        except asyncio.CancelledError:
            self.engine.cancel(job)
            raise
        out = self._base(cid, created, body.model, "chat.completion")
        out["choices"] = [
            {
                "index": 0,
                "message": {"role": "assistant", "content": ev.text, "refusal": None},
                "logprobs": None,
                "finish_reason": ev.finish_reason,
            }
        ]
        out["usage"] = self._usage(ev)
        out["aligntax"] = {"steered": job.steer, "strength": job.strength if job.steer else 0.0}
        if body.aligntax is not None and body.aligntax.options and job.steer:
            out["aligntax"]["options"] = body.aligntax.options
        return out

    async def complete_watched(
        self, body: ChatCompletionRequest, job: Job, receive, deadline: float | None
    ) -> dict:
        """:meth:`complete`, cancelled (its rows leave the batch) when the client disconnects or the
        request's deadline passes (504)."""
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(self.complete(body, job))
        watch = asyncio.ensure_future(_disconnected(receive))
        try:
            timeout = None if deadline is None else max(0.0, deadline - loop.time())
            done, _ = await asyncio.wait({task, watch}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (task, watch):
                if not t.done():
                    t.cancel()
            await asyncio.gather(task, watch, return_exceptions=True)
        if task in done:
            return task.result()
        self.engine.cancel(job)
        if watch in done:
            log.info("client disconnected; its generation was cancelled")
            raise APIError(
                499,
                "The client closed the connection.",
                "invalid_request_error",
                None,
                "client_closed_request",
            )
        raise _timeout_error(self.s.request_timeout_s)

    async def stream(self, body: ChatCompletionRequest, job: Job, deadline: float | None = None):
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        base = self._base(cid, created, body.model, "chat.completion.chunk")

        def chunk(delta: dict, finish: str | None = None) -> str:
            obj = dict(base)
            obj["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
            if include_usage:
                obj["usage"] = None
            return _sse(obj)

        try:
            yield chunk({"role": "assistant", "content": ""})
            loop = asyncio.get_running_loop()
            while True:
                if deadline is None:
                    ev = await job.events.get()
                else:
                    try:
                        ev = await asyncio.wait_for(job.events.get(), max(0.0, deadline - loop.time()))
                    except TimeoutError:
                        self.engine.cancel(job)
                        yield _sse(_timeout_error(self.s.request_timeout_s).body())
                        break
                if isinstance(ev, Delta):
                    yield chunk({"content": ev.text})
                elif isinstance(ev, Finished):
                    yield chunk({}, ev.finish_reason)
                    if include_usage:
                        yield _sse({**base, "choices": [], "usage": self._usage(ev)})
                    break
                elif isinstance(ev, Failed):
                    yield _sse(error_body(ev.message, _error_type(ev.status), None, ev.code))
                    break
            yield _sse("[DONE]")
        finally:
            if not job.done:
                self.engine.cancel(job)


def _overloaded(exc: EngineOverloaded) -> APIError:
    kind = "rate_limit_error" if exc.status == 429 else "server_error"
    return APIError(
        exc.status,
        f"{exc} Retry after {exc.retry_after} s.",
        kind,
        None,
        exc.code,
        headers={"Retry-After": str(exc.retry_after)},
    )


def _error_type(status: int) -> str:
    return "invalid_request_error" if status < 500 else "server_error"


def _timeout_error(timeout_s: float | None) -> APIError:
    return APIError(
        504,
        f"The request did not finish within the server's request timeout ({timeout_s:g} s); "
        "its generation was cancelled. Ask for fewer tokens or retry later.",
        "server_error",
        None,
        "request_timeout",
    )


async def _disconnected(receive) -> None:
    """Return once the client has gone (the body was read before, so only http.disconnect is left)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def create_app(
    lm,
    intervention: Intervention | None = None,
    model_name: str | None = None,
    *,
    steered_suffix: str | None = None,
    api_key: str | None = None,
    max_batch_size: int = 32,
    batch_wait_ms: float = 10.0,
    max_batch_wait_ms: float = 100.0,
    max_prompt_tokens: int | None = None,
    max_new_tokens_limit: int = 2048,
    default_max_tokens: int = 512,
    default_strength: float = 1.0,
    max_queue: int = 1024,
    mix_steered: bool = True,
    drain_timeout_s: float | None = None,
    max_batch_tokens: int | None = 32768,
    allow_unknown_fields: bool = False,
    request_timeout_s: float | None = None,
    shutdown_timeout_s: float | None = None,
    max_queue_wait_ms: float | None = None,
    steer_method: str | None = None,
    steer_options: dict | None = None,
    options_cache_size: int = 16,
    engine_factory: EngineFactory | None = None,
    max_latency_ms: float | None = None,
) -> FastAPI:
    """Build the OpenAI-compatible app for a loaded model (``aligntax.models.load_model``).

    ``model_name`` defaults to the model spec's name; with an ``intervention``, the steered model is
    ``f"{model_name}+{steered_suffix or intervention.name}"``. ``max_prompt_tokens`` defaults to the
    model's context window. ``default_max_tokens`` applies when a request sets no max_tokens.
    ``mix_steered=False`` keeps steered and unsteered requests in separate batches (for interventions
    that cannot steer per row). ``max_batch_tokens`` bounds a batch's padded prompt tokens (rows x
    longest prompt). ``allow_unknown_fields`` accepts (and ignores) request fields this server does
    not know. ``request_timeout_s`` cancels requests that take longer (504). ``shutdown_timeout_s``
    bounds a graceful shutdown (also read by :func:`serve` and ``BackgroundServer`` for uvicorn):
    whatever still runs after it is failed with 503.

    Per-request steering options: ``steer_method`` names the registered method of ``intervention``
    (:mod:`aligntax.interventions.registry`) and ``steer_options`` its ``intervention_args``; a request's
    ``aligntax.options`` (the method's fields declared ``request=True``) update these, and the
    intervention built for them is cached (the ``options_cache_size`` most recently used option sets).
    With ``steer_method`` and no ``intervention``, the intervention is built from ``steer_options``.
    ``engine_factory`` (default :class:`BatchEngine`) builds the generation engine from ``BatchEngine``'s
    arguments: any :class:`~aligntax.serve.base.ServeEngine` (another backend's engine:
    :mod:`aligntax.backends.vllm.serving`); the app talks to that protocol only.

    Admission: a request counts as waiting from its arrival (tokenisation included) until a batch
    takes it; at most ``max_queue`` wait (more get 429 ``queue_full``), and with ``max_queue_wait_ms`` a
    request whose expected wait for a batch (from the measured batch duration) is over that target
    gets 503 ``overloaded``; both with ``Retry-After``. With ``max_latency_ms`` a request whose
    predicted completion latency (the running batch's rest, the batches ahead and its own, from
    measured per-step times; see :meth:`BatchEngine.predicted_latency`) is over that target gets 503
    ``overloaded`` too. See :class:`~aligntax.serve.base.Admission`.
    """
    if request_timeout_s is not None and request_timeout_s <= 0:
        raise ValueError("request_timeout_s must be > 0")
    lm.require_chat_template()
    prepare_tokenizer(lm.tokenizer, lm.model)
    steering = None
    if steer_method is not None and steer_method != "none":
        steering = RequestSteering(steer_method, lm, steer_options, options_cache_size)
        if intervention is None:
            intervention = steering.cache.build({})
    window = context_window(lm)
    if max_prompt_tokens is None:
        max_prompt_tokens = window - 1 if window else 32768
    name = model_name or default_model_name(lm)
    steered_name = None
    if intervention is not None:
        suffix = steered_suffix or getattr(intervention, "name", None) or "steered"
        steered_name = f"{name}+{suffix}"
    settings = ServeSettings(
        model_name=name,
        steered_name=steered_name,
        api_key=api_key,
        max_prompt_tokens=max_prompt_tokens,
        max_new_tokens_limit=max_new_tokens_limit,
        default_max_tokens=default_max_tokens,
        context_window=window,
        default_strength=default_strength,
        created=int(time.time()),
        allow_unknown_fields=allow_unknown_fields,
        request_timeout_s=request_timeout_s,
        max_latency_ms=max_latency_ms,
    )
    if drain_timeout_s is None:
        drain_timeout_s = shutdown_timeout_s
    metrics = ServeMetrics()
    engine = (engine_factory or BatchEngine)(
        lm,
        intervention,
        max_batch_size=max_batch_size,
        batch_wait_ms=batch_wait_ms,
        max_batch_wait_ms=max_batch_wait_ms,
        max_queue=max_queue,
        metrics=metrics,
        mix_steered=mix_steered,
        max_batch_tokens=max_batch_tokens,
        max_queue_wait_ms=max_queue_wait_ms,
        **({} if max_latency_ms is None else {"max_latency_ms": max_latency_ms}),
    )
    server = _Server(lm, intervention, engine, settings, steering)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            # uvicorn has stopped accepting connections and waited for open requests; finish the queue.
            await asyncio.to_thread(engine.shutdown, True, drain_timeout_s)

    app = FastAPI(
        title="aligntax OpenAI-compatible server", lifespan=lifespan, default_response_class=SafeJSONResponse
    )
    app.state.engine = engine
    app.state.shutdown_timeout_s = shutdown_timeout_s
    app.state.server = server
    app.state.metrics = metrics
    app.state.settings = settings
    app.add_middleware(_RequestGuard, api_key=api_key, metrics=metrics)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        err = validation_error(list(exc.errors()))
        return SafeJSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return SafeJSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return SafeJSONResponse(
            error_body(str(exc.detail), kind, None, code),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error")
        return SafeJSONResponse(
            error_body(f"Internal server error: {type(exc).__name__}", "server_error"), status_code=500
        )

    @app.get("/health")
    async def health():
        ok = not engine.closed and (engine.alive or not engine.started)
        body = {
            "status": "ok" if ok else ("shutting_down" if engine.closed else "worker_dead"),
            "models": server.model_names(),
            "queue_depth": engine.queue_depth,
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics_route():
        return metrics.snapshot(queue_depth=engine.queue_depth, in_flight=engine.in_flight)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [server.model_card(n) for n in server.model_names()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        if model_id not in server.model_names():
            raise APIError(
                404,
                f"The model '{model_id}' does not exist.",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        return server.model_card(model_id)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        loop = asyncio.get_running_loop()
        deadline = None if request_timeout_s is None else loop.time() + request_timeout_s
        arrived = time.perf_counter()
        server.admit(body)  # counted as waiting from now on: tokenisation included
        try:
            job = await server.prepare(body)
            job.arrived_at = arrived
            if deadline is not None and loop.time() >= deadline:
                raise _timeout_error(request_timeout_s)
        except BaseException:
            engine.withdraw()
            raise
        server.submit(job, admitted=True)
        if job.stream:
            return StreamingResponse(
                server.stream(body, job, deadline),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await server.complete_watched(body, job, request.receive, deadline)

    return app


def serve(
    lm,
    intervention: Intervention | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    graceful_timeout_s: int | None = None,
    insecure: bool = False,
    app=None,
    **app_kwargs,
) -> None:
    """Run the app with uvicorn until interrupted; Ctrl-C drains in-flight requests first, for at most
    ``graceful_timeout_s`` (default: the app's ``shutdown_timeout_s``). A non-loopback ``host`` needs
    an ``api_key`` unless ``insecure``."""
    import uvicorn

    check_bind(host, app_kwargs.get("api_key") if app is None else app.state.settings.api_key, insecure)
    if app is None:
        app = create_app(lm, intervention, **app_kwargs)
    if graceful_timeout_s is None and app.state.shutdown_timeout_s is not None:
        graceful_timeout_s = max(1, round(app.state.shutdown_timeout_s))
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=graceful_timeout_s
    )
    uvicorn.Server(config).run()
