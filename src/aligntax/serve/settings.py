"""The server's settings, declared once.

Every setting of ``aligntax serve`` (listening, request limits, batching, admission) is one field of
:class:`ServerSettings`, declared with :func:`~aligntax.interventions.options.option`: its help, its
command-line flag, its range rule and its default. The command line (``aligntax serve --max-batch-size
8``), a YAML file (``aligntax serve --config server.yaml``, keys the field names), the library
(``create_app(lm, settings=ServerSettings(max_batch_size=8))``) and both generation engines read them
from here, so a default is written in this file alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from aligntax.interventions.options import check_value, flag_of, option, spec_of

__all__ = ["ServerSettings"]


@dataclass(frozen=True)
class ServerSettings:
    """How the OpenAI-compatible server listens, what a request may ask for, and how requests are batched
    and admitted (see :func:`aligntax.serve.app.create_app`). Values are range-checked on construction."""

    # -- listening ------------------------------------------------------------------------------------
    host: str = option("Interface to listen on.", "127.0.0.1")
    port: int = option("TCP port.", 8000, check="port")
    api_key: str | None = option(
        "Require this bearer key (Authorization: Bearer KEY).", envvar="ALIGNTAX_API_KEY"
    )
    insecure: bool = option("Allow a non-loopback --host without an API key.", False)
    shutdown_timeout: float | None = option(
        "Seconds a graceful shutdown waits for running requests before failing them.",
        30.0,
        check="nonnegative",
    )
    # -- models and requests --------------------------------------------------------------------------
    model_name: str | None = option("Name served in /v1/models (default: from the spec).")
    steered_suffix: str | None = option(
        "Suffix of the steered model's name, NAME+SUFFIX (default: the intervention's name)."
    )
    max_prompt_tokens: int | None = option(
        "Longest prompt in tokens (default: the model's context window less one).", check="positive_count"
    )
    max_tokens_limit: int = option("Largest max_tokens a request may ask for.", 2048, check="positive_count")
    default_max_tokens: int = option(
        "max_tokens when a request sets none (at most --max-tokens-limit).", 512, check="positive_count"
    )
    default_strength: float = option(
        "Steering strength of a steered request that sets none.", 1.0, check="nonnegative"
    )
    allow_unknown_fields: bool = option(
        "Accept (and ignore) request fields the server does not know, instead of answering 400.", False
    )
    request_timeout: float | None = option(
        "Seconds a request may take in all; past it its generation is cancelled (504).", check="positive"
    )
    options_cache_size: int = option(
        "Per-request steering option sets whose intervention is kept built (most recently used).",
        16,
        check="positive_count",
    )
    # -- batching and admission -----------------------------------------------------------------------
    max_batch_size: int = option("Most requests generated together.", 32, check="positive_count")
    batch_wait_ms: float = option(
        "A batch waits for more requests until none has come for this long.", 10.0, check="nonnegative"
    )
    max_batch_wait_ms: float = option(
        "The longest a batch waits for more requests in all.", 100.0, check="nonnegative"
    )
    max_queue: int = option(
        "Most requests waiting for a batch (counted from arrival, tokenisation included); more get 429 "
        "with Retry-After.",
        1024,
        check="positive_count",
    )
    max_batch_tokens: int | None = option(
        "Most padded prompt tokens in one batch (rows x longest prompt).", 32768, check="positive_count"
    )
    mix_steered: bool = option(
        "Steered and unsteered requests share batches (off: separate batches, for an intervention that "
        "cannot steer per row).",
        True,
        cli=False,
    )
    max_queue_wait_ms: float | None = option(
        "Target wait for a batch: a request expected to wait longer (from the measured batch duration "
        "and the requests ahead) gets 503 with Retry-After. Default: no target (only --max-queue bounds "
        "the queue).",
        check="at_least_one",
    )
    max_latency_ms: float | None = option(
        "Target completion latency: a request predicted to finish later (the running batch, the batches "
        "ahead and its own, from measured step times) gets 503 with Retry-After. Default: no target.",
        check="at_least_one",
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check_value(getattr(self, f.name), spec_of(f).check, flag_of(f))

    @property
    def effective_default_max_tokens(self) -> int:
        """``default_max_tokens``, at most ``max_tokens_limit``."""
        return min(self.default_max_tokens, self.max_tokens_limit)

    def replace(self, **changes: object) -> ServerSettings:
        """A copy with ``changes`` (checked as on construction)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
