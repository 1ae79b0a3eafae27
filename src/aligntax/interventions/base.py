"""The one interface every intervention implements: prompting, vector steering, energy steering, adapters.

An intervention may rewrite the chat messages (prompting), and may attach hooks to the model for the
duration of one batched call (steering, adapters). Hooks live inside a context manager and are removed
on exit, also when the body raises, so the user's model is never left changed. An intervention never
runs the model itself: its per-row decisions before generating are computed above it
(:mod:`aligntax.activations.decisions`) from its kernel.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from aligntax.errors import AligntaxError
from aligntax.hooks import hidden_from_args, hooks_attached, replace_hidden_in_args
from aligntax.interventions.kernels import (
    RowKernel,
    attach_kernel,
    decide_at_prefill,
    edited_span,
    span_slice,
)
from aligntax.interventions.options import register
from aligntax.models.layers import decoder_layers, hidden_size

if TYPE_CHECKING:
    from aligntax.models.loader import LoadedModel

__all__ = [
    "AppliedIntervention",
    "Intervention",
    "NoIntervention",
    "NoOptions",
    "SteerContext",
    "decide_at_prefill",
    "hidden_from_args",
    "hooks_attached",
    "replace_hidden_in_args",
    "steered_slice",
]


@dataclass
class SteerContext:
    """What hooks need to know about the batch being run.

    ``prompt_len`` is the padded length of the prompt in the forward that holds it (left padding, so
    the last prompt token of every row is at index ``prompt_len - 1``). When generation computed a
    prefix shared by every row beforehand (for a :attr:`Intervention.prefix_free` intervention), that
    forward holds only the rest of each prompt. ``rows`` marks the rows to steer (None: all rows). ``strength`` is an
    optional per-row multiplier (None: 1.0 for every steered row).

    Generation may drop rows that have finished from the batch (:meth:`keep_rows`). Everything an
    intervention holds per row therefore lives here: ``rows``, ``strength`` and ``row_state`` (tensors
    with the batch as first dimension, e.g. a decision made at the prompt) follow the rows still
    running, while ``decisions`` keeps each decision as first made, for the whole batch.
    """

    prompt_len: int
    rows: torch.Tensor | None = None
    strength: torch.Tensor | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    row_state: dict[Any, torch.Tensor] = field(default_factory=dict)
    decisions: dict[Any, Any] = field(default_factory=dict)

    def row_scale(self, batch: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Per-row multiplier of shape [batch, 1, 1]: 0 for unsteered rows."""
        scale = torch.ones(batch, device=device, dtype=dtype)
        if self.strength is not None:
            scale = scale * self.strength.to(device=device, dtype=dtype)
        if self.rows is not None:
            scale = scale * self.rows.to(device=device, dtype=dtype)
        return scale.view(batch, 1, 1)

    def keep_rows(self, index: torch.Tensor) -> None:
        """Keep only the rows at ``index`` (positions in the current batch, in order) of every per-row
        tensor: called by generation when finished rows leave the batch."""
        index = index.cpu()

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t[index.to(t.device)]

        self.rows = None if self.rows is None else pick(self.rows)
        self.strength = None if self.strength is None else pick(self.strength)
        self.row_state = {k: pick(v) for k, v in self.row_state.items()}


def steered_slice(seq_len: int, ctx: SteerContext, positions: str = "last_and_generated") -> slice:
    """Which positions of the current forward's hidden states to steer, for a hook of its own (the
    position rule :func:`~aligntax.interventions.kernels.edited_span`, without a horizon): a forward of
    one token is a cached decode step (a generated token), a longer one holds the prompt from its start.

    - ``last_and_generated`` (the ELS paper): the last prompt token and every generated token;
    - ``generated``: only tokens after the prompt (the last prompt token's *output* is the first one);
    - ``all``: every position, prompt included.
    """
    start = ctx.prompt_len if seq_len == 1 else 0
    return span_slice(seq_len, start, *edited_span(ctx.prompt_len, positions))


