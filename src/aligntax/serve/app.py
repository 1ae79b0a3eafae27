"""The OpenAI-compatible server's assembly: ``create_app`` builds the FastAPI app from a loaded model, an
optional intervention and :class:`~aligntax.serve.settings.ServerSettings`; ``serve`` runs it.

The pieces, as vLLM's OpenAI entrypoint has them: the routes (:mod:`aligntax.serve.router`, an
``APIRouter``), the request handler they call (:mod:`aligntax.serve.handler`), the door
(:mod:`aligntax.serve.security`: loopback-or-key, bearer key, body size) and the settings
(:mod:`aligntax.serve.settings`). This module wires them to a generation engine and maps every error to
the OpenAI format ``{"error": {"message", "type", "param", "code"}}`` (FastAPI's 422 validation errors
become 400s).

The model is served under ``model_name`` (unsteered) and, with an intervention, ``model_name+suffix``
(steered; the suffix defaults to the intervention's name). A request picks steering with the model name
and may set its strength with the extension field ``{"aligntax": {"strength": 0.5}}``; when the server
knows the registered method it steers with (``steer_method``), a request to the steered model may also set
that method's per-request options, ``{"aligntax": {"options": {"eta": 0.2, "horizon": 8}}}``: the keys
and types come from the registry and are listed in ``GET /v1/models`` (:mod:`aligntax.serve.options`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from aligntax.models.loader import prepare_tokenizer
from aligntax.serve.base import EngineFactory
from aligntax.serve.engine import BatchEngine
from aligntax.serve.handler import ChatHandler
from aligntax.serve.metrics import ServeMetrics
from aligntax.serve.options import RequestSteering
from aligntax.serve.protocol import APIError, SafeJSONResponse, error_body, validation_error
from aligntax.serve.router import router
from aligntax.serve.security import RequestGuard, check_bind
from aligntax.serve.settings import ServerSettings

if TYPE_CHECKING:
    from aligntax.interventions.base import Intervention
    from aligntax.models.loader import LoadedModel

log = logging.getLogger("aligntax.serve")


def default_model_name(lm: LoadedModel) -> str:
    spec = str(getattr(lm, "spec", "") or "model")
    if spec.startswith("embedded:"):
        return spec.split(":", 1)[1]
    if "/" in spec and Path(spec).expanduser().exists():
        return Path(spec).name.removesuffix(".gguf")
    return spec


def context_window(lm: LoadedModel) -> int | None:
    cfg = lm.model.config
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def create_app(
    lm: LoadedModel,
    intervention: Intervention | None = None,
    settings: ServerSettings | None = None,
    *,
    steer_method: str | None = None,
    steer_options: dict[str, Any] | None = None,
    engine_factory: EngineFactory | None = None,
    check_intervention: Callable[[Any], None] | None = None,
) -> FastAPI:
    """Build the OpenAI-compatible app for a loaded model (``aligntax.models.load_model``).

    ``settings`` (default :class:`ServerSettings`'s defaults): ``model_name`` defaults to the model
    spec's name, ``max_prompt_tokens`` to the model's context window less one; the app keeps them
    resolved in ``app.state.settings``. ``shutdown_timeout`` bounds a graceful shutdown (read by
    :func:`serve` and ``BackgroundServer`` for uvicorn): whatever still runs after it is failed with 503.

    Per-request steering options: ``steer_method`` names the registered method of ``intervention``
    (:mod:`aligntax.interventions.registry`) and ``steer_options`` its ``intervention_args``; a request's
    ``aligntax.options`` (the method's fields declared ``request=True``) update these, and the
    intervention built for them is cached (the ``options_cache_size`` most recently used option sets).
    With ``steer_method`` and no ``intervention``, the intervention is built from ``steer_options``.
    ``engine_factory(lm, intervention, settings, metrics=...)`` (default :class:`BatchEngine`) builds the
    generation engine: any :class:`~aligntax.serve.base.ServeEngine` (another backend's engine:
    :mod:`aligntax.backends.vllm.serve_engine`); the app talks to that protocol only.
    ``check_intervention(iv)`` raises an :class:`AligntaxError` for an intervention built from options that
    the engine cannot serve (a request sending them gets a 400).

    Admission (:class:`~aligntax.serve.base.Admission`): a request counts as waiting from its arrival
    (tokenisation included) until a batch takes it; at most ``max_queue`` wait (more get 429
    ``queue_full``), and with ``max_queue_wait_ms`` a request whose expected wait for a batch is over that
    target gets 503 ``overloaded``; with ``max_latency_ms`` a request whose predicted completion latency
    (:meth:`BatchEngine.predicted_latency`) is over that target gets 503 ``overloaded`` too; both with
    ``Retry-After``.
    """
    settings = settings or ServerSettings()
    lm.require_chat_template()
    prepare_tokenizer(lm.tokenizer, lm.model)
    steering = None
    if steer_method is not None and steer_method != "none":
        steering = RequestSteering(
            steer_method, lm, steer_options, settings.options_cache_size, check=check_intervention
        )
        if intervention is None:
            intervention = steering.cache.build({})
    window = context_window(lm)
    settings = settings.replace(
        model_name=settings.model_name or default_model_name(lm),
        max_prompt_tokens=settings.max_prompt_tokens or (window - 1 if window else 32768),
    )
    steered_name = None
    if intervention is not None:
        suffix = settings.steered_suffix or getattr(intervention, "name", None) or "steered"
        steered_name = f"{settings.model_name}+{suffix}"
    metrics = ServeMetrics()
    engine = (engine_factory or BatchEngine)(lm, intervention, settings, metrics=metrics)
    handler = ChatHandler(
        lm, intervention, engine, settings, steering, steered_name=steered_name, context_window=window
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            # uvicorn has stopped accepting connections and waited for open requests; finish the queue.
            await asyncio.to_thread(engine.shutdown, True, settings.shutdown_timeout)

    app = FastAPI(
        title="aligntax OpenAI-compatible server", lifespan=lifespan, default_response_class=SafeJSONResponse
    )
    app.state.engine = engine
    app.state.handler = handler
    app.state.metrics = metrics
    app.state.settings = settings
    app.add_middleware(RequestGuard, api_key=settings.api_key, metrics=metrics)
    add_error_handlers(app)
    app.include_router(router)
    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every error as ``{"error": {...}}``: validation (400), :class:`APIError`, HTTP errors, the rest 500."""

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> SafeJSONResponse:
        err = validation_error(list(exc.errors()))
        return SafeJSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> SafeJSONResponse:
        return SafeJSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> SafeJSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return SafeJSONResponse(
            error_body(str(exc.detail), kind, None, code),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> SafeJSONResponse:
        log.exception("unhandled error")
        return SafeJSONResponse(
            error_body(f"Internal server error: {type(exc).__name__}", "server_error"), status_code=500
        )


def graceful_timeout(app: FastAPI) -> int | None:
    """uvicorn's graceful-shutdown bound for ``app``: its ``shutdown_timeout`` in whole seconds (None: none)."""
    timeout = app.state.settings.shutdown_timeout
    return None if timeout is None else max(1, round(timeout))


def serve(app: FastAPI, log_level: str = "info") -> None:
    """Run ``app`` (:func:`create_app`) with uvicorn on its settings' host and port until interrupted;
    Ctrl-C drains in-flight requests first, for at most its ``shutdown_timeout``. A non-loopback host
    needs an ``api_key`` unless ``insecure``."""
    import uvicorn

    s: ServerSettings = app.state.settings
    check_bind(s.host, s.api_key, s.insecure)
    config = uvicorn.Config(
        app, host=s.host, port=s.port, log_level=log_level, timeout_graceful_shutdown=graceful_timeout(app)
    )
    uvicorn.Server(config).run()
