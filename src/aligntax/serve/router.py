"""The server's routes, on an :class:`~fastapi.APIRouter` that :func:`aligntax.serve.app.create_app`
includes: ``GET /health``, ``GET /metrics``, ``GET /v1/models``, ``GET /v1/models/{id}`` and
``POST /v1/chat/completions`` (plain, or ``stream: true`` server-sent events). Each route reads the
app's :class:`~aligntax.serve.handler.ChatHandler` from ``app.state.handler`` and does nothing else."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from aligntax.serve.handler import ChatHandler
from aligntax.serve.protocol import APIError, ChatCompletionRequest

router = APIRouter()


def handler(request: Request) -> ChatHandler:
    found: ChatHandler = request.app.state.handler
    return found


@router.get("/health", response_model=None)
async def health(request: Request) -> JSONResponse:
    h = handler(request)
    engine = h.engine
    ok = not engine.closed and (engine.alive or not engine.started)
    body = {
        "status": "ok" if ok else ("shutting_down" if engine.closed else "worker_dead"),
        "models": h.model_names(),
        "queue_depth": engine.queue_depth,
    }
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/metrics", response_model=None)
async def metrics(request: Request) -> dict[str, Any]:
    engine = handler(request).engine
    snapshot: dict[str, Any] = engine.metrics.snapshot(
        queue_depth=engine.queue_depth, in_flight=engine.in_flight
    )
    return snapshot


@router.get("/v1/models", response_model=None)
async def list_models(request: Request) -> dict[str, Any]:
    h = handler(request)
    return {"object": "list", "data": [h.model_card(n) for n in h.model_names()]}


@router.get("/v1/models/{model_id:path}", response_model=None)
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    h = handler(request)
    if model_id not in h.model_names():
        raise APIError(
            404,
            f"The model '{model_id}' does not exist.",
            "invalid_request_error",
            "model",
            "model_not_found",
        )
    return h.model_card(model_id)


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request
) -> dict[str, Any] | StreamingResponse:
    answer = await handler(request).chat(body, request.receive)
    if isinstance(answer, dict):
        return answer
    return StreamingResponse(
        answer,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
