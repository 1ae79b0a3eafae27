"""The requests both serve engines take and the events they answer with, and how an answer is made
from the tokens an engine generates: incremental detokenisation, stop strings, and the rules that
finish an answer (:func:`finish_events`), so that every engine answers the same text for the same
tokens (:class:`~aligntax.serve.engine.BatchEngine`, and the vLLM backend's engine)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aligntax.interventions.base import Intervention


class EngineClosed(RuntimeError):
    """The engine is shutting down and takes no new requests."""


class EngineOverloaded(RuntimeError):
    """The request queue is full (``code`` "queue_full", 429) or the expected wait is over the target
    (``code`` "overloaded", 503); ``retry_after`` in whole seconds."""

    def __init__(self, message: str, retry_after: int = 1, status: int = 429, code: str = "queue_full"):
        super().__init__(message)
        self.retry_after = max(1, int(retry_after))
        self.status = status
        self.code = code


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


@dataclass
class Delta:
    """New text for a streaming request."""

    text: str


@dataclass
class Finished:
    text: str  # the whole completion (for a stream: what the deltas add up to)
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Failed:
    message: str
    status: int = 500
    code: str | None = None


@dataclass(eq=False)
class Job:
    """One chat completion request as the worker sees it."""

    prompt_ids: list[int]
    params: SamplingParams
    steer: bool = False
    strength: float = 1.0
    # steered with this instead of the engine's intervention (a request's own steering options); a batch
    # holds steered rows of one intervention only
    intervention: Intervention | None = None
    # the request's checked steering options (``aligntax.options``) that built ``intervention``; an engine
    # that steers elsewhere (the vLLM backend's) sets up its own steering from them
    options: dict[str, Any] | None = None
    stream: bool = False
    # perf_counter() at admission (before tokenisation), when the server knows it
    arrived_at: float | None = None
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue[Any] | None = None
    enqueued_at: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    emitted: bool = False  # some text was already sent (a stream cannot be retried)
    done: bool = False


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without splitting multi-byte characters.

    Decodes a short window (the previously emitted tokens plus the new ones) and emits only what the
    new tokens added, holding text back while it ends in an incomplete character (U+FFFD). The deltas
    add up to ``tokenizer.decode(ids, skip_special_tokens=True)``.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0
        self._prefix_text = ""

    def _decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=True)) if ids else ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        new_text = self._decode(self.ids[self.prefix :])
        if len(new_text) > len(self._prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(self._prefix_text) :]
            self.prefix, self.read = self.read, len(self.ids)
            self._prefix_text = self._decode(self.ids[self.prefix : self.read])
            return delta
        return ""

    def flush(self) -> str:
        new_text = self._decode(self.ids[self.prefix :])
        delta = new_text[len(self._prefix_text) :] if len(new_text) > len(self._prefix_text) else ""
        self.prefix = self.read = len(self.ids)
        self._prefix_text = ""
        return delta


class StopMatcher:
    """Cuts text at the first stop string, holding back a tail that could still become one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.maxlen = max((len(s) for s in self.stops), default=0)
        self.text = ""
        self.sent = 0

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit now, whether a stop string was hit)."""
        if not self.stops:
            self.text += delta
            self.sent = len(self.text)
            return delta, False
        start = max(0, len(self.text) - self.maxlen + 1)
        self.text += delta
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            cut = min(hits)
            self.text = self.text[:cut]
            out, self.sent = self.text[self.sent :], cut
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        safe = len(self.text) - hold
        if safe <= self.sent:
            return "", False
        out, self.sent = self.text[self.sent : safe], safe
        return out, False

    def flush(self) -> str:
        out, self.sent = self.text[self.sent :], len(self.text)
        return out


class RowText:
    """The text state of one answer that streams or has stop strings."""

    def __init__(self, tokenizer: Any, stops: Sequence[str]) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop = StopMatcher(stops)

    def push(self, job: Job, token_id: int, events: list[Any]) -> bool:
        """Take one generated token (not an end token): append the text a stream may send now to
        ``events``; returns whether a stop string was hit."""
        emit, stopped = self.stop.feed(self.detok.push(token_id))
        if emit and job.stream:
            job.emitted = True
            events.append(Delta(emit))
        return stopped


def finish_events(
    job: Job,
    tokenizer: Any,
    tokens: Sequence[int],
    n_generated: int,
    reason: str,
    eos: bool,
    row: RowText | None,
) -> list[Any]:
    """The events that complete ``job``: the rest of a stream's text, then :class:`Finished`.

    ``tokens``: the answer's tokens, of which ``n_generated`` count (an end token, ``eos``, among them
    but not in the text); ``reason``: "stop" (an end token or a stop string) or "length". A stop
    string found in the last text turns "length" into "stop". ``row``: the answer's text state (None
    when it neither streams nor has stop strings: the text is decoded here at once)."""
    events: list[Any] = []
    if row is not None:
        if reason != "stop" or eos:
            emit, stopped = row.stop.feed(row.detok.flush())
            if stopped:
                reason = "stop"
            else:
                emit += row.stop.flush()
            if emit and job.stream:
                job.emitted = True
                events.append(Delta(emit))
        text = row.stop.text
    else:
        ids = list(tokens[: n_generated - (1 if eos else 0)])
        text = tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
    events.append(
        Finished(
            text=text, finish_reason=reason, prompt_tokens=len(job.prompt_ids), completion_tokens=n_generated
        )
    )
    return events
