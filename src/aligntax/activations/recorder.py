"""Recording the prompt states while an unsteered generation runs (:class:`PrefillRecorder`).

An intervention (it attaches hooks through :meth:`Intervention.attach`), so it sits above both
:mod:`aligntax.interventions.base` and :mod:`aligntax.activations.capture`; it used to live in the
capture module, which made capture and the intervention base import each other.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from aligntax.activations.capture import require_finite, resolve_layers
from aligntax.errors import AligntaxError
from aligntax.hooks import hidden_from_args, hooks_attached
from aligntax.interventions.base import Intervention, SteerContext, decide_at_prefill
from aligntax.models.layers import decoder_layers


class PrefillRecorder(Intervention):
    """Records, while an unsteered generation runs, the residual stream entering ``layers`` at each
    row's last prompt token (read in the prefill forward), so one pass both answers the prompts and
    captures the states :func:`capture` would give (up to bf16 batch-composition rounding). Changes
    nothing in the forward.

    Use: pass it as the generation's intervention, then after each batch call :meth:`keep` with the
    batch's prompt ids; :meth:`save` appends what was kept to an activation cache."""

    name = "none"
    prefix_free = True  # reads the last prompt token only

    def __init__(
        self,
        model: nn.Module | int,
        layers: int | str | Sequence[int] | None = "all",
        sink: tuple | None = None,
    ) -> None:
        # ``model``: the model, or its number of blocks (a recorder of states that replicas send back);
        # ``sink``: ``(lm, directory, system)``, the activation cache each kept batch is appended to by
        # :meth:`flush` (None: kept in memory until :meth:`save`)
        self.layers = resolve_layers(model, layers)
        self.sink = sink
        self._last: dict[int, torch.Tensor] | None = None
        self._acts: dict[int, list[torch.Tensor]] = {layer: [] for layer in self.layers}
        self.prompt_ids: list[str] = []
        self.labels: list = []

    @contextmanager
    def attach(self, model: nn.Module, ctx: SteerContext) -> Iterator[None]:
        blocks = decoder_layers(model)

        def make_hook(layer: int):
            def hook(module, args, kwargs):  # the prefill takes the state; decode steps keep it
                decide_at_prefill(
                    hidden_from_args(args, kwargs),
                    ctx,
                    (id(self), layer),
                    lambda h: h.detach().float().cpu(),
                    "Recording prompt states",
                )

            return hook

        self._last = None
        with hooks_attached([(blocks[layer], make_hook(layer), True) for layer in self.layers]):
            yield
        got = {
            layer: ctx.decisions[(id(self), layer)]
            for layer in self.layers
            if (id(self), layer) in ctx.decisions
        }
        for layer, h in got.items():
            require_finite(h, layer)
        self._last = got

    def recorded(self, states: dict[int, torch.Tensor]) -> None:
        """The states ``{layer: [rows, d]}`` of a batch generated elsewhere (a replica of the model,
        :mod:`aligntax.runs.distributed`), rows in the batch's order, taken as if recorded here:
        :meth:`keep` files them next."""
        if sorted(states) != sorted(self.layers):
            raise AligntaxError(
                f"The batch's states are of layers {sorted(states)}, not of the recorded "
                f"layers {sorted(self.layers)}."
            )
        got = {layer: states[layer].float().cpu() for layer in self.layers}
        for layer, h in got.items():
            require_finite(h, layer)
        self._last = got

    def keep(self, prompt_ids: Sequence[str], labels: Sequence | None = None) -> None:
        """File the states of the batch just generated under ``prompt_ids`` (in the batch's row order)."""
        if self._last is None or len(self._last) != len(self.layers):
            raise AligntaxError("No recorded batch to keep: generate a batch with this recorder first.")
        n = next(iter(self._last.values())).shape[0]
        if len(prompt_ids) != n:
            raise AligntaxError(
                f"The recorded batch has {n} rows but {len(prompt_ids)} prompt ids were given."
            )
        for layer in self.layers:
            self._acts[layer].append(self._last[layer])
        self.prompt_ids += [str(p) for p in prompt_ids]
        self.labels += list(labels) if labels is not None else []
        self._last = None

    def states(self) -> dict[int, torch.Tensor]:
        """``{layer: [N, d]}`` float32: the kept states, rows in the order of :attr:`prompt_ids`."""
        return {layer: torch.cat(v) if v else torch.empty(0) for layer, v in self._acts.items()}

    def flush(self) -> None:
        """Append what was kept to the sink's activation cache now and forget it (nothing without a
        sink): a run that stores each batch's states before its samples loses no states when killed."""
        if self.sink is None or not self.prompt_ids:
            return
        self.save(*self.sink)
        self._acts = {layer: [] for layer in self.layers}
        self.prompt_ids, self.labels = [], []

    def save(self, lm, directory, system: str | None = None) -> None:
        """Append the kept states to the activation cache in ``directory`` (nothing if none were kept);
        ``system`` is the system prompt the generation used."""
        from aligntax.activations.cache import ActivationCache

        there = ActivationCache.saved_ids(directory)
        keep = [i for i, pid in enumerate(self.prompt_ids) if pid not in there]
        if not keep:
            return
        idx = torch.tensor(keep)
        acts = {layer: h[idx] for layer, h in self.states().items()}
        ActivationCache(
            acts,
            "last",
            [self.prompt_ids[i] for i in keep],
            [self.labels[i] for i in keep] if self.labels else [],
            None,
            dict(lm.fingerprint),
            {"system": system},
        ).append_to(directory)
