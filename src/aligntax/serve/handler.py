"""The request handler of the OpenAI-compatible server (:class:`ChatHandler`): what every route asks
(model cards, request checks, prompt building, admission, the answer plain or streamed), apart from
the routes themselves (:mod:`aligntax.serve.router`), the door (:mod:`aligntax.serve.security`) and the
assembly (:mod:`aligntax.serve.app`).

Every error is an :class:`~aligntax.serve.protocol.APIError` in the OpenAI format. Unknown fields (unless
``allow_unknown_fields``), invalid Unicode, more than 4 stop strings or one over 256 characters get 400;
a full queue gets 429 and an expected wait over ``max_queue_wait_ms`` (or a predicted completion latency
over ``max_latency_ms``) 503, both with ``Retry-After`` (requests count from their arrival, tokenisation
included); ``request_timeout`` bounds a request's time (504 ``request_timeout``, its generation
cancelled), and a non-streaming client that disconnects has its generation cancelled too. Prompts are
tokenised with a private copy of the tokenizer, so the per-step decoding of running batches never waits
on a long prompt's tokenisation.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool
from starlette.types import Receive

from aligntax.generation.chat import build_messages, render_chat
from aligntax.serve.base import ServeEngine
from aligntax.serve.jobs import (
    Delta,
    EngineClosed,
    EngineOverloaded,
    Failed,
    Finished,
    Job,
    SamplingParams,
)
from aligntax.serve.options import RequestSteering
from aligntax.serve.protocol import APIError, ChatCompletionRequest, error_body, invalid, unknown_field
from aligntax.serve.settings import ServerSettings

if TYPE_CHECKING:
    from aligntax.interventions.base import Intervention
    from aligntax.models.loader import LoadedModel

log = logging.getLogger("aligntax.serve")

MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256


@dataclass
class RequestPlan:
    """What :meth:`ChatHandler.check_model` decided for a request: steered or not, and its own steering
    options (empty: the server's)."""

    steer: bool
    options: dict[str, Any]


def sse(obj: dict[str, Any] | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


class ChatHandler:
    """What the routes call (:mod:`aligntax.serve.router`): request validation, prompt building, admission
    and the answers, plain or streamed. ``settings``: the server's, with ``model_name`` and
    ``max_prompt_tokens`` resolved (:func:`aligntax.serve.app.create_app`); ``steered_name``: the steered
    model's name (None: the server has none); ``context_window``: the model's (None: unknown)."""

    def __init__(
        self,
        lm: LoadedModel,
        intervention: Intervention | None,
        engine: ServeEngine,
        settings: ServerSettings,
        steering: RequestSteering | None = None,
        *,
        steered_name: str | None = None,
        context_window: int | None = None,
    ) -> None:
        self.lm = lm
        self.intervention = intervention
        self.steering = steering  # the per-request options of the steered model (None: it takes none)
        self.engine = engine
        self.settings = settings
        self.model_name: str = settings.model_name or "model"
        self.max_prompt_tokens: int = settings.max_prompt_tokens or 32768
        self.steered_name = steered_name
        self.context_window = context_window
        self.created = int(time.time())
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
        return [self.model_name] + ([self.steered_name] if self.steered_name else [])

    def model_card(self, name: str) -> dict[str, Any]:
        card = {"id": name, "object": "model", "created": self.created, "owned_by": "aligntax"}
        if name == self.steered_name:
            card["aligntax"] = {
                "method": self.steering.method if self.steering else getattr(self.intervention, "name", None),
                "strength": {
                    "type": "number",
                    "default": self.settings.default_strength,
                    "help": "steering strength (0: unsteered)",
                },
                "options": [f.card() for f in self.steering.fields] if self.steering else [],
            }
        return card

    # -- validation and prompt building -------------------------------------------------------------
    def check_model(self, body: ChatCompletionRequest) -> RequestPlan:
        """Whether the request is for the steered model, and its steering options (checked against the
        served method's per-request fields); 404 for an unknown model, 400 for a bad option."""
        if body.model == self.model_name:
            steer = False
        elif self.steered_name is not None and body.model == self.steered_name:
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
                f"the steered model '{self.steered_name}'"
                if self.steered_name
                else "a steered model, and this server has none (start it with an intervention)"
            )
            raise invalid(f"'aligntax.strength' only applies to {where}.", "aligntax.strength")
        raw = ext.options if ext is not None else None
        if not raw:
            return RequestPlan(steer, {})
        if not steer:
            where = (
                f"the steered model '{self.steered_name}'"
                if self.steered_name
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
        err = unknown_field(body, self.settings.allow_unknown_fields)
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
    def messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
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
        self, messages: list[dict[str, Any]], steer: bool, intervention: Intervention | None = None
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
            requested = self.settings.effective_default_max_tokens
        return max(1, min(int(requested), self.settings.max_tokens_limit))

    def max_tokens(self, body: ChatCompletionRequest, n_prompt: int) -> int:
        s = self.settings
        if n_prompt > self.max_prompt_tokens:
            raise invalid(
                f"This model's maximum prompt length is {self.max_prompt_tokens} tokens. However, "
                f"your messages resulted in {n_prompt} tokens. Please reduce the length of the "
                "messages.",
                "messages",
                "context_length_exceeded",
            )
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        room = self.context_window - n_prompt if self.context_window else None
        if requested is not None:
            if requested > s.max_tokens_limit:
                raise invalid(
                    f"{param} is too large: {requested}. This server allows at most "
                    f"{s.max_tokens_limit} completion tokens.",
                    param,
                )
            if room is not None and requested > room:
                raise invalid(
                    f"This model's maximum context length is {self.context_window} tokens. However, "
                    f"you requested {n_prompt + requested} tokens ({n_prompt} in the messages, "
                    f"{requested} in the completion). Please reduce the length of the messages "
                    "or completion.",
                    "messages",
                    "context_length_exceeded",
                )
            return requested
        limit = s.effective_default_max_tokens
        if room is not None:
            if room < 1:
                raise invalid(
                    f"This model's maximum context length is {self.context_window} tokens, and your "
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
        iv = None
        if plan.options and self.steering is not None:  # options are refused without steering
            iv = await run_in_threadpool(self.steering.intervention, plan.options)
        prompt_ids = await run_in_threadpool(self.encode, messages, steer, iv)
        params = SamplingParams(
            max_tokens=self.max_tokens(body, len(prompt_ids)),
            temperature=1.0 if body.temperature is None else float(body.temperature),
            top_p=1.0 if body.top_p is None else float(body.top_p),
            seed=body.seed,
            stop=stops,
        )
        strength = self.settings.default_strength
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
            if self.settings.max_latency_ms is not None and body is not None:
                self.engine.admit(max_tokens=self.requested_tokens(body))
            else:
                self.engine.admit()
        except EngineClosed as exc:
            raise APIError(503, str(exc), "server_error", None, "server_shutting_down") from None
        except EngineOverloaded as exc:
            raise overloaded_error(exc) from None

    def submit(self, job: Job, admitted: bool = False) -> None:
        try:
            self.engine.submit(job, admitted=admitted)
        except EngineClosed as exc:
            raise APIError(503, str(exc), "server_error", None, "server_shutting_down") from None
        except EngineOverloaded as exc:
            raise overloaded_error(exc) from None

    # -- answering ----------------------------------------------------------------------------------
    async def chat(
        self, body: ChatCompletionRequest, receive: Receive
    ) -> dict[str, Any] | AsyncIterator[str]:
        """Answer one chat-completions request: counted as waiting from its arrival (tokenisation
        included), prepared and submitted; a plain answer comes back whole (cancelled when the client
        leaves or the request timeout passes), a streamed one as its server-sent events."""
        loop = asyncio.get_running_loop()
        timeout = self.settings.request_timeout
        deadline = None if timeout is None else loop.time() + timeout
        arrived = time.perf_counter()
        self.admit(body)  # counted as waiting from now on: tokenisation included
        try:
            job = await self.prepare(body)
            job.arrived_at = arrived
            if deadline is not None and loop.time() >= deadline:
                raise timeout_error(timeout)
        except BaseException:
            self.engine.withdraw()
            raise
        self.submit(job, admitted=True)
        if job.stream:
            return self.stream(body, job, deadline)
        answer: dict[str, Any] = await self.complete_watched(body, job, receive, deadline)
        return answer

    def _base(self, cid: str, created: int, model: str, obj: str) -> dict[str, Any]:
        out = {"id": cid, "object": obj, "created": created, "model": model}
        if self.fingerprint:
            out["system_fingerprint"] = self.fingerprint
        return out

    @staticmethod
    def _usage(ev: Finished) -> dict[str, Any]:
        return {
            "prompt_tokens": ev.prompt_tokens,
            "completion_tokens": ev.completion_tokens,
            "total_tokens": ev.prompt_tokens + ev.completion_tokens,
        }

    async def complete(self, body: ChatCompletionRequest, job: Job) -> dict[str, Any]:
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        events = events_of(job)
        try:
            while True:
                ev = await events.get()
                if isinstance(ev, Finished):
                    break
                if isinstance(ev, Failed):
                    raise APIError(ev.status, ev.message, error_type(ev.status), None, ev.code)
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
        self, body: ChatCompletionRequest, job: Job, receive: Receive, deadline: float | None
    ) -> dict[str, Any]:
        """:meth:`complete`, cancelled (its rows leave the batch) when the client disconnects or the
        request's deadline passes (504)."""
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(self.complete(body, job))
        watch = asyncio.ensure_future(disconnected(receive))
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
        raise timeout_error(self.settings.request_timeout)

    async def stream(
        self, body: ChatCompletionRequest, job: Job, deadline: float | None = None
    ) -> AsyncIterator[str]:
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        events = events_of(job)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        base = self._base(cid, created, body.model, "chat.completion.chunk")

        def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
            obj = dict(base)
            obj["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
            if include_usage:
                obj["usage"] = None
            return sse(obj)

        try:
            yield chunk({"role": "assistant", "content": ""})
            loop = asyncio.get_running_loop()
            while True:
                if deadline is None:
                    ev = await events.get()
                else:
                    try:
                        ev = await asyncio.wait_for(events.get(), max(0.0, deadline - loop.time()))
                    except TimeoutError:
                        self.engine.cancel(job)
                        yield sse(timeout_error(self.settings.request_timeout).body())
                        break
                if isinstance(ev, Delta):
                    yield chunk({"content": ev.text})
                elif isinstance(ev, Finished):
                    yield chunk({}, ev.finish_reason)
                    if include_usage:
                        yield sse({**base, "choices": [], "usage": self._usage(ev)})
                    break
                elif isinstance(ev, Failed):
                    yield sse(error_body(ev.message, error_type(ev.status), None, ev.code))
                    break
            yield sse("[DONE]")
        finally:
            if not job.done:
                self.engine.cancel(job)


def events_of(job: Job) -> asyncio.Queue[Any]:
    """The queue a job's events come on (every job the handler makes has one)."""
    if job.events is None:
        raise RuntimeError("the job has no event queue")
    return job.events


def overloaded_error(exc: EngineOverloaded) -> APIError:
    kind = "rate_limit_error" if exc.status == 429 else "server_error"
    return APIError(
        exc.status,
        f"{exc} Retry after {exc.retry_after} s.",
        kind,
        None,
        exc.code,
        headers={"Retry-After": str(exc.retry_after)},
    )


def error_type(status: int) -> str:
    return "invalid_request_error" if status < 500 else "server_error"


def timeout_error(timeout_s: float | None) -> APIError:
    return APIError(
        504,
        f"The request did not finish within the server's request timeout ({timeout_s:g} s); "
        "its generation was cancelled. Ask for fewer tokens or retry later.",
        "server_error",
        None,
        "request_timeout",
    )


async def disconnected(receive: Receive) -> None:
    """Return once the client has gone (the body was read before, so only http.disconnect is left)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
