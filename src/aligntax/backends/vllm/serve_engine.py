"""The server's generation engine on vLLM (:class:`VllmServeEngine`), answering from an
:class:`~aligntax.backends.vllm.async_engine.AsyncVllm` with continuous batching.

The routes, request checks, errors, admission answers (429 / 503) and the answers themselves are the
server's own (:mod:`aligntax.serve`); only the generation engine differs. :class:`VllmServeEngine` is a
:class:`~aligntax.serve.base.ServeEngine`, as :class:`aligntax.serve.engine.BatchEngine` is (``admit`` /
``withdraw`` / ``submit`` / ``cancel`` / ``start`` / ``shutdown``, and ``Delta`` / ``Finished`` /
``Failed`` events on each :class:`Job`'s queue), and is handed to ``create_app(..., engine_factory=...)``
by :func:`aligntax.backends.vllm.serving.create_vllm_app`.

- **Continuous batching.** A request goes to the engine as soon as it is submitted (nothing is
  gathered): vLLM schedules it into the running batch at its next step, and a request that ends leaves
  the batch at once. ``max_batch_size`` is the engine's sequence slots (``max_num_seqs``).
- **Steering.** The steered model ``NAME+SUFFIX`` is a steering preset registered in every worker at
  start-up (:meth:`AsyncVllm.register`); each steered request carries it and its strength (the request's
  ``aligntax.strength``, default 1) in ``SamplingParams.extra_args`` and salts its prefix-cache entries
  per (preset, strength), as :class:`~aligntax.backends.vllm.engine.VllmModel` does. The strength is
  checked before submitting (400 outside ``[0, 10]``); strength 0 is plain generation. A method that
  rewrites the chat messages (a system prompt) is applied by the app to the steered model's prompts.
- **Per-request steering options** (``{"aligntax": {"options": {"eta": 0.2, "horizon": 8}}}``; the keys,
  types and checks of the HF server, :mod:`aligntax.serve.options`, listed in ``GET /v1/models``). The
  app checks a request's options and builds their intervention as the HF server does (a bad key, type or
  value gets 400 before the engine sees the request); the engine steers each distinct option set with a
  steering preset of its own, ``req-<digest of its options>``, built in the workers from the served
  method's folder and the server's options updated with the request's (:class:`OptionSteering`). A new
  set is registered on the engine's loop before its first request is submitted (once, however many
  requests bring it together); at most ``options_cache_size`` (default 16) are kept: past that, the
  least recently used one that no submitted request uses is unregistered (registered again when asked
  for again). The prefix cache is salted per (preset, strength), as above. A registration the workers
  refuse fails that request alone (500 naming the options); the engine keeps serving.
- **Tokens to text.** The engine returns token ids only (``detokenize=False``, ``output_kind=DELTA``);
  text, stop strings and streamed deltas are made here with the server's own
  :class:`~aligntax.serve.jobs.IncrementalDetokenizer` and :class:`~aligntax.serve.jobs.StopMatcher`,
  and end tokens, ``max_tokens`` and ``completion_tokens`` (the end token counted) follow
  :class:`BatchEngine`, so both backends answer the same text for the same tokens. A request hit by a
  stop string is aborted in the engine.
- **Sampling** as the server's: temperature 0 is the argmax, otherwise temperature, top-p and an
  optional seed; the model's own generation config plays no part (no repetition penalty).
- **Admission.** vLLM queues internally, so the bounds count requests *waiting*: admitted and not yet
  submitted (being tokenised), or submitted without a first token yet. ``max_queue`` of them waiting
  gives 429; with ``max_queue_wait_ms``, a request whose expected wait (the moving average of recent
  requests' wait for their first token, times ``1 + waiting // max_batch_size``) is over the target
  gives 503. The first request waiting is always admitted.
- **Cancellation** (the client left, ``request_timeout``, shutdown) aborts the request in the engine.
- **Threads.** The ``AsyncLLM`` runs on its own thread and event loop (:class:`AsyncVllm`), as the
  HF engine's model runs on its worker thread; events reach each request's loop with
  ``call_soon_threadsafe``. vLLM's engine core runs in a child process of its own.

Not covered: failing a request whose logits turn non-finite alone, and ``pause`` / ``resume``. The
batch statistics of ``/metrics`` stay 0 (there are no batches to count); its token counts, latency and
queue depth are kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aligntax.backends.vllm.async_engine import AsyncVllm
from aligntax.backends.vllm.steering import EXTRA_STEER, EXTRA_STRENGTH, MAX_STRENGTH
from aligntax.errors import AligntaxError
from aligntax.serve.base import Admission
from aligntax.serve.jobs import Failed, Job, RowText, finish_events
from aligntax.serve.metrics import ServeMetrics
from aligntax.serve.settings import ServerSettings

if TYPE_CHECKING:
    from aligntax.interventions.base import Intervention
    from aligntax.models.loader import LoadedModel

log = logging.getLogger("aligntax.serve")


@dataclass(eq=False)
class _Request:
    """A submitted job as the engine tracks it."""

    job: Job
    rid: str
    task: asyncio.Task | None = None
    started: bool = False  # its first tokens came


@dataclass(eq=False)
class _Answer:
    """One request's tokens to events, with :class:`~aligntax.serve.engine.BatchEngine`'s rules
    (:func:`~aligntax.serve.jobs.finish_events`): an end token finishes with "stop" (counted in
    ``completion_tokens``, not in the text), a stop string with "stop" (text cut before it),
    ``max_tokens`` with "length"."""

    job: Job
    tokenizer: Any
    eos: set
    tokens: list = field(default_factory=list)
    row: RowText | None = None
    done: bool = False

    def __post_init__(self) -> None:
        if self.job.stream or self.job.params.stop:
            self.row = RowText(self.tokenizer, self.job.params.stop)

    def feed(self, ids, events: list) -> None:
        """Take new token ids (appending events); sets ``done`` when the answer is complete."""
        for tok in ids:
            if self.done:
                return
            self.tokens.append(int(tok))
            if tok in self.eos:
                self._finish("stop", events, eos=True)
                continue
            if self.row is not None and self.row.push(self.job, int(tok), events):
                self._finish("stop", events)
                continue
            if len(self.tokens) >= self.job.params.max_tokens:
                self._finish("length", events)

    def _finish(self, reason: str, events: list, eos: bool = False) -> None:
        events.extend(
            finish_events(self.job, self.tokenizer, self.tokens, len(self.tokens), reason, eos, self.row)
        )
        self.done = True

    def finish_rest(self, events: list) -> None:
        """The engine ended the request first (it should not): complete it with what came."""
        if not self.done:
            eos = bool(self.tokens) and self.tokens[-1] in self.eos
            self._finish("stop" if eos else "length", events, eos=eos)


def _deliver(job: Job, events: list) -> None:
    for ev in events:
        job.events.put_nowait(ev)


@dataclass(frozen=True)
class OptionSteering:
    """How the engine steers requests with steering options of their own: the served ``method``, its
    folder (``source``) and the server's options (``base``); each distinct option set is a steering
    preset of its own, registered on first use, the ``maxsize`` most recently used kept."""

    method: str
    source: str
    base: dict = field(default_factory=dict)
    maxsize: int = 16

    def __post_init__(self) -> None:
        if self.maxsize < 1:
            raise ValueError("maxsize must be >= 1")

    def config(self, options: dict) -> dict:
        """The options the workers build the preset of ``options`` with."""
        return {"name": self.method, **self.base, **options}


@dataclass(eq=False)
class _OptionPreset:
    """A request option set's preset: its registration and the submitted requests using it."""

    name: str
    task: asyncio.Task | None = None
    users: int = 0


