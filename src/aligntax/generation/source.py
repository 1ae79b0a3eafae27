"""Where a run's answers are generated: the :class:`GenerationSource` a command picks once (``--backend``,
``--ray``) and hands down to its runs.

A source is a backend: Hugging Face (:class:`aligntax.backends.hf.HFSource`, aligntax's own batched
loop, the default), vLLM (:class:`aligntax.backends.vllm.source.VllmSource`: continuous batching, one
engine for every run of the process) or Ray replicas of either
(:class:`aligntax.runs.distributed.RaySource`). :func:`aligntax.runs.sources.generation_source` maps the
command-line option to one; nothing below it asks which backend it holds.

A run opens the source for its model and intervention (:meth:`GenerationSource.open`) and gets a
:class:`SourceSession`: the model and intervention as the run records them, where the per-row decisions
are made before generating (:meth:`SourceSession.decider`), the generation itself, and what the engine
decided and counted while generating.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from aligntax.generation.generate import Generation, GenerationConfig

__all__ = [
    "Backend",
    "Decider",
    "GenerationSource",
    "SourceSession",
    "SettingGenerate",
    "Serving",
    "SourceSpec",
    "SweepGeneration",
]


# where answers are generated: aligntax's own loop on a Hugging Face model, or vLLM
Backend = Literal["hf", "vllm"]


@dataclass(frozen=True)
class SourceSpec:
    """What a run generates with: the model spec, its dtype, the intervention by name and options (built
    by the source, once per process), the engine's batch (vLLM: its sequence slots) and, for the
    Hugging Face backend, how a large model is split over devices."""

    model: str
    dtype: str = "bf16"
    intervention: str | None = None
    intervention_args: dict[str, Any] = field(default_factory=dict)
    batch_size: int = 32
    device_map: str | None = None


class Decider(Protocol):
    """Where an intervention's per-row decisions are made before generating
    (:mod:`aligntax.activations.decisions`)."""

    def row_info(
        self, prompts: Sequence[Any], system: str | None = None, batch_size: int = 32
    ) -> list[dict[str, Any]] | None: ...

    def unsteered_rows(
        self, prompts: Sequence[Any], system: str | None = None, batch_size: int = 32
    ) -> list[bool] | None: ...


class SourceSession(Protocol):
    """A source opened for one model and intervention."""

    lm: Any  # the model as the run records it (``fingerprint``, ``spec``)
    intervention: Any  # the intervention as the run records it (``config()``); None: unsteered
    decided: dict[int, dict[str, Any]]  # prompt index -> what the engine decided while generating it

    def decider(self) -> Decider | None:
        """Where the per-row decisions are made before generating (None: nothing decided per row)."""

    def iter_generate(
        self,
        prompts: Sequence[Any],
        cfg: GenerationConfig,
        progress: bool = True,
        desc: str = "generate",
        recorder: Any = None,
    ) -> Iterator[tuple[list[int], list[Generation]]]:
        """Like :func:`aligntax.generation.iter_generate`: ``(indices, generations)`` per batch.
        ``recorder``: a :class:`~aligntax.activations.recorder.PrefillRecorder` keeping each batch's
        prompt states (unsteered runs; a source that cannot record refuses it in :meth:`check`)."""

    def prompt_lengths(self, prompts: Sequence[Any], system: str | None = None) -> list[int]:
        """Token length of each chat-templated prompt, as generation renders it (to form batches)."""

    def stats(self) -> dict[str, Any]:
        """The steering statistics of what was generated (the format of
        :func:`aligntax.interventions.kernels.merge_stats`)."""


# ``gen(prompts, cfg, iv=None, progress=False, desc="generate")``: one sweep setting's answers
SettingGenerate = Callable[..., list[Generation]]


@dataclass
class SweepGeneration:
    """How a sweep generates: ``setting(name, intervention_args)`` gives the generation function of one
    setting (None: the sweep's own loop on the Hugging Face model it loads); ``replicas``: Ray replicas
    that score whole settings (:class:`aligntax.runs.distributed.Replicas`; None: this process)."""

    setting: Callable[[str, dict[str, Any]], SettingGenerate | None]
    replicas: Any = None


@dataclass
class Serving:
    """A model served by a source (``aligntax serve``): ``create_app(settings, steer_method=...,
    steer_options=...)`` builds the OpenAI-compatible app (:func:`aligntax.serve.app.create_app`) with
    the server's settings (:class:`~aligntax.serve.settings.ServerSettings`) on the source's engine;
    ``intervention``: the steered model's (None: none); ``describe``: how it is served, for the start-up
    line (``" (batch <= 32"``)."""

    create_app: Callable[..., Any]
    intervention: Any
    describe: str


class GenerationSource(Protocol):
    """A generation backend, picked once by the command line and handed to every run of the process."""

    backend: Backend  # the backend a run folder records; a folder never mixes backends

    def check(
        self,
        *,
        recorder: bool = False,
        loaded_intervention: bool = False,
        loaded_model: bool = False,
        device_map: bool = False,
        adapters: bool = False,
    ) -> None:
        """Refuse (AligntaxError) what this source cannot take, before anything is loaded: a prompt
        state recorder, an intervention or a model loaded by the caller, a model split over devices,
        adapters applied by hooks on the model's linear layers (``els-lora``)."""

    def open(
        self, spec: SourceSpec, lm: Any = None, intervention: Any = None
    ) -> AbstractContextManager[SourceSession]:
        """The source for one run (``lm`` / ``intervention``: loaded by the caller, where the source
        takes them)."""

    def sweep(self, spec: SourceSpec) -> AbstractContextManager[SweepGeneration]:
        """How a sweep of ``spec.model`` generates."""

    def check_serving(self, *, device: str | None = None, max_latency_ms: float | None = None) -> None:
        """Refuse (AligntaxError) what this source cannot serve, before anything is loaded."""

    def serving(
        self, spec: SourceSpec, device: str | None = None, threads: int | None = None
    ) -> AbstractContextManager[Serving]:
        """The model (and the steered variant of ``spec.intervention``) loaded for serving until the
        ``with`` block ends; ``spec.batch_size``: the most requests generated together."""

    def start(self, spec: SourceSpec) -> Any:
        """Load or start now what runs of ``spec`` generate on, and return it as a run takes it (``lm``);
        None where each run loads its own (Ray replicas)."""

    def adopt(self, lm: Any) -> None:
        """``lm``: a Hugging Face model of the runs' spec loaded by the caller, to use where the source
        needs one (the model itself, or the copy the per-row decisions are made on)."""

    def close(self) -> None:
        """Release what the source started (an engine); it is not used afterwards."""
