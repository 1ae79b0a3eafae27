"""``aligntax serve``: an OpenAI-compatible server for a model, optionally with a steered variant.

Register with ``app.command("serve")(serve_command)``. The server's settings are the fields of
:class:`aligntax.serve.settings.ServerSettings` (options here, or keys of ``--config FILE``).
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
    fail,
    settings_options,
    steering_options,
    use_device,
)
from aligntax.serve.settings import ServerSettings


@steering_options
@settings_options(ServerSettings)
def serve_command(
    model: ModelOpt = None,
    intervention: InterventionOpt = None,
    iv_args: dict | None = None,
    settings: ServerSettings | None = None,
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    threads: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="torch intra-op threads (default: torch's choice; fewer is faster on a busy shared CPU).",
        ),
    ] = None,
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
    with the setting its sweep selected; --gate, --horizon, --eta, ... override it). The server's
    settings are options here or keys of a YAML file (--config; aligntax.serve.settings)."""
    from contextlib import ExitStack

    from aligntax.errors import AligntaxError
    from aligntax.generation.source import SourceSpec
    from aligntax.runs.sources import generation_source
    from aligntax.serve.app import serve
    from aligntax.serve.engine import bound_kernel_cache
    from aligntax.serve.security import check_bind

    s = settings or ServerSettings()
    try:  # everything that can be checked before loading the model
        check_bind(s.host, s.api_key, s.insecure)
        check_dtype(dtype)
        source = generation_source(backend)  # another generation engine behind the same app (docs/vllm.md)
        source.check_serving(device=device, max_latency_ms=s.max_latency_ms)
        if backend == "hf":
            use_device(device)
            bound_kernel_cache()  # before the model runs: oneDNN reads it when it builds its first kernel
    except AligntaxError as exc:
        fail(exc)
    spec = SourceSpec(model, dtype or "bf16", intervention, dict(iv_args or {}), s.max_batch_size)
    with ExitStack() as stack:
        try:
            served = stack.enter_context(source.serving(spec, device=device, threads=threads))
        except (AligntaxError, RuntimeError) as exc:
            fail(exc, 1)  # a model or intervention that fails to load: a runtime failure
        app = served.create_app(
            s,
            steer_method=intervention if served.intervention is not None else None,
            steer_options=iv_args,
        )
        names = ", ".join(app.state.handler.model_names())
        typer.echo(
            f"Serving {names} at http://{s.host}:{s.port}/v1{served.describe}"
            f"{', API key required' if s.api_key else ''})"
        )
        serve(app, log_level="info")
