"""Per-row steering decisions as data, computed above the interventions.

A steering method with a per-request decision (the ELS harm gate and row energy decision, CAST's
condition) reads the states entering its kernel's ``decision_layers`` at each prompt's last token. The
hooks make that decision inside generation; a run also wants it *before* generating, to record per
row why it was steered or held (:func:`row_info`) and to copy the answers of held rows from an
unsteered run instead of generating them again (:func:`unsteered_rows`, :func:`rows_to_copy`).

Here the model runs (a prefill capture, :func:`prefill_states`) and the intervention's kernel only reads
the states: no intervention runs the model. A run picks where decisions are made through a *decider*
(an object with ``row_info(prompts, system, batch_size)`` and ``unsteered_rows(...)``): a
:class:`PrefillDecider` on a loaded model, the Ray replicas (``aligntax.runs.distributed.Replicas``),
or the vLLM backend's Hugging Face copy.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from aligntax.interventions.base import Intervention
    from aligntax.interventions.kernels import RowKernel

__all__ = [
    "PrefillDecider",
    "decides_per_row",
    "prefill_states",
    "prompt_surprisal",
    "remembered_prefill_states",
    "row_info",
    "rows_to_copy",
    "unsteered_rows",
]


def _kernel(intervention: Intervention | None, lm) -> RowKernel | None:
    if intervention is None:
        return None
    return intervention.kernel(lm.num_layers, lm.hidden_size)


def decides_per_row(intervention: Intervention | None, n_layers: int, hidden_size: int | None = None) -> bool:
    """Whether ``intervention`` makes (or records) a per-row decision from the prompt's states."""
    kernel = intervention.kernel(n_layers, hidden_size) if intervention is not None else None
    return kernel is not None and bool(kernel.read_layers)


def prefill_states(
    lm,
    prompts,
    layers: Sequence[int],
    intervention: Intervention,
    system: str | None = None,
    batch_size: int = 32,
) -> dict[int, torch.Tensor]:
    """The states entering blocks ``layers`` at each prompt's last token, ``{block: [N, d]}`` on the
    model's device (and under :data:`~aligntax.interventions.kernels.PROMPT_TOKENS` each prompt's length), as the intervention's pre-hooks see them in generation (same chat template and
    message changes), computed in batches that stop after the last of those blocks (and remembered
    inside :func:`remembered_prefill_states`)."""
    from aligntax.activations.capture import capture_seqs, chat_ids  # looked up per call (tests patch them)

    blocks = sorted({int(x) for x in layers})
    seqs, plens = chat_ids(lm, prompts, system, intervention)
    tokens_key = tuple(map(tuple, seqs)) if _PREFILL_MEMO is not None else None
    key = (
        (id(lm.model), tuple(blocks), tokens_key, _hooks_key(intervention))
        if _PREFILL_MEMO is not None
        else None
    )
    states = _PREFILL_MEMO.get(key) if key is not None else None
    if states is None:
        with intervention.decision_hooks(lm.model):
            states = capture_seqs(
                lm,
                seqs,
                plens,
                blocks,
                batch_size=batch_size,
                progress=False,
                share_prefix=_plain(intervention),
            )
        states = {b: states[b] for b in blocks}
        if key is not None:
            _PREFILL_MEMO[key] = states
    from aligntax.interventions.kernels import PROMPT_NLL, PROMPT_TOKENS, nll_span

    out = {b: h.to(lm.device) for b, h in states.items()}
    out[PROMPT_TOKENS] = torch.tensor(plens, dtype=torch.long, device=lm.device)  # each row's prompt length
    kernel = _kernel(intervention, lm)
    span = nll_span(kernel)
    if span is not None:  # each row's prompt surprisal, as the hooks score it inside generation
        from aligntax.surprisal import seqs_nll

        nll_key = (id(lm.model), tuple(span), tokens_key, _hooks_key(intervention), "nll")
        nll = _PREFILL_MEMO.get(nll_key) if _PREFILL_MEMO is not None else None
        if nll is None:
            with intervention.decision_hooks(lm.model):
                nll = seqs_nll(lm, seqs, span, batch_size)
            if _PREFILL_MEMO is not None:
                _PREFILL_MEMO[nll_key] = nll
        out[PROMPT_NLL] = nll.to(lm.device)
    return out


