"""Thread-safe counters behind ``GET /metrics``."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any


class ServeMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started = time.time()
        self.requests_total = 0
        self.requests_by_status: Counter[int] = Counter()
        self.latency_sum = 0.0
        self.latency_count = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.completions = 0
        self.batches = 0
        self.batch_rows = 0
        self.steered_rows = 0
        self.batch_sizes: Counter[int] = Counter()
        self.queue_wait_sum = 0.0

    def record_request(self, status: int, latency_s: float) -> None:
        with self._lock:
            self.requests_total += 1
            self.requests_by_status[status] += 1
            if status < 400:
                self.latency_sum += latency_s
                self.latency_count += 1

    def record_batch(self, size: int, steered: int = 0, queue_wait_s: float = 0.0) -> None:
        with self._lock:
            self.queue_wait_sum += queue_wait_s
            self.batches += 1
            self.batch_rows += size
            self.steered_rows += steered
            self.batch_sizes[size] += 1

    def record_tokens(self, prompt: int, completion: int) -> None:
        with self._lock:
            self.completions += 1
            self.prompt_tokens += prompt
            self.completion_tokens += completion

    def snapshot(self, queue_depth: int = 0, in_flight: int = 0) -> dict[str, Any]:
        with self._lock:
            uptime = time.time() - self.started
            return {
                "uptime_s": round(uptime, 3),
                "requests_total": self.requests_total,
                "requests_by_status": {str(k): v for k, v in sorted(self.requests_by_status.items())},
                "completions_total": self.completions,
                "prompt_tokens_total": self.prompt_tokens,
                "completion_tokens_total": self.completion_tokens,
                "queue_depth": queue_depth,
                "in_flight": in_flight,
                "batches_total": self.batches,
                "batch_size_histogram": {str(k): v for k, v in sorted(self.batch_sizes.items())},
                "batch_size_mean": round(self.batch_rows / self.batches, 3) if self.batches else 0.0,
                "batch_size_max": max(self.batch_sizes, default=0),
                "steered_rows_total": self.steered_rows,
                "queue_wait_mean_s": round(self.queue_wait_sum / self.batch_rows, 4)
                if self.batch_rows
                else 0.0,
                "latency_mean_s": round(self.latency_sum / self.latency_count, 4)
                if self.latency_count
                else 0.0,
                "completion_tokens_per_s": round(self.completion_tokens / uptime, 3) if uptime > 0 else 0.0,
            }
