"""ELS on top of an els-lora adapter (``els-compose``): the adapter where it helps, ELS's gated descent after it.

The adapter (:mod:`aligntax.interventions.lora`) learns the harm distinction the frozen harm gate cannot
see: benign prompts that look harmful (XSTest-style contrast halves) are moved towards an answer, their
harmful twins towards a refusal. ELS's gated descent moves the rows still heading for a refusal. Composed:

- the adapter acts first, on every row, or with ``lora_gate`` P only on the rows the ELS folder's harm
  gate rates ``p(harmful) >= P`` (prompts that look sensitive at all): an everyday question (a known
  answer, a maths word problem) is then answered exactly as the unsteered model answers it, by
  construction; the gate reads a block before the first adapted block, so the choice is made before
  the adapter acts;
- ELS then steers as it is set up (harm gate, row energy decision, horizon), its row energy decision
  read from the *adapted* model's state entering the first steered block: the rows the adapter has not
  already turned are the ones it moves.

A row is left exactly as the unsteered model answers it when the adapter is off for it and ELS holds it
back (:meth:`ComposeKernel.untouched`), so a run copies those rows from an unsteered run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from aligntax.errors import AligntaxError
from aligntax.hooks import hidden_from_args, hooks_attached
from aligntax.interventions.base import Intervention, SteerContext
from aligntax.interventions.els import ElsOptions, EnergySteering
from aligntax.interventions.kernels import PROMPT_TOKENS, RowKernel, Site, attach_kernel, prompt_tokens_from
from aligntax.interventions.lora import ElsLora
from aligntax.interventions.options import option, register
from aligntax.models.layers import decoder_layers, hidden_size

if TYPE_CHECKING:
    from aligntax.models.loader import LoadedModel

__all__ = ["ComposeKernel", "ComposeOptions", "ComposedSteering"]


class ComposeKernel(RowKernel):
    """The ELS kernel of a composition (its sites, decision and edits), with the adapter's per-row choice
    added to the records: ``adapter`` (the adapter acts on the row) and ``steered`` (the adapter or ELS
    changes it)."""

    def __init__(
        self,
        els: RowKernel,
        gate_layers: list[int],
        adapter_on: Callable[[dict[int, torch.Tensor]], torch.Tensor],
    ) -> None:
        self.els = els
        self.sites, self.decision_layers = els.sites, els.decision_layers
        self.positions, self.horizon = els.positions, els.horizon
        self.needs_prompt_nll, self.prompt_nll_span = els.needs_prompt_nll, els.prompt_nll_span
        self._gate_layers = list(gate_layers)
        self._adapter_on = adapter_on  # states {block: [N, d]} -> [N] bool

    def decision_parts(self, states: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.els.decision_parts(states)

    def decide_with_parts(
        self, states: dict[int, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.els.decide_with_parts(states)

    def record_decisions(self, parts: dict[str, torch.Tensor], stats: dict[str, Any]) -> None:
        self.els.record_decisions(parts, stats)

    def edits_last_prompt(self, site: Site) -> bool:
        return self.els.edits_last_prompt(site)

    def edit(
        self, site: Site, rows: torch.Tensor, strength: torch.Tensor, stats: dict[str, Any] | None = None
    ) -> torch.Tensor:
        return self.els.edit(site, rows, strength, stats)

    def finish(self, site_stats: dict[Site, dict[str, Any]], stats: dict[str, Any]) -> None:
        self.els.finish(site_stats, stats)

    def check(self, n_layers: int) -> None:
        self.els.check(n_layers)

    @property
    def read_layers(self) -> list[int]:
        return sorted({*self.els.read_layers, *self._gate_layers})

    def row_records(self, states: dict[int, torch.Tensor]) -> list[dict[str, Any]]:
        rows = self.els.row_records(states)
        for r, on in zip(rows, self._adapter_on(states).cpu().tolist(), strict=True):
            r["els_steered"] = r["steered"]
            r.update(adapter=bool(on), steered=bool(on) or r["steered"])
        return rows

    def untouched(self, states: dict[int, torch.Tensor]) -> list[bool]:
        return [not r["steered"] for r in self.row_records(states)]


class ComposedSteering(Intervention):
    """An els-lora adapter with ELS descending on top (see the module docstring)."""

    name = "els-compose"
    cacheable = False  # config() names folders, not their content
    kernel_only = False  # the adapter's hooks are on the linear layers, outside the row kernel

    def __init__(self, els: EnergySteering, adapter: ElsLora, lora_gate: float | None = None) -> None:
        self.els, self.adapter = els, adapter
        self.lora_gate = None if lora_gate is None else float(lora_gate)
        if self.lora_gate is not None:
            if els.gate is None:
                raise AligntaxError(
                    "lora_gate reads the ELS folder's harm gate: the ELS setting has none (gate none)."
                )
            if not 0.0 <= self.lora_gate <= 1.0:
                raise AligntaxError(f"lora_gate must be a probability; got {self.lora_gate}.")
            first = min(adapter.layers) if adapter.layers else 0
            if max(els.gate.layers) > first:
                raise AligntaxError(
                    f"The harm gate reads the state entering block {max(els.gate.layers)}, after the adapter's first "
                    f"block {first}: the adapter cannot be chosen per row before it acts."
                )

    # ---- the adapter's per-row choice ------------------------------------------------------------------
    @property
    def _chooses(self) -> bool:
        """Whether the adapter is chosen per row (a ``lora_gate``, or ELS's prompt-length domain)."""
        return self.lora_gate is not None or self.els.max_prompt_tokens is not None

    def _choice_layers(self) -> list[int]:
        """The blocks whose last-prompt-token input the choice reads (before the adapter acts)."""
        if self.lora_gate is not None:
            assert self.els.gate is not None  # a lora_gate needs the gate (__init__)
            return sorted(self.els.gate.layers)
        return [min(self.adapter.layers) if self.adapter.layers else 0]

    def adapter_on(self, states: dict[int, torch.Tensor]) -> torch.Tensor:
        """Per row (``{block: [N, d]}`` at the last prompt token, with the rows' prompt lengths where ELS
        limits them): whether the adapter acts on it: rated at least ``lora_gate`` by the harm gate, and
        no longer than ELS's ``max_prompt_tokens`` (the adapter learned from the same prompts)."""
        n = len(next(iter(states.values())))
        on = torch.ones(n, dtype=torch.bool)
        if self.lora_gate is not None:
            gate = self.els.gate
            assert gate is not None  # a lora_gate needs the gate (__init__)
            dev = states[gate.layer].device
            on = (
                on
                & (gate.prob(gate.stack({b: states[b].to(dev) for b in gate.layers})) >= self.lora_gate).cpu()
            )
        if self.els.max_prompt_tokens is not None:
            tokens = states.get(PROMPT_TOKENS)
            if tokens is None:
                raise AligntaxError("max_prompt_tokens needs each row's prompt length (not given here).")
            on = on & (tokens.cpu() <= self.els.max_prompt_tokens)
        return on

    @contextmanager
    def _adapter(self, model: nn.Module, ctx: SteerContext | None) -> Iterator[None]:
        """The adapter's hooks, for the rows it acts on. Chosen per row (:attr:`_chooses`), pre-hooks on
        the blocks the choice reads take each prompt's last token (and its length, from the position ids)
        in the forward that holds the prompts (a longer forward than one token; left padding puts the
        last prompt token last), and the choice is kept in ``ctx.row_state`` so it follows the rows
        generation keeps (or for that forward, without ``ctx``: the decision capture)."""
        if not self._chooses:
            with self.adapter.attach(model, ctx or SteerContext(prompt_len=0)):
                yield
            return
        key = (id(self), "adapter")
        own: dict[Any, torch.Tensor] = {}

        # generation replaces ctx.row_state as rows finish: read it each time
        def state() -> dict[Any, torch.Tensor]:
            return ctx.row_state if ctx is not None else own

        read: dict[int, torch.Tensor] = {}
        layers = self._choice_layers()

        def make(layer: int) -> Callable[..., None]:
            def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                h = hidden_from_args(args, kwargs)
                if h.shape[1] == 1 and key in state():
                    return None  # a cached decode step: chosen at the prompt
                last = ctx.prompt_len - 1 if ctx is not None else h.shape[1] - 1
                read[layer] = h[:, last]
                if layer == layers[-1]:
                    tokens = prompt_tokens_from(kwargs, last)
                    if tokens is not None:
                        read[PROMPT_TOKENS] = tokens
                    state()[key] = self.adapter_on(dict(read)).to(h.device)
                    read.clear()
                return None

            return hook

        blocks = decoder_layers(model)
        regs = [(blocks[b], make(b), True) for b in layers]
        # ElsLora.attach does not read ctx: None (the decision capture) is passed on as it is
        with (
            hooks_attached(regs),
            self.adapter.attach(model, cast(SteerContext, ctx), row_mask=lambda: state().get(key)),
        ):
            yield

    # ---- the Intervention interface --------------------------------------------------------------------
    def kernel(self, n_layers: int, hidden_size: int | None = None) -> ComposeKernel:
        els = self.els.kernel(n_layers, hidden_size)
        return ComposeKernel(els, self._choice_layers() if self._chooses else [], self.adapter_on)

    @contextmanager
    def attach(self, model: nn.Module, ctx: SteerContext) -> Iterator[None]:
        kernel = self.kernel(len(decoder_layers(model)), hidden_size(model))
        with ExitStack() as stack:
            stack.enter_context(self._adapter(model, ctx))
            stack.enter_context(attach_kernel(model, ctx, kernel.els, id(self), self.name))
            yield

    @contextmanager
    def decision_hooks(self, model: nn.Module) -> Iterator[None]:
        """What the decision capture runs with: the adapter, so ELS decides on the adapted model's states."""
        with self._adapter(model, None):
            yield

    def config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "els": self.els.config(),
            "adapter": self.adapter.config(),
            "lora_gate": self.lora_gate,
        }


