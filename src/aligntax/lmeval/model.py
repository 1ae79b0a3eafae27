"""The ``aligntax`` model type of lm-evaluation-harness: a model loaded by aligntax, optionally steered.

``lm_eval --model aligntax --model_args spec=embedded:qwen2.5-coder-0.5b-instruct,steer=runs/els``
(after ``import aligntax.lmeval.model``, which registers it; ``aligntax lm-eval`` does that) loads the
model with :func:`aligntax.load_model` (a Hub id, a model folder, a ``.gguf`` file or an embedded name)
and builds the intervention with :func:`aligntax.load_intervention`. It is lm-eval's ``HFLM`` around
that model, so every request type works (``loglikelihood``, ``loglikelihood_rolling``,
``generate_until``); each request type's whole batch of requests runs inside
``intervention.apply(model)``, whose hooks are removed when it returns.

Where steering lands. aligntax steers the last prompt token and every token after it, so a
continuation's log-likelihood must be read as generation would produce it: the context is the prompt,
the continuation the generated tokens. ``HFLM`` scores ``context + continuation`` in one right-padded
forward, where a prompt boundary of its own per row cannot be told to the hooks. With an intervention,
loglikelihood requests therefore run like generation with teacher forcing: the contexts, left-padded,
in one forward from an empty KV cache (the hooks take its length as the prompt length, so every row's
last context token is steered), then the continuation tokens one per forward with the cache, as
decode steps. Requests that share the context and all but the last continuation token (the choices of
a multiple-choice question with one-token answers) are computed once. Without an intervention the
requests go through ``HFLM``'s own code, so the unsteered model scores exactly as lm-eval's ``hf``
model does; ``intervention=NoIntervention()`` (Python) runs the steered code path without steering, the
baseline of ``aligntax lm-eval --compare``, so that both sides of a comparison are computed the same
way (lm-eval reads ``intervention=none`` in model args as no intervention).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from tqdm.auto import tqdm

from aligntax.api import load_intervention
from aligntax.errors import AligntaxError
from aligntax.hooks import pad_left, position_ids_from_mask
from aligntax.interventions.options import parse_value
from aligntax.interventions.registry import cli_options
from aligntax.models.loader import LoadedModel, load_model

__all__ = ["INTERVENTION_OPTIONS", "AligntaxLM", "build_intervention"]

# Intervention options accepted as model args: the registered options (aligntax.interventions.options)
# by their field names; ``layers`` as ``18:19``.
_OPTIONS = {o.name: o for o in cli_options() if o.name != "path"}
INTERVENTION_OPTIONS = tuple(_OPTIONS)


def _option(key: str, value):
    """A model-arg value as the intervention wants it (model args arrive as strings or numbers; commas
    separate model args, so a layer list is written ``18:19``)."""
    if key == "layers" and isinstance(value, str):
        value = re.sub(r"[:;\s]", ",", value)
    return parse_value(value, _OPTIONS[key].parse, key)


def build_intervention(
    lm: LoadedModel,
    intervention: str | None = None,
    steer: str | None = None,
    vectors: str | None = None,
    **options,
):
    """The intervention named by ``intervention`` (``--steer DIR`` alone: ELS from DIR; a vector method
    reads ``vectors``), or None for the unsteered model."""
    unknown = set(options) - set(INTERVENTION_OPTIONS)
    if unknown:
        raise AligntaxError(
            f"Unknown intervention options {sorted(unknown)}; known: {', '.join(INTERVENTION_OPTIONS)}."
        )
    name = "els" if steer and not intervention else intervention
    if not name:
        if vectors:
            raise AligntaxError(
                "vectors= needs intervention= the vector method (refusal-add, refusal-ablation, "
                "false-refusal-ablation or cast)."
            )
        return None
    opts = {k: _option(k, v) for k, v in options.items() if v is not None}
    folder = steer or vectors
    if folder and name != "none":
        return load_intervention(str(folder), lm, name=name, **opts)
    return load_intervention(name, lm, **opts)


@dataclass
class _Group:
    """Loglikelihood requests sharing a context and all but the last continuation token."""

    context: list[int]
    shared: list[int]  # the continuation less its last token (teacher-forced decode steps)
    last: list[tuple[int, int]] = field(default_factory=list)  # (request index, last continuation token)


@register_model("aligntax")
class AligntaxLM(HFLM):
    """lm-eval's ``HFLM`` around a model loaded by aligntax, with an optional intervention.

    Model args: ``spec`` (model spec; ``pretrained`` is an alias), ``dtype`` (bf16, fp32, ...; default
    bf16 as everywhere in aligntax), ``device``, ``steer`` (energy bank folder: ELS), ``intervention``
    (a registry name), ``vectors`` (vector folder for the vector baselines) and the intervention options
    of :data:`INTERVENTION_OPTIONS` (``layers`` as ``18:19``); the rest goes to ``HFLM`` (``batch_size``,
    ``max_length``, ...). In Python, ``lm=`` (a :class:`~aligntax.models.loader.LoadedModel`) and
    ``intervention=`` (an :class:`~aligntax.interventions.base.Intervention`) may be passed ready-made.
    """

    def __init__(
        self,
        spec: str | None = None,
        pretrained: str | None = None,
        dtype: str = "bf16",
        device: str | None = None,
        intervention=None,
        steer: str | None = None,
        vectors: str | None = None,
        lm: LoadedModel | None = None,
        **kwargs,
    ) -> None:
        iv_options = {k: kwargs.pop(k) for k in INTERVENTION_OPTIONS if k in kwargs}
        if lm is None:
            spec = spec or pretrained
            if not spec:
                raise AligntaxError("The aligntax model type needs spec= (a model spec or folder).")
            if not isinstance(spec, str):
                raise AligntaxError("spec= is a model spec (text); pass a loaded model as lm=.")
            if device and str(device).startswith("cuda") and not torch.cuda.is_available():
                device = None  # lm-eval's CLI passes its default device, cuda, even where there is none
            lm = load_model(spec, dtype=dtype, device=device)
        self.lm = lm
        if intervention is None or isinstance(intervention, str):
            intervention = build_intervention(lm, intervention, steer, vectors, **iv_options)
        elif iv_options or steer or vectors:
            raise AligntaxError("Give either a ready intervention or its name and options, not both.")
        self.intervention = intervention
        self.steered_forwards = 0  # prompt forwards the intervention was applied to
        self._applying = 0
        kwargs.setdefault("backend", "causal")
        super().__init__(pretrained=lm.model, tokenizer=lm.tokenizer, **kwargs)

    # ---- the intervention, applied around each request type's whole batch
    @contextmanager
    def applied(self) -> Iterator[None]:
        """``intervention.apply(model)`` for the ``with`` body (nothing without an intervention;
        re-entrant: an inner call runs inside the outer one's hooks)."""
        if self.intervention is None or self._applying:
            yield
            return
        self._applying += 1
        try:
            with self.intervention.apply(self.model) as applied:
                try:
                    yield
                finally:
                    self.steered_forwards += applied.calls
        finally:
            self._applying -= 1

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        with self.applied():
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        with self.applied():
            return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)

    def generate_until(self, requests, disable_tqdm: bool = False):
        with self.applied():
            return super().generate_until(requests, disable_tqdm=disable_tqdm)

    def get_model_info(self) -> dict:
        info = super().get_model_info()
        info.update(
            aligntax_spec=self.lm.spec,
            aligntax_source=self.lm.source,
            intervention=None if self.intervention is None else self.intervention.config(),
        )
        return info

    # ---- loglikelihood with the prompt boundary where generation has it
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        if self.intervention is None:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        if self.backend != "causal":
            raise AligntaxError("Steered log-likelihoods need a decoder-only (causal) model.")
        with self.applied():
            return self._steered_loglikelihood(requests, disable_tqdm, override_bs)

    def _steered_loglikelihood(self, requests, disable_tqdm: bool, override_bs: int | None):
        groups: dict[tuple, _Group] = {}
        for i, (_, context, continuation) in enumerate(requests):
            if not context or not continuation:
                raise AligntaxError("A loglikelihood request needs a non-empty context and continuation.")
            if len(continuation) > self.max_length:
                raise AligntaxError(
                    f"A continuation of {len(continuation)} tokens exceeds max_length {self.max_length}."
                )
            # truncated from the left as HFLM does: the scored input is (context + continuation)[:-1]
            full = (list(context) + list(continuation))[-(self.max_length + 1) :]
            ctx = full[: len(full) - len(continuation)]
            key = (tuple(ctx), tuple(continuation[:-1]))
            group = groups.get(key)
            if group is None:
                group = groups[key] = _Group(ctx, list(continuation[:-1]))
            group.last.append((i, int(continuation[-1])))
        order = sorted(groups.values(), key=lambda g: (-len(g.context), -len(g.shared), g.context, g.shared))
        batch_size = self._steered_batch_size(requests, order, override_bs)
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        pbar = tqdm(
            total=len(requests),
            disable=disable_tqdm or self.rank != 0,
            desc="Running steered loglikelihood requests",
        )
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            for group, (total, greedy_ok, last_logp, last_greedy) in zip(
                chunk, self._score_groups(chunk), strict=True
            ):
                for index, token in group.last:
                    answer = (total + float(last_logp[token]), bool(greedy_ok and int(last_greedy) == token))
                    results[index] = answer
                    request_str = requests[index][0]
                    if request_str is not None:
                        self.cache_hook.add_partial("loglikelihood", request_str, answer)
                    pbar.update(1)
        pbar.close()
        return results

    def _steered_batch_size(self, requests, order: list[_Group], override_bs: int | None) -> int:
        if override_bs is not None:
            return max(1, int(override_bs))
        if isinstance(self.batch_size, int):
            return max(1, self.batch_size)
        # "auto": lm-eval's detection on the longest input (a full forward of it, so the prefill and
        # its KV cache fit as well)
        longest = max(range(len(requests)), key=lambda i: len(requests[i][1]) + len(requests[i][2]))
        return max(1, int(self._detect_batch_size(requests, longest)))

    @torch.no_grad()
    def _score_groups(self, chunk: list[_Group]):
        """Per group: (log-probability of the shared continuation tokens, whether each was the argmax,
        log-probabilities at the last continuation position [vocab], that position's argmax)."""
        from transformers import DynamicCache

        model, device = self.model, self.device
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids, mask = pad_left([g.context for g in chunk], pad, device)
        pos = position_ids_from_mask(mask)
        cache = DynamicCache(config=model.config)
        steps = max(len(g.shared) for g in chunk)
        totals = [0.0] * len(chunk)
        greedy_ok = [True] * len(chunk)
        last: list = [None] * len(chunk)
        autocast = (
            torch.autocast(device_type=device.type, dtype=self.mixed_precision_dtype)
            if self.mixed_precision_dtype is not None
            else nullcontext()
        )
        filled = 0
        for step in range(steps + 1):
            # ``cache_position`` tells Intervention.apply whether the forward starts from an empty cache
            with autocast:
                logits = model(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=pos,
                    cache=cache,
                    use_cache=True,
                    cache_position=torch.arange(filled, filled + ids.shape[1], device=device),
                    logits_to_keep=1,
                ).logits[:, -1, :]
            filled += ids.shape[1]
            logp = F.log_softmax(logits, dim=-1, dtype=self.softmax_dtype)
            greedy = logp.argmax(-1).tolist()
            nxt = []
            for r, group in enumerate(chunk):
                n = len(group.shared)
                if step < n:
                    token = group.shared[step]
                    totals[r] += float(logp[r, token])
                    greedy_ok[r] = greedy_ok[r] and greedy[r] == token
                    nxt.append(token)
                else:
                    if step == n:
                        last[r] = (logp[r].detach().to("cpu", torch.float64), greedy[r])
                    nxt.append(pad)  # the row is done; its later outputs are not read
            if step == steps:
                break
            ids = torch.tensor(nxt, dtype=torch.long, device=device)[:, None]
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            pos = pos[:, -1:] + 1
        return [(totals[r], greedy_ok[r], last[r][0], last[r][1]) for r in range(len(chunk))]
