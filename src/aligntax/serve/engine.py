"""The batching engine: one worker thread owns the model and generates queued requests together.

Requests (:class:`Job`) enter a thread-safe queue. The worker takes the first one and gathers more
(up to ``max_batch_size``) until none has come for ``batch_wait_ms``, or ``max_batch_wait_ms`` after
the first (requests of a burst arrive one by one, each tokenised by the server first), and decodes
them as one left-padded batch with the KV cache inside the intervention's ``attach`` context
(:func:`aligntax.generation.generate.decode_batch`): a request leaves the batch as soon as it ends, and the prompt prefix all requests share (the chat
template's system turn) is computed once when the intervention is prefix-free. Everything that
differs between requests is handled per row, so any mix of requests shares a batch:

- steering: ``SteerContext.rows`` / ``.strength`` are per-row tensors (unsteered rows get strength 0);
  a request with its own steering options (``Job.intervention``, built by the server for that option
  set) shares a batch only with unsteered requests and steered ones of the same intervention;
- sampling: :class:`RowSampler` picks each row's token (greedy, or temperature / top-p sampling,
  with a private generator for seeded rows); the model's own generation config plays no part;
- length, eos, stop strings, streaming and cancellation: :class:`_BatchController`, called once per
  step with the new tokens of the rows still in the batch. It checks eos and per-row ``max_tokens``
  with tensor ops; only rows that stream or have stop strings are decoded each step (incrementally,
  so multi-byte characters are never split), and their text goes to each request's asyncio queue
  with one ``call_soon_threadsafe`` per step and event loop. The rows it ends leave the batch.

After each batch the worker hands the C allocator's free pages back to the system (glibc's
``malloc_trim``, :func:`trim_allocator`): batches of changing shapes otherwise leave freed tensor memory
scattered through the heap, and the server's resident memory climbs with every larger batch. For the
same reason ``aligntax serve --backend hf`` caps oneDNN's cache of per-shape kernels
(:func:`bound_kernel_cache`).

A batch that raises is retried one request at a time (requests that already streamed text are failed
instead), so one bad request fails alone and the worker never dies. A row whose logits turn NaN (or
+inf), e.g. steered too hard, is failed alone and leaves the batch; the other rows carry on.

A batch holds at most ``max_batch_tokens`` padded prompt tokens (rows x longest prompt; the first
request of a batch always fits), so one huge prompt does not pad all its neighbours: the requests
that do not fit wait for the next batch, ahead of anything queued after them.

Admission (:meth:`BatchEngine.admit`, called by the server when a request arrives, before its prompt
is tokenised): a request counts as waiting from admission until a batch takes it (``waiting``: being
tokenised, queued or held back). A new one is refused when ``max_queue`` are waiting
(:class:`EngineOverloaded`, 429 ``queue_full``) or, with ``max_queue_wait_ms``, when its expected wait
exceeds that target (503 ``overloaded``). The expected wait follows the batch structure the worker
uses, with the batch duration measured on recent batches (an exponential moving average):
``remaining time of the running batch + (waiting // max_batch_size) * batch duration``. The first
request waiting is always admitted (it starts the next batch), so that an idle or lightly loaded
engine never refuses work. With a target, a batch also stops gathering as soon as nothing is queued and
no admitted request is being tokenised.

With ``max_latency_ms`` a request is refused (503 ``overloaded``) when its predicted completion
latency is over that target (:meth:`BatchEngine.predicted_latency`): the rest of the running batch,
the full batches waiting ahead of it, then its own batch (the requests waiting in the group it joins,
itself included, decoding up to the longest ``max_tokens`` among them). Batch durations come from a
per-step time that grows linearly with the rows of a batch (:class:`StepTimeModel`, fitted on recent
batches), so a request is refused when it would lengthen its batch past the target for the oldest
request already waiting in it, not only when it would itself finish late. An idle engine admits
every request.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import threading
import time
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any

import torch

from aligntax.generation.generate import decode_batch, eos_token_ids
from aligntax.interventions.base import Intervention, NoIntervention
from aligntax.serve.base import Admission
from aligntax.serve.batch import Outbox, RowSampler, StepTimeModel
from aligntax.serve.jobs import (
    EngineOverloaded,
    Failed,
    Job,
    RowText,
    finish_events,
)
from aligntax.serve.metrics import ServeMetrics
from aligntax.serve.settings import ServerSettings

if TYPE_CHECKING:
    from aligntax.models.loader import LoadedModel

log = logging.getLogger("aligntax.serve")

_STOP = object()


class _BatchController:
    """Run once per step on the rows still in the batch: eos, per-row max_tokens, stop strings,
    streaming, cancels. Returns which of those rows end now (they then leave the batch)."""

    def __init__(
        self, engine: BatchEngine, jobs: list[Job], device: torch.device, sampler: RowSampler | None = None
    ) -> None:
        self.engine = engine
        self.jobs = jobs
        self.sampler = sampler
        self.max_new = torch.tensor([j.params.max_tokens for j in jobs], device=device)
        self.eos = torch.tensor(engine.eos_ids or [-1], device=device)
        self.eos_set = set(engine.eos_ids)
        self.cancel_epoch = engine.cancel_epoch
        self.text = {
            i: RowText(engine.tokenizer, j.params.stop)
            for i, j in enumerate(jobs)
            if j.stream or j.params.stop
        }
        self.finished = [False] * len(jobs)
        # each row's tokens: the decoding loop appends to these lists before it calls this controller
        self.tokens: list[list[int]] = [[] for _ in jobs]

    # -- per step -------------------------------------------------------------------------------
    def __call__(self, alive: torch.Tensor, new: torch.Tensor, step: int) -> torch.Tensor:
        t = step + 1  # tokens generated so far
        rows = alive.tolist()
        hit_eos = torch.isin(new, self.eos)
        ending = hit_eos | (self.max_new[alive.to(new.device)] <= t)
        bad = self.sampler.bad if self.sampler is not None else None
        if bad is not None:
            ending = ending | bad.to(ending.device)
        # Host syncs first, outside the tokenizer lock: the (usually empty) list of rows that end now.
        ending_at = ending.nonzero().flatten().tolist()
        ending_rows = [rows[k] for k in ending_at]
        eos_rows = {rows[k] for k in hit_eos.nonzero().flatten().tolist()} if ending_at else set()
        bad_rows = (
            {rows[k] for k in bad.nonzero().flatten().tolist()} if ending_at and bad is not None else set()
        )
        live = [i for i in rows if i in self.text and not self.finished[i] and i not in bad_rows]
        cancels = self.engine.cancel_epoch != self.cancel_epoch
        if live or ending_rows or cancels:
            self._step_events(live, ending_rows, eos_rows, cancels, t, bad_rows)
        return torch.tensor([self.finished[i] for i in rows], device=new.device)

    def _step_events(
        self,
        live: list[int],
        ending_rows: list[int],
        eos_rows: set[int],
        cancels: bool,
        t: int,
        bad_rows: AbstractSet[int] = frozenset(),
    ) -> None:
        out = Outbox()
        with self.engine.tokenizer_lock:
            for i in bad_rows:
                self._fail_row(i, out)
            for i in live:
                tok = self.tokens[i][-1]
                if tok in self.eos_set:
                    continue  # finished below
                events: list[Any] = []
                stopped = self.text[i].push(self.jobs[i], tok, events)
                for ev in events:
                    out.put(self.jobs[i], ev)
                if stopped:
                    self._finish(i, "stop", t, out)
            if cancels:
                self.cancel_epoch = self.engine.cancel_epoch
                for i, j in enumerate(self.jobs):
                    if j.cancelled and not self.finished[i]:
                        self.finished[i] = j.done = True
            for i in ending_rows:
                if not self.finished[i]:
                    eos = i in eos_rows
                    self._finish(i, "stop" if eos else "length", t, out, eos=eos)
        if all(self.finished):
            # every request of the batch is answered: for admission the engine is free from now on (a
            # client's next request must not count the batch's last bookkeeping as a running batch)
            self.engine._batch_started = None
            self.engine._batch_expected_end = None
        out.flush()

    def _fail_row(self, i: int, out: Outbox) -> None:
        """Row i's logits went NaN/+inf: fail that request alone (400 when steering did it)."""
        job = self.jobs[i]
        self.finished[i] = True
        if job.cancelled or job.done:
            return
        job.done = True
        if job.steer:
            msg = (
                f"Steering at strength {job.strength:g} made the model's output non-finite (NaN or inf); "
                "try a smaller aligntax.strength."
            )
            ev = Failed(msg, 400, "non_finite_output")
        else:
            ev = Failed(
                "The model's output became non-finite (NaN or inf) for this request.",
                500,
                "non_finite_output",
            )
        log.warning("request failed: non-finite logits (steered=%s, strength=%s)", job.steer, job.strength)
        out.put(job, ev)

    def _finish(self, i: int, reason: str, n_generated: int, out: Outbox, eos: bool = False) -> None:
        """Complete row i (caller holds the tokenizer lock)."""
        job = self.jobs[i]
        self.finished[i] = True
        events = finish_events(
            job, self.engine.tokenizer, self.tokens[i], n_generated, reason, eos, self.text.get(i)
        )
        job.done = True
        self.engine.metrics.record_tokens(len(job.prompt_ids), n_generated)
        for ev in events:
            out.put(job, ev)

    def finish_rest(self) -> None:
        """After decoding: complete any row that stopped without us (should not happen)."""
        out = Outbox()
        with self.engine.tokenizer_lock:
            for i in range(len(self.jobs)):
                if not self.finished[i] and not self.jobs[i].cancelled and not self.jobs[i].done:
                    if not self.tokens[i]:
                        raise RuntimeError("generation produced no tokens")
                    eos = self.tokens[i][-1] in self.eos_set
                    self._finish(i, "stop" if eos else "length", len(self.tokens[i]), out, eos=eos)
        out.flush()


