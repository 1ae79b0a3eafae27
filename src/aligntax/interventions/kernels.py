"""Steering as row kernels, and the one adapter that runs them inside a Hugging Face model.

Every steering method (ELS, activation addition, direction ablation, CAST) is a :class:`RowKernel`:

- ``sites``: where it edits (:class:`Site`: the residual stream entering a decoder block, what the
  block's attention writes into it, or the stream leaving the last block);
- an optional per-request decision (:meth:`RowKernel.decide`) read from the states entering
  ``decision_layers`` at the request's last prompt token, giving a per-row strength (0: held back,
  never edited);
- ``edit(site, rows [N, d], strength [N])``: the edit of a set of token states, rows of any batch;
- which tokens it edits: :func:`edited_span` of its ``positions`` and ``horizon``, the one rule both
  backends use (:func:`edited`, :func:`token_slice`, :func:`edited_mask`).

A kernel knows nothing of batches, padding, KV caches or hooks. :func:`attach_kernel` maps a padded
Hugging Face batch to rows (the positions from the prompt length and a per-site counter of decode
steps, the per-row strength from the :class:`~aligntax.interventions.base.SteerContext` and the
decision, rows dropped by generation) and registers the forward hooks; another backend (vLLM) maps its
flattened token batch to the same rows with the same rule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from aligntax.errors import AligntaxError
from aligntax.hooks import hidden_from_args, hooks_attached, replace_hidden_in_args
from aligntax.models.layers import decoder_layers
from aligntax.surprisal import span_nll

# the batch's steering context (aligntax.interventions.base.SteerContext, which imports this module)
BatchContext = Any

# a position bound of the position rule: an int, or a tensor of them (one per request)
Bound = Any

__all__ = [
    "POSITION_MODES",
    "PROMPT_NLL",
    "PROMPT_TOKENS",
    "SITE_KINDS",
    "RowKernel",
    "Site",
    "attach_kernel",
    "attention_module",
    "check_positions",
    "decide_at_prefill",
    "edited",
    "edited_mask",
    "edited_span",
    "nll_span",
    "merge_stats",
    "span_slice",
    "token_slice",
]

POSITION_MODES = ("last_and_generated", "generated", "all")
# The key under which a decision's ``states`` also hold each row's prompt length (chat-templated tokens,
# ``[N]`` long) where the caller knows it: a block index is never negative.
PROMPT_TOKENS = -1
# ... and each row's prompt surprisal (:func:`aligntax.surprisal.span_nll`, ``[N]`` float32), for a kernel
# whose :attr:`RowKernel.needs_prompt_nll` asks for it.
PROMPT_NLL = -2


def prompt_tokens_from(kwargs: dict[str, Any], index: int) -> torch.Tensor | None:
    """Each row's prompt length from a decoder block's ``position_ids`` keyword (left padding: the position
    of the token at ``index`` of the forward, plus one), or None when the forward has none."""
    pos = kwargs.get("position_ids")
    if not isinstance(pos, torch.Tensor) or pos.dim() != 2 or pos.shape[1] <= index:
        return None
    return pos[:, index].long() + 1


def check_positions(positions: str) -> str:
    if positions not in POSITION_MODES:
        raise AligntaxError(f"Unknown positions '{positions}'; use one of {', '.join(POSITION_MODES)}.")
    return positions


SITE_KINDS = ("pre", "attn", "post")


@dataclass(frozen=True, order=True)
class Site:
    """Where an edit happens: the residual stream entering block ``layer`` (``"pre"``), the output of
    its attention sub-layer, i.e. what the attention adds to the stream before the MLP reads it
    (``"attn"``), or the stream leaving the block (``"post"``, used for the last block only, so the
    final norm and the LM head see the edit)."""

    layer: int
    where: str = "pre"


class RowKernel:
    """One steering method as pure functions of token states (see the module docstring).

    Subclasses set ``sites`` (and ``decision_layers``, ``positions``, ``horizon`` where they have them)
    and implement :meth:`edit`; a method with a per-request decision implements :meth:`decision_parts`.
    """

    sites: list[Site] = []
    decision_layers: list[int] = []
    positions: str = "last_and_generated"
    horizon: int | None = None
    # A decision that reads each row's prompt surprisal (:data:`PROMPT_NLL`) sets ``needs_prompt_nll``;
    # where the hooks score it themselves (the Hugging Face backend), ``prompt_nll_span`` gives the chat
    # template's ``(head, tail)`` token counts around the user message
    # (:func:`aligntax.surprisal.template_span`). The vLLM backend scores it before generating and sends
    # it with the request, so its workers need no span.
    needs_prompt_nll: bool = False
    prompt_nll_span: tuple[int, int] | None = None

    # ---- the per-request decision ------------------------------------------------------------------
    def decision_parts(self, states: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Named per-row strengths ``{name: [N] float32}`` from ``{block: [N, d]}`` (the states entering
        ``decision_layers`` at the last prompt token); their product is the decision."""
        return {}

    def decide(self, states: dict[int, torch.Tensor]) -> torch.Tensor:
        """The per-row strength ``[N]`` float32 (0: the row is held back and never edited)."""
        return self.decide_with_parts(states)[0]

    def decide_with_parts(
        self, states: dict[int, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The per-row strength and the named parts it is the product of (for the records)."""
        parts = self.decision_parts(states)
        if not parts:
            return torch.ones(len(next(iter(states.values())))), parts
        return _product(parts), parts

    @property
    def read_layers(self) -> list[int]:
        """The blocks whose last-prompt-token input states :meth:`row_records` reads."""
        return self.decision_layers

    def row_records(self, states: dict[int, torch.Tensor]) -> list[dict[str, Any]]:
        """Per row, for the run's records: ``steered`` and ``strength`` (what the method reads, too,
        where it has more to say), from ``{block: [N, d]}`` at :attr:`read_layers`."""
        n = len(next(iter(states.values())))
        strength = self.decide(states).cpu() if self.decision_layers else torch.ones(n)
        return [{"steered": bool(s > 0 and self.sites), "strength": round(float(s), 4)} for s in strength]

    def untouched(self, states: dict[int, torch.Tensor]) -> list[bool]:
        """Per row (``{block: [N, d]}`` at :attr:`read_layers`): whether the row is left exactly as the
        unmodified model runs it (its decided strength is 0, or the kernel edits nowhere)."""
        return [bool(s == 0) or not self.sites for s in self.decide(states).cpu()]

    def record_decisions(self, parts: dict[str, torch.Tensor], stats: dict[str, Any]) -> None:
        """Count a batch's decisions (as first made) into ``stats``: ``{name: {rows, held}}``."""
        for name, part in parts.items():
            held = part.detach().cpu() == 0
            s = stats.setdefault(name, {"rows": 0, "held": 0})
            s["rows"] += len(held)
            s["held"] += int(held.sum())

    # ---- the edit --------------------------------------------------------------------------------------
    def edits_last_prompt(self, site: Site) -> bool:
        """Whether the last prompt token is edited at ``site`` (with ``positions="last_and_generated"``)."""
        return True

    def edit(
        self, site: Site, rows: torch.Tensor, strength: torch.Tensor, stats: dict[str, Any] | None = None
    ) -> torch.Tensor:
        """New states for ``rows`` ``[N, d]`` (model dtype) at ``site``; ``strength`` ``[N]`` float32 scales
        the edit per row (0 leaves a row exactly unchanged). ``stats``: a dict per site the kernel may
        accumulate into (device tensors; summarised by :meth:`finish`)."""
        raise NotImplementedError

    def finish(self, site_stats: dict[Site, dict[str, Any]], stats: dict[str, Any]) -> None:
        """Summarise the per-site accumulators of one batch into ``stats`` (may raise, e.g. on NaNs)."""

    def check(self, n_layers: int) -> None:
        """Refuse sites or decision layers outside a model of ``n_layers`` blocks."""
        for s in self.sites:
            if s.where not in SITE_KINDS:
                raise AligntaxError(f"Unknown steering site '{s.where}'; use one of {', '.join(SITE_KINDS)}.")
            if not 0 <= s.layer < n_layers:
                raise AligntaxError(
                    f"Steering layer {s.layer} does not exist: the model has {n_layers} layers."
                )
            if s.where == "post" and s.layer != n_layers - 1:
                raise AligntaxError("A 'post' site is only allowed on the last block.")
        for layer in self.decision_layers:
            if not 0 <= layer < n_layers:
                raise AligntaxError(
                    f"Decision layer {layer} does not exist: the model has {n_layers} layers."
                )


def nll_span(kernel: RowKernel | None) -> tuple[int, int] | None:
    """The template span to score each row's prompt surprisal with, for a kernel whose decision reads it
    (None otherwise); a kernel that reads it without a span is refused with one line."""
    if kernel is None or not kernel.needs_prompt_nll:
        return None
    if kernel.prompt_nll_span is None:
        raise AligntaxError(
            "max_prompt_surprisal needs the chat template's span around the user message: load the "
            "folder with its model (EnergySteering.from_dir(directory, lm)) or pass surprisal_span."
        )
    return kernel.prompt_nll_span


def edited_span(
    prompt_len: Bound,
    positions: str = "last_and_generated",
    horizon: int | None = None,
    last_prompt: bool = True,
) -> tuple[Bound, Bound | None]:
    """The position rule: the absolute positions (0-based) edited in a request whose prompt has
    ``prompt_len`` tokens (an int, or a tensor of them), as ``(first, stop)``: positions ``first <= p <
    stop`` (``stop`` None: no end). Every token with ``positions="all"``; else from the last prompt token
    (``"last_and_generated"``, where ``last_prompt``: the kernel edits it at this site) or the first
    generated token's input on; with a ``horizon`` H only positions before ``prompt_len + H`` (the last
    prompt token and the first H generated tokens fed back). Both backends edit by this rule alone
    (:func:`edited`, :func:`token_slice`, :func:`edited_mask`)."""
    if positions == "all":
        first = 0
    elif positions == "last_and_generated" and last_prompt:
        first = prompt_len - 1
    else:
        first = prompt_len
    return first, (None if horizon is None else prompt_len + horizon)


def _kernel_span(prompt_len: Bound, kernel: RowKernel, site: Site) -> tuple[Bound, Bound | None]:
    return edited_span(prompt_len, kernel.positions, kernel.horizon, kernel.edits_last_prompt(site))


def edited(position: int, prompt_len: int, kernel: RowKernel, site: Site) -> bool:
    """Whether the token at absolute ``position`` of a request whose prompt has ``prompt_len`` tokens is
    edited at ``site`` (:func:`edited_span` of the kernel's ``positions`` and ``horizon``)."""
    first, stop = _kernel_span(prompt_len, kernel, site)
    return first <= position and (stop is None or position < stop)


def edited_mask(
    positions: torch.Tensor, prompt_lens: torch.Tensor, kernel: RowKernel, site: Site
) -> torch.Tensor:
    """:func:`edited` for many tokens at once: ``positions`` and their requests' ``prompt_lens`` (long
    tensors of one shape) -> bool mask of the tokens edited at ``site``."""
    first, stop = _kernel_span(prompt_lens, kernel, site)
    mask: torch.Tensor = positions >= first
    if stop is not None:
        mask &= positions < stop
    return mask


def span_slice(seq_len: int, start: int, first: int, stop: int | None) -> slice:
    """The slice of a forward holding the contiguous absolute positions ``start .. start + seq_len - 1``
    that lies in the span ``[first, stop)`` of :func:`edited_span` (empty: ``start >= stop``)."""
    stop_abs = start + seq_len if stop is None else min(start + seq_len, stop)
    lo = min(max(first - start, 0), seq_len)
    hi = max(lo, min(stop_abs - start, seq_len))
    return slice(lo, hi)


def token_slice(seq_len: int, start: int, prompt_len: int, kernel: RowKernel, site: Site) -> slice:
    """:func:`edited` for a forward holding the contiguous absolute positions ``start ..
    start + seq_len - 1`` of every row (left padding puts each row's last prompt token at
    ``prompt_len - 1``): the slice of the forward's positions to edit."""
    return span_slice(seq_len, start, *_kernel_span(prompt_len, kernel, site))


def decide_at_prefill(
    h: torch.Tensor, ctx: BatchContext, key: Any, decide: Callable[[torch.Tensor], torch.Tensor], what: str
) -> torch.Tensor:
    """A per-row decision made from the last prompt token's state and kept for the whole generation.

    Called from a pre-hook with the block's input ``h``: the forward that holds the whole prompt sets
    ``ctx.row_state[key] = decide(h[:, prompt_len - 1])`` (and ``ctx.decisions[key]``, the whole
    batch's, once); a cached decode step (one token, decision made) keeps it, while generation drops
    finished rows from it; without the KV cache the unchanged prompt is re-fed and the same decision
    is reached. A forward holding only part of the prompt (chunked prefill) is refused. Returns the
    decision for the rows of this forward. ``key`` must be unique to the intervention and layer.
    """
    if h.shape[1] == 1 and key in ctx.row_state:
        kept: torch.Tensor = ctx.row_state[key]
        return kept
    if h.shape[1] < ctx.prompt_len:
        raise AligntaxError(f"{what} needs the whole prompt in one forward (no chunked prefill).")
    decision = decide(h[:, ctx.prompt_len - 1])
    ctx.row_state[key] = decision
    ctx.decisions.setdefault(key, decision)
    return decision


@contextmanager
def attach_kernel(
    model: nn.Module, ctx: BatchContext, kernel: RowKernel, owner: Any, what: str = "Steering"
) -> Iterator[None]:
    """Run ``kernel`` inside ``model`` for one batched call described by ``ctx`` (a
    :class:`~aligntax.interventions.base.SteerContext`).

    One forward pre-hook per block that decides or edits, a forward hook on the attention sub-layer
    for an ``attn`` site and on the block for a ``post`` site.
    The decision is made on the forward that holds the whole prompt, at the last of
    ``decision_layers`` (the earlier ones' last-prompt-token states are kept until then), before any
    edit at that block, and kept in ``ctx.row_state`` (so it follows the rows generation keeps). A
    forward of one token after the prompt forward is a cached decode step: its absolute position is
    counted per site; a longer forward (the prompt, or the whole sequence re-fed without the KV cache)
    starts at position 0, so steering is the same with and without the cache. Only reached on a clean
    exit: the decisions are counted and the kernel summarises its statistics into ``ctx.stats``."""
    blocks = decoder_layers(model)
    n = len(blocks)
    kernel.check(n)
    key = (owner, "decision")
    parts_key = (owner, "decision_parts")
    decision_layers = sorted(set(kernel.decision_layers))
    deciding = decision_layers[-1] if decision_layers else None
    read: dict[int, torch.Tensor] = {}
    next_pos: dict[Site, int] = {}
    site_stats: dict[Site, dict[str, Any]] = {s: {} for s in kernel.sites}
    span = nll_span(kernel) if decision_layers else None
    prompt_ids: dict[str, torch.Tensor] = {}
    scoring = [False]  # inside the forward that scores the prompt's surprisal: every hook stands aside

    def take_ids(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = args[0] if args else kwargs.get("input")
        if (
            not scoring[0]
            and isinstance(ids, torch.Tensor)
            and ids.dim() == 2
            and ids.shape[1] >= ctx.prompt_len
        ):
            prompt_ids["ids"] = ids[:, : ctx.prompt_len]
        return None

    def surprisal(tokens: torch.Tensor | None, n: int) -> torch.Tensor:
        ids = prompt_ids.get("ids")
        if ids is None or tokens is None or len(ids) != n:
            raise AligntaxError(
                f"{what}: the prompt surprisal needs the prompt's token ids and lengths in the forward that "
                "holds it (input_ids, no shared prefix)."
            )
        assert span is not None  # only called where the kernel asks for the surprisal
        scoring[0] = True
        try:
            return span_nll(model, ids, tokens, span)
        finally:
            scoring[0] = False

    def decide(h: torch.Tensor, layer: int, kwargs: dict[str, Any]) -> None:
        if layer != deciding:
            if h.shape[1] >= ctx.prompt_len:  # a forward holding the prompt (decode steps: decided)
                read[layer] = h[:, ctx.prompt_len - 1]
            return

        def make(last: torch.Tensor) -> torch.Tensor:
            # every state on the deciding block's device (a model split over devices)
            states = {b: s.to(last.device) for b, s in {**read, layer: last}.items()}
            tokens = prompt_tokens_from(kwargs, ctx.prompt_len - 1)
            if tokens is not None and len(tokens) == len(last):
                states[PROMPT_TOKENS] = tokens.to(last.device)
            if span is not None:
                states[PROMPT_NLL] = surprisal(tokens, len(last)).to(last.device)
            decision, parts = kernel.decide_with_parts(states)
            ctx.decisions.setdefault(parts_key, parts)
            return decision

        decide_at_prefill(h, ctx, key, make, what)
        read.clear()

    def run_edit(site: Site, h: torch.Tensor) -> torch.Tensor | None:
        seq = h.shape[1]
        if kernel.positions != "all" and 1 < seq < ctx.prompt_len:
            raise AligntaxError(
                f"A forward of {seq} tokens with a {ctx.prompt_len}-token prompt: chunked prefill is not "
                "supported by steering (set generation_config.prefill_chunk_size=None)."
            )
        start = next_pos.get(site, 0) if seq == 1 else 0
        next_pos[site] = start + seq
        sl = token_slice(seq, start, ctx.prompt_len, kernel, site)
        if sl.start >= sl.stop:
            return None
        decision = ctx.row_state.get(key)
        if decision_layers and decision is None:
            return None  # the prompt forward, before the decision is made
        scale = ctx.row_scale(h.shape[0], h.device, torch.float32).view(-1)
        if decision is not None:
            scale = scale * decision.to(device=h.device, dtype=torch.float32).view(-1)
        if not bool(scale.any()):
            return None  # every row of the batch is held back: nothing to move
        x = h[:, sl]
        b, t, d = x.shape
        rows = kernel.edit(site, x.reshape(b * t, d), scale.repeat_interleave(t), site_stats[site])
        new = h.clone()
        new[:, sl] = rows.view(b, t, d).to(h.dtype)
        return new

    by_block: dict[int, list[Site]] = {}
    for s in kernel.sites:
        if s.where == "pre":
            by_block.setdefault(s.layer, []).append(s)

    def make_pre(layer: int) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if scoring[0]:
                return None
            h = hidden_from_args(args, kwargs)
            if layer in decision_layers:
                decide(h, layer, kwargs)
            new = None
            for site in by_block.get(layer, ()):
                out = run_edit(site, h if new is None else new)
                new = out if out is not None else new
            return None if new is None else replace_hidden_in_args(args, kwargs, new)

        return hook

    def make_post(site: Site) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            if scoring[0]:
                return None
            h = output[0] if isinstance(output, tuple) else output
            new = run_edit(site, h)
            if new is None:
                return None
            return (new, *output[1:]) if isinstance(output, tuple) else new

        return hook

    pre_blocks = sorted(set(decision_layers) | set(by_block))
    regs = [(blocks[b], make_pre(b), True) for b in pre_blocks]
    regs += [(blocks[s.layer], make_post(s), False) for s in kernel.sites if s.where == "post"]
    regs += [
        (attention_module(blocks[s.layer], s.layer), make_post(s), False)
        for s in kernel.sites
        if s.where == "attn"
    ]
    if span is not None:
        regs.append((model.get_input_embeddings(), take_ids, True))  # type: ignore[operator]
    with hooks_attached(regs):
        yield
    if parts_key in ctx.decisions:
        kernel.record_decisions(ctx.decisions.pop(parts_key), ctx.stats)
    kernel.finish({s: a for s, a in site_stats.items() if a}, ctx.stats)


def attention_module(block: nn.Module, layer: int) -> nn.Module:
    """The attention sub-layer of a decoder block (``self_attn``, or ``attn``/``attention``), whose
    output is what the block's attention adds to the residual stream."""
    for name in ("self_attn", "attn", "attention"):
        mod = getattr(block, name, None)
        if isinstance(mod, nn.Module):
            return mod
    raise AligntaxError(
        f"Block {layer} ({type(block).__name__}) has no attention sub-layer (self_attn) to edit."
    )


def merge_stats(acc: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """Fold one batch's steering statistics (``SteerContext.stats``) into ``acc`` and return it: counts
    add up; a per-layer block with ``positions`` (ELS: positions, steered, mean energy before and after)
    is merged with its means weighted by positions."""
    for key, value in new.items():
        if isinstance(value, dict):
            if "positions" in value and key in acc:
                acc[key] = _merge_means(acc[key], value)
            elif "positions" in value:
                acc[key] = dict(value)
            else:
                merge_stats(acc.setdefault(key, {}), value)
        elif isinstance(value, int | float) and not isinstance(value, bool) and key in acc:
            acc[key] = acc[key] + value
        else:
            acc[key] = value
    return acc


def _merge_means(prev: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    n0, n1 = prev["positions"], new["positions"]
    out = dict(new)
    out["positions"] = n0 + n1
    out["steered"] = prev.get("steered", 0) + new.get("steered", 0)
    for k in ("energy_before", "energy_after"):
        if prev.get(k) is not None and new.get(k) is not None and n0 + n1:
            out[k] = (prev[k] * n0 + new[k] * n1) / (n0 + n1)
        else:
            out[k] = prev.get(k) if new.get(k) is None else new.get(k)
    return out


def _product(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    values = list(parts.values())
    out = values[0].float()
    for p in values[1:]:
        out = out * p.float().to(out.device)
    return out
