"""vLLM's ``AsyncLLM`` for the server (:class:`AsyncVllm`): the engine on an aligntax model spec, on its
own thread and event loop, with steering presets registered in every worker; and the model as the
server reads it (:func:`served_model`: tokenizer, spec, fingerprint and config, no weights). The
server's engine on top of it is :class:`~aligntax.backends.vllm.serve_engine.VllmServeEngine`; the
assembly is :mod:`aligntax.backends.vllm.serving`."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass
from typing import Any

from aligntax.backends.vllm.engine import (
    DTYPES,
    ModelFacts,
    VllmOptions,
    engine_kwargs,
    eos_ids,
    model_facts,
    require_vllm,
)
from aligntax.errors import AligntaxError
from aligntax.models.loader import LoadedModel


def refuse_surprisal(local, facts) -> None:
    """Refuse, for the server, an intervention whose per-row decision reads the prompt's surprisal."""
    kernel = local.kernel(facts.num_layers, facts.hidden_size)
    if kernel is not None and kernel.needs_prompt_nll:
        raise AligntaxError(
            f"Intervention '{local.name}': the vLLM server does not score prompts' surprisal "
            "(max_prompt_surprisal; offline generation with vLLM and the Hugging Face server do): serve "
            "with --max-prompt-surprisal none, or with --backend hf."
        )


class AsyncVllm:
    """vLLM's ``AsyncLLM`` on an aligntax model spec, on its own thread and event loop, with steering
    presets registered in every worker (the same engine settings as
    :class:`~aligntax.backends.vllm.engine.VllmModel`). ``call(coro)`` runs a coroutine on that loop."""

    def __init__(self, spec: str, dtype: str = "bf16", options: VllmOptions | None = None) -> None:
        require_vllm()
        if dtype not in DTYPES:
            raise AligntaxError(f"Unknown dtype '{dtype}'; use bf16, fp16 or fp32.")
        self.options = options = options or VllmOptions()
        self.facts: ModelFacts = model_facts(spec, dtype)
        self.spec, self.source, self.tokenizer = self.facts.spec, self.facts.source, self.facts.tokenizer
        self.fingerprint = self.facts.fingerprint
        self.dtype = dtype
        self.max_model_len = min(options.max_model_len, self.facts.max_positions or options.max_model_len)
        self.eos_ids = eos_ids(self.source, self.tokenizer)
        self.presets: dict[str, dict] = {}
        self.interventions: dict[str, object] = {}  # preset -> the intervention as built in this process
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="aligntax-vllm", daemon=True)
        self._thread.start()
        self.engine = None
        try:
            self.engine = self.call(self._start())
            # a server never reads the per-request decision records: keep none
            self.call(self.engine.collective_rpc("aligntax_keep_records", args=(False,)))
        except BaseException:
            self.close()
            raise

    async def _start(self):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            **engine_kwargs(self.source, self.dtype, self.options, self.max_model_len), disable_log_stats=True
        )
        return AsyncLLM.from_engine_args(args)

    def call(self, coro, timeout: float | None = None):
        """Run ``coro`` on the engine's loop and return its result (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.engine is not None and not self.engine.errored

    # ---- LoadedModel-like facts (for intervention loaders) ------------------------------------------
    @property
    def hidden_size(self) -> int | None:
        return self.facts.hidden_size

    @property
    def num_layers(self) -> int | None:
        return self.facts.num_layers

    def register(self, preset: str, source: str, /, **options) -> dict:
        """As :meth:`VllmModel.register <aligntax.backends.vllm.engine.VllmModel.register>`: load the
        intervention ``source`` in every worker as ``preset`` (first built here against this model's
        fingerprint and sizes). Returns its resolved config."""
        from aligntax.api import load_intervention

        return self.register_built(
            preset, source, load_intervention(source, self.facts, **dict(options)), options
        )

    def register_built(self, preset: str, source: str, local, options: dict) -> dict:
        """:meth:`register` with the intervention already built here (kept in :attr:`interventions`)."""
        if local.rewrites_messages():
            raise AligntaxError(
                f"Intervention '{local.name}' rewrites the chat messages: it is applied to the "
                "messages, not registered as a steering preset."
            )
        refuse_surprisal(local, self.facts)
        configs = self.call(
            self.engine.collective_rpc("aligntax_register", args=(preset, str(source), dict(options)))
        )
        self.presets[preset] = configs[0]
        self.interventions[preset] = local
        return configs[0]

    def summary(self) -> dict:
        """The workers' steering statistics per preset and any errors."""
        return self.call(self.engine.collective_rpc("aligntax_summary"))[0]

    def close(self) -> None:
        """Shut the engine (and its child process) down and stop the loop."""
        if self.engine is not None and self._thread.is_alive():

            async def stop():
                self.engine.shutdown()

            with contextlib.suppress(Exception):
                self.call(stop(), timeout=60)
            self.engine = None
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)


@dataclass
class _ConfigOnly:
    """What the server reads of ``lm.model``: its config (the context window) and generation config."""

    config: Any
    generation_config: Any


@dataclass
class _ServedModel(LoadedModel):
    """:class:`LoadedModel` without weights: its sizes come from the engine's model facts (for the
    intervention loaders that check a request's steering options against the model)."""

    facts: ModelFacts | None = None

    @property
    def num_layers(self) -> int:
        return int(self.facts.num_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.facts.hidden_size)


def served_model(vm: AsyncVllm):
    """The model as :func:`aligntax.serve.app.create_app` reads it: tokenizer, spec, fingerprint and
    config, no weights (those live in the engine). Its context window is the engine's
    ``max_model_len``, so the server's prompt and ``max_tokens`` checks use the engine's limit."""
    from transformers import AutoConfig
    from transformers import GenerationConfig as HFGenerationConfig

    cfg = AutoConfig.from_pretrained(vm.source)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    text.max_position_embeddings = vm.max_model_len
    try:
        gc = HFGenerationConfig.from_pretrained(vm.source)
    except OSError:
        gc = HFGenerationConfig()
    return _ServedModel(
        model=_ConfigOnly(cfg, gc),
        tokenizer=vm.tokenizer,
        spec=vm.spec,
        source=vm.source,
        fingerprint=dict(vm.fingerprint or {}),
        facts=vm.facts,
    )