@dataclass
class ComposeOptions(ElsOptions):
    """Every ELS option (``path``: the ELS folder) and the adapter's."""

    adapter: str | None = option(
        "els-compose: the els-lora adapter folder (aligntax els distill) that ELS descends on top of",
        flag="--adapter",
    )
    scale: float | None = option(
        "els-lora: multiplier of the adapter's update (0: the unsteered model; default 1)",
        flag="--lora-scale",
        parse="float",
        check="finite",
    )
    lora_gate: float | str | None = option(
        "els-compose: apply the adapter only to rows the harm gate rates p(harmful) >= P ('none': every row)",
        parse="float_or_none",
        check="probability",
        grid=True,
        optional=True,
    )


_ELS_FIELDS = [f.name for f in fields(ElsOptions)]


@register(
    "els-compose",
    ComposeOptions,
    "ELS descending on top of an els-lora adapter (the adapter optionally only on rows the harm gate rates "
    "sensitive)",
)
def _compose(lm: LoadedModel | None, o: ComposeOptions) -> ComposedSteering:
    from aligntax.interventions.options import METHODS

    els = METHODS["els"].make(lm, **{k: getattr(o, k) for k in _ELS_FIELDS})
    if not o.adapter:
        raise AligntaxError(
            "Intervention 'els-compose' needs adapter= (--adapter DIR: an els distill folder)."
        )
    adapter = ElsLora.load(o.adapter, lm, scale=o.scale)
    gate = None if o.lora_gate in (None, "none") else float(o.lora_gate)
    return ComposedSteering(els, adapter, gate)
