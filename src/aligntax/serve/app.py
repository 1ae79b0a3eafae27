"""The OpenAI-compatible HTTP layer: ``create_app`` builds the FastAPI app, ``serve`` runs it.

Endpoints: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/chat/completions`` (plain and
``stream: true`` server-sent events), ``GET /health`` and ``GET /metrics``. The model is served under
``model_name`` (unsteered) and, when an intervention is given, ``model_name+suffix`` (steered, suffix
defaulting to the intervention's name). A request picks steering with the model name and may set its
strength with the extension field ``{"aligntax": {"strength": 0.5}}``.

Every error is answered as ``{"error": {"message", "type", "param", "code"}}``; FastAPI's 422
validation errors become 400s. With ``api_key`` set, ``/v1/*`` and ``/metrics`` need
``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
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

from aligntax.generation.chat import build_messages, render_chat
from aligntax.interventions.base import Intervention
from aligntax.models.loader import prepare_tokenizer
from aligntax.serve.engine import (
    BatchEngine,
    Delta,
    EngineClosed,
    EngineOverloaded,
    Failed,
    Finished,
    Job,
    SamplingParams,
)
from aligntax.serve.metrics import ServeMetrics
from aligntax.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    error_body,
    invalid,
    validation_error,
)

log = logging.getLogger("aligntax.serve")

MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_STOP_SEQUENCES = 16


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


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


class _Gate:
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
            if error is not None:
                response = JSONResponse(error.body(), status_code=error.status,
                                        headers={"WWW-Authenticate": "Bearer"} if error.status == 401 else None)
                return await response(scope, receive, send_wrapper)
            return await self.app(scope, receive, send_wrapper)
        finally:
            if counted:
                self.metrics.record_request(status[0], time.perf_counter() - start)

    def _check(self, scope, path: str) -> APIError | None:
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and (path.startswith("/v1") or path == "/metrics"):
            auth = headers.get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if not auth:
                return APIError(401, "You didn't provide an API key. Send it in the Authorization header "
                                "(Authorization: Bearer YOUR_KEY).", "invalid_request_error", None,
                                "invalid_api_key")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                return APIError(401, "Incorrect API key provided.", "invalid_request_error", None,
                                "invalid_api_key")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            return APIError(413, f"Request body too large (over {MAX_BODY_BYTES} bytes).",
                            "invalid_request_error", None, "request_too_large")
        return None


class _Server:
    """Request handling shared by the routes: validation, prompt building and answering."""

    def __init__(self, lm, intervention: Intervention | None, engine: BatchEngine, settings: ServeSettings):
        self.lm = lm
        self.intervention = intervention
        self.engine = engine
        self.s = settings
        digest = (getattr(lm, "fingerprint", None) or {}).get("embedding_digest")
        self.fingerprint = f"fp_{digest[:10]}" if digest else None

    # -- models -------------------------------------------------------------------------------------
    def model_names(self) -> list[str]:
        return [self.s.model_name] + ([self.s.steered_name] if self.s.steered_name else [])

    def model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.s.created, "owned_by": "aligntax"}

    # -- validation and prompt building -------------------------------------------------------------
    def check_model(self, body: ChatCompletionRequest) -> bool:
        """Whether the request is for the steered model; 404 for an unknown model."""
        if body.model == self.s.model_name:
            steer = False
        elif self.s.steered_name is not None and body.model == self.s.steered_name:
            steer = True
        else:
            raise APIError(404, f"The model '{body.model}' does not exist. Available models: "
                           + ", ".join(self.model_names()) + ".", "invalid_request_error", "model",
                           "model_not_found")
        ext = body.aligntax
        if ext is not None and ext.strength is not None and not steer:
            where = (f"the steered model '{self.s.steered_name}'" if self.s.steered_name
                     else "a steered model, and this server has none (start it with an intervention)")
            raise invalid(f"'aligntax.strength' only applies to {where}.", "aligntax.strength")
        return steer

    def check_params(self, body: ChatCompletionRequest) -> None:
        if body.n is not None and body.n > 1:
            raise invalid("Only n=1 is supported.", "n", "unsupported_value")
        if body.logprobs:
            raise invalid("logprobs are not supported by this server.", "logprobs", "unsupported_value")
        if body.top_logprobs:
            raise invalid("top_logprobs are not supported by this server.", "top_logprobs",
                          "unsupported_value")
        if body.logit_bias:
            raise invalid("logit_bias is not supported by this server.", "logit_bias", "unsupported_value")
        if body.tools:
            raise invalid("Tool calling is not supported by this server.", "tools", "unsupported_value")
        if body.tool_choice not in (None, "none"):
            raise invalid("Tool calling is not supported by this server.", "tool_choice",
                          "unsupported_value")
        if body.response_format and body.response_format.get("type", "text") != "text":
            raise invalid("Only response_format {'type': 'text'} is supported.", "response_format",
                          "unsupported_value")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(body, name):
                raise invalid(f"{name} is not supported by this server (only 0).", name, "unsupported_value")

    def stops(self, body: ChatCompletionRequest) -> tuple[str, ...]:
        stop = body.stop
        if stop is None:
            return ()
        stops = [stop] if isinstance(stop, str) else list(stop)
        if len(stops) > MAX_STOP_SEQUENCES:
            raise invalid(f"At most {MAX_STOP_SEQUENCES} stop sequences are allowed.", "stop")
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
                        raise invalid(f"Only text content parts are supported; messages[{i}].content[{k}] "
                                      f"has type '{part.type}'.", f"messages[{i}].content[{k}].type",
                                      "unsupported_value")
                    texts.append(part.text)
                content = "\n".join(texts)
            if content is None:
                if m.role != "assistant":
                    raise invalid(f"messages[{i}].content is required for role '{m.role}'.",
                                  f"messages[{i}].content", "missing_required_parameter")
                content = ""
            msg = {"role": "system" if m.role == "developer" else m.role, "content": content}
            if m.name:
                msg["name"] = m.name
            out.append(msg)
        return out

    def encode(self, messages: list[dict], steer: bool) -> list[int]:
        """Chat template + tokenisation (runs in a thread pool)."""
        tok = self.lm.tokenizer
        msgs = build_messages(messages, None, self.intervention if steer else None)
        with self.engine.tokenizer_lock:
            try:
                text = render_chat(tok, msgs)
            except Exception as exc:  # jinja errors: e.g. roles the template does not accept
                raise invalid(f"The chat template rejected these messages: {exc}", "messages") from exc
            return list(tok(text, add_special_tokens=False)["input_ids"])

    def max_tokens(self, body: ChatCompletionRequest, n_prompt: int) -> int:
        s = self.s
        if n_prompt > s.max_prompt_tokens:
            raise invalid(f"This model's maximum prompt length is {s.max_prompt_tokens} tokens. However, "
                          f"your messages resulted in {n_prompt} tokens. Please reduce the length of the "
                          "messages.", "messages", "context_length_exceeded")
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        room = s.context_window - n_prompt if s.context_window else None
        if requested is not None:
            if requested > s.max_new_tokens_limit:
                raise invalid(f"{param} is too large: {requested}. This server allows at most "
                              f"{s.max_new_tokens_limit} completion tokens.", param)
            if room is not None and requested > room:
                raise invalid(f"This model's maximum context length is {s.context_window} tokens. However, "
                              f"you requested {n_prompt + requested} tokens ({n_prompt} in the messages, "
                              f"{requested} in the completion). Please reduce the length of the messages "
                              "or completion.", "messages", "context_length_exceeded")
            return requested
        limit = min(s.default_max_tokens, s.max_new_tokens_limit)
        if room is not None:
            if room < 1:
                raise invalid(f"This model's maximum context length is {s.context_window} tokens, and your "
                              f"messages resulted in {n_prompt} tokens, leaving no room for a completion.",
                              "messages", "context_length_exceeded")
            limit = min(limit, room)
        return limit

    async def prepare(self, body: ChatCompletionRequest) -> Job:
        steer = self.check_model(body)
        self.check_params(body)
        stops = self.stops(body)
        messages = self.messages(body)
        prompt_ids = await run_in_threadpool(self.encode, messages, steer)
        params = SamplingParams(
            max_tokens=self.max_tokens(body, len(prompt_ids)),
            temperature=1.0 if body.temperature is None else float(body.temperature),
            top_p=1.0 if body.top_p is None else float(body.top_p),
            seed=body.seed, stop=stops,
        )
        strength = self.s.default_strength
        if body.aligntax is not None and body.aligntax.strength is not None:
            strength = float(body.aligntax.strength)
        return Job(prompt_ids=prompt_ids, params=params, steer=steer, strength=strength,
                   stream=bool(body.stream), loop=asyncio.get_running_loop(), events=asyncio.Queue())

    def submit(self, job: Job) -> None:
        try:
            self.engine.submit(job)
        except EngineClosed as exc:
            raise APIError(503, str(exc), "server_error", None, "server_shutting_down") from None
        except EngineOverloaded as exc:
            raise APIError(503, str(exc), "server_error", None, "server_overloaded") from None

    # -- answering ----------------------------------------------------------------------------------
    def _base(self, cid: str, created: int, model: str, obj: str) -> dict:
        out = {"id": cid, "object": obj, "created": created, "model": model}
        if self.fingerprint:
            out["system_fingerprint"] = self.fingerprint
        return out

    @staticmethod
    def _usage(ev: Finished) -> dict:
        return {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
                "total_tokens": ev.prompt_tokens + ev.completion_tokens}

    async def complete(self, body: ChatCompletionRequest, job: Job) -> dict:
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        try:
            while True:
                ev = await job.events.get()
                if isinstance(ev, Finished):
                    break
                if isinstance(ev, Failed):
                    raise APIError(ev.status, ev.message, "server_error", None, None)
        except asyncio.CancelledError:
            self.engine.cancel(job)
            raise
        out = self._base(cid, created, body.model, "chat.completion")
        out["choices"] = [{
            "index": 0,
            "message": {"role": "assistant", "content": ev.text, "refusal": None},
            "logprobs": None,
            "finish_reason": ev.finish_reason,
        }]
        out["usage"] = self._usage(ev)
        out["aligntax"] = {"steered": job.steer, "strength": job.strength if job.steer else 0.0}
        return out

    async def stream(self, body: ChatCompletionRequest, job: Job):
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
            while True:
                ev = await job.events.get()
                if isinstance(ev, Delta):
                    yield chunk({"content": ev.text})
                elif isinstance(ev, Finished):
                    yield chunk({}, ev.finish_reason)
                    if include_usage:
                        yield _sse({**base, "choices": [], "usage": self._usage(ev)})
                    break
                elif isinstance(ev, Failed):
                    yield _sse(error_body(ev.message, "server_error"))
                    break
            yield _sse("[DONE]")
        finally:
            if not job.done:
                self.engine.cancel(job)


def create_app(lm, intervention: Intervention | None = None, model_name: str | None = None, *,
               steered_suffix: str | None = None, api_key: str | None = None, max_batch_size: int = 32,
               batch_wait_ms: float = 10.0, max_batch_wait_ms: float = 100.0,
               max_prompt_tokens: int | None = None,
               max_new_tokens_limit: int = 2048, default_max_tokens: int = 512,
               default_strength: float = 1.0, max_queue: int = 1024, mix_steered: bool = True,
               drain_timeout_s: float | None = None) -> FastAPI:
    """Build the OpenAI-compatible app for a loaded model (``aligntax.models.load_model``).

    ``model_name`` defaults to the model spec's name; with an ``intervention``, the steered model is
    ``f"{model_name}+{steered_suffix or intervention.name}"``. ``max_prompt_tokens`` defaults to the
    model's context window. ``default_max_tokens`` applies when a request sets no max_tokens.
    ``mix_steered=False`` keeps steered and unsteered requests in separate batches (for interventions
    that cannot steer per row).
    """
    lm.require_chat_template()
    prepare_tokenizer(lm.tokenizer, lm.model)
    window = context_window(lm)
    if max_prompt_tokens is None:
        max_prompt_tokens = window - 1 if window else 32768
    name = model_name or default_model_name(lm)
    steered_name = None
    if intervention is not None:
        suffix = steered_suffix or getattr(intervention, "name", None) or "steered"
        steered_name = f"{name}+{suffix}"
    settings = ServeSettings(
        model_name=name, steered_name=steered_name, api_key=api_key, max_prompt_tokens=max_prompt_tokens,
        max_new_tokens_limit=max_new_tokens_limit, default_max_tokens=default_max_tokens,
        context_window=window, default_strength=default_strength, created=int(time.time()),
    )
    metrics = ServeMetrics()
    engine = BatchEngine(lm, intervention, max_batch_size=max_batch_size, batch_wait_ms=batch_wait_ms,
                         max_batch_wait_ms=max_batch_wait_ms, max_queue=max_queue, metrics=metrics, mix_steered=mix_steered)
    server = _Server(lm, intervention, engine, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            # uvicorn has stopped accepting connections and waited for open requests; finish the queue.
            await asyncio.to_thread(engine.shutdown, True, drain_timeout_s)

    app = FastAPI(title="aligntax OpenAI-compatible server", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.settings = settings
    app.add_middleware(_Gate, api_key=api_key, metrics=metrics)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        err = validation_error(list(exc.errors()))
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(error_body(str(exc.detail), kind, None, code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error")
        return JSONResponse(error_body(f"Internal server error: {type(exc).__name__}", "server_error"),
                            status_code=500)

    @app.get("/health")
    async def health():
        ok = not engine.closed and (engine.alive or not engine.started)
        body = {"status": "ok" if ok else ("shutting_down" if engine.closed else "worker_dead"),
                "models": server.model_names(), "queue_depth": engine.queue_depth}
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
            raise APIError(404, f"The model '{model_id}' does not exist.", "invalid_request_error", "model",
                           "model_not_found")
        return server.model_card(model_id)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        job = await server.prepare(body)
        server.submit(job)
        if job.stream:
            return StreamingResponse(server.stream(body, job), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await server.complete(body, job)

    return app


def serve(lm, intervention: Intervention | None = None, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info", graceful_timeout_s: int | None = None, **app_kwargs) -> None:
    """Run the app with uvicorn until interrupted; Ctrl-C drains in-flight requests first."""
    import uvicorn

    app = create_app(lm, intervention, **app_kwargs)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=graceful_timeout_s)
    uvicorn.Server(config).run()
