"""The Hugging Face backend as a :class:`~aligntax.generation.source.GenerationSource`: aligntax's own
batched decode loop (:func:`aligntax.generation.iter_generate`) on a model loaded in this process, the
per-row decisions made by a :class:`~aligntax.activations.decisions.PrefillDecider` on the same model."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from aligntax.generation.generate import Generation, GenerationConfig, generate, iter_generate
from aligntax.generation.source import Serving, SettingGenerate, SourceSpec, SweepGeneration


def hf_generate(lm) -> SettingGenerate:
    """The generation function of a sweep setting on ``lm``: ``gen(prompts, cfg, iv, progress, desc)``."""

    def gen(prompts, cfg, iv=None, progress: bool = False, desc: str = "generate") -> list[Generation]:
        return generate(lm, prompts, cfg, iv, progress=progress, desc=desc)

    return gen


class HFSession:
    """One run's generation on a loaded model, with the run's intervention (None: unsteered)."""

    def __init__(self, lm, intervention=None) -> None:
        self.lm, self.intervention = lm, intervention
        self.decided: dict[int, dict] = {}  # decisions are made before generating, by the decider
        self._stats: dict = {}  # the hooks' statistics of every batch generated

    def decider(self):
        from aligntax.activations.decisions import PrefillDecider

        return PrefillDecider(self.lm, self.intervention)

    def iter_generate(
        self,
        prompts: Sequence,
        cfg: GenerationConfig,
        progress: bool = True,
        desc: str = "generate",
        recorder=None,
    ) -> Iterator[tuple[list[int], list[Generation]]]:
        return iter_generate(
            self.lm,
            prompts,
            cfg,
            intervention=recorder or self.intervention,
            stats=self._stats,
            progress=progress,
            desc=desc,
        )

    def prompt_lengths(self, prompts: Sequence, system: str | None = None) -> list[int]:
        from aligntax.generation.chat import build_messages, render_chat
        from aligntax.interventions.base import NoIntervention

        self.lm.require_chat_template()
        iv = self.intervention or NoIntervention()
        texts = [render_chat(self.lm.tokenizer, build_messages(p, system, iv)) for p in prompts]
        return [len(self.lm.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]

    def stats(self) -> dict:
        return self._stats


class HFSource:
    """The Hugging Face backend (the default): the model is loaded on first need (or adopted from the
    caller, :meth:`adopt`) and kept for every later run of the process."""

    backend = "hf"

    def __init__(self, lm=None) -> None:
        self.lm = lm

    def check(
        self,
        *,
        recorder: bool = False,
        loaded_intervention: bool = False,
        loaded_model: bool = False,
        device_map: bool = False,
        adapters: bool = False,
    ) -> None:
        """Everything is taken: a loaded model and intervention are used as given."""

    def _model(self, spec: SourceSpec, lm=None):
        if lm is not None:
            return lm
        if self.lm is None:
            from aligntax.models import load_model

            self.lm = load_model(spec.model, dtype=spec.dtype, device_map=spec.device_map)
        return self.lm

    @contextmanager
    def open(self, spec: SourceSpec, lm=None, intervention=None) -> Iterator[HFSession]:
        lm = self._model(spec, lm)
        if intervention is None and spec.intervention:
            from aligntax.interventions.registry import make_intervention

            intervention = make_intervention(spec.intervention, lm, **spec.intervention_args)
        yield HFSession(lm, intervention)

    @contextmanager
    def sweep(self, spec: SourceSpec) -> Iterator[SweepGeneration]:
        yield SweepGeneration(lambda name, args: None)  # the sweep's own loop on its model

    def check_serving(self, *, device: str | None = None, max_latency_ms: float | None = None) -> None:
        """Everything is served: any device, a latency target."""

    @contextmanager
    def serving(
        self, spec: SourceSpec, device: str | None = None, threads: int | None = None
    ) -> Iterator[Serving]:
        from functools import partial

        from aligntax.models.loader import load_model
        from aligntax.serve.app import create_app

        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        lm = load_model(spec.model, dtype=spec.dtype, device=device)
        iv = None
        if spec.intervention is not None:  # --steer DIR alone means els; every method's options apply
            from aligntax.interventions.registry import make_intervention

            iv = make_intervention(spec.intervention, lm, **spec.intervention_args)
            iv = None if iv is None or getattr(iv, "name", None) == "none" else iv
        yield Serving(partial(create_app, lm, iv), iv, f" (batch <= {spec.batch_size}")

    def start(self, spec: SourceSpec):
        return self._model(spec)

    def adopt(self, lm) -> None:
        self.lm = self.lm or lm

    def close(self) -> None:
        """Nothing to release: the model is freed with the source."""
