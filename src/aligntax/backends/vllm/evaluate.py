"""The vLLM backend's generation for one run (an evaluation, a known-answer check; opened by
:class:`~aligntax.backends.vllm.source.VllmSource`).

:class:`VllmSession` holds a :class:`~aligntax.backends.vllm.engine.VllmModel` with the run's
intervention registered as a steering preset (or, for a method that rewrites the chat messages, applied
to the messages), and generates the run's prompts in chunks, so that samples are appended as chunks
finish and a killed run resumes as the Hugging Face backend's does.

Row decisions recorded before generating (:mod:`aligntax.activations.decisions`: the harm probability,
the row energy, whether the row is steered) and the rows ``--reuse-unsteered`` copies are decided on a
Hugging Face copy of the model (``VllmModel.hf``: loaded on first need and kept on the engine, or given
by the caller, as ``aligntax demo --backend vllm`` gives its own), used only for an intervention that
decides per row: the engine decides inside generation
(too late to skip a copied row), and its decision records hold the decision's parts (gate strength,
row energy pass) but not the harm probability or the row energy. The strength the engine itself
applied to each generated row is kept next to those records (``engine_strength``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from aligntax.backends.vllm.engine import VllmModel, prepare
from aligntax.generation.generate import Generation, GenerationConfig

PRESET = "eval"
CHUNK_SLOTS = 4  # prompts per engine call: this many times the engine's sequence slots


class VllmSession:
    """Generation for one evaluation on a started vLLM engine (a
    :class:`~aligntax.generation.source.SourceSession`): the run's intervention is built once, when it is
    registered (or, for a method that rewrites the chat messages, applied to the messages)."""

    def __init__(
        self, vm: VllmModel, intervention: str | None = None, intervention_args: dict | None = None
    ) -> None:
        self.vm = self.lm = vm
        self.preset, self.rewriting = prepare(vm, intervention, intervention_args, preset=PRESET)
        self.intervention = self.rewriting if self.preset is None else vm.interventions[self.preset]
        self.decided: dict[int, dict] = {}  # prompt index -> the engine's decision record

    def decider(self):
        """Where the intervention's per-row decisions are made before generating: a
        :class:`~aligntax.activations.decisions.PrefillDecider` on a Hugging Face copy of the model,
        loaded on first need (None when the intervention decides nothing per row)."""
        from aligntax.activations.decisions import PrefillDecider, decides_per_row

        facts = self.vm.facts
        if not decides_per_row(self.intervention, facts.num_layers, facts.hidden_size):
            return None
        if self.vm.hf is None:  # kept on the engine: later runs on it share the copy
            from aligntax.models import load_model

            self.vm.hf = load_model(self.vm.spec, dtype=self.vm.dtype)
        return PrefillDecider(self.vm.hf, self.intervention)

    def iter_generate(
        self,
        prompts: Sequence,
        cfg: GenerationConfig,
        progress: bool = True,
        desc: str = "generate",
        recorder=None,
    ) -> Iterator[tuple[list[int], list[Generation]]]:
        """Like :func:`aligntax.generation.iter_generate`: ``(indices, generations)`` per chunk of
        prompts, each chunk one continuously batched engine call (no prompt states are recorded:
        :meth:`~aligntax.backends.vllm.source.VllmSource.check` refuses a recorder)."""
        prompts = list(prompts)
        chunk = max(1, CHUNK_SLOTS * self.vm.options.max_num_seqs)
        for start in range(0, len(prompts), chunk):
            idx = list(range(start, min(len(prompts), start + chunk)))
            gens, decided = self.vm.generate(
                [prompts[i] for i in idx],
                cfg,
                steer=self.preset,
                intervention=self.rewriting,
                progress=progress,
            )
            self.decided.update({i: d for i, d in zip(idx, decided, strict=True) if d is not None})
            yield idx, gens

    def prompt_lengths(self, prompts: Sequence, system: str | None = None) -> list[int]:
        return [len(ids) for ids in self.vm.encode(prompts, system, self.rewriting)[1]]

    def stats(self) -> dict:
        """The steering statistics of the preset since it was registered (the format of
        :func:`aligntax.interventions.kernels.merge_stats`)."""
        if self.preset is None:
            return {}
        return dict(self.vm.summary()["presets"].get(self.preset, {}).get("stats") or {})