class Intervention:
    """Base class. Subclasses override ``prepare_messages`` and/or ``attach``."""

    name: str = "none"
    # True when the hooks neither read nor change any prompt position before the last prompt token,
    # so a prefix every prompt of a batch shares may be computed once, without them.
    prefix_free: bool = False
    # True when config() pins down everything this intervention does (a prompt's text, an adapter's
    # digest), so results computed with it may be cached under its config, e.g. the value alignment
    # tax's judgment cache. False when config() names something whose content can change under the
    # same config (a folder read when it was built, which may be retrained in place): such results
    # are recomputed every time.
    cacheable: bool = True
    # True when everything the intervention does to hidden states is its row kernel (:meth:`kernel`), so a
    # backend that runs kernels (vLLM) runs all of it; False for hooks of its own (an adapter's).
    kernel_only: bool = True

    def prepare_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return messages

    def kernel(self, n_layers: int, hidden_size: int | None = None) -> RowKernel | None:
        """This intervention as a :class:`~aligntax.interventions.kernels.RowKernel` for a model of
        ``n_layers`` blocks (and ``hidden_size``, to refuse vectors of another size), or None when it does
        not act on hidden states (prompting)."""
        return None

    @contextmanager
    def attach(self, model: nn.Module, ctx: SteerContext) -> Iterator[None]:
        """Steer ``model`` for one batched call described by ``ctx``: the :meth:`kernel` run by
        :func:`~aligntax.interventions.kernels.attach_kernel` (subclasses with other hooks override)."""
        acts = type(self).kernel is not Intervention.kernel  # prompting and no-op interventions: no hooks
        kernel = self.kernel(len(decoder_layers(model)), hidden_size(model)) if acts else None
        if kernel is None:
            yield
            return
        with attach_kernel(model, ctx, kernel, id(self), self.name):
            yield

    @contextmanager
    def decision_hooks(self, model: nn.Module) -> Iterator[None]:
        """Hooks the per-row decision capture runs with (:mod:`aligntax.activations.decisions`), where the
        decision reads states this intervention changes before it decides (none by default)."""
        yield

    def config(self) -> dict[str, Any]:
        return {"name": self.name}

    def rewrites_messages(self) -> bool:
        """Whether this intervention changes the chat messages (a system prompt, few-shot turns)."""
        return type(self).prepare_messages is not Intervention.prepare_messages

    @contextmanager
    def apply(self, model: nn.Module) -> Iterator[AppliedIntervention]:
        """Attach this intervention's hooks to a plain Hugging Face causal LM for the ``with`` body, so
        that ``model.generate(**tok(texts, padding=True, padding_side="left"))`` (or a plain forward) is
        steered as aligntax's own generation steers it.

        Each ``model.generate`` call (and each forward outside ``generate`` that starts from an empty KV
        cache) gets a fresh :class:`SteerContext`: its ``prompt_len`` is the sequence length of the first
        forward, the one holding the left-padded prompts, and the intervention's :meth:`attach` is
        entered then and left when the call ends, as aligntax's generation does per batch. The prompts
        must be left-padded (AligntaxError otherwise) and rendered with the chat template by the caller.
        Interventions that rewrite the messages (system prompt, few-shot) cannot act through hooks:
        AligntaxError. All hooks are removed on exit, also when the body raises. Yields an
        :class:`AppliedIntervention` whose ``ctx`` is the last call's context (its ``stats``)."""
        if self.rewrites_messages():
            raise AligntaxError(
                f"Intervention '{self.name}' rewrites the chat messages (prepare_messages), which hooks on "
                "the model cannot do: render the prompts with intervention.prepare_messages(messages) "
                "before tokenising, or use aligntax.generation.generate."
            )
        applied = AppliedIntervention(self, model)
        with applied._installed():
            yield applied


class NoIntervention(Intervention):
    name = "none"
    prefix_free = True


