"""Serving through vLLM (``aligntax serve --backend vllm``): the assembly. The OpenAI-compatible server
of :mod:`aligntax.serve` (its routes, handler, security and settings) answering from vLLM's ``AsyncLLM``
with continuous batching: :func:`create_vllm_app` hands the server a
:class:`~aligntax.backends.vllm.serve_engine.VllmServeEngine` on an
:class:`~aligntax.backends.vllm.async_engine.AsyncVllm`; :func:`serving` starts the engine for
``aligntax serve --backend vllm``. What the engine does (continuous batching, steering presets,
per-request options, admission): :mod:`aligntax.backends.vllm.serve_engine`."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from aligntax.backends.vllm.async_engine import AsyncVllm, served_model
from aligntax.backends.vllm.engine import VllmOptions
from aligntax.backends.vllm.serve_engine import OptionSteering, VllmServeEngine
from aligntax.errors import AligntaxError
from aligntax.generation.source import Serving
from aligntax.serve.metrics import ServeMetrics
from aligntax.serve.settings import ServerSettings

if TYPE_CHECKING:
    from fastapi import FastAPI

    from aligntax.interventions.base import Intervention
    from aligntax.models.loader import LoadedModel

PRESET = "serve"


def create_vllm_app(
    vm: AsyncVllm,
    intervention: Intervention | None = None,
    preset: str | None = None,
    settings: ServerSettings | None = None,
    *,
    steer_method: str | None = None,
    steer_options: dict[str, Any] | None = None,
) -> FastAPI:
    """The OpenAI-compatible app (:func:`aligntax.serve.app.create_app`, the same settings) answering
    from ``vm``. ``preset``: the registered steering preset of the steered model (``intervention``,
    built against ``vm.facts``, gives its name and, for a method that rewrites messages, its prompts).
    ``settings`` default to the server's with the engine's sequence slots as ``max_batch_size``.

    Per-request steering options as :func:`~aligntax.serve.app.create_app` takes them: ``steer_method``
    (the registered method of the steered model) and ``steer_options`` (its ``intervention_args``, its
    folder included). Each distinct option set a request sends is steered by a preset of its own
    (:class:`~aligntax.backends.vllm.serve_engine.OptionSteering`; the ``options_cache_size`` most
    recently used kept). With ``steer_method`` and no ``preset``, the method is registered here as
    preset :data:`PRESET` (unless it rewrites messages)."""
    from aligntax.backends.vllm.async_engine import refuse_surprisal
    from aligntax.backends.vllm.engine import prepare
    from aligntax.interventions.options import split_path
    from aligntax.serve.app import create_app

    settings = settings or ServerSettings(max_batch_size=vm.options.max_num_seqs)
    option_steering = None
    if steer_method is not None and steer_method != "none":
        args = dict(steer_options or {})
        rewrites = intervention is not None and intervention.rewrites_messages()
        if preset is None and not rewrites:
            preset, _ = prepare(vm, steer_method, args, preset=PRESET)
        if preset is not None:
            source, base = split_path(args, steer_method)
            if source is None:
                raise AligntaxError(
                    f"Intervention '{steer_method}' needs its folder (path=) in steer_options to serve "
                    "per-request steering options."
                )
            option_steering = OptionSteering(steer_method, str(source), base, settings.options_cache_size)
    lm = served_model(vm)

    def factory(
        lm_: LoadedModel, iv_: Intervention | None, s: ServerSettings, metrics: ServeMetrics
    ) -> VllmServeEngine:
        return VllmServeEngine(
            lm_, iv_, s, metrics=metrics, vm=vm, preset=preset, option_steering=option_steering
        )

    return create_app(
        lm,
        intervention,
        settings,
        steer_method=steer_method,
        steer_options=steer_options,
        engine_factory=factory,
        check_intervention=lambda iv: refuse_surprisal(iv, vm.facts),
    )


@contextlib.contextmanager
def serving(
    model: str,
    dtype: str = "bf16",
    intervention: str | None = None,
    iv_args: dict | None = None,
    max_batch_size: int = 32,
    threads: int | None = None,
) -> Iterator[Serving]:
    """``aligntax serve --backend vllm``: start the engine (``max_batch_size`` sequence slots), register the
    intervention as the steered model's preset (or, for one that rewrites messages, apply it to the
    steered model's prompts) and serve until the ``with`` block ends (SIGTERM ends it too), then shut the
    engine down. ``threads`` sets ``OMP_NUM_THREADS`` of the engine's process (unbound:
    ``VLLM_CPU_OMP_THREADS_BIND=nobind``)."""
    import os
    from functools import partial

    from aligntax.backends.vllm.engine import prepare

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    vm = AsyncVllm(model, dtype, VllmOptions(max_num_seqs=max_batch_size))
    try:
        preset, iv = prepare(vm, intervention, iv_args, preset=PRESET)
        iv = iv if preset is None else vm.interventions[preset]
        with _exit_on_sigterm():
            yield Serving(
                partial(create_vllm_app, vm, iv, preset), iv, f" from vLLM (sequence slots {max_batch_size}"
            )
    finally:
        vm.close()


@contextlib.contextmanager
def _exit_on_sigterm():
    """SIGTERM raises SystemExit here, so that the engine (and its process) is shut down on the way out:
    uvicorn stops gracefully on SIGTERM and then raises the signal again, whose default action would
    end this process at once and leave the engine's process behind."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
