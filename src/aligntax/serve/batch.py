"""The parts of a batch that know nothing of the engine around them: the per-step outbox of events
(:class:`Outbox`), the per-row token choice (:class:`RowSampler`: greedy, or temperature / top-p with a
private generator for seeded rows) and the step-time model the latency target reads
(:class:`StepTimeModel`). :class:`aligntax.serve.engine.BatchEngine` runs them."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import torch

from aligntax.serve.jobs import Job


def deliver(items: list[tuple[asyncio.Queue[Any], object]]) -> None:
    for q, ev in items:
        q.put_nowait(ev)


class Outbox:
    """Events of one step, sent with a single call_soon_threadsafe per event loop."""

    def __init__(self) -> None:
        self.items: dict[asyncio.AbstractEventLoop, list[Any]] = {}

    def put(self, job: Job, ev: object) -> None:
        if job.loop is None or job.events is None:
            return
        self.items.setdefault(job.loop, []).append((job.events, ev))

    def flush(self) -> None:
        for loop, items in self.items.items():
            try:
                loop.call_soon_threadsafe(deliver, items)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass
        self.items = {}


class RowSampler:
    """Chooses the next token of every row still in the batch: the argmax for greedy requests, else a
    draw at the request's temperature and top-p (from its own generator when it gave a seed)."""

    def __init__(self, jobs: Sequence[Job], device: torch.device) -> None:
        ps = [j.params for j in jobs]
        self.greedy = torch.tensor([p.greedy for p in ps], device=device)
        self.temps = torch.tensor([1.0 if p.greedy else p.temperature for p in ps], device=device).unsqueeze(
            1
        )
        self.top_p = torch.tensor([p.top_p for p in ps], device=device).unsqueeze(1)
        self.use_top_p = any(p.top_p < 1.0 and not p.greedy for p in ps)
        self.seeded = {
            i: torch.Generator(device=device).manual_seed(p.seed)
            for i, p in enumerate(ps)
            if p.seed is not None and not p.greedy
        }
        self.all_greedy = all(p.greedy for p in ps)
        self.bad: torch.Tensor | None = None  # this step: rows (of those alive) whose logits are NaN/+inf

    def __call__(self, logits: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
        """Next tokens ``[rows]`` from ``logits`` ``[rows, vocab]`` of the original rows ``alive``.

        Rows with a NaN or +inf logit are flagged in ``self.bad`` (no host sync here; the controller
        ends and fails them) and given finite scores, so that sampling the others cannot raise."""
        bad = (torch.isnan(logits) | torch.isposinf(logits)).any(-1)
        self.bad = bad
        logits = torch.where(bad[:, None], torch.zeros((), dtype=logits.dtype, device=logits.device), logits)
        if self.all_greedy:
            return logits.argmax(-1)
        rows = alive.to(logits.device)
        scores = logits.float()
        probs = torch.softmax(scores / self.temps[rows], dim=-1)
        if self.use_top_p:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            sorted_p = sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p > self.top_p[rows], 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        choice = torch.multinomial(probs, 1).squeeze(1)
        for k, row in enumerate(alive.tolist()):
            if row in self.seeded:
                choice[k] = torch.multinomial(probs[k], 1, generator=self.seeded[row])[0]
        return torch.where(self.greedy[rows], scores.argmax(-1), choice)


class StepTimeModel:
    """Seconds per decoding step of a batch as ``a + b * rows``, fitted by least squares on recent
    batches (each weighted ``decay`` times the one after it). A batch's duration divided by its steps
    includes its prefill. Before two batch sizes were seen the slope is 0 (every size is predicted at
    the mean).

    Predictions add ``margin`` times the mean absolute error of recent predictions (``dev``, a moving
    average like TCP's round-trip variance), so that on a machine whose speed varies the prediction
    is an upper estimate rather than the mean."""

    def __init__(self, decay: float = 0.95, margin: float = 2.0, dev_alpha: float = 0.25):
        self.decay = decay
        self.margin = margin
        self.dev_alpha = dev_alpha
        self.w = self.x = self.y = self.xx = self.xy = 0.0
        self.dev = 0.0  # moving average of |observed - predicted| seconds per step

    def observe(self, rows: int, seconds: float, steps: int) -> None:
        if steps < 1 or seconds <= 0:
            return
        y = seconds / steps
        if self.fitted:
            a, b = self.coefficients()
            self.dev += self.dev_alpha * (abs(y - (a + b * rows)) - self.dev)
        d = self.decay
        self.w = d * self.w + 1.0
        self.x = d * self.x + rows
        self.y = d * self.y + y
        self.xx = d * self.xx + rows * rows
        self.xy = d * self.xy + rows * y

    @property
    def fitted(self) -> bool:
        return self.w > 0

    def coefficients(self) -> tuple[float, float]:
        """(a, b): seconds per step of a batch of ``rows`` is ``a + b * rows``; b >= 0."""
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        slope = max(0.0, (self.xy / self.w - mx * my) / var) if var > 1e-6 else 0.0
        return my - slope * mx, slope

    def step_seconds(self, rows: int, margin: float | None = None) -> float | None:
        """Predicted seconds per step for ``rows`` rows, plus ``margin`` (default: the model's) x ``dev``."""
        if not self.fitted:
            return None
        a, b = self.coefficients()
        k = self.margin if margin is None else margin
        return max(a + b * rows, 1e-6) + k * self.dev

    def batch_seconds(self, rows: int, steps: int, margin: float | None = None) -> float | None:
        per = self.step_seconds(rows, margin)
        return None if per is None else per * max(1, steps)
