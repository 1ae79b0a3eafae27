"""The vLLM backend as a :class:`~aligntax.generation.source.GenerationSource`
(``--backend vllm``): one engine for every run of the process, started when a run first generates.

Each run registers its intervention as a steering preset of that engine
(:class:`~aligntax.backends.vllm.evaluate.VllmSession`; a sweep each of its settings,
:class:`~aligntax.backends.vllm.sweep.VllmSweepSource`). The per-row decisions made before generating
run on a Hugging Face copy of the model, loaded on first need or adopted from the caller
(:meth:`VllmSource.adopt`: ``aligntax demo`` loads one anyway).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from aligntax.backends.vllm.engine import VllmModel, VllmOptions
from aligntax.backends.vllm.evaluate import VllmSession
from aligntax.errors import AligntaxError
from aligntax.generation.source import SettingGenerate, SourceSpec, SweepGeneration


class VllmSource:
    """The vLLM backend: ``vm``, a started :class:`VllmModel`, or one started on first need with the
    first run's model, dtype and batch size as sequence slots (closed by :meth:`close`)."""

    backend = "vllm"

    def __init__(self, vm: VllmModel | None = None) -> None:
        self.vm = vm
        self._own = False  # whether close() shuts the engine down
        self.hf = None  # a Hugging Face copy of the model adopted from the caller

    def check(
        self,
        *,
        recorder: bool = False,
        loaded_intervention: bool = False,
        loaded_model: bool = False,
        device_map: bool = False,
        adapters: bool = False,
    ) -> None:
        if adapters:
            raise AligntaxError(
                "els-lora settings are generated on the Hugging Face backend only (hooks on the "
                "model's linear layers); leave out the adapters or the vLLM backend."
            )
        if device_map:
            raise AligntaxError(
                "--device-map is for the Hugging Face backend; a vLLM replica places its model itself."
            )
        if recorder:
            raise AligntaxError(
                "The vLLM backend loads the intervention from its settings and records no prompt "
                "states: no prompt state recorder or loaded intervention."
            )
        if loaded_intervention:
            raise AligntaxError(
                "The vLLM backend loads the intervention from its settings: no loaded intervention."
            )

    def engine(self, spec: SourceSpec, vm=None) -> VllmModel:
        """The engine a run generates on: ``vm`` (a started engine the caller gives), else this source's."""
        if vm is not None and not isinstance(vm, VllmModel):
            raise AligntaxError("The vLLM backend takes a started VllmModel as its model (or none).")
        if vm is None:
            if self.vm is None:
                self.vm = VllmModel(
                    spec.model, dtype=spec.dtype, options=VllmOptions(max_num_seqs=max(1, spec.batch_size))
                )
                self._own = True
            vm = self.vm
        if vm.hf is None:
            vm.hf = self.hf  # the per-row decisions made before generating use the caller's model
        return vm

    @contextmanager
    def open(self, spec: SourceSpec, lm=None, intervention=None) -> Iterator[VllmSession]:
        yield VllmSession(self.engine(spec, lm), spec.intervention, spec.intervention_args)

    @contextmanager
    def sweep(self, spec: SourceSpec) -> Iterator[SweepGeneration]:
        from aligntax.backends.vllm.sweep import VllmSweepSource

        engines: list[VllmSweepSource] = []  # started when a setting is first generated

        def setting(name: str, args: dict) -> SettingGenerate:
            if not engines:
                engines.append(VllmSweepSource(self.engine(spec)))
            return engines[0].setting(name, args)

        yield SweepGeneration(setting)

    def check_serving(self, *, device: str | None = None, max_latency_ms: float | None = None) -> None:
        from aligntax.backends.vllm.engine import require_vllm

        if device not in (None, "cpu"):
            raise AligntaxError("--device is not used with --backend vllm (vLLM picks its own device).")
        if max_latency_ms is not None:
            raise AligntaxError(
                "A completion-latency target (--max-latency-ms) is not served by the vLLM backend."
            )
        require_vllm()

    def serving(self, spec: SourceSpec, device: str | None = None, threads: int | None = None):
        from aligntax.backends.vllm.serving import serving

        return serving(
            spec.model, spec.dtype, spec.intervention, spec.intervention_args, spec.batch_size, threads
        )

    def start(self, spec: SourceSpec) -> VllmModel:
        return self.engine(spec)

    def adopt(self, lm) -> None:
        self.hf = self.hf or lm
        if self.vm is not None and self.vm.hf is None:
            self.vm.hf = lm

    def close(self) -> None:
        if self._own and self.vm is not None:
            self.vm.close()
        self.vm, self._own = None, False