# oneDNN (torch's CPU kernels for bf16 matrices) compiles a kernel per matrix shape and keeps up to 1,024
# of them; a server's batches of changing rows and prompt lengths bring new shapes without end, and each
# kept kernel holds memory. A small cache keeps the server's memory flat (docs/RESULTS.md 9.1).
ONEDNN_CACHE = 8


def bound_kernel_cache(capacity: int = ONEDNN_CACHE) -> None:
    """Cap oneDNN's kernel cache at ``capacity`` unless ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` is set already.
    oneDNN reads it when it first builds a kernel: call this before the model runs."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(capacity))


_LIBC: Any = None


def trim_allocator() -> bool:
    """Return the C allocator's free memory to the system (glibc ``malloc_trim(0)``: every arena, the
    free pages inside the heap included). False where there is no glibc (nothing done)."""
    global _LIBC
    if _LIBC is None:
        try:
            libc = ctypes.CDLL("libc.so.6")
            libc.malloc_trim.argtypes = [ctypes.c_size_t]
            libc.malloc_trim.restype = ctypes.c_int
            _LIBC = libc
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC is False:
        return False
    _LIBC.malloc_trim(0)
    return True


class BatchEngine(Admission):
    """Owns the model in one worker thread and generates queued :class:`Job` s in dynamic batches.

    Its limits are ``settings``' (:class:`~aligntax.serve.settings.ServerSettings`: batch size, waits,
    queue, batch tokens, admission targets). ``mix_steered=False`` keeps steered and unsteered requests
    in separate batches, for interventions that cannot act per row (e.g. an adapter that changes the
    weights of the whole batch).
    """

    def __init__(
        self,
        lm: LoadedModel,
        intervention: Intervention | None = None,
        settings: ServerSettings | None = None,
        *,
        metrics: ServeMetrics | None = None,
    ) -> None:
        s = settings or ServerSettings()
        self._init_admission(s.max_queue, s.max_queue_wait_ms)
        self.max_batch_tokens = s.max_batch_tokens
        self.lm = lm
        self.tokenizer = lm.tokenizer
        self.intervention = intervention or NoIntervention()
        self.max_batch_size = s.max_batch_size
        self.batch_wait = s.batch_wait_ms / 1000.0
        self.max_batch_wait = max(self.batch_wait, s.max_batch_wait_ms / 1000.0)
        self.mix_steered = s.mix_steered
        self.metrics = metrics or ServeMetrics()
        self.eos_ids = sorted(eos_token_ids(lm))
        pad = lm.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0))
        self.tokenizer_lock = threading.Lock()
        self.cancel_epoch = 0
        self.max_latency = None if s.max_latency_ms is None else s.max_latency_ms / 1000.0
        self.step_model = StepTimeModel()
        self._batch_expected_end: float | None = None  # predicted perf_counter() end of the running batch
        self.batch_seconds: float | None = None  # moving average of recent batches' durations
        self._batch_started: float | None = None  # perf_counter() at the start of the running batch
        self._q: queue.Queue[Any] = queue.Queue()  # bounded by admit() / submit(), not by the queue itself
        self._held: list[Job] = []  # taken from the queue but left for the next batch (mix_steered=False)
        self._waiting: Job | None = None  # taken from the queue while the engine is paused
        self._unpaused = threading.Event()
        self._unpaused.set()
        self._closed = False
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._current: list[Job] = []  # the batch being generated
        self._last_steps = 0  # decoding steps of the running batch so far (for the step-time model)
        self._aborted = False
        self.in_flight = 0

    # -- public API -------------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return self._q.qsize() + len(self._held) + (self._waiting is not None)

    @property
    def waiting(self) -> int:
        """Requests admitted and not yet taken by a batch: being tokenised, queued or held back (the one
        the worker holds to start its next batch not counted)."""
        return self._arriving + self._q.qsize() + len(self._held)

    def expected_wait(self, ahead: int | None = None) -> float | None:
        """Seconds until a request with ``ahead`` requests waiting before it starts generating, from the
        measured batch duration; None before any batch was measured."""
        d = self.batch_seconds
        if d is None:
            return None
        ahead = self.waiting if ahead is None else ahead
        started = self._batch_started
        remaining = max(0.0, d - (time.perf_counter() - started)) if started is not None else 0.0
        return remaining + (ahead // self.max_batch_size) * d

    def _waiting_jobs(self) -> list[Job]:
        """The submitted jobs not yet taken by a batch, in the order the worker takes them."""
        with self._q.mutex:
            queued = [j for j in self._q.queue if j is not _STOP]
        return [j for j in list(self._held) + queued if not j.cancelled]

    def predicted_latency(
        self, max_tokens: int, ahead: int | None = None, now: float | None = None
    ) -> float | None:
        """Seconds from now until a new request asking for ``max_tokens`` would finish, or until the
        oldest request of the batch it would join would finish counted from that request's arrival,
        whichever is longer; None before any batch was measured. The running batch ends at its
        predicted end; the ``ahead // max_batch_size`` full batches before the new request's take the
        predicted duration of a full batch each; its own batch holds ``ahead % max_batch_size + 1`` rows
        and decodes for the longest ``max_tokens`` among them."""
        model = self.step_model
        if not model.fitted:
            return None
        now = time.perf_counter() if now is None else now
        ahead = self.waiting if ahead is None else ahead
        end = self._batch_expected_end
        remaining = max(0.0, end - now) if end is not None and self._batch_started is not None else 0.0
        jobs = self._waiting_jobs()
        full, rows = divmod(ahead, self.max_batch_size)
        total = remaining
        for k in range(full):
            group = jobs[k * self.max_batch_size : (k + 1) * self.max_batch_size]
            steps = max([j.params.max_tokens for j in group] + [max_tokens])
            total += model.batch_seconds(self.max_batch_size, steps) or 0.0
        group = jobs[full * self.max_batch_size :]
        steps = max([j.params.max_tokens for j in group] + [max_tokens])
        total += self.batch_wait + (model.batch_seconds(rows + 1, steps) or 0.0)
        oldest = min(
            (j.arrived_at if j.arrived_at is not None else j.enqueued_at for j in group), default=now
        )
        return total + max(0.0, now - oldest)

    def _check_admission(self, ahead: int, max_tokens: int | None) -> None:
        """The latency target (``max_latency_ms``; checked for a request that gives its ``max_tokens``
        while the engine is busy): a request predicted to complete later is refused."""
        busy = ahead > 0 or self._batch_started is not None
        if self.max_latency is not None and max_tokens is not None and busy:
            latency = self.predicted_latency(max_tokens, ahead)
            if latency is not None and latency > self.max_latency:
                raise EngineOverloaded(
                    f"The server is overloaded: a new request would take about {latency:.2f} s to "
                    f"complete (target {self.max_latency:.2f} s; {ahead} requests waiting); retry later.",
                    self._retry_after(ahead),
                    status=503,
                    code="overloaded",
                )

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def closed(self) -> bool:
        return self._closed

    def start(self) -> None:
        with self._lock:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="aligntax-serve-worker", daemon=True)
                self._thread.start()

    def submit(self, job: Job, admitted: bool = False) -> Job:
        """Queue ``job``. ``admitted``: it was counted by :meth:`admit` already (so it is not refused
        now); otherwise the ``max_queue`` bound is checked here."""
        if self._thread is None:
            self.start()
        job.enqueued_at = time.perf_counter()
        with self._lock:  # so that nothing lands behind the stop marker of shutdown()
            with self._admit_lock:
                self._take(admitted)
                self._q.put_nowait(job)
        return job

    def cancel(self, job: Job) -> None:
        """Stop working on a job whose client went away (no further events are sent)."""
        if not job.done:
            job.cancelled = True
            self.cancel_epoch += 1

    def pause(self) -> None:
        """Let requests queue up without starting a batch (for tests and maintenance)."""
        self._unpaused.clear()

    def resume(self) -> None:
        self._unpaused.set()

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; with ``drain`` finish everything queued, else fail it; join the worker.

        With a ``timeout``, whatever is still queued or generating when it runs out is failed (503) and
        cancelled, so that the worker stops within about one decoding step."""
        with self._lock:
            self._closed = True
            thread = self._thread
        self._unpaused.set()
        if not drain:
            self._fail_queued("The server shut down before this request ran.", 503)
        if thread is None:
            self._fail_queued("The server shut down before this request ran.", 503)
            return
        self._q.put(_STOP)
        thread.join(timeout)
        if thread.is_alive() and timeout is not None:
            self.abort("The server shut down before this request finished.")
            thread.join(10.0)

    def abort(self, message: str, status: int = 503) -> None:
        """Fail everything queued and generating now (the shutdown timeout ran out)."""
        self._aborted = True
        self._fail_queued(message, status)
        out = Outbox()
        for job in list(self._current):
            if not job.done:
                job.done = job.cancelled = True
                out.put(job, Failed(message, status, "server_shutting_down"))
        self.cancel_epoch += 1
        out.flush()

    # -- worker -----------------------------------------------------------------------------------
    def _fail_queued(self, message: str, status: int) -> None:
        pending, self._held = list(self._held), []
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                pending.append(item)
        out = Outbox()
        for job in pending:
            job.done = True
            out.put(job, Failed(message, status, "server_shutting_down"))
        out.flush()

    def _next_batch(self) -> tuple[list[Job], bool]:
        """Block for the first job, then gather more until none has come for batch_wait, or for at most
        max_batch_wait in all (with a latency target, ``max_queue_wait``, only while requests are queued
        or admitted and being tokenised: a batch never waits for requests that may not come). Returns
        (jobs, stop)."""
        if self._held:
            first = self._held.pop(0)
        else:
            first = self._q.get()
            if first is _STOP:
                return [], True
        self._waiting = first
        self._unpaused.wait()
        self._waiting = None
        batch, leftovers, stop = [first], [], False
        pool, self._held = self._held, []
        start = last = time.monotonic()
        longest = len(first.prompt_ids)
        budget = self.max_batch_tokens
        steer_iv = self._steering_of(first) if first.steer else None
        while len(batch) < self.max_batch_size:
            if pool:
                item = pool.pop(0)
            else:
                if (
                    (self.max_queue_wait is not None or self.max_latency is not None)
                    and self._arriving == 0
                    and self._q.empty()
                ):
                    break  # latency target: wait only for requests known to be on their way
                remaining = min(last + self.batch_wait, start + self.max_batch_wait) - time.monotonic()
                try:
                    item = self._q.get(timeout=remaining) if remaining > 0 else self._q.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    stop = True
                    break
                last = time.monotonic()
            if item.cancelled:
                continue
            if not self.mix_steered and item.steer != first.steer:
                leftovers.append(item)
                continue
            if item.steer and steer_iv is not None and self._steering_of(item) is not steer_iv:
                leftovers.append(item)  # steered by another intervention (other options): next batch
                continue
            grown = max(longest, len(item.prompt_ids))
            if budget is not None and grown * (len(batch) + 1) > budget:
                leftovers.append(item)  # padded with this batch it would exceed the budget: next batch
                continue
            longest = grown
            batch.append(item)
            if item.steer and steer_iv is None:
                steer_iv = self._steering_of(item)
        self._held = leftovers + pool
        return batch, stop

    def _steering_of(self, job: Job) -> Intervention:
        """The intervention that steers ``job`` (when it is steered)."""
        return job.intervention if job.intervention is not None else self.intervention

    def _run(self) -> None:
        while True:
            try:
                batch, stop = self._next_batch()
            except Exception:  # pragma: no cover - defensive: never let the worker die
                log.exception("batching failed")
                continue
            batch = [j for j in batch if not j.cancelled and not j.done]
            if batch and self._aborted:
                out = Outbox()
                for job in batch:
                    job.done = True
                    out.put(
                        job,
                        Failed("The server shut down before this request ran.", 503, "server_shutting_down"),
                    )
                out.flush()
                batch = []
            if batch:
                self.in_flight = len(batch)
                self._current = batch
                steps = max(j.params.max_tokens for j in batch)
                self._batch_started = t0 = time.perf_counter()
                predicted = self.step_model.batch_seconds(len(batch), steps)
                self._batch_expected_end = None if predicted is None else t0 + predicted
                self._last_steps = 0
                try:
                    self._process(batch)
                finally:
                    self._batch_started = None
                    self._batch_expected_end = None
                    seconds = time.perf_counter() - t0
                    self._record_batch_time(seconds)
                    self.step_model.observe(len(batch), seconds, self._last_steps)
                    self.in_flight = 0
                    self._current = []
                    trim_allocator()
            if stop:
                if self._held:
                    self._q.put(_STOP)  # finish the held-back jobs first
                    continue
                return

    def _record_batch_time(self, seconds: float, alpha: float = 0.3) -> None:
        d = self.batch_seconds
        self.batch_seconds = seconds if d is None else (1 - alpha) * d + alpha * seconds

    def _process(self, batch: list[Job]) -> None:
        try:
            self._generate(batch)
            return
        except Exception as exc:  # reported to the affected requests only
            log.exception("generation failed for a batch of %d", len(batch))
            first_error = exc
        out = Outbox()
        for job in batch:
            if job.done or job.cancelled:
                continue
            if len(batch) > 1 and not job.emitted:
                try:
                    self._generate([job])
                    continue
                except Exception as exc:
                    log.exception("generation failed for a single request")
                    err = exc
            else:
                err = first_error
            job.done = True
            out.put(job, Failed(f"Generation failed: {type(err).__name__}: {err}", 500))
        out.flush()

    def _generate(self, jobs: list[Job]) -> None:
        lm, model = self.lm, self.lm.model
        device = lm.device
        n = len(jobs)
        prompt_len = max(len(j.prompt_ids) for j in jobs)
        input_ids = torch.full((n, prompt_len), self.pad_id, dtype=torch.long)
        attention = torch.zeros((n, prompt_len), dtype=torch.long)
        for i, job in enumerate(jobs):
            k = len(job.prompt_ids)
            input_ids[i, prompt_len - k :] = torch.tensor(job.prompt_ids, dtype=torch.long)
            attention[i, prompt_len - k :] = 1
        sampler = RowSampler(jobs, device)
        controller = _BatchController(self, jobs, device, sampler)
        now = time.perf_counter()
        self.metrics.record_batch(
            n, steered=sum(j.steer for j in jobs), queue_wait_s=sum(now - j.enqueued_at for j in jobs)
        )
        intervention = next((self._steering_of(j) for j in jobs if j.steer), NoIntervention())
        enc = {"input_ids": input_ids.to(device), "attention_mask": attention.to(device)}
        decode_batch(
            model,
            enc,
            intervention,
            max(j.params.max_tokens for j in jobs),
            set(self.eos_ids),
            rows=torch.tensor([j.steer for j in jobs]),
            strength=torch.tensor([float(j.strength) if j.steer else 0.0 for j in jobs]),
            choose=sampler,
            ended=controller,
            out=controller.tokens,
        )
        self._last_steps = max(self._last_steps, max((len(t) for t in controller.tokens), default=0))
        controller.finish_rest()