_ENGINES = itertools.count()  # distinguishes the option presets of engines sharing one AsyncVllm


class VllmServeEngine(Admission):
    """The server's generation engine on an :class:`AsyncVllm` (see the module docstring). Built by
    ``create_app`` through ``engine_factory`` with the server's settings, as
    :class:`~aligntax.serve.engine.BatchEngine` is; the batch-gathering ones (``batch_wait_ms``,
    ``max_batch_wait_ms``, ``mix_steered``, ``max_batch_tokens``) have no meaning here: vLLM's scheduler
    forms every step's batch. Admission (:class:`~aligntax.serve.base.Admission`) counts a request as
    waiting until its first tokens come."""

    waits_for = "its first tokens"

    def __init__(
        self,
        lm: LoadedModel,
        intervention: Intervention | None = None,
        settings: ServerSettings | None = None,
        *,
        metrics: ServeMetrics | None = None,
        vm: AsyncVllm,
        preset: str | None = None,
        option_steering: OptionSteering | None = None,
    ) -> None:
        s = settings or ServerSettings()
        if s.max_latency_ms is not None:
            raise AligntaxError(
                "A completion-latency target (max_latency_ms) is not served by the vLLM backend."
            )
        self._lock = threading.Lock()
        self._init_admission(s.max_queue, s.max_queue_wait_ms, lock=self._lock)
        if preset is not None and preset not in vm.presets:
            raise AligntaxError(f"Steering preset {preset!r} is not registered in the engine.")
        self.vm = vm
        self.lm = lm
        self.tokenizer = vm.tokenizer  # used on the engine's loop only
        self.tokenizer_lock = threading.Lock()
        self.intervention = intervention
        self.preset = preset
        self.option_steering = option_steering if preset is not None else None
        self._serial = next(_ENGINES)
        self._option_presets: OrderedDict[str, _OptionPreset] = OrderedDict()  # least recently used first
        self._unregistering: dict[str, asyncio.Task] = {}
        self.option_registrations = 0  # option presets registered in the workers (re-registrations too)
        self.option_unregistrations = 0
        self.max_batch_size = vm.options.max_num_seqs  # the engine's sequence slots (set when it started)
        self.metrics = metrics or ServeMetrics()
        self.eos_ids = set(vm.eos_ids)
        self.first_token_wait: float | None = None  # moving average: submit -> first tokens
        self._ids = itertools.count()
        self._queued = 0  # submitted, no tokens yet
        self._requests: dict[Job, _Request] = {}
        self._closed = False
        self._started = False
        self._idle = threading.Event()
        self._idle.set()

    # -- the interface the app uses -------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        """Requests admitted and without a first token yet (being tokenised, or queued in the engine)."""
        return self._arriving + self._queued

    @property
    def queue_depth(self) -> int:
        return self._queued

    @property
    def in_flight(self) -> int:
        return len(self._requests) - self._queued

    @property
    def started(self) -> bool:
        return self._started

    @property
    def alive(self) -> bool:
        return self.vm.alive

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def option_presets(self) -> list[str]:
        """The request option sets' presets registered (or being registered), least recently used first."""
        return list(self._option_presets)

    def option_preset_name(self, options: dict) -> str:
        """The preset name of a request's option set: a digest of the options the workers build it with."""
        spec = self.option_steering
        if spec is None:
            raise AligntaxError("This engine serves no per-request steering options.")
        raw = json.dumps([self._serial, spec.source, spec.config(options)], sort_keys=True, default=str)
        return "req-" + hashlib.sha1(raw.encode()).hexdigest()[:12]

    def expected_wait(self, ahead: int | None = None) -> float | None:
        """Seconds until a request with ``ahead`` requests waiting before it gets its first tokens, from
        recent requests' waits; None before any was measured."""
        d = self.first_token_wait
        if d is None:
            return None
        ahead = self.waiting if ahead is None else ahead
        return d * (1 + ahead // self.max_batch_size)

    def start(self) -> None:
        self._started = True

    def submit(self, job: Job, admitted: bool = False) -> Job:
        if job.steer and self.preset is not None:
            s = float(job.strength) if job.strength is not None else 1.0
            if not 0.0 <= s <= MAX_STRENGTH:
                if admitted:
                    self.withdraw()
                from aligntax.serve.protocol import invalid

                raise invalid(
                    f"With the vLLM backend 'aligntax.strength' must lie in [0, {MAX_STRENGTH:g}]; "
                    f"got {s:g}.",
                    "aligntax.strength",
                )
        self._started = True
        job.enqueued_at = time.perf_counter()
        with self._lock:
            self._take(admitted)
            req = _Request(job, f"aligntax-{next(self._ids)}")
            self._requests[job] = req
            self._queued += 1
            self._idle.clear()
        self.vm.loop.call_soon_threadsafe(self._begin, req)
        return job

    def cancel(self, job: Job) -> None:
        """Stop working on a job whose client went away (no further events are sent)."""
        if job.done:
            return
        job.cancelled = True
        req = self._requests.get(job)
        if req is not None:
            self.vm.loop.call_soon_threadsafe(self._cancel_task, req)

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; with ``drain`` let the running ones finish (for at most ``timeout``
        seconds), then fail (503) and abort whatever is left. The engine itself stays up (its owner,
        :class:`AsyncVllm`, is closed by whoever started it)."""
        with self._lock:
            self._closed = True
        if drain:
            self._idle.wait(timeout)
        self.abort("The server shut down before this request finished.")
        self._idle.wait(10.0)
        if self._option_presets and self.vm.alive:  # the engine outlives this server: drop its presets
            with contextlib.suppress(Exception):
                self.vm.call(self._drop_option_presets(), timeout=30)

    def abort(self, message: str, status: int = 503) -> None:
        """Fail every submitted request now."""
        for req in list(self._requests.values()):
            job = req.job
            if not job.done:
                job.done = job.cancelled = True
                self._send(job, [Failed(message, status, "server_shutting_down")])
            self.vm.loop.call_soon_threadsafe(self._cancel_task, req)

    # -- on the engine's loop ----------------------------------------------------------------------------
    def _send(self, job: Job, events: list) -> None:
        if job.loop is None or job.events is None or not events:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
            job.loop.call_soon_threadsafe(_deliver, job, events)

    def _begin(self, req: _Request) -> None:
        if req.job.cancelled or req.job.done:
            self._forget(req)
            return
        req.task = self.vm.loop.create_task(self._generate(req))

    def _cancel_task(self, req: _Request) -> None:
        if req.task is None:
            self._forget(req)
        elif not req.task.done():
            req.task.cancel()

    def _params(self, job: Job, preset: str | None):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        p = job.params
        sp = dict(
            max_tokens=p.max_tokens,
            stop_token_ids=sorted(self.eos_ids),
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        if p.greedy:
            sp["temperature"] = 0.0
        else:
            sp.update(temperature=p.temperature, top_p=p.top_p, seed=p.seed)
        if preset is not None:
            sp["extra_args"] = {EXTRA_STEER: preset, EXTRA_STRENGTH: float(job.strength)}
        return SamplingParams(**sp)

    # -- the presets of request option sets (on the engine's loop) ---------------------------------------
    async def _acquire(self, options: dict) -> _OptionPreset:
        """The registered preset of a request's option set (registered first if new: concurrent requests
        with the same new set register it once), held until :meth:`_release`."""
        name = self.option_preset_name(options)
        entry = self._option_presets.get(name)
        if entry is None:
            entry = self._option_presets[name] = _OptionPreset(name)
            entry.task = self.vm.loop.create_task(self._register(entry, options))
            entry.task.add_done_callback(lambda t: t.cancelled() or t.exception())  # read by the requests
        else:
            self._option_presets.move_to_end(name)
        entry.users += 1
        try:
            await asyncio.shield(entry.task)
        except BaseException:
            self._release(entry)
            raise
        return entry

    def _release(self, entry: _OptionPreset) -> None:
        entry.users -= 1
        self._evict()

    async def _register(self, entry: _OptionPreset, options: dict) -> None:
        spec = self.option_steering
        pending = self._unregistering.get(entry.name)
        if pending is not None:  # the same set was evicted a moment ago: register it after that
            await asyncio.wait([pending])
        try:
            await self.vm.engine.collective_rpc(
                "aligntax_register", args=(entry.name, spec.source, spec.config(options))
            )
        except BaseException:
            if self._option_presets.get(entry.name) is entry:  # a later request tries again
                del self._option_presets[entry.name]
            raise
        self.option_registrations += 1
        self._evict()

    def _evict(self) -> None:
        """Over the bound, unregister the least recently used presets no submitted request uses."""
        spec = self.option_steering
        while spec is not None and len(self._option_presets) > spec.maxsize:
            victim = next((e for e in self._option_presets.values() if e.users == 0 and e.task.done()), None)
            if victim is None:
                return  # all in use: over the bound until one is released
            del self._option_presets[victim.name]
            self._unregistering[victim.name] = self.vm.loop.create_task(self._unregister(victim.name))

    async def _unregister(self, name: str) -> None:
        try:
            await self.vm.engine.collective_rpc("aligntax_unregister", args=(name,))
            self.option_unregistrations += 1
        except Exception:
            log.exception("unregistering the steering preset %s failed", name)
        finally:
            if self._unregistering.get(name) is asyncio.current_task():
                del self._unregistering[name]

    async def _drop_option_presets(self) -> None:
        for name, entry in list(self._option_presets.items()):
            if entry.task.done() and not entry.task.cancelled() and entry.task.exception() is None:
                del self._option_presets[name]
                await self._unregister(name)

    async def _generate(self, req: _Request) -> None:
        job = req.job
        answer = _Answer(job, self.tokenizer, self.eos_ids)
        entry = None
        try:
            preset = self.preset if job.steer and float(job.strength) > 0 else None
            if preset is not None and job.options and self.option_steering is not None:
                try:
                    entry = await self._acquire(job.options)
                except Exception as exc:  # this request fails alone
                    log.exception("registering a request's steering options failed")
                    if not job.done:
                        job.done = True
                        self._send(
                            job,
                            [
                                Failed(
                                    "These steering options could not be set up in the engine "
                                    f"({json.dumps(job.options)}): {type(exc).__name__}: {exc}",
                                    500,
                                )
                            ],
                        )
                    return
                preset = entry.name
                if job.cancelled:
                    return
            params = self._params(job, preset)
            prompt: dict = {"prompt_token_ids": list(job.prompt_ids)}
            if preset is not None:
                prompt["cache_salt"] = f"aligntax:{preset}:{float(job.strength)!r}"
            stream = self.vm.engine.generate(prompt, params, req.rid)
            async with contextlib.aclosing(stream):  # leaving early aborts the request in the engine
                async for out in stream:
                    if not req.started:
                        self._first_tokens(req)
                    if job.cancelled:
                        break
                    events: list = []
                    answer.feed(out.outputs[0].token_ids, events)
                    if answer.done:
                        job.done = True
                        self.metrics.record_tokens(len(job.prompt_ids), len(answer.tokens))
                    self._send(job, events)
                    if answer.done:
                        break
            if not answer.done and not job.cancelled:
                events = []
                answer.finish_rest(events)
                job.done = True
                self.metrics.record_tokens(len(job.prompt_ids), len(answer.tokens))
                self._send(job, events)
        except asyncio.CancelledError:
            pass  # cancelled: the client is gone, or shutdown failed it already
        except Exception as exc:  # reported to this request only
            log.exception("generation failed for a request")
            if not job.done:
                job.done = True
                self._send(job, [Failed(f"Generation failed: {type(exc).__name__}: {exc}", 500)])
        finally:
            if entry is not None:
                self._release(entry)
            self._forget(req)

    def _first_tokens(self, req: _Request, alpha: float = 0.3) -> None:
        req.started = True
        wait = time.perf_counter() - req.job.enqueued_at
        with self._lock:
            self._queued -= 1
            d = self.first_token_wait
            self.first_token_wait = wait if d is None else (1 - alpha) * d + alpha * wait

    def _forget(self, req: _Request) -> None:
        with self._lock:
            if self._requests.pop(req.job, None) is None:
                return
            if not req.started:
                self._queued -= 1
            if not self._requests:
                self._idle.set()