@dataclass
class NoOptions:
    """No options."""


@register("none", NoOptions, "no intervention")
def _none(lm: LoadedModel | None, o: NoOptions) -> NoIntervention:
    return NoIntervention()


def _cache_is_empty(kwargs: dict[str, Any]) -> bool:
    """Whether a model forward starts from an empty KV cache (it holds a prompt from its start)."""
    pos = kwargs.get("cache_position")
    if isinstance(pos, torch.Tensor) and pos.numel():
        return int(pos.reshape(-1)[0]) == 0
    past = kwargs.get("cache", kwargs.get("past_key_values"))
    if past is None:
        return True
    if hasattr(past, "get_seq_length"):
        return int(past.get_seq_length()) == 0
    return len(past) == 0


class AppliedIntervention:
    """An intervention applied to a plain Hugging Face model (:meth:`Intervention.apply`).

    A forward pre-hook on the model notices the forward that holds a new batch of prompts (the first
    forward of each ``generate`` call; outside ``generate``, a forward from an empty KV cache), checks
    the left padding, and enters the intervention's :meth:`~Intervention.attach` with a fresh
    :class:`SteerContext` whose ``prompt_len`` is that forward's length; the attach is left at the end
    of the ``generate`` call (or when the next prompt forward comes, or on exit). ``ctx`` is the last
    context; ``calls`` counts the prompt forwards seen."""

    def __init__(self, intervention: Intervention, model: nn.Module) -> None:
        self.intervention = intervention
        self.model = model
        self.ctx: SteerContext | None = None
        self.calls = 0
        self._attached: ExitStack | None = None
        self._generating = 0
        self._pending = False

    def _start(self, prompt_len: int) -> None:
        self._finish()
        ctx = SteerContext(prompt_len=prompt_len)
        stack = ExitStack()
        stack.enter_context(self.intervention.attach(self.model, ctx))
        self._attached, self.ctx = stack, ctx
        self.calls += 1

    def _finish(self) -> None:
        stack, self._attached = self._attached, None
        if stack is not None:
            stack.close()

    def _pre_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        x = kwargs.get("input_ids", args[0] if args else None)
        if x is None:
            x = kwargs.get("inputs_embeds")
        if x is None:
            return None
        new_prompt = self._pending if self._generating else _cache_is_empty(kwargs)
        if not new_prompt:
            if self._attached is None:
                raise AligntaxError(
                    "Intervention.apply: this forward continues a KV cache filled without the intervention; "
                    "run the prompt forward (or the whole generate call) inside the with block."
                )
            return None
        self._pending = False
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        if (
            isinstance(mask, torch.Tensor)
            and mask.dim() == 2
            and mask.shape[1]
            and not bool(mask[:, -1].all())
        ):
            raise AligntaxError(
                "Intervention.apply needs left-padded prompts (the hooks find each row's last prompt "
                "token at the end): tokenise with padding_side='left'."
            )
        self._start(int(x.shape[1]))
        return None

    @contextmanager
    def _installed(self) -> Iterator[None]:
        # a Hugging Face model: its ``generate`` is read and replaced, which nn.Module's typing cannot express
        model: Any = self.model
        had_own = "generate" in vars(model)
        own = vars(model).get("generate")
        inner = model.generate if hasattr(model, "generate") else None

        def generate(*args: Any, **kwargs: Any) -> Any:
            assert inner is not None  # installed only when the model has a generate
            self._generating += 1
            self._pending = True
            try:
                return inner(*args, **kwargs)
            finally:
                self._generating -= 1
                self._pending = False
                if not self._generating:
                    self._finish()

        handle = model.register_forward_pre_hook(self._pre_forward, with_kwargs=True, prepend=True)
        try:
            if inner is not None:
                model.generate = generate
            yield
        finally:
            handle.remove()
            if inner is not None:
                if had_own:
                    model.generate = own
                else:
                    del model.generate
            self._finish()
