"""The vLLM backend as the generation of an ELS sweep (``aligntax els sweep --backend vllm``).

:class:`VllmSweepSource` holds one :class:`~aligntax.backends.vllm.engine.VllmModel` for the whole sweep
and registers each steering setting of the grid as a preset of its own (``sweep-0``, ``sweep-1``, ...;
registered once, kept for the sweep); a method that rewrites the chat messages (the system-prompt
baselines) is applied to the messages instead. :meth:`VllmSweepSource.setting` returns the generation
function the sweep calls for one setting: ``gen(prompts, cfg, iv, desc)``, steered when ``iv`` is given
and plain otherwise, returning the Hugging Face backend's ``Generation`` records.

Everything else of the sweep is unchanged and runs on the Hugging Face copy of the model the sweep loads
anyway: which rows a setting leaves unsteered (their answers copied from the unsteered run), the
harm-gate decisions of the leak check, first-token screening, and judging.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from aligntax.backends.vllm.engine import VllmModel, prepare
from aligntax.generation.generate import Generation, GenerationConfig


class VllmSweepSource:
    """The sweep's vLLM engine and its registered settings."""

    def __init__(self, vm: VllmModel) -> None:
        self.vm = vm
        self._presets: dict[str, tuple[str | None, object]] = {}

    def setting(self, name: str, iv_args: dict) -> Callable[..., list[Generation]]:
        """The generation function of the sweep setting ``name`` with intervention options ``iv_args``
        (as the sweep builds its intervention): its preset is registered on first use."""
        key = json.dumps({"name": name, "args": iv_args}, sort_keys=True, default=str)
        if key not in self._presets:
            if name == "none":
                self._presets[key] = (None, None)
            else:
                self._presets[key] = prepare(
                    self.vm, name, dict(iv_args), preset=f"sweep-{len(self._presets)}"
                )
        preset, rewriting = self._presets[key]

        def gen(
            prompts: Sequence[str],
            cfg: GenerationConfig,
            iv=None,
            progress: bool = False,
            desc: str = "generate",
        ) -> list[Generation]:
            if not prompts:
                return []
            steered = iv is not None and getattr(iv, "name", None) != "none"
            gens, _ = self.vm.generate(
                list(prompts),
                cfg,
                steer=preset if steered else None,
                intervention=rewriting if steered else None,
                progress=progress,
            )
            return gens

        return gen