def prompt_surprisal(
    lm, prompts: Sequence[str], system: str | None = None, batch_size: int = 16
) -> list[float]:
    """The prompt surprisal (:func:`aligntax.surprisal.span_nll`: the mean NLL of the user message's
    tokens, nats per token) of each prompt inside ``lm``'s chat template (with ``system``), in order."""
    from aligntax.activations.capture import chat_ids
    from aligntax.surprisal import seqs_nll, template_span

    seqs, _ = chat_ids(lm, list(prompts), system)
    return seqs_nll(lm, seqs, template_span(lm.tokenizer, system), batch_size).tolist()


_PREFILL_MEMO: dict | None = None


def _plain(intervention: Intervention) -> bool:
    """Whether the decision capture runs the unmodified model (the intervention has no decision hooks)."""
    from aligntax.interventions.base import Intervention

    return type(intervention).decision_hooks is Intervention.decision_hooks


def _hooks_key(intervention: Intervention) -> object:
    """What the decision capture's states depend on besides the tokens: the intervention's decision hooks
    (none for most methods, so one capture serves every setting of a sweep)."""
    if _plain(intervention):
        return None
    return repr(sorted(intervention.config().items(), key=lambda kv: kv[0]))


@contextmanager
def remembered_prefill_states() -> Iterator[None]:
    """Inside, :func:`prefill_states` captures the states of the same token sequences at the same
    block once and reuses them: a sweep over settings of one harm gate (or one CAST condition) decides
    on the same prompts again and again. Forgotten on exit."""
    global _PREFILL_MEMO
    outer = _PREFILL_MEMO
    _PREFILL_MEMO = {} if outer is None else outer
    try:
        yield
    finally:
        _PREFILL_MEMO = outer


def unsteered_rows(
    intervention: Intervention | None, lm, prompts, system: str | None = None, batch_size: int = 32
) -> list[bool] | None:
    """Which prompts ``intervention`` leaves exactly as the unmodified model would answer them, decided
    from the prompt alone (before generating); None when it cannot tell in advance (no per-row
    decision: every row may change). A row whose decided strength is 0 is never edited."""
    kernel = _kernel(intervention, lm)
    if kernel is None or not kernel.decision_layers:
        return None
    if not prompts:
        return []
    states = prefill_states(lm, prompts, kernel.read_layers, intervention, system, batch_size)
    return kernel.untouched(states)


def row_info(
    intervention: Intervention | None, lm, prompts, system: str | None = None, batch_size: int = 32
) -> list[dict] | None:
    """Per prompt, what ``intervention`` decides for it before generating (``steered``, ``strength`` and
    what the method reads, e.g. a harm probability, an energy: the kernel's ``row_records``), for the
    run's records; None when it decides nothing per row."""
    kernel = _kernel(intervention, lm)
    if kernel is None or not kernel.read_layers:
        return None
    if not prompts:
        return []
    return kernel.row_records(
        prefill_states(lm, prompts, kernel.read_layers, intervention, system, batch_size)
    )


class PrefillDecider:
    """Decisions of ``intervention`` made on ``lm`` (a loaded model) by a prefill capture."""

    def __init__(self, lm, intervention: Intervention | None) -> None:
        self.lm = lm
        self.intervention = intervention

    def row_info(self, prompts, system: str | None = None, batch_size: int = 32) -> list[dict] | None:
        return row_info(self.intervention, self.lm, prompts, system, batch_size)

    def unsteered_rows(self, prompts, system: str | None = None, batch_size: int = 32) -> list[bool] | None:
        return unsteered_rows(self.intervention, self.lm, prompts, system, batch_size)


def rows_to_copy(decider, prompts, available, system: str | None = None, batch_size: int = 32) -> list[bool]:
    """Per prompt: an unsteered answer is ``available`` and the decider's intervention leaves the row
    unsteered, so that answer can be copied instead of generating the row again."""
    idx = [i for i, a in enumerate(available) if a]
    held = decider.unsteered_rows([prompts[i] for i in idx], system, batch_size) if idx else None
    out = [False] * len(prompts)
    for i, h in zip(idx, held or [False] * len(idx), strict=True):
        out[i] = bool(h)
    return out
