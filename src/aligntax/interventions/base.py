"""The one interface every intervention implements: prompting, vector steering, energy steering, adapters.

An intervention may rewrite the chat messages (prompting), and may attach hooks to the model for the
duration of one batched call (steering, adapters). Hooks live inside a context manager and are removed
on exit, also when the body raises, so the user's model is never left changed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from aligntax.errors import AligntaxError


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
    stats: dict = field(default_factory=dict)
    row_state: dict = field(default_factory=dict)
    decisions: dict = field(default_factory=dict)

    def row_scale(self, batch: int, device, dtype) -> torch.Tensor:
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
    """Which positions of the current forward's hidden states to steer.

    - ``last_and_generated`` (the ELS paper): the last prompt token and every generated token. With a
      KV cache a decode step has seq_len 1 (a generated token); without it the whole sequence is re-fed
      and positions from ``prompt_len - 1`` on are steered.
    - ``generated``: only tokens after the prompt (the last prompt token's *output* is the first one).
    - ``all``: every position, prompt included.
    """
    if positions == "all":
        return slice(0, seq_len)
    start = ctx.prompt_len - 1 if positions == "last_and_generated" else ctx.prompt_len
    if seq_len == 1:
        return slice(0, 1)
    return slice(min(start, seq_len), seq_len)


def decide_at_prefill(h: torch.Tensor, ctx: SteerContext, key, decide: Callable[[torch.Tensor], torch.Tensor],
                      what: str) -> torch.Tensor:
    """A per-row decision made from the last prompt token's state and kept for the whole generation.

    Called from a pre-hook with the block's input ``h``: the forward that holds the whole prompt sets
    ``ctx.row_state[key] = decide(h[:, prompt_len - 1])`` (and ``ctx.decisions[key]``, the whole
    batch's, once); a cached decode step (one token, decision made) keeps it, while generation drops
    finished rows from it; without the KV cache the unchanged prompt is re-fed and the same decision
    is reached. A forward holding only part of the prompt (chunked prefill) is refused. Returns the
    decision for the rows of this forward. ``key`` must be unique to the intervention and layer.
    """
    if h.shape[1] == 1 and key in ctx.row_state:
        return ctx.row_state[key]
    if h.shape[1] < ctx.prompt_len:
        raise AligntaxError(f"{what} needs the whole prompt in one forward (no chunked prefill).")
    decision = decide(h[:, ctx.prompt_len - 1])
    ctx.row_state[key] = decision
    ctx.decisions.setdefault(key, decision)
    return decision


class Intervention:
    """Base class. Subclasses override ``prepare_messages`` and/or ``attach``."""

    name: str = "none"
    # True when the hooks neither read nor change any prompt position before the last prompt token,
    # so a prefix every prompt of a batch shares may be computed once, without them.
    prefix_free: bool = False

    def prepare_messages(self, messages: list[dict]) -> list[dict]:
        return messages

    @contextmanager
    def attach(self, model: nn.Module, ctx: SteerContext) -> Iterator[None]:
        yield

    def config(self) -> dict:
        return {"name": self.name}

    def unsteered_rows(self, lm, prompts, system: str | None = None, batch_size: int = 32) -> list[bool] | None:
        """Which prompts this intervention leaves exactly as the unmodified model would answer them,
        decided from the prompt alone (before generating); None when it cannot tell in advance.

        An evaluation may take those rows' answers from an unsteered run instead of generating them
        again. Interventions that decide once per row at the last prompt token (the ELS harm gate,
        CAST's condition) answer with :func:`prefill_decisions`; the others change every row."""
        return None

    def row_info(self, lm, prompts, system: str | None = None, batch_size: int = 32) -> list[dict] | None:
        """Per prompt, what the intervention decides for it before generating (e.g. ``steered``, a harm
        probability, an energy), for the run's records; None when it decides nothing per row."""
        return None


def prefill_states(lm, prompts, layers: Sequence[int], intervention: Intervention, system: str | None = None,
                   batch_size: int = 32) -> dict[int, torch.Tensor]:
    """The states entering blocks ``layers`` at each prompt's last token, ``{block: [N, d]}`` on the
    model's device, as the intervention's pre-hooks see them in generation (same chat template and
    message changes), computed in batches that stop after the last of those blocks (and remembered
    inside :func:`remembered_prefill_states`)."""
    from aligntax.activations.capture import capture_seqs, chat_ids

    blocks = sorted({int(x) for x in layers})
    seqs, plens = chat_ids(lm, prompts, system, intervention)
    key = (id(lm.model), tuple(blocks), tuple(map(tuple, seqs))) if _PREFILL_MEMO is not None else None
    states = _PREFILL_MEMO.get(key) if key is not None else None
    if states is None:
        states = capture_seqs(lm, seqs, plens, blocks, batch_size=batch_size, progress=False)
        states = {b: states[b] for b in blocks}
        if key is not None:
            _PREFILL_MEMO[key] = states
    return {b: h.to(lm.device) for b, h in states.items()}


def prefill_decisions(lm, prompts, layers: Sequence[int], decide: Callable[[dict[int, torch.Tensor]], torch.Tensor],
                      intervention: Intervention, system: str | None = None, batch_size: int = 32) -> list[bool]:
    """``decide`` applied to :func:`prefill_states` of ``prompts`` at blocks ``layers``."""
    if not prompts:
        return []
    return [bool(x) for x in decide(prefill_states(lm, prompts, layers, intervention, system, batch_size)).cpu()]


_PREFILL_MEMO: dict | None = None


@contextmanager
def remembered_prefill_states() -> Iterator[None]:
    """Inside, :func:`prefill_decisions` captures the states of the same token sequences at the same
    block once and reuses them: a sweep over settings of one harm gate (or one CAST condition) decides
    on the same prompts again and again. Forgotten on exit."""
    global _PREFILL_MEMO
    outer = _PREFILL_MEMO
    _PREFILL_MEMO = {} if outer is None else outer
    try:
        yield
    finally:
        _PREFILL_MEMO = outer


def rows_to_copy(intervention: Intervention, lm, prompts, available, system: str | None = None,
                 batch_size: int = 32) -> list[bool]:
    """Per prompt: an unsteered answer is ``available`` and the intervention leaves the row unsteered,
    so that answer can be copied instead of generating the row again."""
    idx = [i for i, a in enumerate(available) if a]
    held = intervention.unsteered_rows(lm, [prompts[i] for i in idx], system, batch_size) if idx else None
    out = [False] * len(prompts)
    for i, h in zip(idx, held or [False] * len(idx), strict=True):
        out[i] = bool(h)
    return out


class NoIntervention(Intervention):
    name = "none"
    prefix_free = True


@contextmanager
def hooks_attached(
    registrations: list[tuple[nn.Module, Callable, bool]],
) -> Iterator[None]:
    """Register (module, hook, is_pre) hooks and remove them on exit, even after an exception."""
    handles = []
    try:
        for module, hook, is_pre in registrations:
            if is_pre:
                handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
            else:
                handles.append(module.register_forward_hook(hook, with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()


def replace_hidden_in_args(args: tuple, kwargs: dict, new_hidden: torch.Tensor) -> tuple[tuple, dict]:
    """Return (args, kwargs) of a decoder block call with the hidden states replaced."""
    if args:
        return (new_hidden, *args[1:]), kwargs
    kwargs = dict(kwargs)
    kwargs["hidden_states"] = new_hidden
    return args, kwargs


def hidden_from_args(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]
