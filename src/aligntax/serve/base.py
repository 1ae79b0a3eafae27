"""What the server (:func:`aligntax.serve.app.create_app`) asks of a generation engine
(:class:`ServeEngine`), and the admission rules every engine applies (:class:`Admission`).

Two engines implement it: :class:`aligntax.serve.engine.BatchEngine` (the Hugging Face model, dynamic
batches on a worker thread) and the vLLM backend's
:class:`~aligntax.backends.vllm.serve_engine.VllmServeEngine` (continuous batching). The app talks to the
protocol only; the answers both make from their tokens follow :func:`aligntax.serve.jobs.finish_events`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

from aligntax.serve.jobs import EngineClosed, EngineOverloaded, Job
from aligntax.serve.metrics import ServeMetrics


class ServeEngine(Protocol):
    """A generation engine behind the server. Each request is admitted on arrival (:meth:`admit`),
    then submitted once tokenised (:meth:`submit`) or withdrawn (:meth:`withdraw`); its answer comes as
    ``Delta`` / ``Finished`` / ``Failed`` events on the job's queue."""

    tokenizer_lock: threading.Lock  # held while the engine decodes text (the server tokenises under it)
    metrics: ServeMetrics

    @property
    def queue_depth(self) -> int: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def started(self) -> bool: ...

    @property
    def alive(self) -> bool: ...

    @property
    def closed(self) -> bool: ...

    def admit(self, max_tokens: int | None = None) -> None:
        """Count a new request as waiting, or raise :class:`EngineOverloaded` / :class:`EngineClosed`."""

    def withdraw(self) -> None:
        """An admitted request that will not be submitted."""

    def submit(self, job: Job, admitted: bool = False) -> Job:
        """Start working on ``job``."""

    def cancel(self, job: Job) -> None:
        """Stop working on a job whose client went away (no further events are sent)."""

    def start(self) -> None: ...

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; with ``drain`` finish what runs (for at most ``timeout`` seconds), then
        fail (503) whatever is left."""


# ``factory(lm, intervention, settings, metrics=...)``, as BatchEngine is built: how create_app builds its engine
EngineFactory = Callable[..., ServeEngine]


class Admission:
    """The admission rules of every engine: a request counts as waiting from admission (before its
    prompt is tokenised) until the engine starts on it (the subclass's ``waiting``, arriving requests
    included). A new one is refused when ``max_queue`` are waiting (429 ``queue_full``) or, with
    ``max_queue_wait_ms``, when its expected wait (the subclass's ``expected_wait``) is over that target
    (503 ``overloaded``); the first request waiting is always admitted. Both answers carry the whole
    seconds until about the work ahead has drained (``Retry-After``)."""

    waits_for = "a batch"  # what an admitted request waits for (named in the 503 message)

    def _init_admission(
        self, max_queue: int, max_queue_wait_ms: float | None, lock: threading.Lock | None = None
    ) -> None:
        if max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        if max_queue_wait_ms is not None and max_queue_wait_ms <= 0:
            raise ValueError("max_queue_wait_ms must be > 0")
        self.max_queue = max_queue
        self.max_queue_wait = None if max_queue_wait_ms is None else max_queue_wait_ms / 1000.0
        self._arriving = 0  # admitted requests not submitted yet (their prompts are being tokenised)
        self._admit_lock = lock or threading.Lock()

    @property
    def waiting(self) -> int:
        raise NotImplementedError

    @property
    def closed(self) -> bool:
        raise NotImplementedError

    def expected_wait(self, ahead: int | None = None) -> float | None:
        raise NotImplementedError

    def _check_admission(self, ahead: int, max_tokens: int | None) -> None:
        """An engine's own admission rule, checked after the queue bound (raise to refuse)."""

    def admit(self, max_tokens: int | None = None) -> None:
        """Count a new request as waiting from now on, or raise :class:`EngineOverloaded` (or
        :class:`EngineClosed`). Each admission ends with ``submit(job, admitted=True)`` or
        :meth:`withdraw`. ``max_tokens``: the request's completion limit, for an engine's own rule."""
        if self.closed:
            raise EngineClosed("The server is shutting down.")
        with self._admit_lock:
            ahead = self.waiting
            if ahead >= self.max_queue:
                raise self._queue_full(ahead)
            self._check_admission(ahead, max_tokens)
            if self.max_queue_wait is not None and ahead > 0:
                wait = self.expected_wait(ahead)
                if wait is not None and wait > self.max_queue_wait:
                    raise EngineOverloaded(
                        f"The server is overloaded: a new request would wait about {wait:.2f} s for "
                        f"{self.waits_for} (target {self.max_queue_wait:.2f} s; {ahead} requests waiting); "
                        "retry later.",
                        self._retry_after(ahead),
                        status=503,
                        code="overloaded",
                    )
            self._arriving += 1

    def withdraw(self) -> None:
        """An admitted request that will not be submitted (it failed validation or its client left)."""
        with self._admit_lock:
            self._arriving = max(0, self._arriving - 1)

    def _take(self, admitted: bool) -> None:
        """A request being submitted, with the admission lock held: one admitted stops counting as
        arriving; a closed engine refuses it, and a full queue one that was not admitted."""
        if admitted:
            self._arriving = max(0, self._arriving - 1)
        if self.closed:
            raise EngineClosed("The server is shutting down.")
        if not admitted and self.waiting >= self.max_queue:
            raise self._queue_full(self.waiting)

    def _queue_full(self, ahead: int) -> EngineOverloaded:
        return EngineOverloaded(
            f"The server's request queue is full ({self.max_queue} waiting); retry later.",
            self._retry_after(ahead),
        )

    def _retry_after(self, ahead: int) -> int:
        """Whole seconds until about the work ahead has drained (at least 1)."""
        wait = self.expected_wait(ahead)
        return 1 if wait is None else max(1, int(wait + 0.999))
