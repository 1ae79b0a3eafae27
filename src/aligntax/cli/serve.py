"""``aligntax serve``: an OpenAI-compatible server for a model, optionally with a steered variant.

Register with ``app.command("serve")(serve_command)``.
"""

from __future__ import annotations

from typing import Annotated

import typer

from aligntax.cli.options import (
    DeviceOpt,
    DtypeOpt,
    InterventionOpt,
    ModelOpt,
    check_dtype,
    check_port,
    fail,
    steering_options,
    use_device,
)


@steering_options
def serve_command(
    model: ModelOpt = None,
    intervention: InterventionOpt = None,
    iv_args: dict | None = None,
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(envvar="ALIGNTAX_API_KEY", help="Require this bearer key (Authorization: Bearer KEY)."),
    ] = None,
    dtype: DtypeOpt = None,
    max_batch_size: Annotated[int, typer.Option(min=1, help="Most requests generated together.")] = 32,
    batch_wait_ms: Annotated[
        float, typer.Option(min=0, help="A batch waits for more requests until none has come for this long.")
    ] = 10.0,
    max_batch_wait_ms: Annotated[
        float, typer.Option(min=0, help="The longest a batch waits for more requests in all.")
    ] = 100.0,
    model_name: Annotated[
        str | None, typer.Option(help="Name served in /v1/models (default: from the spec).")
    ] = None,
    max_tokens_limit: Annotated[
        int, typer.Option(min=1, help="Largest max_tokens a request may ask for.")
    ] = 2048,
    default_max_tokens: Annotated[
        int, typer.Option(min=1, help="max_tokens when a request sets none.")
    ] = 512,
    device: DeviceOpt = None,
    threads: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="torch intra-op threads (default: torch's choice; fewer is faster on a busy shared CPU).",
        ),
    ] = None,
    insecure: Annotated[
        bool, typer.Option("--insecure", help="Allow a non-loopback --host without an API key.")
    ] = False,
    allow_unknown_fields: Annotated[
        bool,
        typer.Option(
            "--allow-unknown-fields",
            help="Accept (and ignore) request fields the server does not know, instead of answering 400.",
        ),
    ] = False,
    request_timeout: Annotated[
        float | None,
        typer.Option(
            min=0.001, help="Seconds a request may take in all; past it its generation is cancelled (504)."
        ),
    ] = None,
    max_queue: Annotated[
        int,
        typer.Option(
            min=1,
            help="Most requests waiting for a batch (counted from "
            "arrival, tokenisation included); more get 429 with "
            "Retry-After.",
        ),
    ] = 1024,
    max_batch_tokens: Annotated[
        int, typer.Option(min=1, help="Most padded prompt tokens in one batch (rows x longest prompt).")
    ] = 32768,
    max_queue_wait_ms: Annotated[
        float | None,
        typer.Option(
            min=1,
            help="Target wait for a batch: a request "
            "expected to wait longer (from the measured "
            "batch duration and the requests ahead) gets 503 "
            "with Retry-After. Default: no target (only "
            "--max-queue bounds the queue).",
        ),
    ] = None,
    max_latency_ms: Annotated[
        float | None,
        typer.Option(
            min=1,
            help="Target completion latency: a request "
            "predicted to finish later (the running batch, the "
            "batches ahead and its own, from measured step "
            "times) gets 503 with Retry-After. Default: no "
            "target.",
        ),
    ] = None,
    shutdown_timeout: Annotated[
        float,
        typer.Option(
            min=0, help="Seconds a graceful shutdown waits for running requests before failing them."
        ),
    ] = 30.0,
    backend: Annotated[
        str,
        typer.Option(
            help="hf, or vllm (vLLM's continuous batching, steered per request; "
            "./run setup-vllm; docs/vllm.md)."
        ),
    ] = "hf",
) -> None:
    """Serve MODEL (and MODEL+<intervention> when steering) behind an OpenAI-compatible API. The steered
    variant takes the intervention's options like every steering command (--steer DIR alone means ELS
    with the setting its sweep selected; --gate, --horizon, --eta, ... override it)."""
    from contextlib import ExitStack

    from aligntax.errors import AligntaxError
    from aligntax.generation.source import SourceSpec
    from aligntax.runs.sources import generation_source
    from aligntax.serve.app import check_bind, serve

    try:  # everything that can be checked before loading the model
        check_port(port)
        check_bind(host, api_key, insecure)
        check_dtype(dtype)
        source = generation_source(backend)  # another generation engine behind the same app (docs/vllm.md)
        source.check_serving(device=device, max_latency_ms=max_latency_ms)
        if backend == "hf":
            use_device(device)
    except AligntaxError as exc:
        fail(exc)
    spec = SourceSpec(model, dtype or "bf16", intervention, dict(iv_args or {}), max_batch_size)
    with ExitStack() as stack:
        try:
            served = stack.enter_context(source.serving(spec, device=device, threads=threads))
        except (AligntaxError, RuntimeError) as exc:
            fail(exc, 1)  # a model or intervention that fails to load: a runtime failure
        app = served.create_app(
            model_name,
            api_key=api_key,
            max_batch_size=max_batch_size,
            batch_wait_ms=batch_wait_ms,
            max_batch_wait_ms=max_batch_wait_ms,
            max_new_tokens_limit=max_tokens_limit,
            default_max_tokens=min(default_max_tokens, max_tokens_limit),
            max_queue=max_queue,
            max_batch_tokens=max_batch_tokens,
            allow_unknown_fields=allow_unknown_fields,
            request_timeout_s=request_timeout,
            shutdown_timeout_s=shutdown_timeout,
            max_queue_wait_ms=max_queue_wait_ms,
            steer_method=intervention if served.intervention is not None else None,
            steer_options=iv_args,
            max_latency_ms=max_latency_ms,
        )
        settings = app.state.settings
        names = ", ".join(n for n in (settings.model_name, settings.steered_name) if n)
        typer.echo(
            f"Serving {names} at http://{host}:{port}/v1{served.describe}"
            f"{', API key required' if api_key else ''})"
        )
        serve(None, host=host, port=port, log_level="info", insecure=insecure, app=app)
